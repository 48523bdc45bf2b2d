"""One search update for the whole model: every NWS layer's lazy-search state in flat buffers.

The per-layer lazy search (:class:`~nwsconvert.core.layers.NWSWeight`) does a few
small steps per layer and reads their sizes back to the host: fine on a CPU,
where those reads are free, but on a GPU a step then waits on the host about
six times per layer. :class:`SearchEngine` keeps the same state (each kernel's
W at its last search, its squared movement budget, its index) for all layers
with the same vector size D side by side, and brings every index up to date in
a fixed number of device operations per D, whatever the depth of the model.
On CUDA (``kernel='triton'``) these are, per D:

1. W of every layer read where the layer keeps it, through a table of the layers' addresses (float32
   W; any other dtype is concatenated into one ``(R, D)`` float32 buffer first);
2. one pass over the rows (:func:`~nwsconvert.core.fused_search.engine_flags`): budgets
   shrunk by their layer's largest pool-entry movement when a pool changed, each
   row's drift since its last search, the scalar pools' exact-interval test: which
   rows to search;
3. the flagged rows compacted per layer (a cumulative sum and a permutation kernel),
   a float32 search pass over them, certified on the device, and a float64 pass over
   those it could not certify; both write the new index, reference and budget in
   place (:func:`~nwsconvert.core.fused_search.engine_search`), each a persistent launch
   whose programs share the flagged rows' blocks, counted on the device: a pass costs what
   the flagged rows cost;
4. every layer's ``K = M[index]`` gathered at once, and the indices copied back into
   the layers' buffers (one ``_foreach_copy_``).

A pool's change is seen through its identity, storage and version counter: a frozen
pool costs nothing per step (an edit through ``.data``, which the counter does not
see, is not seen; optimiser steps, in-place ops and ``copy_`` are). The torch kernel (CPU) runs the same steps in torch ops
and searches the flagged rows with :func:`~nwsconvert.core.search.nearest_two`.

Nothing is read back to the host: no ``.item()``, ``nonzero``, ``equal`` or
branch on a tensor value. The result equals the per-layer search, which equals
:func:`~nwsconvert.core.search.brute_force`, exactly.

With ``graph=True`` (CUDA) the update's launches are captured once in a CUDA graph and replayed while
no pool moves and its buffers stay where they were: an eager step then pays one launch for it, not some
20 launches and their Python (an eager GPU step is paced by its host).

Use it for a training stage::

    with SearchEngine(model):   # CUDA (Triton), or CPU under TRITON_INTERPRET=1
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)   # the update runs in a forward pre-hook
            ...

Leaving the block hands the state back to the layers (their own lazy search
goes on from it).
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import fused_search
from .fused_search import layer_table, row_blocks
from .layers import writable_gradient
from .nwsmodel import _require
from .rounding import budget_sq, full_precision, shrunk_budget_sq
from .search import PreparedPool, flat_nonzero, nearest_two

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["SearchEngine", "search_engine"]


class _TorchSearch:
    """:func:`~nwsconvert.core.fused_search.segmented_nearest_two` through :func:`~nwsconvert.core.search.nearest_two`,
    layer by layer over the flagged rows (CPU: reading their number back costs nothing there). Each
    layer's :class:`~nwsconvert.core.search.PreparedPool` is kept while its pool's values stay the same."""

    def __init__(self) -> None:
        self.preps: dict[int, PreparedPool] = {}

    def _prepared(self, off: int, pool: torch.Tensor) -> PreparedPool:
        prep = self.preps.get(off)
        if prep is None or prep.pool.shape != pool.shape or not torch.equal(prep.pool, pool):
            prep = self.preps[off] = PreparedPool(pool)
        return prep

    def __call__(self, x, pools, blocks, need):
        blk_row, blk_end, blk_off, blk_n = (t.tolist() for t in blocks[:4])
        index = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        radius = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        exact = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        done = set()
        for start, end, off, n in zip(blk_row, blk_end, blk_off, blk_n):
            if end in done:  # one layer = the blocks sharing an end; its first block starts at its first row
                continue
            done.add(end)
            rows = flat_nonzero(need[start:end]) + start
            if rows.numel():
                res = nearest_two(x.index_select(0, rows), self._prepared(off, pools[off : off + n]))
                index[rows] = res.index.to(x.device)
                radius[rows] = res.radius.to(x.device)
                exact[rows[: int(res.exact_rows)]] = True  # nearest_two counts them: the count is what is kept
        return index, radius, exact


class _GroupSTE(torch.autograd.Function):
    """Every layer's ``K = M[index]`` of one group at once, straight-through gradient to each layer's W.

    The forward returns each layer's weight, exactly its gathered pool vectors: a view of ``k`` ``(R, D)``
    in W's shape (one autograd node for the group, not a split and a view per layer). The backward hands
    each weight its gradient; with ``commit`` (:class:`_Commit`, or None) it first adds ``scale * (W - K)``
    per layer, the gradient of every layer's commitment term (see :class:`~nwsconvert.core.layers._GatherSTE`),
    in one pass for the whole group: into each layer's own float32 gradient in place, through a table of
    their addresses (Triton), or else into one ``(R, D)`` buffer joining them. ``src``: where the
    backward reads W: the layers' W address table ``(L,)`` int64 (float32 W, read where each layer keeps
    it), or W as the update concatenated it ``(R, D)`` float32 where that buffer lives through the step
    anyway (a graphed update's), or None (W concatenated again in the backward: an eager forward keeps no
    copy of W alive through the step). The weights are saved either way: autograd refuses a backward
    after they changed in place, so ``src`` still reads W there; a table whose addresses are no longer
    the weights' (one was given new storage) is not used.
    """

    @staticmethod
    def forward(ctx, k: torch.Tensor, commit: _Commit | None, src: torch.Tensor | None, *weights: torch.Tensor):
        ctx.shapes, ctx.commit, ctx.has_src = [w.shape for w in weights], commit, src is not None
        if commit is not None:
            ctx.save_for_backward(k, *weights, *((src,) if src is not None else ()))
            ctx.ptrs = _layout(weights) if src is not None and src.dim() == 1 else None
        rows = k.split([w.numel() // k.shape[1] for w in weights])
        return tuple(piece.view(shape) for piece, shape in zip(rows, ctx.shapes))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.commit is None:  # each weight's gradient is its layer's, as it came
            return (None, None, None, *grads)
        k, *weights = ctx.saved_tensors
        src = weights.pop() if ctx.has_src else None
        if ctx.ptrs is not None and ctx.ptrs != _layout(weights):
            src = None  # a weight now lives elsewhere, or in another layout: concatenate them
        own = ctx.commit.in_place(grads, k, weights, src)  # each layer's own gradient takes its term
        if own is not None:
            return (None, None, None, *own)
        # One (R, D) buffer of this backward's own, which the commitment term then takes in place.
        grad = ctx.commit(torch.cat([g.reshape(-1, k.shape[1]) for g in grads]), k, weights, src)
        pieces = grad.reshape(-1).split([s.numel() for s in ctx.shapes])
        return (None, None, None, *(piece.view(shape) for piece, shape in zip(pieces, ctx.shapes)))


def _no_table(device: torch.device) -> bool:
    """Whether an address table cannot be read or made on ``device`` now: the interpreter with CUDA tensors
    (it copies them to the host, but not the memory a table points at), or a CUDA graph being captured (no
    host copy into it)."""
    return device.type == "cuda" and (fused_search._interpreting() or torch.cuda.is_current_stream_capturing())


def _address_table(tensors, device: torch.device) -> torch.Tensor | None:
    """An ``(L,)`` int64 table of ``tensors``' addresses on ``device`` for the Triton kernels, through pinned
    memory on CUDA (no host sync); None where none can be had (:func:`_no_table`)."""
    if _no_table(device):
        return None
    cuda = device.type == "cuda"
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, pin_memory=cuda)
    return table.to(device, non_blocking=cuda)


def _layout(weights) -> tuple:
    """Where and how the weights lie (address, strides, dtype each): what an address table of them assumes."""
    return tuple((w.data_ptr(), w.stride(), w.dtype) for w in weights)


class _Commit:
    """``grad + scale * (W - K)`` ``(R, D)``, each row with its layer's commitment scale: per layer
    ``(L,)`` float32 through one Triton kernel (``wide``: the group's block table), or per row
    ``(R, 1)`` in torch ops (``wide`` None). Holds no reference to the group (the autograd graph
    keeps it, and the group keeps the graph's output)."""

    def __init__(self, dim: int, scale: torch.Tensor, wide: tuple | None):
        self.dim, self.scale, self.wide = dim, scale, wide
        self._grads: tuple | None = None  # (the last gradients' addresses, their table on the device)

    def _w(self, weights, src: torch.Tensor | None) -> torch.Tensor:
        """Where the kernel reads W: ``src`` (:class:`_GroupSTE`'s), else the weights concatenated ``(R, D)``."""
        return src if src is not None else torch.cat([w.reshape(-1, self.dim) for w in weights])

    def in_place(self, grads, k: torch.Tensor, weights, src: torch.Tensor | None) -> list[torch.Tensor] | None:
        """Each layer's gradient with its term, added in place to the layers' own gradients ``grads`` through
        a table of their addresses (one Triton launch, no ``(R, D)`` buffer joining them); a gradient the
        backward may not write (a view, say a linear layer's transposed product) is copied first, that
        layer's alone. None, with nothing done, where this cannot be: the torch ops' path, a gradient not
        float32, or no table to be had (:func:`_no_table`)."""
        if self.wide is None or not all(g.dtype == torch.float32 for g in grads):
            return None
        device = k.device
        if _no_table(device):
            return None
        own = [g if writable_gradient(g) else g.clone(memory_format=torch.contiguous_format) for g in grads]
        # The table is made on the current stream; one made on another is not reused (its memory may be
        # freed while a kernel there still reads it).
        key = (tuple(g.data_ptr() for g in own), torch.cuda.current_stream(device) if device.type == "cuda" else None)
        if self._grads is None or self._grads[0] != key:  # the caching allocator mostly gives the same ones
            self._grads = (key, _address_table(own, device))
        table = self._grads[1]
        fused_search.engine_commit(table, self._w(weights, src), k, self.scale, self.wide, table)
        return own

    def __call__(self, grad: torch.Tensor, k: torch.Tensor, weights, src: torch.Tensor | None = None) -> torch.Tensor:
        """``src``: as :class:`_GroupSTE`'s (an address table only with the Triton kernel)."""
        w = self._w(weights, src)
        # The group's incoming gradient is the layers' weight gradients joined into a buffer of the backward's
        # own, which nothing else reads: the term goes into it in place, so the backward's peak holds no
        # second (R, D) buffer (the kernel reads and writes each element in the same program).
        own = writable_gradient(grad)
        if self.wide is not None:
            out = grad if own else torch.empty_like(grad)
            fused_search.engine_commit(grad.contiguous(), w, k, self.scale, self.wide, out)
            return out
        if own and grad.dtype == w.dtype:
            return grad.addcmul_(self.scale.to(grad.dtype), w - k.to(w.dtype))
        return torch.addcmul(grad, self.scale.to(grad.dtype), w - k.to(w.dtype))


class _Group:
    """The layers of one vector size D: flat layout and search state.

    Layer ``i``'s kernels are rows ``rows[i][0] ..`` of every ``(R, D)`` / ``(R,)`` buffer, its pool
    rows ``pools[i][0] ..`` of the flat ``(P, D)`` pool.

    Attributes (device tensors unless said):
        layers: the :class:`~nwsconvert.core.nwsmodel.NWSLayer` s, in model order.
        rows, pools: per layer ``(offset, count)`` (Python ints).
        fused: whether the update runs the engine's Triton kernels (else torch ops and ``search``).
        blocks, wide: the block tables (:func:`~nwsconvert.core.fused_search.row_blocks`) of
            :data:`~nwsconvert.core.fused_search.BLOCK_R` rows (the torch ops' search; None when ``fused``) and
            :func:`~nwsconvert.core.fused_search.wide_rows` rows (the Triton kernels'; the commitment's too).
        layer_table: the persistent search's per-layer table (:func:`~nwsconvert.core.fused_search.layer_table`),
            when ``fused``.
        pool_grid: ``(L * Pmax,)`` int64: layer ``i``'s pool rows at ``i * Pmax ..``, then the index ``P``
            (a padding slot): a per-pool-row vector with one value appended, gathered through it and
            viewed ``(L, Pmax)``, reduces per layer along dim 1 (no scatter of P rows into L slots).
        ref: ``(R, D)`` float32 W at each row's last search. budget: ``(R,)`` float32 squared budget
            (<= 0 or NaN: search again).
        index: ``(R,)`` int32 pool-local index. seen: ``(P, D)`` float32, the pools the budgets account
            for, which the search runs against. native: the same pools in their own dtype (``seen``
            itself when float32). move: ``(L,)`` float64 largest pool-entry movement at the last change.
            stale: ``(L,)`` int8, scalar pools no longer the ones the exact intervals were cut from.
        pieces: per layer, its gathered weight in W's shape (views of one buffer) from the last update.
        w_table: the layers' W address table (:meth:`_w_table`), once built; None while W is concatenated.
        need: ``(R,)`` int8: 0 where the last update did not search the row, 1 where it did, 2 where it
            searched it in float64; per-layer counts are taken from it when read (:meth:`counts`).
    """

    def __init__(self, dim: int, layers: list, device: torch.device, search):
        self.dim, self.layers, self.search = dim, layers, search
        self.fused = search is None
        self.rows, self.pools = [], []
        r = p = 0
        for layer in layers:
            self.rows.append((r, layer.nws.num_vectors))
            self.pools.append((p, layer.nws.pool_size))
            r += layer.nws.num_vectors
            p += layer.nws.pool_size
        self.row_counts = [count for _, count in self.rows]  # rows per layer
        self.shapes = [layer.nws.weight_shape for layer in layers]
        # Each layer's parametrization (holding W as ``original``): one attribute read per step and layer
        # instead of the three module look-ups of NWSLayer.weight.
        self.holders = [layer.module.parametrizations.weight for layer in layers]
        segments = [(count, size) for (_, count), (_, size) in zip(self.rows, self.pools)]
        # The torch ops' search reads the narrow block table; the Triton kernels read the wide one and the
        # persistent search's per-layer table (a narrow table is 406 K entries for ResNet-50's 13 M rows).
        self.blocks = None if self.fused else row_blocks(segments, device)
        self.wide = row_blocks(segments, device, fused_search.wide_rows(dim))
        self.layer_table = layer_table(segments, device) if self.fused else None
        if not self.fused:  # per-row tables of the torch ops
            counts = torch.tensor([count for _, count in self.rows], device=device)
            self.row_layer = torch.repeat_interleave(torch.arange(len(layers), device=device), counts)
            self.row_pool = torch.tensor([off for off, _ in self.pools], device=device).index_select(0, self.row_layer)
        widest = max(n for _, n in self.pools)
        grid = torch.full((len(layers), widest), p, dtype=torch.int64)
        for i, (off, n) in enumerate(self.pools):
            grid[i, :n] = torch.arange(off, off + n)
        self.pool_grid = grid.view(-1).to(device)
        self.consts = fused_search.engine_consts(dim, device)
        self.ones = torch.ones(dim, device=device)
        # Reference and budget: scalar pools keep none until a pool moves (their exact intervals need
        # neither): 8 bytes a row that 1x1 convolutions (most rows of a ResNet-50) never use in a task.
        self.ref: torch.Tensor | None = None
        self.budget: torch.Tensor | None = None
        if dim != 1:
            self._start_tracking()
        self.index = torch.cat([layer.nws.indices.to(device=device, dtype=torch.int32) for layer in layers])
        self.index_pieces = list(self.index.split([count for _, count in self.rows]))
        seen = []  # the pools each layer's budgets were measured against
        for layer, (off, count) in zip(layers, self.rows):
            nws = layer.nws
            nws._settle_shift()  # the engine keeps budgets per row only
            prep = nws._prep
            state = nws._ref is not None and nws._budget_sq is not None and nws._ref.shape[0] == count
            ok = state and prep is not None and prep.pool.shape == nws.pool.shape and prep.pool.device == device
            if ok and self.ref is not None and self.budget is not None:
                self.ref[off : off + count] = nws._ref.to(device=device, dtype=torch.float32)
                self.budget[off : off + count] = nws._budget_sq.to(device)
                seen.append(prep.pool.float())  # (a float64 model never reaches here: SearchEngine refuses it)
            else:
                seen.append(nws.pool.detach().float())
        self.seen = torch.cat(seen)
        self.native = self.seen
        self.move = torch.zeros(len(layers), dtype=torch.float64, device=device)
        self.stale = torch.zeros(len(layers), dtype=torch.int8, device=device)
        self._pool_stamp: list | None = None
        self._cut_stamp = self._stamp_pools()  # the pools the scalar intervals are cut from (below)
        self.cells = None
        if dim == 1:
            # Scalar pools: each entry's exact interval (PreparedPool.lo32 / hi32). A kernel strictly
            # inside its entry's interval keeps it, however far it moved: the per-layer path's test,
            # which searches far fewer kernels than the radius budget. Valid while the pools are the
            # ones the intervals were cut from; a layer whose pool moves goes back to its budgets.
            preps = [PreparedPool(layer.nws.pool.detach()) for layer in layers]
            self.cells = (
                torch.cat([p.lo32 for p in preps]).to(device),
                torch.cat([p.hi32 for p in preps]).to(device),
                torch.cat([p.pool for p in preps]).to(device),
            )
            if any(bool(p.pool.isnan().any()) for p in preps):  # NaN entries: never "unchanged", as before
                self._start_tracking()
        self.pieces: list[torch.Tensor] | None = None
        # The layers' W addresses, on the device and on the host (the Triton kernels read float32 W where it is).
        self.w_table: torch.Tensor | None = None
        self._w_ptrs: tuple[int, ...] | None = None
        self._scales: tuple[tuple[float, ...], _Commit] | None = None  # (per-layer scales, their commitment)
        self.need = torch.zeros(r, dtype=torch.int8, device=device)

    def __deepcopy__(self, memo) -> _Group:
        """A copy without the last update's weights (autograd outputs, which cannot be deep-copied: a copied
        model, e.g. a best-so-far snapshot taken mid-stage, gathers its own at its next training forward)."""
        clone = _Group.__new__(_Group)
        memo[id(self)] = clone
        for name, value in vars(self).items():
            # (the address table is the original's W's: the copy makes its own at its first update)
            dropped = name in ("pieces", "w_table", "_w_ptrs")
            setattr(clone, name, None if dropped else copy.deepcopy(value, memo))
        return clone

    def _start_tracking(self) -> None:
        """Allocate every row's reference and budget (none yet: searched at the next update)."""
        rows, device = sum(n for _, n in self.rows), self.consts.device
        self.ref = torch.zeros(rows, self.dim, device=device)
        self.budget = torch.full((rows,), -1.0, device=device)

    def _stamp_pools(self) -> list:
        return [(id(p), p.data_ptr(), p._version) for p in (layer.nws.pool for layer in self.layers)]

    def _commit(self) -> _Commit | None:
        """The commitment gradient's scales, per layer ``(L,)`` float32 (Triton kernel) or per row
        ``(R, 1)`` (torch ops); None when every layer's is 0. Built once per commitment setting."""
        scales = tuple(layer.nws._fused_scale() for layer in self.layers)
        if not any(scales):
            return None
        if self._scales is None or self._scales[0] != scales:
            device = self.index.device
            per_layer = torch.tensor(scales, dtype=torch.float32, device=device)
            if not self.fused:
                per_layer = per_layer.index_select(0, self.row_layer)[:, None]
            self._scales = (scales, _Commit(self.dim, per_layer, self.wide if self.fused else None))
        return self._scales[1]

    @full_precision
    @torch.no_grad()
    def refresh(self, moved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Search what drifted and gather every layer's K; the layers' indices brought up to date. No host
        sync, fixed shapes (capturable in a CUDA graph when ``fused``).

        Args:
            moved: a pool changed since the last update (:meth:`_track_pools`, run first).

        Returns:
            ``(k, src)``: K ``(R, D)`` in the pools' dtype, and where it read W: the layers' W address table
            (:meth:`_w_table`), or W concatenated ``(R, D)`` float32.
        """
        table = self._w_table() if self.fused else None
        if table is None:
            src = torch.cat([holder.original.detach().reshape(-1, self.dim) for holder in self.holders])
            src = src if src.dtype == torch.float32 else src.float()
        else:
            src = table
        k = self._update_fused(src, moved) if self.fused else self._update_torch(src, moved)
        torch._foreach_copy_([layer.nws.indices for layer in self.layers], self.index_pieces)
        return k, src

    def _w_table(self) -> torch.Tensor | None:
        """The ``(L,)`` int64 table of the layers' W addresses on the device, when every W is float32 and
        contiguous (else None: the rows are concatenated). A new tensor whenever an address changed (a
        backward still holding the old one reads the old, saved W); built through pinned memory on CUDA
        (no host sync)."""
        weights = [holder.original for holder in self.holders]
        device = self.index.device
        if device.type == "cuda" and fused_search._interpreting():
            return None  # (the kept table too: the interpreter cannot read the memory it points at)
        if not all(w.dtype == torch.float32 and w.is_contiguous() for w in weights):
            return None
        ptrs = tuple(w.data_ptr() for w in weights)
        if ptrs != self._w_ptrs:
            table = _address_table(weights, device)
            if table is None:
                return None  # a graph being captured: concatenate, which captures
            self.w_table, self._w_ptrs = table, ptrs
        return self.w_table

    @full_precision
    def attach(self, k: torch.Tensor, src: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Make ``k`` (:meth:`refresh`) the layers' weights for the next forward, differentiable in W while grad
        is on. ``src``: where :meth:`refresh` read W, for the commitment term's backward to read it there
        instead of concatenating W again (an address table; concatenated rows only where they live through
        the step anyway), or None. Returns the layers' temporary weights."""
        weights = [holder.original for holder in self.holders]
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            exact = src is not None and all(w.dtype == torch.float32 for w in weights)  # then src reads W bit for bit
            self.pieces = list(_GroupSTE.apply(k, self._commit(), src if exact else None, *weights))
        else:
            self.pieces = [piece.view(shape) for piece, shape in zip(k.split(self.row_counts), self.shapes)]
        return weights

    def _track_pools(self) -> bool:
        """Take in pool changes: each layer's largest entry movement since the pools the budgets account for
        (``move``), the scalar pools' staleness, and the new pools (``seen``, ``native``). Only when a
        pool's identity, storage or version changed since the last update (an in-place edit, an optimiser
        step, a new tensor): a frozen pool costs nothing per step. Returns whether it ran."""
        pools = [layer.nws.pool for layer in self.layers]
        stamp = self._stamp_pools()
        if stamp == self._pool_stamp:
            return False
        self._pool_stamp = stamp
        if self.ref is None and stamp != self._cut_stamp:  # a scalar pool moved: its layer needs budgets
            self._start_tracking()
        now = torch.cat([p.detach().float() for p in pools])
        # Budgets shrink by their layer's largest pool-entry movement (float64, 1e-5 slack, rounded down),
        # measured in float64: a float32 norm of a tiny move can underflow to 0, which shrinks nothing.
        entry_move = (now.double() - self.seen.double()).norm(dim=1)
        self.move.copy_(self._per_layer(entry_move).amax(1))  # NaN stays NaN
        self.seen.copy_(now)  # in place: a CUDA graph replaying the step carries it over
        native = [p.detach() for p in pools]
        if all(p.dtype == torch.float32 for p in native):
            self.native = self.seen
        elif self.native is not self.seen and all(p.dtype == self.native.dtype for p in native):
            torch.cat(native, out=self.native)  # in place: a graphed update reads it where it was captured
        else:
            self.native = torch.cat(native)
        if self.cells is not None:
            changed = (~(now == self.cells[2])).any(dim=1)  # NaN counts as changed
            self.stale.copy_(self._per_layer(changed).any(1))
        return True

    def _update_fused(self, src: torch.Tensor, moved: bool) -> torch.Tensor:
        """The update in five Triton launches and one cumulative sum (fixed shapes, no host sync). ``src``: W's
        rows ``(R, D)`` float32, or the layers' W address table (:meth:`_w_table`)."""
        state = (self.ref, self.budget, self.index, self.need, self.consts)
        cells = self.cells[:2] if self.cells is not None else None
        fused_search.engine_flags(state, self.wide, src, moved, self.move, self.stale, cells, self.dim)
        rows, device = self.index.numel(), self.index.device
        csum = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        perm = torch.empty(rows, dtype=torch.int32, device=device)
        fused_search.engine_search(state, self.wide, self.layer_table, src, self.seen, csum, perm)
        k = torch.empty(rows, self.dim, dtype=self.native.dtype, device=device)
        fused_search.engine_gather(self.index, self.native, self.wide, k)
        return k

    def _update_torch(self, x: torch.Tensor, moved: bool) -> torch.Tensor:
        """The update in torch ops, searching the flagged rows with ``search``."""
        budget, ref = self.budget, self.ref
        outside = None
        if self.cells is not None:
            lo, hi, _ = self.cells
            entry = self.index + self.row_pool
            value = x[:, 0]
            outside = ~((lo.index_select(0, entry) < value) & (value < hi.index_select(0, entry)))
        if ref is not None and budget is not None:
            if moved:
                move = self.move.index_select(0, self.row_layer)
                budget = torch.where(move != 0, shrunk_budget_sq(budget, move * (1 + 1e-5)), budget)  # NaN: searched
            drift = torch.mv((x - ref).square_(), self.ones)
            need = ~(drift < budget)  # NaN counts as drifted
            if outside is not None:
                need = torch.where(self.stale.bool().index_select(0, self.row_layer), need, outside)
        else:
            assert outside is not None  # only scalar pools keep no budgets
            need = outside
        index, radius, exact = self.search(x, self.seen, self.blocks, need)
        self.index.copy_(torch.where(need, index, self.index))
        if ref is not None and budget is not None and self.budget is not None:
            ref.copy_(torch.where(need[:, None], x, ref))
            self.budget.copy_(torch.where(need, budget_sq(radius, x, x), budget))
        self.need.copy_(need.to(torch.int8) + exact.to(torch.int8))
        return self.native.index_select(0, self.index + self.row_pool)

    def _per_layer(self, values: torch.Tensor) -> torch.Tensor:
        """``(P,)`` per pool row -> ``(L, Pmax)``, each layer's row padded with zeros (``False``)."""
        padded = torch.cat([values, values.new_zeros(1)])
        return padded.index_select(0, self.pool_grid).view(len(self.layers), -1)

    def counts(self) -> torch.Tensor:
        """``(L, 2)`` int64: rows the last update searched, and searched in float64, per layer (each
        layer's rows are contiguous: differences of one cumulative sum at the layer offsets)."""
        flags = torch.stack([self.need != 0, self.need == 2], 1).to(torch.int64)
        total = torch.cat([flags.new_zeros(1, 2), flags.cumsum(0)])
        starts = torch.tensor([off for off, _ in self.rows], device=flags.device)
        ends = torch.tensor([off + count for off, count in self.rows], device=flags.device)
        return total.index_select(0, ends) - total.index_select(0, starts)

    @torch.no_grad()
    def hand_back(self) -> None:
        """Give every layer the state the engine kept, so that its own lazy search goes on from it."""
        counts = self.counts().tolist()
        for i, layer in enumerate(self.layers):
            nws = layer.nws
            (off, count), (poff, size) = self.rows[i], self.pools[i]
            nws.stats = {"searched": counts[i][0], "total": count, "exact_rows": counts[i][1]}
            if self.dim == 1 or self.ref is None or self.budget is None:
                nws._scalar_ready = True  # scalar pools need no state beyond the indices
                continue
            nws._ref = self.ref[off : off + count].clone()
            nws._budget_sq = self.budget[off : off + count].clone()
            nws._shift, nws._shift_steps = 0.0, 0
            nws._prep = PreparedPool(self.seen[poff : poff + size].to(nws.pool.dtype))


#: Eager updates with the same buffers and no pool moved before a graphed engine captures its update.
GRAPH_WARMUP = 2


class _UpdateGraph:
    """The engine's update with no pool moved (every group's :meth:`_Group.refresh`) captured in one CUDA graph.

    Built at an update: runs that update eagerly on a side stream first (a graph's warm-up), its result
    in ``warm``, then captures it (a capture runs nothing). :meth:`replay` reruns the captured kernels on
    the current stream and returns the graph's output buffers ``[(k, src), ...]`` per group, rewritten in
    place by every replay. The capture reads every buffer at its address then: the engine replays only
    while those addresses stay the same (:meth:`SearchEngine._buffers`). ``error``: why the capture failed
    (None: it did not); the warm-up's result is there either way.
    """

    def __init__(self, engine: SearchEngine):
        device = engine.device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.warm = engine._refresh_groups()
        current.wait_stream(side)
        for pair in self.warm:  # made on the side stream, read and freed on this one
            for t in pair:
                t.record_stream(current)
        self.outputs: list | None = None
        self.error: str | None = None
        self.graph = torch.cuda.CUDAGraph()
        try:
            # A private pool per graph (GraphedStep says why); thread_local: a DataLoader's pin-memory thread
            # may use CUDA while this thread captures.
            with torch.cuda.device(device), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.outputs = engine._refresh_groups()
        except RuntimeError as e:  # e.g. an op this torch or driver cannot capture: the engine goes on eagerly
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda"

    def replay(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.outputs is not None  # (replayed only after a capture that succeeded)
        self.graph.replay()
        return self.outputs

    def __deepcopy__(self, memo) -> None:
        return None  # a copied model's engine captures its own (a CUDA graph cannot be copied)


#: How a graphed engine captures its update (tests substitute a stand-in that runs the bookkeeping on CPU).
GRAPH_CAPTURE = _UpdateGraph


class SearchEngine:
    """Model-level lazy exact search (see the module docstring).

    Args:
        model: a converted model; its NWS layers must not change (shape, pool size) while the engine runs.
        kernel: the search of the flagged rows. ``triton``: the fused kernel
            (:func:`~nwsconvert.core.fused_search.segmented_nearest_two`; on CPU only under
            ``TRITON_INTERPRET=1``, which CI uses to see the CUDA path's host work); ``torch``: the
            layers' BLAS + NumPy search over the flagged rows (reads their number: fine on CPU);
            ``auto``: ``triton`` on CUDA with Triton, else ``torch``.
        graph: capture the update (searches, gathers, the indices' copies: some 20 launches and their
            Python) in a CUDA graph once :data:`GRAPH_WARMUP` eager updates saw the same buffers, and replay
            it at every update where no pool moved and those buffers are still the ones captured (pool
            learning's updates, a weight given new storage, run eagerly; a new capture follows). The rest of
            the step stays eager; the indices and weights are the eager update's. A weight the last update
            gave out that something still holds (a forward not yet backpropagated, a caller's copy) is never
            rewritten: that update runs eagerly. A capture the driver refuses warns once and leaves the
            engine eager. Costs the graph's temporaries, kept in its pool; for weights other than float32
            also one W-sized float32 buffer through the step (W as searched, which the commitment term's
            backward then reads instead of concatenating W again; float32 W is read where it is). Needs
            ``kernel='triton'`` on CUDA. Inside a capture of the whole step (``cuda_graph=true``) the update
            runs as captured there.

    Attributes:
        captures, replays: graphs captured and replayed so far (``graph=True``).

    Raises:
        RuntimeError: ``kernel='triton'`` where it cannot run; ``graph=True`` without CUDA.
        ValueError: a layer holds float64 weights or pools (the engine searches in float32; the layers' own search,
            ``search='layer'``, is exact for them).
    """

    def __init__(self, model: nn.Module, kernel: str = "auto", graph: bool = False):
        layers = _require(model)
        wide = _float64_layer(layers)
        if wide is not None:
            raise ValueError(
                f"layer {wide.name!r} holds float64 weights or pools, which the search engine would round to float32: "
                "train with search='layer' (exact in float64), or convert the model to float32 first"
            )
        device = layers[0].weight.device
        if kernel == "auto":
            kernel = "triton" if device.type == "cuda" and fused_search.available(device) else "torch"
        if kernel == "triton" and not fused_search.available(device):
            raise RuntimeError(
                f"SearchEngine(kernel='triton') on {device} needs Triton, and on CPU "
                "TRITON_INTERPRET=1; kernel='torch' runs everywhere"
            )
        if kernel not in ("triton", "torch"):
            raise ValueError(f"kernel={kernel!r}: choose auto, triton or torch")
        if graph and kernel != "triton":
            raise ValueError(
                "SearchEngine(graph=True) captures the Triton kernels' update; kernel='torch' reads the device back"
            )
        if graph and not GRAPH_CAPTURE.supports(device):
            raise RuntimeError(f"SearchEngine(graph=True) captures a CUDA graph; the model is on {device}")
        self.kernel, self.graph, self.device = kernel, graph, device
        self.captures = self.replays = 0
        self._graph: _UpdateGraph | None = None
        self._graph_key: tuple | None = None
        self._warm = 0  # eager updates in a row that saw the buffers of _warm_key
        self._warm_key: tuple | None = None
        dims: dict[int, list] = {}
        for layer in layers:
            dims.setdefault(layer.nws.vector_size, []).append(layer)
        self.groups = [
            _Group(d, members, device, None if kernel == "triton" else _TorchSearch())
            for d, members in sorted(dims.items())
        ]
        self.total = sum(count for g in self.groups for _, count in g.rows)  # kernels of every layer
        self._place = {}
        for g in self.groups:
            for i, layer in enumerate(g.layers):
                self._place[id(layer.nws)] = (g, i)
                layer.nws._engine = weakref.ref(self)
        self._stamp: dict[int, tuple] | None = None
        self._used: dict[int, bool] = {}
        self._hook: RemovableHandle | None = model.register_forward_pre_hook(self._pre_forward)

    # ------------------------------------------------------------------ use
    def __enter__(self) -> SearchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pre_forward(self, module: nn.Module, args) -> None:
        if module.training:
            self.update()

    @staticmethod
    def _state(weight: torch.Tensor, pool: torch.Tensor) -> tuple:
        """What an update read of a layer, checkable without touching device memory: W's and the pool's identity and version."""
        return (id(weight), weight._version, id(pool), pool._version)

    def update(self) -> None:
        """Bring every layer's indices up to date with its temporary weights and pool, and gather the
        weights the next forward uses (differentiable in W when grad is enabled, as in a forward)."""
        moved = [g._track_pools() for g in self.groups]
        stamp = {}
        for g, (k, src) in zip(self.groups, self._refresh(moved)):
            # the backward reads W where the update did: through the table, or (graphed) in the graph's copy
            weights = g.attach(k, src if self.graph or src.dim() == 1 else None)
            for layer, w in zip(g.layers, weights):
                stamp[id(layer.nws)] = self._state(w, layer.nws.pool)
        self._stamp = stamp
        self._used = dict.fromkeys(stamp, False)

    def _refresh(self, moved: list[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every group's :meth:`_Group.refresh`: eagerly, or (``graph=True``) replayed from the captured graph."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not self.graph or any(moved) or capturing:  # a moved pool's step shrinks budgets: not the graph's
            self._warm = 0
            return [g.refresh(m) for g, m in zip(self.groups, moved)]
        key = self._buffers()
        if self._graph is not None and key == self._graph_key:
            for g in self.groups:
                g.pieces = None  # the last update's views of the graph's outputs, made again by attach()
            if self._outputs_held():  # a weight handed out never changes under its holder: this update eager
                return self._refresh_groups()
            self.replays += 1
            outs = self._graph.replay()
            # A replay writes the layers' indices behind autograd's version counters, which the layers' own
            # weight caches and commitment bookkeeping read: count it as the in-place write it is.
            torch.autograd.graph.increment_version([layer.nws.indices for g in self.groups for layer in g.layers])
            return outs
        self._warm = self._warm + 1 if key == self._warm_key else 1
        self._warm_key = key
        if self._warm < GRAPH_WARMUP:
            return self._refresh_groups()
        self._graph = None  # the old graph's memory goes before the new one's is taken
        graph = GRAPH_CAPTURE(self)
        outs = graph.warm
        graph.warm = []  # this update's: the graph keeps no reference to them
        if graph.error is not None:
            warnings.warn(
                f"SearchEngine(graph=True): the update could not be captured in a CUDA graph ({graph.error}); "
                "it runs eagerly from here",
                stacklevel=2,
            )
            self.graph = False
            return outs
        self._graph, self._graph_key = graph, key
        self.captures += 1
        return outs

    def _refresh_groups(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every group's :meth:`_Group.refresh` with no pool moved: what a graph captures."""
        return [g.refresh(False) for g in self.groups]

    def _outputs_held(self) -> bool:
        """Whether a tensor other than the graph's own output references the storage of one of its outputs:
        a weight the last update gave out, held by a forward not yet backpropagated or by a caller (the
        groups' own views dropped first). A replay would rewrite it under its holder."""
        outputs = self._graph.outputs if self._graph is not None else None
        if not outputs:
            return False
        # Each output tensor holds its storage once, and the temporary storage object once more. (An address
        # table is the group's own, not the graph's: not an output that is given out.)
        return any(
            torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2
            for pair in outputs
            for t in pair
            if t.dim() == 2
        )

    def _buffers(self) -> tuple:
        """The addresses a captured update reads and writes outside its own memory: every W (with its dtype
        and strides), every layer's indices, and the groups' state that can be reallocated (the rest lives
        as long as the engine)."""
        key: list = []
        for g in self.groups:
            key += [(h.original.data_ptr(), h.original.dtype, h.original.stride()) for h in g.holders]
            key += [layer.nws.indices.data_ptr() for layer in g.layers]
            # (a group's W address table is made again only when a W moved, which the key holds already)
            key += [t.data_ptr() if t is not None else 0 for t in (g.ref, g.budget, g.seen, g.native)]
        return tuple(key)

    def weight(self, nws, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """The gathered weight of layer ``nws`` (an :class:`~nwsconvert.core.layers.NWSWeight`) for a training forward.

        ``weight``: the layer's temporary weights W as its forward received them (read from the layer when
        not given). Updates first when a weight or pool changed since the last update (a forward that did
        not go through the model's own, e.g. a submodule called on its own). None for a layer the engine
        does not manage."""
        place = self._place.get(id(nws))
        if place is None or place[0].layers[place[1]].nws is not nws:
            return None  # not one of this engine's layers (e.g. a deep copy of the model)
        g, i = place
        w = weight if weight is not None else g.layers[i].weight
        if self._stamp is None or self._stamp[id(nws)] != self._state(w, nws.pool) or self._used[id(nws)]:
            self.update()  # W or a pool changed, or this layer's weight already went into a forward
        self._used[id(nws)] = True
        assert g.pieces is not None  # update() gathered every group's pieces before _stamp was set
        return g.pieces[i]

    def manages(self, layers) -> bool:
        """Whether this engine keeps the search state of every one of ``layers`` (NWSLayer s)."""
        return all(id(layer.nws) in self._place for layer in layers) and len(layers) == len(self._place)

    def searched_fraction(self) -> torch.Tensor:
        """Fraction of kernels the last update re-searched, a 0-dim device tensor (no host sync)."""
        return sum((g.need != 0).sum() for g in self.groups) / max(self.total, 1)

    def stats(self) -> dict:
        """Kernels re-searched by the last update, as :func:`~nwsconvert.core.nwsmodel.search_stats` reports them
        (reading them back is one host sync)."""
        total = self.total
        if self._stamp is None:
            return {"searched": 0, "total": total, "fraction": 0.0, "exact_rows": 0}
        counts = torch.stack([torch.stack([(g.need != 0).sum(), (g.need == 2).sum()]) for g in self.groups]).sum(0)
        searched, exact = (int(v) for v in counts.tolist())
        return {"searched": searched, "total": total, "fraction": searched / max(total, 1), "exact_rows": exact}

    def close(self) -> None:
        """Remove the hook and hand the search state back to the layers."""
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        self._graph = None
        for g in self.groups:
            if g.pieces is not None:
                g.hand_back()
            for layer in g.layers:
                layer.nws._engine = None


def _float64_layer(layers: list):
    """The first of ``layers`` whose weight or pool is float64, or None."""
    f64 = torch.float64
    return next((layer for layer in layers if layer.weight.dtype == f64 or layer.nws.pool.dtype == f64), None)


def search_engine(model: nn.Module, search: str = "auto", graph: bool = False) -> SearchEngine | None:
    """The engine a training stage runs with ``search`` (``TrainConfig.search``), or None for the layers' own search.

    ``auto``: an engine on CUDA where Triton is installed, for a model without float64 weights; ``engine``:
    always (an error where the fused search cannot run, or on float64 weights); ``layer``: never.
    ``graph``: :class:`SearchEngine`'s (``TrainConfig.engine_graph``)."""
    if search == "layer":
        return None
    layers = _require(model)
    device = layers[0].weight.device
    if search == "auto" and not (device.type == "cuda" and fused_search.available(device)):
        return None
    if search == "auto" and _float64_layer(layers) is not None:
        return None  # the layers' own search: exact in float64, where the engine's float32 would round
    return SearchEngine(model, graph=graph)  # its kernel: Triton on CUDA, the BLAS + NumPy search on CPU
