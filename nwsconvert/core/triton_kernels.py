"""Triton kernels (imported on first use: importing Triton takes a noticeable part of a second).

Decorated when this module is first imported: under ``TRITON_INTERPRET=1`` set before that, they run
in Triton's interpreter on CPU tensors.

Block tables (:func:`~nwsconvert.core.fused_search.row_blocks`): program ``b`` works on rows
``blk_row[b] ..`` of one layer, never past that layer's end ``blk_end[b]``; the layer starts at
``blk_start[b]``, is layer number ``blk_layer[b]`` and its pool is the ``blk_n[b]`` rows from
``blk_off[b]`` of the flat pool.

Rows of W: the engine's kernels read a group's temporary weights either from one ``(R, D)`` float32 buffer
(``x``, the layers' W concatenated) or, with ``TABLE``, where each layer keeps them: ``x`` is then an
``(L,)`` int64 table of the layers' W addresses (float32, contiguous), and row ``r`` of layer ``l`` is at
``table[l] + (r - first row of l) * D``. Both give the same values, so the same results bit for bit. The
commitment gradient reads and writes the layers' own weight gradients the same way (``GRAD_TABLE``).

The engine's kernels (``engine_*``) take their float64 constants from a small tensor (``consts``, see
:data:`~nwsconvert.core.fused_search.ENGINE_CONSTS`) rather than from literals, whose type Triton picks
by value (a literal is float32 where it fits).
"""

import triton
import triton.language as tl

__all__ = [
    "engine_commit_kernel",
    "engine_compact_kernel",
    "engine_flag_kernel",
    "engine_gather_kernel",
    "engine_search_kernel",
    "nearest_two_kernel",
]


@triton.jit
def _nearest_two_loop(x_row, live, pool_blk, n_pool, D: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_P: tl.constexpr):  # fmt: skip
    """Nearest pool entry (lowest index on ties), its squared distance and the runner-up's, per live row;
    no pool loop at all when no row is live."""
    pool_end = n_pool * tl.max(live.to(tl.int32), axis=0)  # 0: nothing to search in this block
    best = tl.full([BLOCK_R], float("inf"), ACC)
    second = tl.full([BLOCK_R], float("inf"), ACC)
    best_i = tl.zeros([BLOCK_R], dtype=tl.int32)
    lanes = tl.arange(0, BLOCK_P)
    for start in range(0, pool_end, BLOCK_P):
        cols = start + lanes
        in_pool = cols < n_pool
        acc = tl.zeros([BLOCK_R, BLOCK_P], dtype=ACC)
        for k in tl.static_range(D):
            xk = tl.load(x_row + k, mask=live, other=0.0).to(ACC)
            mk = tl.load(pool_blk + cols.to(tl.int64) * D + k, mask=in_pool, other=0.0).to(ACC)
            diff = xk[:, None] - mk[None, :]
            acc = acc + diff * diff
        acc = tl.where(acc != acc, float("-inf"), acc)  # NaN wins, as in NumPy's argmin
        acc = tl.where(in_pool[None, :], acc, float("inf"))
        tile_best = tl.min(acc, axis=1)
        tile_arg = tl.argmin(acc, axis=1, tie_break_left=True)
        tile_second = tl.min(tl.where(lanes[None, :] == tile_arg[:, None], float("inf"), acc), axis=1)
        better = tile_best < best  # a tie keeps the earlier tile's lower index
        second = tl.where(better, tl.minimum(best, tile_second), tl.minimum(second, tile_best))
        best_i = tl.where(better, tile_arg + start, best_i)
        best = tl.where(better, tile_best, best)
    return best, second, best_i


