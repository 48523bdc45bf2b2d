"""Exact nearest-pool-vector search (paper Eq. 1), chunked and certified.

The hot path of NWS: every temporary kernel ``w`` (a row of ``vectors``) is
replaced by its nearest pool vector in L2. Two entry points:

* :func:`brute_force` is the definition: float64 distances accumulated in a
  fixed order, ``argmin`` taking the lowest index on ties.
* :func:`nearest_two` gives the same answer fast. It computes float32
  distances with one ``addmm`` per chunk (so no ``N x n`` matrix is ever
  materialised), takes the two smallest, and certifies the winner with a
  rounding-error bound. Rows whose top-2 gap is inside the bound (near-ties,
  exact ties) are recomputed with the float64 definition, so the result equals
  :func:`brute_force` exactly. Small CPU batches (the rows a lazy update
  re-searches) take the same steps in float64, in NumPy.

It also returns each row's *safe radius*: half the gap between the nearest and
second-nearest distance, shrunk by the error bound. While a row moves less
than its radius (plus the largest pool-entry movement), no other pool vector
can become its nearest, so it need not be searched again. The lazy update of
:class:`~nwsconvert.core.layers.NWSWeight` uses that.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .rounding import RADIUS_SHRINK, U32, round_down_f32, round_f32  # noqa: F401 (round_down_f32: re-exported)

__all__ = [
    "SearchResult",
    "PreparedPool",
    "brute_force",
    "nearest_two",
    "nearest_scalar",
    "scalar_cells",
    "DEFAULT_CHUNK",
]

#: Rows per ``addmm`` block. 2048 x 512 float32 distances = 4 MiB: fits in L2/L3
#: caches on CPUs and is large enough to keep a GPU busy.
DEFAULT_CHUNK = 2048


def _quiet_floats(fn):
    """``fn`` under ``np.errstate(over="ignore", invalid="ignore")``, a new one each call (nesting one shared
    instance is unsafe on older NumPy). Brute force's arithmetic overflows to inf (and inf - inf gives NaN) at
    extreme magnitudes by definition: the float64 searches say so with their results, not with warnings."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore"):
            return fn(*args, **kwargs)

    return wrapper


#: Distances between which float64 squares stay normal and finite, with a margin (see ``PreparedPool._cells``).
_SQUARE_SAFE_LOW, _SQUARE_SAFE_HIGH = 2.0**-500, 2.0**500


