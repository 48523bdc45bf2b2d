"""Triton kernels (imported on first use: importing Triton takes a noticeable part of a second).

Decorated when this module is first imported: under ``TRITON_INTERPRET=1`` set before that, they run
in Triton's interpreter on CPU tensors.
"""

import triton
import triton.language as tl

__all__ = ["nearest_two_kernel"]


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
    n_pool = tl.load(blk_n_ptr + blk)
    pool_blk = pool_ptr + tl.load(blk_off_ptr + blk).to(tl.int64) * D
    pool_end = n_pool * tl.max(live.to(tl.int32), axis=0)  # 0: nothing to search in this block
    x_row = x_ptr + rows.to(tl.int64) * D
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
    tl.store(idx_ptr + rows, best_i.to(tl.int64), mask=live)
    tl.store(d1_ptr + rows, best, mask=live)
    tl.store(d2_ptr + rows, second, mask=live)