@triton.jit
def nearest_two_kernel(
    x_ptr,
    pool_ptr,
    blk_row_ptr,
    blk_end_ptr,
    blk_off_ptr,
    blk_n_ptr,
    active_ptr,
    idx_ptr,
    d1_ptr,
    d2_ptr,
    D: tl.constexpr,
    ACC: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Per row of ``x`` ``(n_rows, D)``: the nearest entry of its block's pool (lowest index on ties),
    that squared distance and the second smallest one, accumulated in ``ACC``.

    Program ``b`` searches rows ``blk_row[b] .. min(blk_row[b] + BLOCK_R, blk_end[b])`` (one layer's)
    against the ``blk_n[b]`` pool rows starting at row ``blk_off[b]`` of ``pool`` (several layers'
    pools side by side); indices are pool-local.
    ``GATED``: only rows whose ``active`` flag is set are searched and written; a block with none
    does no pool loop at all."""
    blk = tl.program_id(0)
    rows = tl.load(blk_row_ptr + blk) + tl.arange(0, BLOCK_R)
    live = rows < tl.load(blk_end_ptr + blk)
    if GATED:
        live = live & (tl.load(active_ptr + rows, mask=live, other=0) != 0)
    pool_blk = pool_ptr + tl.load(blk_off_ptr + blk).to(tl.int64) * D
    x_row = x_ptr + rows.to(tl.int64) * D
    best, second, best_i = _nearest_two_loop(x_row, live, pool_blk, tl.load(blk_n_ptr + blk), D, ACC, BLOCK_R, BLOCK_P)
    tl.store(idx_ptr + rows, best_i.to(tl.int64), mask=live)
    tl.store(d1_ptr + rows, best, mask=live)
    tl.store(d2_ptr + rows, second, mask=live)


@triton.jit
def _round_down_f32(v, consts_ptr):
    """float64 ``v >= 0`` -> float32 never above it (:func:`~nwsconvert.core.rounding.round_down_f32`), at most
    float32's largest value, as :func:`~nwsconvert.core.rounding.budget_sq` clamps: a budget that became +inf
    could never be shrunk by a pool's movement (inf - move is inf). NaN stays NaN (searched again)."""
    v = v * tl.load(consts_ptr + 4) - tl.load(consts_ptr + 5)
    return tl.where(v > 3.4028234663852886e38, 3.4028234663852886e38, v).to(tl.float32)


@triton.jit
def _rows_base(src_ptr, layer, first_row, D: tl.constexpr, TABLE: tl.constexpr):
    """Where row 0 of the flat ``(R, D)`` rows lies for the rows of ``layer`` (whose first row is ``first_row``):
    ``src_ptr`` itself, or (``TABLE``) the layer's own W, through the address table, less its first row."""
    if TABLE:
        return tl.load(src_ptr + layer).to(tl.pointer_type(tl.float32)) + (-first_row.to(tl.int64) * D)
    else:
        return src_ptr


@triton.jit
def engine_flag_kernel(
    x_ptr,
    ref_ptr,
    budget_ptr,
    index_ptr,
    need_ptr,
    blk_row_ptr,
    blk_end_ptr,
    blk_off_ptr,
    blk_start_ptr,
    blk_layer_ptr,
    move_ptr,
    stale_ptr,
    lo_ptr,
    hi_ptr,
    consts_ptr,
    D: tl.constexpr,
    DP: tl.constexpr,
    MOVED: tl.constexpr,
    CELLS: tl.constexpr,
    TRACK: tl.constexpr,
    TABLE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Which rows the update searches, in one pass over the rows (the drift ``(x - ref)²`` is never stored).

    ``MOVED``: shrink every budget by its layer's largest pool movement ``move[layer]`` (float64; NaN:
    no budget left), written back. A row is searched when its drift has reached its budget (NaN
    counts as reached). ``CELLS`` (scalar pools): a row whose layer's pool is the one the exact
    intervals ``lo``/``hi`` were cut from (``stale[layer] == 0``) is searched when it left its entry's
    interval instead. ``TRACK`` false (scalar pools none of which moved: no reference or budget kept):
    the interval test alone. ``TABLE``: ``x`` is the layers' W address table (module docstring). Writes
    ``need``: 1 where searched, else 0 (int8)."""
    blk = tl.program_id(0)
    rows = tl.load(blk_row_ptr + blk) + tl.arange(0, BLOCK_R)
    live = rows < tl.load(blk_end_ptr + blk)
    x_base = _rows_base(x_ptr, tl.load(blk_layer_ptr + blk), tl.load(blk_start_ptr + blk), D, TABLE)
    if CELLS:
        entry = tl.load(index_ptr + rows, mask=live, other=0).to(tl.int64) + tl.load(blk_off_ptr + blk)
        value = tl.load(x_base + rows.to(tl.int64), mask=live, other=0.0)
        inside = (tl.load(lo_ptr + entry, mask=live, other=0.0) < value) & (
            value < tl.load(hi_ptr + entry, mask=live, other=0.0)
        )
        outside = inside == 0  # (not ~: Triton 3.1's interpreter cannot invert a boolean)
    if TRACK:
        cols = tl.arange(0, DP)
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        inside2 = live[:, None] & (cols[None, :] < D)
        diff = tl.load(x_base + offs, mask=inside2, other=0.0) - tl.load(ref_ptr + offs, mask=inside2, other=0.0)
        drift = tl.sum(diff * diff, axis=1)
        budget = tl.load(budget_ptr + rows, mask=live, other=0.0)
        if MOVED:
            move = tl.load(move_ptr + tl.load(blk_layer_ptr + blk))
            b64 = budget.to(tl.float64)
            left = tl.sqrt(tl.where(b64 > 0, b64, 0.0)) - move * tl.load(consts_ptr + 6)
            left = tl.where(left > 0, left, 0.0)  # NaN movement: 0, no budget left
            shrunk = tl.where(budget > 0, _round_down_f32(left * left, consts_ptr), tl.where(budget < 0, budget, 0.0))
            budget = tl.where(move != 0, shrunk, budget)
            tl.store(budget_ptr + rows, budget, mask=live)
        need = (drift < budget) == 0  # NaN counts as drifted
        if CELLS:
            need = tl.where(tl.load(stale_ptr + tl.load(blk_layer_ptr + blk)) != 0, need, outside)
    else:
        need = outside
    tl.store(need_ptr + rows, need.to(tl.int8), mask=live)


@triton.jit
def engine_compact_kernel(need_ptr, csum_ptr, perm_ptr, blk_row_ptr, blk_end_ptr, blk_start_ptr, BLOCK_R: tl.constexpr):
    """Each layer's rows reordered with its flagged rows first (stable): ``perm[start .. start + F)`` are
    the flagged rows of the layer starting at ``start`` (``F`` of them), the others follow.

    ``csum`` is ``(R + 1,)``: 0, then the running count of flagged rows (``need``), so a layer's count
    and a row's rank are differences of two entries. Every position is written once (a permutation):
    no atomics."""
    blk = tl.program_id(0)
    rows = tl.load(blk_row_ptr + blk) + tl.arange(0, BLOCK_R)
    end = tl.load(blk_end_ptr + blk)
    live = rows < end
    start = tl.load(blk_start_ptr + blk)
    before = tl.load(csum_ptr + start)
    count = tl.load(csum_ptr + end) - before
    rank = tl.load(csum_ptr + rows + 1, mask=live, other=0) - before  # flagged rows up to and with this one
    flagged = tl.load(need_ptr + rows, mask=live, other=0) != 0
    dest = tl.where(flagged, start + rank - 1, rows + count - rank)
    tl.store(perm_ptr + dest, rows, mask=live)


@triton.jit
def engine_search_kernel(
    x_ptr,
    pool_ptr,
    ref_ptr,
    budget_ptr,
    index_ptr,
    need_ptr,
    csum_ptr,
    perm_ptr,
    consts_ptr,
    lay_start_ptr,
    lay_end_ptr,
    lay_off_ptr,
    lay_n_ptr,
    n_layers,
    D: tl.constexpr,
    EXACT: tl.constexpr,
    TRACK: tl.constexpr,
    TABLE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    LP: tl.constexpr,
):
    """Search the flagged rows, compacted (:func:`engine_compact_kernel`), in a persistent launch: the
    work is every layer's flagged rows in blocks of ``BLOCK_R`` (a layer's ``F`` flagged rows are
    positions ``start .. start + F`` of its reordered rows: ``ceil(F / BLOCK_R)`` blocks), counted on the
    device, and program ``p`` of ``G`` takes work blocks ``p, p + G, ...``. A launch costs what the
    flagged rows cost, whatever the grid: no program walks rows nobody flagged. The new state is
    written in place.

    ``lay_*``: per layer (``n_layers`` <= ``LP`` of them) its first row, its end, its pool offset and size.

    ``EXACT`` false (float32 pass, with FMA): index; ``ref = x``; the row's budget when the result is
    certified (computed distances within ``gamma`` relative + ``tiny`` of the true ones, runner-up
    beyond both bounds: the squared half certified gap, shrunk, rounded down), else ``need = 2``.
    ``EXACT`` true (float64, compiled without contraction: brute force's numbers): only rows with
    ``need == 2``; index and budget (half the gap, or 0 on a tie). ``TRACK`` false: no reference or
    budget written. ``TABLE``: ``x`` is the layers' W address table (module docstring)."""
    lanes = tl.arange(0, LP)
    has = lanes < n_layers
    l_start = tl.load(lay_start_ptr + lanes, mask=has, other=0)
    l_count = tl.load(csum_ptr + tl.load(lay_end_ptr + lanes, mask=has, other=0), mask=has, other=0)
    l_count = l_count - tl.load(csum_ptr + l_start, mask=has, other=0)
    l_blocks = (l_count + BLOCK_R - 1) // BLOCK_R
    l_last = tl.cumsum(l_blocks, axis=0)  # work blocks up to and with each layer's
    for work in range(tl.program_id(0), tl.sum(l_blocks, axis=0), tl.num_programs(0)):
        layer = tl.sum((l_last <= work).to(tl.int32), axis=0)
        this = lanes == layer
        start = tl.sum(tl.where(this, l_start, 0), axis=0)
        first = tl.sum(tl.where(this, l_last - l_blocks, 0), axis=0)
        pos = start + (work - first) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = pos < start + tl.sum(tl.where(this, l_count, 0), axis=0)
        _search_block(
            _rows_base(x_ptr, layer, start, D, TABLE), pool_ptr, ref_ptr, budget_ptr, index_ptr, need_ptr, perm_ptr,
            consts_ptr, pos, live,
            tl.load(lay_off_ptr + layer), tl.load(lay_n_ptr + layer), D, EXACT, TRACK, BLOCK_R, BLOCK_P,
        )  # fmt: skip


@triton.jit
def _search_block(x_ptr, pool_ptr, ref_ptr, budget_ptr, index_ptr, need_ptr, perm_ptr, consts_ptr, pos, live,
                  pool_off, n_pool, D: tl.constexpr, EXACT: tl.constexpr, TRACK: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """One block of :func:`engine_search_kernel`'s work: reordered positions ``pos`` (``live`` ones),
    against the layer's pool at ``pool_off`` (``n_pool`` entries)."""
    rows = tl.load(perm_ptr + pos, mask=live, other=0)
    if EXACT:
        live = live & (tl.load(need_ptr + rows, mask=live, other=0) == 2)
        acc_type = tl.float64
    else:
        acc_type = tl.float32
    pool_blk = pool_ptr + pool_off.to(tl.int64) * D
    x_row = x_ptr + rows.to(tl.int64) * D
    best, second, best_i = _nearest_two_loop(x_row, live, pool_blk, n_pool, D, acc_type, BLOCK_R, BLOCK_P)
    tl.store(index_ptr + rows, best_i, mask=live)
    a = tl.where(live, best.to(tl.float64), 0.0)  # rows not searched: inf, whose differences are NaN
    b = tl.where(live, second.to(tl.float64), 0.0)
    if EXACT:
        r1 = tl.sqrt(a)
        r2 = tl.sqrt(b)
        half_gap = (r2 - r1) * 0.5
        tie = (half_gap > tl.load(consts_ptr + 7) * (r2 + tl.load(consts_ptr + 8))) == 0  # NaN: a tie
        lonely = (r2 == float("inf")) & (r1 < float("inf"))  # no runner-up (a pool of one entry): no tie
        tie = tie & (lonely == 0)
        radius = tl.where(tie, 0.0, half_gap * tl.load(consts_ptr + 3))
        if TRACK:
            tl.store(budget_ptr + rows, _round_down_f32(radius * radius, consts_ptr), mask=live)
    else:
        gamma = tl.load(consts_ptr + 0)
        tiny = tl.load(consts_ptr + 1)
        upper1 = a * (1.0 + gamma) + tiny
        lower2 = b * (1.0 - gamma) - tiny
        finite = (a == a) & (a < float("inf")) & (a > float("-inf"))
        # a runner-up whose float32 distance overflowed certifies nothing (b = inf also for a pool of one entry:
        # the float64 pass keeps its radius infinite)
        certified = finite & (b < float("inf")) & (lower2 > upper1)
        radius = tl.sqrt(tl.where(lower2 > 0, lower2, 0.0)) - tl.sqrt(tl.where(certified, upper1, 0.0))
        radius = radius * tl.load(consts_ptr + 2)
        radius = tl.where(radius > 0, radius, 0.0)
        tl.store(need_ptr + rows, tl.where(certified, 1, 2).to(tl.int8), mask=live)
        if TRACK:
            tl.store(budget_ptr + rows, _round_down_f32(radius * radius, consts_ptr), mask=live & certified)
            for k in tl.static_range(D):
                tl.store(ref_ptr + rows.to(tl.int64) * D + k, tl.load(x_row + k, mask=live, other=0.0), mask=live)


@triton.jit
def engine_gather_kernel(index_ptr, pool_ptr, out_ptr, blk_row_ptr, blk_end_ptr, blk_off_ptr, D: tl.constexpr,
                         DP: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """``out[row] = pool[blk_off + index[row]]`` for every row: each layer's gathered weight, in the
    pools' own dtype."""
    blk = tl.program_id(0)
    rows = tl.load(blk_row_ptr + blk) + tl.arange(0, BLOCK_R)
    live = rows < tl.load(blk_end_ptr + blk)
    entry = tl.load(index_ptr + rows, mask=live, other=0).to(tl.int64) + tl.load(blk_off_ptr + blk)
    cols = tl.arange(0, DP)
    inside2 = live[:, None] & (cols[None, :] < D)
    values = tl.load(pool_ptr + entry[:, None] * D + cols[None, :], mask=inside2)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], values, mask=inside2)


@triton.jit
def engine_commit_kernel(grad_ptr, w_ptr, k_ptr, scale_ptr, out_ptr, blk_row_ptr, blk_end_ptr, blk_start_ptr,
                         blk_layer_ptr, D: tl.constexpr, DP: tl.constexpr, TABLE: tl.constexpr,
                         GRAD_TABLE: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """``out = grad + scale[layer] * (w - k)`` for every row, in float32, stored in ``out``'s dtype: the
    straight-through gradient with every layer's commitment term, in one pass. ``TABLE``: ``w`` is the
    layers' W address table (module docstring). ``GRAD_TABLE``: ``grad`` and ``out`` are one address table
    of the layers' own float32 gradients, which take the term in place (each element read and written by
    the same program)."""
    blk = tl.program_id(0)
    rows = tl.load(blk_row_ptr + blk) + tl.arange(0, BLOCK_R)
    live = rows < tl.load(blk_end_ptr + blk)
    layer = tl.load(blk_layer_ptr + blk)
    scale = tl.load(scale_ptr + layer)
    first = tl.load(blk_start_ptr + blk)
    w_base = _rows_base(w_ptr, layer, first, D, TABLE)
    g_base = _rows_base(grad_ptr, layer, first, D, GRAD_TABLE)
    out_base = _rows_base(out_ptr, layer, first, D, GRAD_TABLE)
    cols = tl.arange(0, DP)
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    inside2 = live[:, None] & (cols[None, :] < D)
    g = tl.load(g_base + offs, mask=inside2, other=0.0).to(tl.float32)
    w = tl.load(w_base + offs, mask=inside2, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + offs, mask=inside2, other=0.0).to(tl.float32)
    tl.store(out_base + offs, (g + scale * (w - k)).to(out_base.dtype.element_ty), mask=inside2)
