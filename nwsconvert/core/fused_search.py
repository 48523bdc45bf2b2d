"""Fused exact nearest-two search (Triton): the CUDA path of :func:`~nwsconvert.core.search.nearest_two`.

One kernel walks the pool in tiles and keeps, per row, the nearest entry, its
distance and the runner-up's distance in registers: the ``N x n`` distance
matrix is never written to memory, and nothing is read back to the host.

1. **float32 pass** over every row: squared distances from direct differences,
   ``sum_k (x_k - m_k)^2`` (no ``||x||^2 - 2 x.m + ||m||^2`` cancellation).
2. **Certification** on the device: the computed distances are within a
   relative ``2 (D + 2) 2^-24`` (plus a subnormal term) of the true ones, so a
   winner whose runner-up is farther than both error bounds is the exact
   argmin; its safe radius is half the certified gap.
3. **float64 pass**, the same kernel launched over every row block but only
   looping over the pool for blocks that hold an uncertified row (near-ties,
   exact ties, NaN or infinite rows or pool entries). Compiled without
   floating-point contraction, so every difference, square and sum is
   correctly rounded in the order ``k = 0 .. D-1``: the same numbers as
   :func:`~nwsconvert.core.search.brute_force`, hence the same argmin, lowest index
   on ties and the first NaN winning as NumPy's ``argmin`` has it.

No ``.item()``, ``nonzero`` or branch on a tensor value: the result is ready
when the device is, so the search can sit inside a training step without host
syncs. On a CPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported), which is how CI
checks it; elsewhere on CPU :func:`~nwsconvert.core.search.nearest_two` keeps its
BLAS + NumPy path.

The search engine's kernels are launched from here too (``engine_*``: flags,
compaction and the two search passes, gather, commitment gradient; see
:mod:`nwsconvert.core.engine`), with the same certification carried out in the
search kernel's epilogue.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .rounding import RADIUS_SHRINK, U32

__all__ = [
    "BLOCK_R",
    "ENGINE_CONSTS",
    "WIDE_R",
    "available",
    "engine_commit",
    "engine_flags",
    "engine_gather",
    "engine_search",
    "fused_nearest_two",
    "layer_table",
    "row_blocks",
    "segmented_nearest_two",
    "w_rows",
    "wide_rows",
]

#: Triton is imported on first search (it is slow to import), from :mod:`nwsconvert.core.triton_kernels`. CPU-only torch
#: wheels come without it.
_HAVE_TRITON = importlib.util.find_spec("triton") is not None

#: The oldest Triton the kernels are known to run right on (under its interpreter the engine's tests fail
#: on 3.1 and 3.2: booleans it cannot invert, then other results; 3.3, 3.4, 3.6 and 3.8 pass). torch 2.7
#: ships 3.3; with an older Triton the engine runs its torch kernel and ``cuda_graph`` is refused.
MIN_TRITON = (3, 3)


def _triton_version() -> tuple[int, ...] | None:
    """The installed Triton's version, or ``None`` without one (read from its metadata, not imported)."""
    if not _HAVE_TRITON:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("triton")
    except PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


_TRITON_OK = (_triton_version() or (0,)) >= MIN_TRITON

#: The smallest subnormal float32 (unit roundoff and radius shrink: the BLAS path's, from search.py).
_TINY32 = 2.0**-149
#: Rows per search-kernel program (a block never holds two layers' rows).
BLOCK_R = 32
#: Rows per program of the engine's elementwise kernels (flags, compaction, gather, commitment), at most:
#: :func:`wide_rows` gives wide vectors fewer.
WIDE_R = 256
#: Elements (rows x D padded to a power of two) per program of those kernels, at most (up to D = 256: a
#: program takes 16 rows at least).
WIDE_ELEMENTS = 4096


