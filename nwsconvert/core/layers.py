"""The NWS layer: a weight parametrization that draws every kernel from a pool.

:class:`NWSWeight` is registered on a layer's ``weight`` with
``torch.nn.utils.parametrize``. The host module keeps its class and its own
``forward`` (so ``Conv2dSame`` padding, ``StdConv2d`` standardisation,
``CondConv2d`` expert mixing... stay exactly as they were); only the tensor it
reads as ``self.weight`` changes:

* ``host.parametrizations.weight.original`` holds the temporary weights W
  (trainable, same shape as the original weight);
* ``NWSWeight.pool`` is the layer's pool M, ``(n, D)``;
* ``NWSWeight.indices`` holds the chosen pool entry of every kernel, ``(N,)``;
* ``host.weight`` returns ``K = M[indices]`` reshaped to W's shape.

In training mode every forward brings ``indices`` up to date with W (exact
nearest neighbour, re-searching only kernels that drifted past their safe
radius, see ``search.py``; on a CPU such a kernel is first settled between its
entry and its runner-up when the last search's bound on every other entry allows)
and passes the gradient of K straight through to W.
In eval mode ``indices`` are used as stored. In both modes the gathered weight
is cached and only the rows whose index changed are gathered again, so
inference costs what the dense layer costs and a training step does not
rebuild every weight.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .rounding import RADIUS_SHRINK, budget_sq, full_precision, round_f32, shifted_drift_sq, shrunk_budget_sq
from .search import (
    DEFAULT_CHUNK,
    PreparedPool,
    flat_nonzero,
    index_sum,
    nearest_scalar,
    nearest_scalar_from,
    nearest_two,
    pair_sq_dist,
)

if TYPE_CHECKING:
    from .engine import SearchEngine

__all__ = ["NWSWeight", "index_bits"]


#: dtype of the lazy search's reference copy of W. float32 makes the copy exact
#: (no budget lost to rounding); float16 halves its memory but every row whose
#: safe radius is below its own rounding error is re-searched at every step.
REF_DTYPE = torch.float32


#: Weight dtypes whose values are all exact float32 values.
_F32_EXACT = (torch.float32, torch.float16, torch.bfloat16)

#: Float dtypes NumPy holds (not bfloat16).
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)

_SCRATCH: dict = {}


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable temporary of ``numel`` elements (shared by all layers, never escapes a call).

    Reusing it saves the page faults of allocating and freeing a layer-sized
    tensor at every training step.
    """
    key = (like.device, like.dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _SCRATCH[key] = buf
    return buf[:numel]


def _rows_not_below(value: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Rows where ``value < bound`` fails (NaN included), ``(k,)`` int64 ascending."""
    if value.device.type == "cpu" and value.dtype in _NUMPY_FLOATS and bound.dtype in _NUMPY_FLOATS:
        # NumPy: about 3x faster than torch's compare + nonzero here.
        return torch.from_numpy(np.flatnonzero(~np.less(value.numpy(), bound.numpy())))
    return (~(value < bound)).nonzero().squeeze(1)


def _scatter_index(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` for an op that scatters into the pool (``index_select``'s backward, ``index_add_``): int64 on
    a CPU, where torch vectorises those ops for int64 only (4-5x faster than int32, the same sums in the same
    order: bitwise equal); as they are on a GPU (no extra launch per layer)."""
    return indices.long() if indices.device.type == "cpu" else indices


def _copied_into(into: torch.Tensor | None, src: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``src``, written into ``into`` when it has the same shape, dtype and device (no
    allocation and page faults of a new tensor: a task start restores ResNet-18's 49 MB of search state)."""
    if src is None:
        return None
    if into is None or into.shape != src.shape or into.dtype != src.dtype or into.device != src.device:
        return src.clone()
    return into.copy_(src)


def writable_gradient(grad: torch.Tensor) -> bool:
    """Whether a custom backward may add to its incoming ``grad`` in place: a contiguous tensor of its own, no
    view, held once (autograd made it for this op's output alone, and nothing else reads it). A gradient
    autograd hands to two places (``weight + delta``: the sum's backward gives both the same tensor), or
    that ``torch.autograd.grad`` returns, is held twice. A Python hook that keeps the tensor is not seen."""
    return grad.is_contiguous() and not grad._is_view() and grad._use_count() == 1  # type: ignore[attr-defined]


def index_bits(pool_size: int) -> int:
    """Bits per stored index for a pool of ``pool_size`` entries (``ceil(log2 n)``, at least 1)."""
    return max(1, math.ceil(math.log2(pool_size)))


class _GatherSTE(torch.autograd.Function):
    """``K = pool[indices]`` in the forward, straight-through gradient to W in the backward.

    The forward value is exactly the gathered pool vectors (no ``W + (K - W)``
    rounding), so an NWS forward equals the materialised dense forward bitwise.
    With ``scale > 0`` the backward also adds ``scale * (W - K)``: the gradient
    of the commitment term ``c * mean((W - sg[K])^2)`` for ``scale = 2c / W.numel()``,
    fused into the pass that hands the gradient to W.
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, gathered: torch.Tensor, scale: float) -> torch.Tensor:
        k = gathered.view(weight.shape)  # M[indices], built (or kept) by NWSWeight._gathered
        ctx.scale = scale
        if scale:
            ctx.save_for_backward(weight, k)
        return k

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.scale:
            return grad, None, None
        weight, k = ctx.saved_tensors
        if grad.dtype == weight.dtype and writable_gradient(grad):
            # The weight gradient the layer's own op computed for K, which nothing else reads: added to in
            # place (a new tensor of the weight's size costs its allocation and page faults every step).
            out = grad.add_(weight, alpha=ctx.scale)
        else:
            out = torch.add(grad, weight, alpha=ctx.scale)
        out.sub_(k.to(out.dtype), alpha=ctx.scale)
        return out, None, None


class _DistillFromK(torch.autograd.Function):
    """``mse_loss(pool[index], W)`` given ``K = pool[index]`` already gathered: the forward gathers nothing;
    the backward is what autograd runs for the gathered form (``mse_loss_backward``, then ``index_select``'s
    backward: a zero pool gradient with ``index_add_``), so the gradient has the same bits wherever the
    gathered form's are reproducible (on a CPU; on CUDA with ``deterministic=true``, ``index_add_`` adding
    with atomics otherwise).

    On a CPU both passes work in the shared scratch instead of new layer-sized tensors (whose page faults
    cost more than the arithmetic), with the same bits: the forward is ``mse_loss``'s own sequence (its
    squared differences, then their mean), and the backward sums the gradient of K by index with
    :func:`~nwsconvert.core.search.index_sum` (2.3x faster with the gradient's pass on ResNet-18's largest
    layer; ``tests/test_layers.py`` compares the bits)."""

    @staticmethod
    def forward(ctx, pool: torch.Tensor, k: torch.Tensor, target: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(k, target, index)
        ctx.pool_shape = pool.shape
        if not _scratch_form(k, target):
            return F.mse_loss(k, target)
        # mse_loss itself: its elementwise squares (reduction 0: none) into the scratch, then their mean
        return torch.ops.aten.mse_loss.out(k, target, 0, out=_scratch(k.numel(), k).view_as(k)).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        k, target, index = ctx.saved_tensors
        n, size = ctx.pool_shape
        if _scratch_form(k, target):
            out = _scratch(k.numel(), grad).view_as(k)
            grad_k = torch.ops.aten.mse_loss_backward.grad_input(grad, k, target, 1, grad_input=out)
        else:
            grad_k = torch.ops.aten.mse_loss_backward(grad, k, target, 1)  # 1: reduction "mean"
        return index_sum(grad_k.reshape(-1, size), index, n), None, None, None


def _scratch_form(k: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether :class:`_DistillFromK` works in the shared scratch: contiguous CPU tensors of one dtype."""
    return k.device.type == "cpu" and k.dtype == target.dtype and k.is_contiguous() and target.is_contiguous()


class NWSWeight(nn.Module):
    """Weight parametrization ``W -> M[nearest(W)]`` with a lazy exact search.

    Args:
        weight: the temporary weights W, e.g. ``(O, I/groups, kh, kw)`` for a
            conv or ``(O, I)`` for a linear layer.
        vector_size: D, floats per pool vector (``kh*kw`` for a kxk conv, the
            group size g for 1x1 convs and linear layers). ``W.numel()`` must be
            a multiple of D; kernel ``i`` is row ``i`` of ``W.reshape(-1, D)``.
        pool: ``(n, D)`` initial pool M.
        role: ``stem`` / ``body`` / ``shortcut`` / ``head`` (for reports).
        search: search every kernel now (default). ``False`` leaves every index 0 for a caller
            that sets them at once (loading a task pack: the search would be thrown away).

    Attributes:
        pool: ``(n, D)`` buffer in task mode, ``nn.Parameter`` in pool-learning mode.
        pool_file_dtype: the dtype the pool file this pool came from stores it in
            (:func:`~nwsconvert.core.nwsmodel.load_pools` sets it; ``float32`` until then).
            While the pool holds values that dtype represents exactly, :func:`pool_set` gives it
            in that dtype, so the model and the file share one pool-set hash.
        indices: ``(N,)`` int32, ``N = W.numel() / D``.
        stats: search statistics of the last training forward
            (``searched``: rows re-searched, ``total``: N, ``exact_rows``: float64 fallbacks).
    """

    # Registered in __init__ (buffers, or pool an nn.Parameter in pool mode); declared for the type checker.
    pool: torch.Tensor
    indices: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, vector_size: int, pool: torch.Tensor, role: str = "body", *, search: bool = True
    ):
        super().__init__()
        if weight.numel() % vector_size:
            raise ValueError(f"weight of shape {tuple(weight.shape)} does not split into vectors of {vector_size}")
        if pool.ndim != 2 or pool.shape[1] != vector_size:
            raise ValueError(f"pool must be (n, {vector_size}), got {tuple(pool.shape)}")
        self.weight_shape = tuple(weight.shape)
        self.vector_size = int(vector_size)
        self.num_vectors = weight.numel() // vector_size
        self.role = role
        self.mode = "task"
        self.register_buffer("pool", pool.detach().to(weight.dtype).clone())
        self.pool_file_dtype = torch.float32
        # int32 indices: half the memory of int64; index_select/bincount accept them.
        self.register_buffer("indices", torch.zeros(self.num_vectors, dtype=torch.int32, device=weight.device))
        # Lazy-search state (D > 1): each row's W at its last search, and the
        # squared distance it may still move before its nearest entry can change
        # (float32, rounded down, shrunk by pool movement; <= 0 or NaN: search again).
        # Plain attributes, not buffers: .half() or .to() must not round them;
        # after a device move the next update searches everything.
        self._ref: torch.Tensor | None = None
        self._budget_sq: torch.Tensor | None = None
        # What the last search of each row knew beyond its nearest entry (CPU): ``(the _budget_sq it goes
        # with, others, other)``. ``other`` (int32) is the runner-up; every entry but the index and ``other``
        # is at least ``others`` away from the row's reference (float32, rounded down; the shift at the time
        # added, as budgets hold theirs). A row past its budget is first settled by comparing its index and
        # ``other`` alone (see _settle_pairs). Valid only beside the very _budget_sq tensor it was made with
        # (an engine writing budgets back drops it).
        self._pair: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Pool movement not yet taken off the rows' budgets (float64, rounded up), and over how many
        # pool changes it was gathered: see _track_pool and rounding.shifted_drift_sq.
        self._shift = 0.0
        self._shift_steps = 0
        self._ones_vec: torch.Tensor | None = None
        self._scalar_ready = False
        self._cache: torch.Tensor | None = None  # M[indices] in W's shape, kept across forwards (see _gathered)
        # (a copy of the pool it was gathered from, id and version of `pool` then)
        self._cache_key: tuple[torch.Tensor, int, int] | None = None
        # (a copy of the indices it holds, id and version of `indices` then)
        self._cache_indices: tuple[torch.Tensor, int, int] | None = None
        # (rows, id, version before, version after) of the last lazy index update
        self._touched: tuple[torch.Tensor, int, int, int] | None = None
        # views of the cache given to callers and autograd graphs
        self._handed_out: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        # (key, weakref to K) of the last training forward, for the commitment loss
        self._last: tuple[tuple, weakref.ref[torch.Tensor]] | None = None
        self._ema: tuple[torch.Tensor, torch.Tensor] | None = None  # (running count, running sum) per entry
        self._prep: PreparedPool | None = None  # PreparedPool of the current pool
        self.commitment_weight = 0.0  # > 0: commitment gradient fused into the backward
        self.export_gather = False  # True while exporting to ONNX (see nwsconvert.export)
        # weakref to the SearchEngine keeping this layer's search state, while one runs
        self._engine: weakref.ref[SearchEngine] | None = None
        self.chunk = DEFAULT_CHUNK
        # exact_rows: a 0-dim device tensor after a fused (CUDA) search
        self.stats: dict[str, int | torch.Tensor] = {"searched": 0, "total": self.num_vectors, "exact_rows": 0}
        if search:  # else the indices stay 0 until the caller sets them (a task pack), and the next
            self.full_search(weight)  # training forward searches every kernel

    # ------------------------------------------------------------------ info
    @property
    def pool_size(self) -> int:
        return self.pool.shape[0]

    @property
    def bits(self) -> int:
        return index_bits(self.pool_size)

    def extra_repr(self) -> str:
        return (
            f"role={self.role}, kernels={self.num_vectors}, vector_size={self.vector_size}, "
            f"pool={self.pool_size}, bits={self.bits}, mode={self.mode}"
        )

    def _ones(self, like: torch.Tensor) -> torch.Tensor:
        if self._ones_vec is None or self._ones_vec.device != like.device or self._ones_vec.dtype != like.dtype:
            self._ones_vec = torch.ones(self.vector_size, dtype=like.dtype, device=like.device)
        return self._ones_vec

    def _vectors(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.detach().reshape(self.num_vectors, self.vector_size)

    def _prepared(self) -> PreparedPool:
        """Search tables of the current pool, rebuilt when its content changes.

        Compared by value (n x D floats, cheap), not by version counter: edits
        through ``.data`` do not bump the counter. For D > 1 the snapshot is also
        the reference :meth:`_track_pool` measures pool movement from, so it is
        only rebuilt by ``_track_pool`` itself or right before a full search.
        """
        pool = self.pool.detach()
        prep = self._prep
        if prep is None or not prep.holds(pool):
            prep = self._prep = PreparedPool(pool)
        return prep

    def _key(self) -> tuple:
        p, i = self.pool, self.indices
        return (id(p), p._version, id(i), i._version, p.device, p.dtype)

    # ---------------------------------------------------------------- search
    @torch.no_grad()
    @full_precision
    def full_search(self, weight: torch.Tensor) -> None:
        """Search every kernel of ``weight`` and restart the lazy-search state."""
        vec = self._vectors(weight)
        exact_rows: int | torch.Tensor = 0
        if self.vector_size == 1:
            self.indices.copy_(nearest_scalar(vec, self._prepared()))
            self._scalar_ready = True
        else:
            # The pair state (see _settle_pairs) for float32 weights, whose reference copy is exact.
            res = nearest_two(vec, self._prepared(), self.chunk, pair=vec.dtype == REF_DTYPE)
            self.indices.copy_(res.index)
            self._ref = vec.to(REF_DTYPE, copy=True)  # never an alias of W
            self._budget_sq = budget_sq(res.radius, vec, self._ref)
            self._pair = None
            if res.second is not None and res.third is not None:
                self._pair = (self._budget_sq, round_f32(res.third, up=False), res.second.to(torch.int32))
            self._shift, self._shift_steps = 0.0, 0
            exact_rows = res.exact_rows
        self.stats = {"searched": self.num_vectors, "total": self.num_vectors, "exact_rows": exact_rows}

    @torch.no_grad()
    def resize(self, weight: torch.Tensor, search: bool = True) -> None:
        """Follow a new weight shape (a resized head): new index table, fresh search; the pool is kept.

        Args:
            weight: the new temporary weights; ``weight.numel()`` must be a multiple of D.
            search: search ``weight`` now; ``False``: the indices stay 0 for the caller to set,
                and the next training forward searches every kernel.
        """
        if weight.numel() % self.vector_size:
            raise ValueError(f"weight of shape {tuple(weight.shape)} does not split into vectors of {self.vector_size}")
        self.weight_shape = tuple(weight.shape)
        self.num_vectors = weight.numel() // self.vector_size
        self.indices = torch.zeros(self.num_vectors, dtype=self.indices.dtype, device=self.indices.device)
        self.invalidate_cache()
        self.reset_search()
        self._last = None
        if search:
            self.full_search(weight)

    def search_state(self) -> tuple:
        """A copy of what the lazy search knows: ``(pool, indices, reference, budgets, scalar intervals
        ready, pair state)``; :meth:`restore_search` puts it back, as if the search that made it ran again."""
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        self._settle_shift()
        pair = self._pair_region()
        return (
            self.pool.detach().clone(),
            self.indices.clone(),
            copy(self._ref),
            copy(self._budget_sq),
            self._scalar_ready,
            None if pair is None else (pair[0].clone(), pair[1].clone()),
        )

    def restore_search(self, state: tuple) -> None:
        """Put back a :meth:`search_state` taken of this layer's weights as they are now: the indices and the
        lazy search continue exactly as after the search that made it.

        Raises:
            ValueError: the state is of another pool or another number of kernels.
        """
        pool, indices, ref, budget, ready, pair = state
        if indices.shape != self.indices.shape or not torch.equal(pool, self.pool.detach()):
            raise ValueError("the search state is of another pool or another number of kernels")
        self._prepared()  # the pool's search tables, as the search that made the state left them
        self.indices.copy_(indices)
        held = self._pair_region()
        self._ref = _copied_into(self._ref, ref)
        self._budget_sq = _copied_into(self._budget_sq, budget)
        self._pair = None
        if pair is not None and self._budget_sq is not None:
            others, other = (_copied_into(h, p) for h, p in zip(held or (None, None), pair))
            assert others is not None and other is not None
            self._pair = (self._budget_sq, others, other)
        self._shift, self._shift_steps = 0.0, 0
        self._scalar_ready = ready
        self._touched = None

    def reset_search(self) -> None:
        """Forget the lazy-search state: the next training forward searches every kernel."""
        self._ref = None
        self._budget_sq = None
        self._pair = None
        self._shift, self._shift_steps = 0.0, 0
        self._scalar_ready = False

    @torch.no_grad()
    def _update_scalar(self, weight: torch.Tensor) -> None:
        """Scalar pools: a kernel keeps its entry while it lies strictly inside that entry's interval."""
        if not self._scalar_ready:
            self.full_search(weight)
            return
        prep = self._prepared()
        x = weight.detach().reshape(-1)
        if x.dtype in _F32_EXACT:  # every value is a float32: float32 cell bounds are exact
            lo, hi, x = prep.lo32, prep.hi32, x.float()
        else:
            lo, hi, x = prep.lo, prep.hi, x.double()
        inside = (lo.index_select(0, self.indices) < x) & (x < hi.index_select(0, self.indices))
        rows = flat_nonzero(~inside)  # NaN counts as outside
        if rows.numel():
            start = self.indices.index_select(0, rows)
            self._set_indices(rows, nearest_scalar_from(x.index_select(0, rows), start, prep))
        self.stats = {"searched": rows.numel(), "total": self.num_vectors, "exact_rows": 0}

    #: Pool changes a layer's shift gathers before it is taken off every row's budget (one pass over
    #: the rows): the shift costs a row's drift test 4 passes, and a large shift beside a small budget
    #: loses float32 digits of that budget.
    SHIFT_STEPS = 32

    @torch.no_grad()
    def _track_pool(self) -> PreparedPool | None:
        """Account for the largest pool-entry movement since the last look.

        Measured by value at every update (n x D floats), so pool edits of any
        kind, ``.data`` included, are accounted for. The movement is added to the
        layer's shift (one number, see :func:`~nwsconvert.core.rounding.shifted_drift_sq`),
        which is taken off every row's budget only every :attr:`SHIFT_STEPS` changes
        and once the pool stops moving.

        Returns:
            The search tables of the current pool, or ``None`` when the lazy-search
            state was dropped (the caller searches everything).
        """
        pool = self.pool.detach()
        seen = self._prep  # the pool as the budgets last accounted for it
        if self._ref is None or seen is None or seen.pool.shape != pool.shape or seen.pool.device != pool.device:
            self.reset_search()  # the next update searches everything against the new pool
            return None
        if seen.holds(pool):  # the usual case in task mode
            self._settle_shift()  # the pool stopped moving: the drift test goes back to one compare
            return seen
        # The pool changed (NaN drops every budget): the largest entry movement, in float64 (no float32
        # norm underflows to 0; 1e-5 relative slack covers its rounding), rounded up, joins the shift,
        # and the search tables follow the new pool.
        move = float((pool.double() - seen.pool.double()).norm(dim=1).max())
        if math.isnan(move):
            self.reset_search()
            return None
        self._shift = math.nextafter(self._shift + move * (1 + 1e-5), math.inf)
        self._shift_steps += 1
        if self._shift_steps >= self.SHIFT_STEPS:
            self._settle_shift()
        self._prep = PreparedPool(pool)
        return self._prep

    @torch.no_grad()
    def _settle_shift(self) -> None:
        """Take the shift off every row's budget (float64, rounded down; none left stays none)."""
        if not self._shift:
            return
        assert self._budget_sq is not None  # a shift is only gathered while the budgets exist
        pair = self._pair_region()
        self._budget_sq = shrunk_budget_sq(self._budget_sq, self._shift)
        if pair is not None:
            self._pair = (self._budget_sq, round_f32(pair[0].double() - self._shift, up=False), pair[1])
        self._shift, self._shift_steps = 0.0, 0

    @torch.no_grad()
    @full_precision
    def update_indices(self, weight: torch.Tensor) -> None:
        """Bring ``indices`` up to date with ``weight``; equals a full search exactly.

        Only rows whose drift since their last search, plus the pool shift,
        reaches their safe radius are searched again (scalar pools: only
        values that left their entry's interval).
        """
        # W's version counter is not consulted to skip work: updates made through
        # ``.data`` do not bump it, and a stale index would be a silent error.
        if self.vector_size == 1:
            self._update_scalar(weight)
        else:
            self._update_vectors(weight)

    def _update_vectors(self, weight: torch.Tensor) -> None:
        prep = self._track_pool()
        if (
            prep is None
            or self._ref is None
            or self._ref.shape[0] != self.num_vectors
            or self._ref.device != weight.device
        ):
            self.full_search(weight)  # (_track_pool returns None whenever _ref is None)
            return
        assert self._budget_sq is not None  # set and reset together with _ref
        vec = self._vectors(weight)
        # The drift in float64 for float64 weights, else in float32 (the reference copy's dtype): float16 and
        # bfloat16 differences and squares would round the drift down or underflow it to 0 (float16 weights
        # of 1e-3 then kept stale indices), and the budgets certify float32 arithmetic.
        like = vec if vec.dtype == torch.float64 else self._ref
        diff = torch.sub(vec, self._ref, out=_scratch(vec.numel(), like).view_as(vec))
        # Squared drift per row: a matrix-vector product sums rows of D far faster
        # than a reduction over a short inner dimension on CPU.
        drift_sq = torch.mv(diff.square_(), self._ones(diff))
        if self._shift:
            drift_sq = shifted_drift_sq(drift_sq, self._shift)
        rows = _rows_not_below(drift_sq, self._budget_sq)  # NaN counts as drifted
        count = rows.numel()
        if count == 0:
            self.stats = {"searched": 0, "total": self.num_vectors, "exact_rows": 0, "paired": 0}
            return
        pair = self._pair_region()
        changed: list[tuple[torch.Tensor, torch.Tensor]] = []
        if pair is not None and count >= self.PAIR_ROWS and vec.dtype == REF_DTYPE:
            settled, rows = self._settle_pairs(rows, vec, drift_sq, prep, *pair)
            changed.append(settled)
        if rows.numel() * 2 > self.num_vectors:
            self.full_search(weight)
            return
        exact_rows: int | torch.Tensor = 0
        if rows.numel():
            sub = vec.index_select(0, rows)
            res = nearest_two(sub, prep, self.chunk, pair=pair is not None)
            ref = sub.to(REF_DTYPE)
            changed.append((rows, res.index))
            self._budget_sq.index_copy_(0, rows, budget_sq(res.radius, sub, ref, self._shift))
            self._ref.index_copy_(0, rows, ref)
            if pair is not None and res.second is not None and res.third is not None:
                pair[0].index_copy_(0, rows, round_f32(res.third + self._shift, up=False))
                pair[1].index_copy_(0, rows, res.second.to(pair[1].dtype))
            exact_rows = res.exact_rows
        if len(changed) > 1:  # one update of the indices: _gathered compares only these rows
            changed = [(torch.cat([c[0] for c in changed]), torch.cat([c[1] for c in changed]))]
        if changed and changed[0][0].numel():
            self._set_indices(*changed[0])
        paired = count - rows.numel()
        self.stats = {"searched": count, "total": self.num_vectors, "exact_rows": exact_rows, "paired": paired}

    #: Rows past their budget from which a layer settles them by pairs first: below, the search's float64
    #: path for a few rows costs less than the settling's fixed ~70 array operations.
    PAIR_ROWS = 256

    def _pair_region(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(others, other)`` while they go with the current budgets, else ``None``."""
        pair = self._pair
        return (pair[1], pair[2]) if pair is not None and pair[0] is self._budget_sq else None

    def _settle_pairs(
        self,
        rows: torch.Tensor,
        vec: torch.Tensor,
        drift_sq: torch.Tensor,
        prep: PreparedPool,
        others: torch.Tensor,
        other: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Rows past their budget, settled without a search where their index and runner-up decide.

        The two entries' float64 distances (``search._exact_sq_dist``'s arithmetic, so brute force's own
        values) give the nearer one, the lower index on a tie. Every other entry is at least ``others``
        less the row's drift (and the pool's shift) away. Where that bound stays above the nearer distance
        with a margin of 1e-9 (float64 rounds ~1e-15), the nearer one is brute force's answer: the row
        takes it, its reference moves to where it is now, its budget becomes half the gap to the farther
        one or to the bound, and the bound is carried over. The rest need a search.

        Args:
            rows: ``(b,)`` rows past their budget. drift_sq: every row's tested drift (shift included).

        Returns:
            ``((settled rows, their index), rows still to search)``.
        """
        assert self._budget_sq is not None and self._ref is not None
        at = rows.numpy()
        cur = self.indices.numpy().take(at).astype(np.int64)
        alt = other.numpy().take(at).astype(np.int64)
        xs = vec.index_select(0, rows)
        x = xs.double().numpy()
        dist_cur, dist_alt = pair_sq_dist(x, prep.pool64, np.stack([cur, alt], axis=1)).T
        take = (dist_alt < dist_cur) | ((dist_alt == dist_cur) & (alt < cur))
        near = np.sqrt(np.where(take, dist_alt, dist_cur)) * (1 + 1e-12)
        far = np.sqrt(np.where(take, dist_cur, dist_alt)) * (1 - 1e-12)
        # drift + shift, with the slack of the float32 drift test's rounding (RADIUS_SHRINK covers it for budgets)
        # and what the D squares of a tiny drift can lose to underflow (2^-150 each), added outside the root:
        # drift_sq already holds the shift, beside which a term under the root would vanish
        moved = (np.sqrt(drift_sq.numpy().take(at).astype(np.float64)) + math.sqrt(vec.shape[1] * 2.0**-149)) * (
            1 + 1e-5
        )
        rest = others.numpy().take(at).astype(np.float64) - moved  # every other entry is at least this far
        ok = np.flatnonzero(rest * (1 - 1e-9) > near)  # NaN: not settled
        done = torch.from_numpy(at.take(ok))
        win = torch.from_numpy(np.where(take, alt, cur).take(ok))
        if ok.size:
            pick = torch.from_numpy(ok)
            radius = (np.minimum(far.take(ok), rest.take(ok)) - near.take(ok)) * (0.5 * RADIUS_SHRINK)
            sub = xs.index_select(0, pick)
            ref = sub.to(REF_DTYPE)
            self._budget_sq.index_copy_(0, done, budget_sq(torch.from_numpy(radius), sub, ref, self._shift))
            self._ref.index_copy_(0, done, ref)
            others.index_copy_(0, done, round_f32(torch.from_numpy(rest.take(ok)) + self._shift, up=False))
            other.index_copy_(0, done, torch.from_numpy(np.where(take, cur, alt).take(ok)).to(other.dtype))
        left = np.ones(at.size, dtype=bool)
        left[ok] = False
        return (done, win), torch.from_numpy(at[left])

    def _set_indices(self, rows: torch.Tensor, new: torch.Tensor) -> None:
        """``indices[rows] = new``, remembered so that :meth:`_gathered` compares only these rows."""
        idx = self.indices
        before = idx._version
        idx.index_copy_(0, rows, new.to(idx.dtype))
        self._touched = (rows, id(idx), before, idx._version)

    # --------------------------------------------------------------- forward
    def gather(self) -> torch.Tensor:
        """``M[indices]`` reshaped to the weight's shape (no gradient to W)."""
        return self.pool.detach().index_select(0, self.indices).view(self.weight_shape)

    @torch.no_grad()
    def _gathered(self) -> torch.Tensor:
        """``M[indices]`` in W's shape, kept between forwards.

        The cache follows the pool (see :meth:`_same_pool`) and the indices by
        value whenever their identity or version changed: only rows whose index differs are gathered
        again, so a training step, which changes few of them, does not gather
        and page in a whole weight tensor. The rewrite is in place only while
        no tensor handed out earlier is alive (no autograd graph or caller
        holds one); otherwise the cache is copied first, so a weight given out
        never changes under its holder.
        """
        pool, idx = self.pool.detach(), self.indices
        cache = self._cache
        if (
            cache is None
            or cache.device != pool.device
            or cache.dtype != pool.dtype
            or tuple(cache.shape) != self.weight_shape
            or not self._same_pool(pool)
        ):
            # A new tensor, never the old one rewritten: a view of it (a Linear's graph keeps only K.t())
            # can outlive the tensors _handed_out tracks.
            self._cache = self.gather()
            self._cache_key = (pool.clone(), id(self.pool), self.pool._version)
            self._cache_indices = (idx.clone(), id(idx), idx._version)
            self._handed_out = weakref.WeakSet()
            return self._cache
        assert self._cache_indices is not None  # set and reset together with _cache
        seen, seen_id, seen_version = self._cache_indices
        if (seen_id, seen_version) == (id(idx), idx._version):
            return cache
        touched = self._touched
        if touched is not None and touched[1:] == (seen_id, seen_version, idx._version) and seen_id == id(idx):
            # The only change since the cache was brought up to date: one lazy update of these rows.
            cand = touched[0]
            rows = cand.masked_select(idx.index_select(0, cand) != seen.index_select(0, cand))
        else:
            rows = flat_nonzero(idx != seen)
        if rows.numel():
            if len(self._handed_out):
                cache = self._cache = cache.clone()
                self._handed_out = weakref.WeakSet()
            new = idx.index_select(0, rows)
            cache.view(-1, self.vector_size).index_copy_(0, rows, pool.index_select(0, new))
            seen.index_copy_(0, rows, new)
        self._cache_indices = (seen, id(idx), idx._version)
        return cache

    def _same_pool(self, pool: torch.Tensor) -> bool:
        """Whether the cache was gathered from ``pool``: by value in training (a step costs far
        more than comparing n x D floats, and ``.data`` edits count), by identity and version
        in eval mode (no device sync per inference forward on a GPU)."""
        assert self._cache_key is not None  # set and reset together with _cache (only called while it is set)
        saved, saved_id, saved_version = self._cache_key
        if not self.training and (saved_id, saved_version) == (id(self.pool), self.pool._version):
            return True
        if not torch.equal(saved, pool):
            return False
        self._cache_key = (saved, id(self.pool), self.pool._version)
        return True

    def _hand_out(self, k: torch.Tensor) -> torch.Tensor:
        self._handed_out.add(k)
        return k

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.export_gather:
            # ONNX export: Reshape(Gather(pool, Cast(indices))) stays in the traced graph.
            return self.pool.index_select(0, self.indices.to(torch.int64)).view(self.weight_shape)
        if not self.training and torch.compiler.is_compiling():
            # Traced by torch.compile: the plain gather, without the cache's bookkeeping (which would
            # break the graph); the compiled model computes the same weights.
            gathered = self.gather()
            if torch.is_grad_enabled() and weight.requires_grad:
                return _GatherSTE.apply(weight, gathered, self._fused_scale())
            return gathered
        if self.training:
            engine = self._engine() if self._engine is not None else None
            # The engine's weight is already straight-through to W, and not this layer's cache (which
            # _hand_out protects from being rewritten in place while a graph holds it).
            k = engine.weight(self, weight) if engine is not None else None
            if k is None:  # the layer's own lazy search
                self.update_indices(weight)
                k = self._hand_out(_GatherSTE.apply(weight, self._gathered(), self._fused_scale()))
            self._last = (self._key(), weakref.ref(k))
            return k
        if torch.is_grad_enabled() and weight.requires_grad:
            # eval() with gradients on (e.g. frozen-BN fine-tuning): stored
            # indices, gradient still reaches W.
            return self._hand_out(_GatherSTE.apply(weight, self._gathered(), self._fused_scale()))
        return self._hand_out(self._gathered().view(self.weight_shape))

    def invalidate_cache(self) -> None:
        """Drop the weight cache (done automatically when indices or pool change)."""
        self._cache = None
        self._cache_key = None
        self._cache_indices = None
        self._handed_out = weakref.WeakSet()

    # ---------------------------------------------------------------- losses
    def _fused_scale(self) -> float:
        return 2.0 * self.commitment_weight / self.num_vectors / self.vector_size if self.commitment_weight else 0.0

    def commitment_loss(self, weight: torch.Tensor) -> torch.Tensor:
        """``mean((W - sg[K])^2)`` (paper Eq. 2).

        Differentiable in W, unless the commitment gradient is fused into the
        backward (``commitment_weight > 0``): then the value is detached, for logging.
        """
        k = self._last[1]() if self._last is not None and self._last[0] == self._key() else None
        if k is None:
            k = self.gather()
        k = k.detach()
        if self.commitment_weight:
            with torch.no_grad():
                return F.mse_loss(weight, k.to(weight.dtype))
        return F.mse_loss(weight, k.to(weight.dtype))

    def distillation_loss(self, weight: torch.Tensor) -> torch.Tensor:
        """``||sg[W] - K||^2`` (mean squared error), differentiable in the pool (paper Eq. 4).

        After a training forward with the same pool and indices, K is that forward's (``pool[indices]``
        already gathered): no second gather; the value and the pool's gradient are bit for bit those of
        gathering again (:class:`_DistillFromK` runs autograd's own backward ops)."""
        if self.mode != "pool":
            raise RuntimeError("distillation_loss needs pool-learning mode: call nwsconvert.set_mode(model, 'pool')")
        index = _scatter_index(self.indices)
        k = self._last[1]() if self._last is not None and self._last[0] == self._key() else None
        if k is None or k.dtype != self.pool.dtype or not torch.is_grad_enabled():
            k = self.pool.index_select(0, index).view(self.weight_shape)
            return F.mse_loss(k, weight.detach().to(k.dtype))
        # Handed out: the cache it views is copied, not rewritten, while the autograd graph holds it.
        return _DistillFromK.apply(self.pool, self._hand_out(k.detach()), weight.detach().to(k.dtype), index)

    # ------------------------------------------------------------ pool modes
    def set_mode(self, mode: str) -> None:
        """``'task'``: pool frozen (buffer). ``'pool'``: pool trainable (``nn.Parameter``)."""
        if mode not in ("task", "pool"):
            raise ValueError(f"mode must be 'task' or 'pool', got {mode!r}")
        if mode == self.mode:
            return
        data = self.pool.detach()
        del self.pool
        if mode == "pool":
            self.pool = nn.Parameter(data)
        else:
            self.register_buffer("pool", data)
        self.mode = mode

    @torch.no_grad()
    def ema_update(self, weight: torch.Tensor, decay: float = 0.99) -> None:
        """VQ-VAE style EMA pool update: each entry moves toward the mean of its kernels.

        Entries nobody selects keep their value (their running sum and count
        decay together); :meth:`reseed_unused` replaces them.
        """
        vec = self._vectors(weight).to(self.pool.dtype)
        if self._ema is None or self._ema[0].device != vec.device:
            self._ema = (torch.ones(self.pool_size, dtype=vec.dtype, device=vec.device), self.pool.detach().clone())
        count, total = self._ema
        count.mul_(decay).add_(torch.bincount(self.indices, minlength=self.pool_size).to(vec.dtype), alpha=1 - decay)
        sums = index_sum(vec, self.indices, self.pool_size)
        total.mul_(decay).add_(sums, alpha=1 - decay)
        self.pool.copy_(total / count.clamp_min(1e-12)[:, None])  # in place: bumps the version the search tracks

    @torch.no_grad()
    def reseed_unused(self, weight: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """Move pool entries no kernel selects onto the kernels farthest from their pool vector.

        Returns:
            The number of entries reseeded.
        """
        used = torch.bincount(self.indices, minlength=self.pool_size) > 0
        dead = (~used).nonzero().squeeze(1)
        if dead.numel() == 0:
            return 0
        vec = self._vectors(weight).to(self.pool.dtype)
        err = (vec - self.gather().reshape_as(vec)).pow(2).sum(1)
        take = min(dead.numel(), vec.shape[0])
        far = err.topk(take).indices
        self.pool[dead[:take]] = vec[far]
        if self._ema is not None:
            self._ema[0][dead[:take]] = 1.0
            self._ema[1][dead[:take]] = vec[far]
        return take