class PreparedPool:
    """What the searches derive from a pool: each table built on first use, reused until the pool's values change.

    Args:
        pool: ``(n, D)``.

    Attributes:
        pool: ``(n, D)`` snapshot, float32 (float64 for a float64 pool, whose values float32 would round).
        wide: whether the pool is float64: :func:`nearest_two` then searches in float64 only.
        pool_t: ``(D, n)`` contiguous. pool_sq: ``(n,)`` squared norms. max_pool_sq: their maximum (a Python float). pool64_t:
        ``(D, n)`` float64 NumPy array for the exact fallback. pool64_tt,
        pool64_sq, max_pool64_sq: the float64 twins of pool_t, pool_sq and
        max_pool_sq, for the float64 search of small batches. For D = 1 also
        ``uniq`` (sorted distinct values, float64), ``rep`` (the lowest index
        holding each), the Voronoi cells ``lo``, ``hi`` (float64, ``(n,)``) and
        ``lo32``, ``hi32``: the same cells for float32 values.
    """

    def __init__(self, pool: torch.Tensor):
        self.wide = pool.dtype == torch.float64
        self.pool = pool.detach().to(_snapshot_dtype(pool), copy=True)  # a snapshot, never an alias
        # The tables below are built on first use: a lazy update that searches nothing in a layer, or only a
        # few rows (float64 tables) or many (float32 tables), builds only what it reads. In pool learning a
        # layer's tables are rebuilt at every step (its pool moves), so what is never read is never built.

    def holds(self, pool: torch.Tensor) -> bool:
        """Whether these tables are of ``pool`` as it is now: its device, shape, width and values."""
        return (
            self.pool.device == pool.device
            and self.pool.shape == pool.shape
            and self.pool.dtype == _snapshot_dtype(pool)
            and torch.equal(self.pool, pool.detach().to(self.pool.dtype))
        )

    @functools.cached_property
    def pool_t(self) -> torch.Tensor:
        return self.pool.t().contiguous()

    @functools.cached_property
    def pool_sq(self) -> torch.Tensor:
        return (self.pool * self.pool).sum(dim=1)

    @functools.cached_property
    def max_pool_sq(self) -> float:
        return float(self.pool_sq.max())

    @functools.cached_property
    def pool64_t(self) -> np.ndarray:
        return np.ascontiguousarray(self.pool.double().cpu().numpy().T)  # (D, n), for the float64 fallback

    @functools.cached_property
    def pool64(self) -> np.ndarray:
        return np.ascontiguousarray(self.pool64_t.T)  # (n, D), for search.pair_sq_dist

    @functools.cached_property
    def pool64_tt(self) -> torch.Tensor:
        return torch.from_numpy(self.pool64_t)  # the same memory, as a CPU tensor

    @functools.cached_property
    def pool64_sq(self) -> torch.Tensor:
        return (self.pool64_tt * self.pool64_tt).sum(dim=0)

    @functools.cached_property
    def max_pool64_sq(self) -> float:
        return float(self.pool64_sq.max())

    @functools.cached_property
    def _cells(self) -> tuple[torch.Tensor, ...]:
        """D = 1: ``(uniq, rep, lo, hi, lo32, hi32)``."""
        if self.pool.shape[1] != 1:
            raise AttributeError("scalar cells exist for pools of vector size 1 only")
        p = self.pool.reshape(-1).double()
        order = torch.argsort(p, stable=True)  # equal values keep index order
        sp = p[order]
        first = torch.ones_like(sp, dtype=torch.bool)
        first[1:] = sp[1:] != sp[:-1]
        uniq, rep = sp[first], order[first]
        inf = torch.full((1,), float("inf"), dtype=torch.float64, device=p.device)
        # Each border is moved inside both cells by a band where brute force's own float64 arithmetic,
        # fl(fl(x - m)^2) (relative error < 3.01 u of the squared distance), can rank the two entries otherwise
        # than the exact border (|x - mid| <= 1.51 u * gap) or call them tied: a value 1e-17 between entries -1
        # and 1 is a tie there. The band, gap * 2^-49 = 16 u * gap, plus |mid| * 2^-50 and one ulp for the
        # rounding of the midpoint and of the sum, leaves a value inside its cell's bounds only where brute force
        # picks that entry; values in the band are searched with that arithmetic (nearest_scalar).
        # The relative bound needs squares in float64's normal range: the band is at least 2^-500 (nearer
        # than that, both squares may be subnormal) and a cell ends 2^500 from its entry (farther, a
        # square may overflow to inf and tie), on both sides. float32 values never come near either.
        mids = (uniq[1:] + uniq[:-1]) * 0.5
        gaps = uniq[1:] - uniq[:-1]
        band = gaps * 2.0**-49 + mids.abs() * 2.0**-50 + _SQUARE_SAFE_LOW
        lo_u = torch.cat([-inf, torch.nextafter(mids + band, inf[0])])
        hi_u = torch.cat([torch.nextafter(mids - band, -inf[0]), inf])
        # A cell also ends where the entry on its other side comes within rounding: at a distance d from entry
        # a, its neighbour b across (gap g) rounds to the same squared distance once g < ~3 u d (entries 0 and
        # 1e-20 tie for 0.01, and the lowest index wins there). Up to d = g * 2^48 they cannot (2^-49.2 * d
        # would be needed): a cell reaches no farther from its entry than 2^48 of the gap on its other side.
        reach = gaps * 2.0**48
        lo_u[:-1] = torch.maximum(lo_u[:-1], torch.nextafter(uniq[:-1] - reach, inf[0]))
        hi_u[1:] = torch.minimum(hi_u[1:], torch.nextafter(uniq[1:] + reach, -inf[0]))
        lo_u = torch.maximum(lo_u, torch.nextafter(uniq - _SQUARE_SAFE_HIGH, inf[0]))
        hi_u = torch.minimum(hi_u, torch.nextafter(uniq + _SQUARE_SAFE_HIGH, -inf[0]))
        lo = torch.full_like(p, float("inf"))
        hi = torch.full_like(p, float("-inf"))
        lo[rep] = lo_u
        hi[rep] = hi_u
        # The same cells for float32 values: x > lo iff x > lo rounded down to
        # float32, x < hi iff x < hi rounded up (x itself being a float32).
        return uniq, rep, lo, hi, round_f32(lo, up=False), round_f32(hi, up=True)

    @functools.cached_property
    def _walk(self) -> tuple[np.ndarray, ...]:
        """D = 1, for :func:`nearest_scalar_from`, as NumPy arrays: ``rank`` (each entry's position among the
        distinct values, duplicates sharing their value's, plus :data:`WALK_STEPS`), and by that position
        ``rep``, ``lo``, ``hi``, ``lo32``, ``hi32``, padded with :data:`WALK_STEPS` cells on each side that hold
        nothing (``lo = +inf``, ``hi = -inf``): a walk never leaves the arrays and needs no clipping."""
        uniq, rep, lo, hi, lo32, hi32 = self._cells
        rank = torch.searchsorted(uniq, self.pool.reshape(-1).double()) + WALK_STEPS  # exact: uniq holds them all

        def padded(t: torch.Tensor, fill: float) -> np.ndarray:
            pad = torch.full((WALK_STEPS,), fill, dtype=t.dtype, device=t.device)
            return torch.cat([pad, t[rep], pad]).cpu().numpy()

        reps = torch.cat([rep[:1].expand(WALK_STEPS), rep, rep[:1].expand(WALK_STEPS)]).cpu().numpy()
        inf = float("inf")
        return rank.cpu().numpy(), reps, padded(lo, inf), padded(hi, -inf), padded(lo32, inf), padded(hi32, -inf)

    @functools.cached_property
    def min_gap(self) -> float:
        """D = 1: the smallest gap between distinct values (``inf`` for one value)."""
        return float((self.uniq[1:] - self.uniq[:-1]).min()) if self.uniq.numel() > 1 else math.inf

    uniq = property(lambda self: self._cells[0])
    rep = property(lambda self: self._cells[1])
    lo = property(lambda self: self._cells[2])
    hi = property(lambda self: self._cells[3])
    lo32 = property(lambda self: self._cells[4])
    hi32 = property(lambda self: self._cells[5])


def flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the ``True`` elements of a 1-D bool tensor, ``(k,)`` int64, ascending.

    On CPU NumPy's ``flatnonzero`` is several times faster than ``torch.nonzero``
    (measured with torch 2.14 on 262,144 elements), and the lazy update calls this
    for every layer at every training step.
    """
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


def index_sum(rows: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """``zeros(n, D).index_add_(0, index, rows)``: the rows of ``rows`` ``(N, D)`` summed by ``index`` ``(N,)``
    into ``(n, D)``, with the same bits.

    On a CPU the sum runs along dim 1 of the ``(D, N)`` view with an int64 index: ``index_add_`` then loops once
    over the indices instead of adding a row of D floats per index (2-4x faster for D = 9, measured with torch
    2.14), and every output still adds its rows in ascending order (``tests/test_search.py`` compares the bits).
    """
    if rows.device.type != "cpu":
        return rows.new_zeros(n, rows.shape[1]).index_add_(0, index, rows)
    return rows.new_zeros(rows.shape[1], n).index_add_(1, index.long(), rows.t()).t().contiguous()


def _snapshot_dtype(pool: torch.Tensor) -> torch.dtype:
    """The dtype :class:`PreparedPool` keeps ``pool`` in: float32 holds float16 and bfloat16 exactly."""
    return torch.float64 if pool.dtype == torch.float64 else torch.float32


def _prepared(pool) -> PreparedPool:
    return pool if isinstance(pool, PreparedPool) else PreparedPool(pool)


@dataclass
class SearchResult:
    """Nearest pool entries of a batch of vectors.

    Attributes:
        index: ``(N,)`` int64, the nearest pool entry of each row (lowest index on ties).
        radius: ``(N,)`` float64, how far (L2) the row may move, together with
            any pool-entry movement, before its nearest entry can change. ``0`` on ties.
        exact_rows: how many rows needed the float64 fallback (near-ties); a 0-dim device
            tensor on the fused CUDA path, so that reading it is the caller's (one) sync.
        second: with ``pair=True`` on a CPU, ``(N,)`` int64: the runner-up entry of each row.
        third: with ``second``, ``(N,)`` float64: a lower bound on the distance from the row to every
            entry but ``index`` and ``second`` (``inf`` when there is none).
    """

    index: torch.Tensor
    radius: torch.Tensor
    exact_rows: int | torch.Tensor = 0
    second: torch.Tensor | None = None
    third: torch.Tensor | None = None


@_quiet_floats
def _exact_sq_dist(x: torch.Tensor, pool) -> np.ndarray:
    """Float64 squared distances, each computed from its own row and entry alone.

    Args:
        x: ``(b, D)`` vectors. pool: ``(n, D)`` tensor, or the ``(D, n)`` float64
            array ``PreparedPool.pool64_t``.

    Returns:
        ``(b, n)`` float64 NumPy array. Element ``(i, j)`` is
        ``sum_k (x[i, k] - m[j, k])^2`` with every difference and square correctly
        rounded and the sum accumulated over ``k = 0 .. D-1`` in that order, so its
        value does not depend on which other rows or entries are computed
        alongside it. (NumPy also has a far smaller per-call cost than torch for
        the few rows this sees.)
    """
    x = x.detach()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        xa = x.numpy().astype(np.float64)  # 2 us instead of 40 for a torch cast, on each call
    else:
        xa = x.to(torch.float64).cpu().numpy()
    pt = pool if isinstance(pool, np.ndarray) else np.ascontiguousarray(pool.detach().to(torch.float64).cpu().numpy().T)
    acc = np.subtract.outer(xa[:, 0], pt[0])
    np.square(acc, out=acc)
    term = np.empty_like(acc)
    for k in range(1, xa.shape[1]):  # one (b, n) pass per coordinate: no (b, n, D) temporary
        np.subtract.outer(xa[:, k], pt[k], out=term)
        np.square(term, out=term)
        acc += term
    return acc


def pair_sq_dist(x: np.ndarray, pool: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """Each row's float64 squared distances to entries of its own, with :func:`_exact_sq_dist`'s arithmetic
    (the same bits as those entries' columns there: each difference squared, summed over k in order).

    Args:
        x: ``(b, D)`` float64. pool: ``(n, D)`` float64 (``PreparedPool.pool64``). entries: ``(b, c)`` int.

    Returns:
        ``(b, c)`` float64.
    """
    sq = x[:, None, :] - pool.take(entries, axis=0)  # (b, c, D)
    np.square(sq, out=sq)
    acc = sq[:, :, 0].copy()
    for k in range(1, x.shape[1]):
        acc += sq[:, :, k]
    return acc


def brute_force(vectors: torch.Tensor, pool: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Reference nearest-neighbour search (the definition the fast path must equal).

    Args:
        vectors: ``(N, D)`` floating point.
        pool: ``(n, D)`` floating point.
        chunk: rows per block (bounds memory to ``chunk x n`` float64).

    Returns:
        ``(N,)`` int64 index of the nearest pool row; the lowest index wins ties.
    """
    out = torch.empty(vectors.shape[0], dtype=torch.int64, device=vectors.device)
    for s in range(0, vectors.shape[0], chunk):
        out[s : s + chunk] = torch.from_numpy(_exact_sq_dist(vectors[s : s + chunk], pool).argmin(axis=1))
    return out


@_quiet_floats
def _exact_two(x: torch.Tensor, pool, pair: bool = False) -> tuple[torch.Tensor, ...]:
    """Float64 search of a few rows: the definition itself, used where float32 cannot certify.

    Args:
        x: ``(b, D)``. pool: ``(n, D)`` tensor or ``PreparedPool.pool64_t``.
        pair: also the runner-up and a lower bound on the distance to every other entry.

    Returns:
        ``(index, radius)`` (with ``pair``: ``(index, radius, second, third)``): ``(b,)`` int64 nearest
        entries and ``(b,)`` float64 radii, on ``x``'s device.
    """
    dist = _exact_sq_dist(x, pool)
    n = dist.shape[1]
    d1, d2, d3, idx, second = _smallest_three_np(dist)
    if n >= 2:  # a row whose other values all overflowed masked nothing: its runner-up is another entry
        same = np.flatnonzero(second == idx)
        second[same] = np.where(idx[same] == 0, 1, 0)
    r1, r2 = np.sqrt(d1), np.sqrt(d2)
    radius = (r2 - r1) * 0.5
    # Float64 rounding of the distances is ~1e-16 relative: below 1e-12 of the
    # distance scale we call it a tie and always re-search. The same test calls a
    # runner-up whose distance overflowed a tie (inf > 1e-12 * inf is false).
    radius = np.where(radius > 1e-12 * (r2 + 1e-30), radius * RADIUS_SHRINK, 0.0)
    out = [torch.from_numpy(idx), torch.from_numpy(radius)]
    if pair:  # the definition's own values: their rounding (~1e-15 relative) taken off; none if overflowed
        out += [torch.from_numpy(second), torch.from_numpy(_finite_third(np.sqrt(d3) * (1 - 1e-12), n))]
    return tuple(t.to(x.device) for t in out)


#: Up to this many rows (on CPU) the distances are computed in float64
#: (``||m||^2 - 2 x.m + ||x||^2`` with one float64 ``addmm``), whose error bound is
#: 2^29 times smaller than float32's: the near-border rows a lazy update
#: re-searches are certified there, where about one in ten needed the float64
#: definition after a float32 search. D = 9, 512 entries: 54 us for 10 rows
#: against 99 us in float32, even at 300 rows; float32 wins from ~1000 rows
#: (full searches).
FLOAT64_ROWS = 1024

# Unit roundoff of float64.
_U64 = 2.0**-53
#: Per product or square in the distances' bounds: 4x the largest absolute rounding of a subnormal result
#: (half the smallest subnormal), the part of the error a relative bound misses where values are tiny
#: (float32 distances of values near 1e-22, float64 ones near 1e-160).
_TINY32 = 2.0**-148
_TINY64 = 2.0**-1073


def _finite_third(third: np.ndarray, n: int) -> np.ndarray:
    """The lower bound on every other entry's distance, 0 (none) where it overflowed: ``inf`` stays only
    where the pool has fewer than three entries (there is no other entry)."""
    return np.where(np.isfinite(third), third, 0.0) if n >= 3 else third


def _two_smallest_np(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Smallest and second-smallest value of every row of ``a`` ``(b, n)``, and the smallest one's column.

    NumPy's SIMD ``argmin`` / ``min`` are several times faster than ``torch.topk``
    on CPU: the winner is taken with ``argmin`` (its first minimum: the lowest
    column on ties), masked in place (``a`` is overwritten), and the runner-up
    with ``min``; ``inf`` when n = 1.

    Returns:
        ``(v1, v2, idx)``: ``(b,)`` values and ``(b,)`` int64 columns.
    """
    idx = a.argmin(axis=1)
    rows = np.arange(a.shape[0])
    v1 = a[rows, idx]
    if a.shape[1] > 1:
        a[rows, idx] = np.inf
        v2 = a.min(axis=1)
    else:
        v2 = np.full_like(v1, np.inf)
    return v1, v2, idx.astype(np.int64, copy=False)


def _smallest_three_np(a: np.ndarray) -> tuple[np.ndarray, ...]:
    """:func:`_two_smallest_np` and the third smallest value, and the second one's column (``a`` is
    overwritten; values ``inf`` and the column the winner's where a row has fewer columns).

    Returns:
        ``(v1, v2, v3, idx, second)``: ``(b,)`` values and ``(b,)`` int64 columns.
    """
    idx = a.argmin(axis=1)
    rows = np.arange(a.shape[0])
    v1 = a[rows, idx]
    a[rows, idx] = np.inf
    second = a.argmin(axis=1)
    v2 = a[rows, second]
    a[rows, second] = np.inf
    v3 = a.min(axis=1)
    if a.shape[1] < 2:
        second = idx.copy()
    return v1, v2, v3, idx.astype(np.int64, copy=False), second.astype(np.int64, copy=False)


def _two_smallest(dist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smallest and second-smallest value of every row, and the smallest one's column.

    Args:
        dist: ``(b, n)``, n >= 2, a temporary the caller owns (on CPU it is overwritten).

    Returns:
        ``(v1, v2, idx)``: ``(b,)`` values and ``(b,)`` int64 columns. Which column wins
        an exact tie is unspecified (the caller never certifies ties).
    """
    if dist.device.type != "cpu":
        top = dist.topk(2, dim=1, largest=False, sorted=True)
        return top.values[:, 0], top.values[:, 1], top.indices[:, 0]
    v1, v2, idx = _two_smallest_np(dist.numpy())
    return torch.from_numpy(v1), torch.from_numpy(v2), torch.from_numpy(idx)


def _radius(d1, d2, tol):
    """Safe radius from the certified distances: ``(sqrt(d2 - tol) - sqrt(d1 + tol)) / 2``, shrunk, >= 0.

    Args:
        d1, d2, tol: ``(b,)`` float64 NumPy arrays.
    """
    r1 = np.sqrt(np.maximum(d1 + tol, 0.0))
    r2 = np.sqrt(np.maximum(d2 - tol, 0.0))
    return np.maximum((r2 - r1) * (0.5 * RADIUS_SHRINK), 0.0)


@_quiet_floats
def _nearest_two_f64(vectors: torch.Tensor, prep: PreparedPool, pair: bool = False) -> tuple:
    """:func:`nearest_two` of a small CPU batch: float64 distances, certified, in NumPy.

    The same certification as the float32 path with float64's unit roundoff, so
    only true near-ties (margin below ~1e-15 of the distances) reach the
    float64 definition. NumPy instead of torch: a lazy update calls this once
    per layer for ~10-300 rows, where torch's per-op cost (~5-10 us for each of
    ~25 ops) would outweigh the arithmetic.

    Args:
        vectors: ``(b, D)`` float32 CPU tensor, ``b >= 1``.
        pair: also each row's runner-up and ``third`` (see :class:`SearchResult`).

    Returns:
        ``(index, radius, exact_rows)``: ``(b,)`` int64 and float64 arrays, and how
        many rows needed the definition; with ``pair``, then ``second`` and ``third``.
    """
    xa = vectors.numpy().astype(np.float64)
    # ||m||^2 - 2 x.m through torch's BLAS (NumPy's would start its own threads).
    dist = torch.addmm(prep.pool64_sq, torch.from_numpy(xa), prep.pool64_tt, alpha=-2.0).numpy()
    x_sq = np.einsum("ij,ij->i", xa, xa)
    tol = ((xa.shape[1] + 4) * _U64 * 2.0) * (x_sq + prep.max_pool64_sq) + (xa.shape[1] + 4) * _TINY64
    if pair:
        v1, v2, v3, idx, second = _smallest_three_np(dist)
    else:
        v1, v2, idx = _two_smallest_np(dist)
    d1, d2 = v1 + x_sq, v2 + x_sq
    rad = _radius(d1, d2, tol)
    third_lo = _finite_third(np.sqrt(np.maximum(v3 + x_sq - tol, 0.0)), dist.shape[1]) if pair else None
    unsure = np.flatnonzero(~(((d2 - d1) > 2 * tol) & (np.isfinite(d2) | (dist.shape[1] < 2))))
    if unsure.size:
        exact = _exact_two(torch.from_numpy(xa[unsure]), prep.pool64_t, pair)
        idx[unsure] = exact[0].numpy()
        rad[unsure] = exact[1].numpy()
        if pair:
            assert second is not None and third_lo is not None
            second[unsure] = exact[2].numpy()
            third_lo[unsure] = exact[3].numpy()
    if pair:
        return idx, rad, int(unsure.size), second, third_lo
    return idx, rad, int(unsure.size)


def nearest_two(vectors: torch.Tensor, pool, chunk: int = DEFAULT_CHUNK, pair: bool = False) -> SearchResult:
    """Exact nearest pool entry of every row, with a safe re-search radius.

    Args:
        vectors: ``(N, D)``: float32, or float16 / bfloat16 (cast to float32, exactly); float64 vectors,
            or a float64 pool, are searched in float64 only.
        pool: ``(n, D)`` tensor on ``vectors``' device, or its :class:`PreparedPool`.
        chunk: rows per ``addmm`` block; memory is ``chunk x n`` floats.
        pair: on a CPU, also each row's runner-up (``second``) and the bound ``third``: one more pass over
            the distances (elsewhere they stay ``None``).

    Returns:
        :class:`SearchResult` whose ``index`` equals :func:`brute_force` exactly.

    Remarks:
        float32 ``||m||^2 - 2 x.m + ||x||^2`` has absolute error at most
        ``(D + 4) * u * 2 * (||x||^2 + max ||m||^2)`` (u = 2^-24, standard dot
        product bound, with a factor 2 of slack for BLAS blocking). A winner
        whose margin over the runner-up exceeds twice that is the true argmin;
        the rest go to the float64 fallback. On CPU, batches of up to
        :data:`FLOAT64_ROWS` rows use the same bound in float64 (u = 2^-53). CUDA
        tensors take :func:`~nwsconvert.core.fused_search.fused_nearest_two` (Triton) when
        Triton is installed: the same answer without the distance matrix or a host sync.
    """
    prep = _prepared(pool)
    pool = prep.pool
    if vectors.ndim != 2 or vectors.shape[1] != pool.shape[1]:
        raise ValueError(f"vectors {tuple(vectors.shape)} and pool {tuple(pool.shape)} must be (N, D) and (n, D)")
    n, dim = pool.shape
    if prep.wide or vectors.dtype == torch.float64:
        return _nearest_two_wide(vectors.detach(), prep, chunk, pair)
    vectors = vectors.detach().float()
    num = vectors.shape[0]
    on_cpu = vectors.device.type == "cpu"
    pair = pair and on_cpu
    if 0 < num <= FLOAT64_ROWS and on_cpu:
        found = _nearest_two_f64(vectors, prep, pair)
        res = SearchResult(torch.from_numpy(found[0]), torch.from_numpy(found[1]), found[2])
        if pair:
            res.second, res.third = torch.from_numpy(found[3]), torch.from_numpy(found[4])
        return res
    if vectors.device.type == "cuda":
        from . import fused_search  # imports Triton's wrapper only when a CUDA search runs

        if fused_search.available(vectors.device):
            # One fused kernel pass, certified and resolved on the device (no N x n matrix, no host sync).
            idx, rad, exact = fused_search.fused_nearest_two(vectors, pool)
            return SearchResult(idx, rad, exact.sum())
    index = torch.empty(num, dtype=torch.int64, device=vectors.device)
    radius = torch.empty(num, dtype=torch.float64, device=vectors.device)
    second = torch.empty_like(index) if pair else None
    third = torch.empty_like(radius) if pair else None
    if num == 0:
        return SearchResult(index, radius, 0, second, third)
    pool_sq, pool_t, max_pool_sq = prep.pool_sq, prep.pool_t, prep.max_pool_sq
    err_scale = (dim + 4) * U32 * 2.0
    # The products' and squares' subnormal rounding (2^-150 each, with slack), folded into the sum it scales.
    tiny_sq = max_pool_sq + (dim + 4) * _TINY32 / err_scale
    exact_rows = 0
    for s in range(0, num, chunk):
        x = vectors[s : s + chunk]
        dist = torch.addmm(pool_sq, x, pool_t, alpha=-2.0)  # ||m||^2 - 2 x.m, (b, n)
        x_sq = (x * x).sum(dim=1)
        tol = err_scale * (x_sq + tiny_sq)
        if pair:  # on a CPU (n = 1 included: the runner-up is the winner, both further values inf)
            v1, v2, v3, i1, i2 = (torch.from_numpy(a) for a in _smallest_three_np(dist.numpy()))
            idx, d1, d2 = i1, v1 + x_sq, v2 + x_sq
            assert second is not None and third is not None
            second[s : s + x.shape[0]] = i2
            d3_lo = (v3 + x_sq - tol).double().clamp_min(0).sqrt()
        elif n > 1:
            v1, v2, idx = _two_smallest(dist)
            d1 = v1 + x_sq
            d2 = v2 + x_sq
        else:
            idx = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
            d1 = dist[:, 0] + x_sq
            d2 = torch.full_like(d1, float("inf"))
        certain = (d2 - d1) > 2 * tol
        d1_hi = (d1 + tol).double().clamp_min(0).sqrt()
        d2_lo = (d2 - tol).double().clamp_min(0).sqrt()
        rad = ((d2_lo - d1_hi) * 0.5 * RADIUS_SHRINK).clamp_min(0)
        index[s : s + x.shape[0]] = idx
        radius[s : s + x.shape[0]] = rad
        if pair:
            assert third is not None
            third[s : s + x.shape[0]] = d3_lo
        if not bool(certain.all()):
            rows = flat_nonzero(~certain)
            found = _exact_two(x[rows], prep.pool64_t, pair)
            index[s + rows] = found[0]
            radius[s + rows] = found[1]
            if pair:
                assert second is not None and third is not None
                second[s + rows] = found[2]
                third[s + rows] = found[3]
            exact_rows += rows.numel()
    if n > 1:  # a runner-up whose float32 distance overflowed certified nothing (its radius reads inf): redone
        exact_rows += _redo_overflowed(vectors, prep, pair, index, radius, second, third)
    return SearchResult(index, radius, exact_rows, second, third)


def _redo_overflowed(vectors, prep: PreparedPool, pair: bool, index, radius, second, third) -> int:
    """After the float32 search: rows whose radius is not finite had a runner-up distance that overflowed; they
    take the definition. A third distance that overflowed bounds nothing (0). One pass over the results, not
    one per chunk: such rows need values near 1e19. Returns how many rows were redone."""
    rows = flat_nonzero(~torch.isfinite(radius))
    if rows.numel():
        found = _exact_two(vectors[rows], prep.pool64_t, pair)
        index[rows], radius[rows] = found[0], found[1]
        if pair:
            second[rows], third[rows] = found[2], found[3]
    if pair and prep.pool.shape[0] >= 3:
        third.nan_to_num_(nan=0.0, posinf=0.0)  # (a NaN bound settles nothing either)
    return rows.numel()


def _nearest_two_wide(vectors: torch.Tensor, prep: PreparedPool, chunk: int, pair: bool) -> SearchResult:
    """:func:`nearest_two` of float64 vectors or a float64 pool: float32 would round them, so every chunk takes
    the float64 search (:func:`_nearest_two_f64`, on a CPU; the answer is moved back to the vectors' device).
    1.1-2.0x the float32 search's time (262,144 rows of 9 against 512 entries on the project's CPU, run to run)."""
    device, x = vectors.device, vectors.to("cpu", torch.float64)  # exact for every float dtype
    pair = pair and device.type == "cpu"
    found = [_nearest_two_f64(x[s : s + chunk], prep, pair) for s in range(0, x.shape[0], chunk)]
    parts = _WIDE_PARTS if pair else _WIDE_PARTS[:2]
    cat = [np.concatenate([f[k] for f in found]) if found else np.empty(0, dtype) for k, dtype in parts]
    index, radius = (torch.from_numpy(a).to(device) for a in cat[:2])
    res = SearchResult(index, radius, sum(f[2] for f in found))
    if pair:
        res.second, res.third = (torch.from_numpy(a).to(device) for a in cat[2:])
    return res


#: Where :func:`_nearest_two_f64`'s parts sit in its answer, and their dtypes when there are no rows.
_WIDE_PARTS = ((0, np.int64), (1, np.float64), (3, np.int64), (4, np.float64))


def nearest_scalar(values: torch.Tensor, pool) -> torch.Tensor:
    """Exact nearest entry of a scalar pool (D = 1), by sorting: ``O(N log n)``.

    Args:
        values: ``(N,)`` or ``(N, 1)``.
        pool: ``(n,)`` / ``(n, 1)`` tensor, or its :class:`PreparedPool`.

    Returns:
        ``(N,)`` int64, equal to :func:`brute_force`: each value's two sorted
        neighbours are compared with the same float64 squared distance, and
        ties (equal pool values, or a value exactly midway) go to the lowest index.
        Values whose distance rounds to a tie with an entry beyond the neighbours
        (a value more than 2^48 gaps from two close entries) are left to brute force.
    """
    prep = _prepared(pool if isinstance(pool, PreparedPool) else pool.reshape(-1, 1))
    uniq, uidx = prep.uniq, prep.rep
    x = values.detach().reshape(-1).to(torch.float64)
    m = uniq.numel()
    right = torch.searchsorted(uniq, x).clamp_(max=m - 1)
    left = (right - 1).clamp_(min=0)
    dl = (x - uniq.index_select(0, left)).square_()
    dr = (x - uniq.index_select(0, right)).square_()
    il, ir = uidx.index_select(0, left), uidx.index_select(0, right)
    take_right = (dr < dl) | ((dr == dl) & (ir < il))
    out = torch.where(take_right, ir, il)
    # Rounding can tie the next entry out on either side with the nearer neighbour (the value far from two
    # close entries: 0.01 from 0 and 1e-20); then every entry at that distance counts, and brute force
    # itself decides those (rare) values. It cannot within 2^48 of the gap between them (see
    # PreparedPool._cells): when no value is that far from any entry, there is nothing to look at.
    if not x.numel():
        return out
    low, high = torch.aminmax(x)
    span = float(torch.maximum(high, uniq[-1]) - torch.minimum(low, uniq[0]))
    gap = prep.min_gap
    # (a NaN value makes span NaN: the check below runs, though NaN values themselves are not matched to
    # brute force, which takes entry 0 for them)
    if gap >= 2 * _SQUARE_SAFE_LOW and span <= min(gap * 2.0**48, _SQUARE_SAFE_HIGH):
        return out
    best = torch.minimum(dl, dr)
    outer_l, outer_r = (left - 1).clamp_(min=0), (right + 1).clamp_(max=m - 1)
    tied = ((x - uniq.index_select(0, outer_l)).square_() <= best) & (outer_l != left)
    tied |= ((x - uniq.index_select(0, outer_r)).square_() <= best) & (outer_r != right)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        out[rows] = brute_force(x.index_select(0, rows)[:, None], prep.pool).to(out.device)
    return out


#: Cells a re-searched scalar walks from its previous entry's before a binary search takes over. Values that
#: leave their cell in training mostly land in a neighbour: MobileNetV2 at 224², 40 steps into a task, moved
#: 78 % of them one cell, 13 % two and 4 % three; 3 steps then cost 7.9 ms a step against 26-28 ms.
WALK_STEPS = 3


def nearest_scalar_from(values: torch.Tensor, start: torch.Tensor, pool) -> torch.Tensor:
    """:func:`nearest_scalar` of values that were nearest to the entries ``start`` a moment ago, found by
    walking from cell to cell.

    Each step moves one cell toward the value and keeps the entry whose cell holds it strictly (the cell test
    is exact); values still outside after :data:`WALK_STEPS` steps (farther moves, a value on a border, NaN)
    take :func:`nearest_scalar`. The result equals it whatever ``start`` is.

    Args:
        values: ``(k,)`` float32 or float64 (the cells are taken in that precision).
        start: ``(k,)`` integer entries, any of the pool's.
        pool: ``(n,)`` / ``(n, 1)`` tensor, or its :class:`PreparedPool`.

    Returns:
        ``(k,)`` int64 on the values' device.
    """
    prep = _prepared(pool if isinstance(pool, PreparedPool) else pool.reshape(-1, 1))
    if values.device.type != "cpu" or values.dtype not in (torch.float32, torch.float64) or not values.numel():
        return nearest_scalar(values, prep)
    rank, rep, lo64, hi64, lo32, hi32 = prep._walk
    lo, hi = (lo32, hi32) if values.dtype == torch.float32 else (lo64, hi64)
    v = values.numpy()
    # (a start entry that is NaN has no cell among the distinct values: it starts from the last)
    r = np.clip(rank.take(start.cpu().numpy()), WALK_STEPS, len(rep) - WALK_STEPS - 1)
    r += np.where(v < hi.take(r), -1, 1)  # one cell toward the value (NaN: up, into the padding at worst)
    out = rep.take(r)  # right where the value is inside; the rest is walked on or searched below
    todo = np.flatnonzero(~((lo.take(r) < v) & (v < hi.take(r))))
    v, r = v[todo], r[todo]
    for _ in range(WALK_STEPS - 1):
        if not todo.size:
            break
        r += np.where(v < hi.take(r), -1, 1)
        out[todo] = rep.take(r)
        left = np.flatnonzero(~((lo.take(r) < v) & (v < hi.take(r))))
        todo, v, r = todo[left], v[left], r[left]
    if todo.size:
        out[todo] = nearest_scalar(torch.from_numpy(v), prep).numpy()
    return torch.from_numpy(out)


def scalar_cells(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Voronoi cells of a scalar pool, cut inside by a band: where ``lo[j] < x < hi[j]``, entry j is what
    :func:`brute_force` picks for x (float32 or float64); a value outside every cell lies within about
    ``2^-49`` of a gap from a border (brute force's rounding can rank the two entries otherwise there) and is
    searched.

    Args:
        pool: ``(n,)`` or ``(n, 1)``.

    Returns:
        ``(lo, hi)``, each ``(n,)`` float64. Duplicate entries other than the
        lowest-index one get an empty cell (``lo = +inf``).
    """
    prep = _prepared(pool.reshape(-1, 1))
    return prep.lo, prep.hi