def wide_rows(dim: int) -> int:
    """Rows per program of the engine's elementwise kernels for vectors of ``dim``: :data:`WIDE_R` up to
    D = 16, fewer beyond (a 7x7 kernel's 64; 16 at least), so that a stem's few wide rows spread over
    several programs instead of one program holding every row in registers."""
    return min(WIDE_R, max(16, WIDE_ELEMENTS // _pow2(dim)))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str) -> bool:
    """Whether :func:`fused_nearest_two` runs on ``device``: CUDA with Triton, or any device under the interpreter."""
    if not _TRITON_OK:
        return False
    return torch.device(device).type == "cuda" or _interpreting()


def _launch(x, pool, blocks, active, idx, d1, d2, acc: str) -> None:
    """One kernel pass: ``acc`` ``'float32'`` (with FMA) or ``'float64'`` (correctly rounded, as brute force)
    over the rows whose ``active`` flag is set (every row when ``active`` is None)."""
    import triton.language as tl

    from .triton_kernels import nearest_two_kernel

    exact = acc == "float64"
    gated = active is not None
    blk_row, blk_end, blk_off, blk_n = blocks[:4]
    nearest_two_kernel[(blk_n.numel(),)](
        x,
        pool,
        blk_row,
        blk_end,
        blk_off,
        blk_n,
        active if gated else blk_n,
        idx,
        d1,
        d2,
        D=x.shape[1],
        ACC=tl.float64 if exact else tl.float32,
        GATED=gated,
        BLOCK_R=BLOCK_R,
        **search_launch(exact, _interpreting()),
    )


def segmented_nearest_two(x: torch.Tensor, pool: torch.Tensor, blocks: tuple, active: torch.Tensor | None = None):
    """:func:`fused_nearest_two` of many layers at once, each row block against its own pool.

    Args:
        x: ``(R, D)`` float32 contiguous: the layers' rows one after another.
        pool: ``(P, D)`` float32 contiguous: the layers' pools one after another.
        blocks: ``(blk_row, blk_end, blk_off, blk_n, ...)``, each ``(B,)`` int32 (see :func:`row_blocks`):
            block ``b`` is rows ``blk_row[b] .. min(blk_row[b] + BLOCK_R, blk_end[b])``, searched
            against pool rows ``blk_off[b] .. blk_off[b] + blk_n[b]``.
        active: ``(R,)`` bool, the rows to search (None: all). Other rows' outputs are unspecified.

    Returns:
        ``(index, radius, exact)`` as :func:`fused_nearest_two`, indices local to each block's pool;
        ``exact`` is False outside ``active``.
    """
    n_rows, dim = x.shape
    idx = torch.empty(n_rows, dtype=torch.int64, device=x.device)
    d1 = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    d2 = torch.empty_like(d1)
    flags = None if active is None else active.to(torch.int8)
    _launch(x, pool, blocks, flags, idx, d1, d2, "float32")

    # Certify: true distances lie within gamma (relative) + tiny (subnormal rounding) of the computed ones.
    gamma = 2.0 * (dim + 2) * U32
    tiny = (2 * dim + 2) * _TINY32
    a, b = d1.double(), d2.double()
    upper1 = a * (1 + gamma) + tiny
    lower2 = b * (1 - gamma) - tiny
    # NaN compares false: uncertified; so is a runner-up whose float32 distance overflowed (b = inf also where a
    # block's pool has one entry: the float64 pass then keeps the radius infinite)
    exact = ~(torch.isfinite(a) & torch.isfinite(b) & (lower2 > upper1))
    if active is not None:
        exact &= active
    radius = ((lower2.clamp_min(0).sqrt() - upper1.sqrt()) * (0.5 * RADIUS_SHRINK)).clamp_min(0)

    e1 = torch.empty(n_rows, dtype=torch.float64, device=x.device)
    e2 = torch.empty_like(e1)
    _launch(x, pool, blocks, exact, idx, e1, e2, "float64")
    r1, r2 = e1.sqrt(), e2.sqrt()
    half_gap = (r2 - r1) * 0.5
    # float64 distances are ~1e-16 relative: a gap below 1e-12 of their scale is a tie (radius 0). No runner-up
    # (r2 = inf: a pool of one entry; float32 values never overflow float64) is no tie.
    apart = (half_gap > 1e-12 * (r2 + 1e-30)) | (torch.isposinf(r2) & torch.isfinite(r1))
    exact_radius = torch.where(apart, half_gap * RADIUS_SHRINK, 0.0)
    return idx, torch.where(exact, exact_radius, radius), exact


def fused_nearest_two(vectors: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact nearest pool entry of every row, its safe radius, and which rows needed float64.

    Args:
        vectors: ``(N, D)``, cast to float32 (as :func:`~nwsconvert.core.search.nearest_two` does).
        pool: ``(n, D)`` on the same device, ``n >= 1``.

    Returns:
        ``(index, radius, exact)``: ``(N,)`` int64 equal to :func:`~nwsconvert.core.search.brute_force`
        of the float32 rows, ``(N,)`` float64 radii (how far a row may move, together with any
        pool-entry movement, before its nearest entry can change; 0 on ties), ``(N,)`` bool rows
        resolved in float64. All on ``vectors``' device; no host sync.
    """
    if not available(vectors.device):
        raise RuntimeError(
            f"fused search needs CUDA and Triton >= {'.'.join(map(str, MIN_TRITON))} (device {vectors.device}; Triton "
            f"{'.'.join(map(str, _triton_version() or ())) or 'missing'}; TRITON_INTERPRET=1 runs it on CPU)"
        )
    if vectors.ndim != 2 or pool.ndim != 2 or vectors.shape[1] != pool.shape[1] or pool.shape[0] < 1:
        raise ValueError(f"vectors {tuple(vectors.shape)} and pool {tuple(pool.shape)} must be (N, D) and (n >= 1, D)")
    x = vectors.detach().to(torch.float32).contiguous()
    m = pool.detach().to(device=x.device, dtype=torch.float32).contiguous()
    n_rows = x.shape[0]
    if n_rows == 0:
        empty = torch.empty(0, dtype=torch.float64, device=x.device)
        return (
            torch.empty(0, dtype=torch.int64, device=x.device),
            empty,
            torch.zeros(0, dtype=torch.bool, device=x.device),
        )
    # One pool: the block table made on the device (a table built on the host would be a blocking copy).
    starts = torch.arange(0, n_rows, BLOCK_R, dtype=torch.int32, device=x.device)
    blocks = (starts, torch.full_like(starts, n_rows), torch.zeros_like(starts), torch.full_like(starts, m.shape[0]))
    return segmented_nearest_two(x, m, blocks)


def row_blocks(segments: list[tuple[int, int]], device, block: int = BLOCK_R) -> tuple[torch.Tensor, ...]:
    """The kernels' block table for layers laid out one after another.

    Args:
        segments: per layer ``(rows, pool size)``, in the order of the flat row and pool buffers.
        block: rows per program.

    Returns:
        ``(blk_row, blk_end, blk_off, blk_n, blk_start, blk_layer)``, ``(B,)`` int32 each on ``device``:
        every layer's rows in blocks of ``block`` that never cross into the next layer (first row, the
        layer's end, its pool offset and size, its first row, its number).
    """
    cols: list[list[int]] = [[], [], [], [], [], []]
    row = off = 0
    for layer, (count, size) in enumerate(segments):
        for start in range(row, row + count, block):
            for c, v in zip(cols, (start, row + count, off, size, row, layer)):
                c.append(v)
        row += count
        off += size
    return tuple(torch.tensor(c, dtype=torch.int32, device=device) for c in cols)


#: The engine kernels' float64 constants, by position: the float32 certification's relative error per
#: unit of ``D + 2`` and subnormal term per unit of ``2 D + 2`` (scaled by :func:`engine_consts`), half
#: the radius shrink, the radius shrink, :func:`~nwsconvert.core.rounding.round_down_f32`'s factor and
#: offset (the offset per unit of ``D``: a budget is also less what the float32 drift's D squares can lose to
#: underflow), the pool-movement slack, and the tie test's relative and absolute thresholds.
ENGINE_CONSTS = (
    2.0 * U32,
    _TINY32,
    0.5 * RADIUS_SHRINK,
    RADIUS_SHRINK,
    1.0 - 2.0**-22,
    2.0**-149,
    1 + 1e-5,
    1e-12,
    1e-30,
)


def engine_consts(dim: int, device) -> torch.Tensor:
    """:data:`ENGINE_CONSTS` for vectors of ``dim`` elements, ``(9,)`` float64 on ``device``."""
    c = list(ENGINE_CONSTS)
    c[0] *= dim + 2
    c[1] *= 2 * dim + 2
    c[5] *= dim  # budgets less what the float32 drift's D squares can lose to underflow (2^-150 each)
    return torch.tensor(c, dtype=torch.float64, device=device)


def search_launch(exact: bool, interpreting: bool) -> dict:
    """The search kernels' pool tile and compiler options: the interpreter pays per tile, the GPU per
    register (a wide tile would spill); the float64 pass is compiled without contraction."""
    if interpreting:
        return {"BLOCK_P": 1024}
    return {"BLOCK_P": 64, "enable_fp_fusion": not exact}


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def w_rows(x: torch.Tensor, dim: int) -> bool:
    """Whether ``x``, the engine kernels' rows of W, is the layers' W address table (``(L,)`` int64; see
    :mod:`~nwsconvert.core.triton_kernels`) rather than the rows themselves (``(R, dim)`` float32); anything
    else is refused."""
    if x.dim() == 1 and x.dtype == torch.int64:
        return True
    if x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == dim:
        return False
    raise TypeError(f"rows of W: (R, {dim}) float32 or an (L,) int64 address table, got {tuple(x.shape)} {x.dtype}")


def engine_flags(state, wide, x, moved: bool, move, stale, cells, dim: int) -> None:
    """Flag the rows to search (:func:`~nwsconvert.core.triton_kernels.engine_flag_kernel`).

    Args:
        state: the group's ``(ref, budget, index, need, consts)``: ``(R, D)`` float32, ``(R,)`` float32
            (both None: not kept, scalar pools with intervals), ``(R,)`` int32 pool-local, ``(R,)`` int8 (0:
            kept, 1: searched, 2: searched in float64), :func:`engine_consts`.
        wide: block table of :func:`wide_rows` rows. x: ``(R, D)`` float32 contiguous, or the layers' W
            address table (:func:`w_rows`). dim: D.
        moved: whether ``move`` (``(L,)`` float64, each layer's largest pool movement) is to be taken off
            the budgets. stale: ``(L,)`` int8. cells: ``(lo, hi)`` ``(P,)`` float32 for scalar pools, or None.
    """
    from .triton_kernels import engine_flag_kernel

    ref, budget, index, need, consts = state
    table = w_rows(x, dim)
    track = ref is not None
    if not track:
        assert cells is not None  # only scalar pools with intervals keep no budgets
        ref, budget = cells  # not read: any float32 tensors
    lo, hi = cells if cells is not None else (budget, budget)
    engine_flag_kernel[(wide[0].numel(),)](
        x, ref, budget, index, need, wide[0], wide[1], wide[2], wide[4], wide[5], move, stale, lo, hi, consts,
        D=dim, DP=_pow2(dim), MOVED=moved and track, CELLS=cells is not None, TRACK=track, TABLE=table,
        BLOCK_R=wide_rows(dim),
    )  # fmt: skip


def engine_search(state, wide, layers, x, pool, csum, perm) -> None:
    """Search the flagged rows and write their index, reference and budget in place: the flagged rows
    compacted per layer (:func:`~nwsconvert.core.triton_kernels.engine_compact_kernel`), a float32 pass
    over them, a float64 pass over those it could not certify, each a persistent launch whose programs
    share the flagged rows' blocks, counted on the device. Fixed launch shapes, no host sync.

    Args:
        state: as :func:`engine_flags` (``need`` set by it). wide: block table of :func:`wide_rows` rows.
        layers: :func:`layer_table`. x: ``(R, D)`` float32, or the layers' W address table (:func:`w_rows`).
        pool: ``(P, D)`` float32.
        csum: ``(R + 1,)`` int32, ``csum[0] == 0`` (filled here). perm: ``(R,)`` int32 (filled here).
    """
    from .triton_kernels import engine_compact_kernel, engine_search_kernel

    ref, budget, index, need, consts = state
    dim = pool.shape[1]
    table = w_rows(x, dim)
    track = ref is not None
    ref, budget = (ref, budget) if track else (pool, pool[:, 0])  # not written: any float32 tensors
    torch.cumsum(need, 0, dtype=torch.int32, out=csum[1:])
    engine_compact_kernel[(wide[0].numel(),)](need, csum, perm, wide[0], wide[1], wide[4], BLOCK_R=wide_rows(dim))
    start, end, off, size, programs = layers
    for exact_pass in (False, True):
        engine_search_kernel[(programs,)](
            x, pool, ref, budget, index, need, csum, perm, consts, start, end, off, size, start.numel(),
            D=dim, EXACT=exact_pass, TRACK=track, TABLE=table, BLOCK_R=BLOCK_R, LP=_pow2(start.numel()),
            **search_launch(exact_pass, _interpreting()),
        )  # fmt: skip


#: Programs per streaming multiprocessor of the engine's persistent search (its float64 pass holds about
#: 250 registers a thread, two programs of four warps a multiprocessor): a few waves, so that programs
#: whose blocks end early leave others to take more.
SEARCH_PROGRAMS_PER_SM = 4


def layer_table(segments: list[tuple[int, int]], device) -> tuple:
    """The engine's persistent search's per-layer table for layers laid out one after another.

    Args:
        segments: per layer ``(rows, pool size)``, in the order of the flat row and pool buffers.

    Returns:
        ``(start, end, off, size, programs)``: ``(L,)`` int32 each on ``device`` (the layer's first row, its
        end, its pool offset and size) and the launch's program count: at most one per block of
        :data:`BLOCK_R` rows, at most :data:`SEARCH_PROGRAMS_PER_SM` a multiprocessor on CUDA, and 3 in
        Triton's interpreter (programs run one after another there; three make each take several blocks).
    """
    cols: list[list[int]] = [[], [], [], []]
    row = off = 0
    for count, size in segments:
        for c, v in zip(cols, (row, row + count, off, size)):
            c.append(v)
        row += count
        off += size
    blocks = sum(-(-count // BLOCK_R) for count, _ in segments)
    device = torch.device(device)
    if device.type == "cuda" and not _interpreting():
        cap = SEARCH_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cap = 3
    table = tuple(torch.tensor(c, dtype=torch.int32, device=device) for c in cols)
    return (*table, max(1, min(blocks, cap)))


def engine_gather(index, pool, wide, out) -> None:
    """``out[row] = pool[its layer's offset + index[row]]`` for all rows, in ``pool``'s dtype (one launch)."""
    from .triton_kernels import engine_gather_kernel

    dim = pool.shape[1]
    engine_gather_kernel[(wide[0].numel(),)](
        index, pool, out, wide[0], wide[1], wide[2], D=dim, DP=_pow2(dim), BLOCK_R=wide_rows(dim)
    )


def engine_commit(grad, w, k, scale, wide, out) -> None:
    """``out = grad + scale[layer] * (w - k)`` per row (one launch): the group's straight-through gradient
    with each layer's commitment term. ``k``: ``(R, D)`` contiguous; ``w``: the same, or the layers' W
    address table (:func:`w_rows`; float32 W); ``scale``: ``(L,)`` float32; ``grad`` and ``out``: ``(R, D)``
    contiguous, or both the same ``(L,)`` int64 table of the layers' own float32 weight gradients, which
    then take the term in place."""
    from .triton_kernels import engine_commit_kernel

    dim = k.shape[1]
    table = w.dim() == 1 and w_rows(w, dim)
    grad_table = grad.dim() == 1
    if grad_table and (grad.dtype != torch.int64 or out is not grad):
        raise TypeError("a gradient address table is written in place: give it as both grad and out (int64)")
    engine_commit_kernel[(wide[0].numel(),)](
        grad, w, k, scale, out, wide[0], wide[1], wide[4], wide[5], D=dim, DP=_pow2(dim), TABLE=table,
        GRAD_TABLE=grad_table, BLOCK_R=wide_rows(dim),
    )  # fmt: skip
