"""Fused exact nearest-two search (Triton): the CUDA path of :func:`~nwsconvert.search.nearest_two`.

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
   :func:`~nwsconvert.search.brute_force`, hence the same argmin, lowest index
   on ties and the first NaN winning as NumPy's ``argmin`` has it.

No ``.item()``, ``nonzero`` or branch on a tensor value: the result is ready
when the device is, so the search can sit inside a training step without host
syncs. On a CPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported), which is how CI
checks it; elsewhere on CPU :func:`~nwsconvert.search.nearest_two` keeps its
BLAS + NumPy path.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["available", "fused_nearest_two"]

#: Triton is imported on first search (0.3 s), from :mod:`nwsconvert.triton_kernels`. CPU-only torch
#: wheels come without it.
_HAVE_TRITON = importlib.util.find_spec("triton") is not None

#: Unit roundoff of float32, and the smallest subnormal float32.
_U32 = 2.0**-24
_TINY32 = 2.0**-149
#: Same shrink of every radius as the BLAS path (``search._RADIUS_SHRINK``).
_RADIUS_SHRINK = 1.0 - 1e-4
#: Rows per program.
_BLOCK_R = 32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str) -> bool:
    """Whether :func:`fused_nearest_two` runs on ``device``: CUDA with Triton, or any device under the interpreter."""
    if not _HAVE_TRITON:
        return False
    return torch.device(device).type == "cuda" or _interpreting()


def _launch(x, pool, active, idx, d1, d2, gated: bool) -> None:
    """The float32 pass over every row (``gated=False``), or the float64 pass over the ``active`` rows."""
    import triton
    import triton.language as tl

    from .triton_kernels import nearest_two_kernel

    n_rows, dim = x.shape
    interp = _interpreting()
    block_p = 1024 if interp else 64  # the interpreter pays per tile, the GPU per register
    extra = {} if interp else {"enable_fp_fusion": not gated}  # float64 pass: no FMA, as brute_force
    grid = (triton.cdiv(n_rows, _BLOCK_R),)
    acc = tl.float64 if gated else tl.float32
    nearest_two_kernel[grid](x, pool, active, idx, d1, d2, n_rows, pool.shape[0], D=dim, ACC=acc, GATED=gated,
                              BLOCK_R=_BLOCK_R, BLOCK_P=block_p, **extra)


def fused_nearest_two(vectors: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact nearest pool entry of every row, its safe radius, and which rows needed float64.

    Args:
        vectors: ``(N, D)``, cast to float32 (as :func:`~nwsconvert.search.nearest_two` does).
        pool: ``(n, D)`` on the same device, ``n >= 1``.

    Returns:
        ``(index, radius, exact)``: ``(N,)`` int64 equal to :func:`~nwsconvert.search.brute_force`
        of the float32 rows, ``(N,)`` float64 radii (how far a row may move, together with any
        pool-entry movement, before its nearest entry can change; 0 on ties), ``(N,)`` bool rows
        resolved in float64. All on ``vectors``' device; no host sync.
    """
    if not available(vectors.device):
        raise RuntimeError(f"fused search needs CUDA and Triton (device {vectors.device}; Triton "
                           f"{'present' if _HAVE_TRITON else 'missing'}; TRITON_INTERPRET=1 runs it on CPU)")
    if vectors.ndim != 2 or pool.ndim != 2 or vectors.shape[1] != pool.shape[1] or pool.shape[0] < 1:
        raise ValueError(f"vectors {tuple(vectors.shape)} and pool {tuple(pool.shape)} must be (N, D) and (n >= 1, D)")
    x = vectors.detach().to(torch.float32).contiguous()
    m = pool.detach().to(device=x.device, dtype=torch.float32).contiguous()
    n_rows, dim = x.shape
    idx = torch.empty(n_rows, dtype=torch.int64, device=x.device)
    if n_rows == 0:
        empty = torch.empty(0, dtype=torch.float64, device=x.device)
        return idx, empty, torch.zeros(0, dtype=torch.bool, device=x.device)
    d1 = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    d2 = torch.empty_like(d1)
    _launch(x, m, idx, idx, d1, d2, gated=False)  # active_ptr unused when not gated

    # Certify: true distances lie within gamma (relative) + tiny (subnormal rounding) of the computed ones.
    gamma = 2.0 * (dim + 2) * _U32
    tiny = (2 * dim + 2) * _TINY32
    a, b = d1.double(), d2.double()
    upper1 = a * (1 + gamma) + tiny
    lower2 = b * (1 - gamma) - tiny
    exact = ~(torch.isfinite(a) & (lower2 > upper1))  # NaN compares false: uncertified
    radius = ((lower2.clamp_min(0).sqrt() - upper1.sqrt()) * (0.5 * _RADIUS_SHRINK)).clamp_min(0)

    e1 = torch.empty(n_rows, dtype=torch.float64, device=x.device)
    e2 = torch.empty_like(e1)
    _launch(x, m, exact.to(torch.int8), idx, e1, e2, gated=True)
    r1, r2 = e1.sqrt(), e2.sqrt()
    half_gap = (r2 - r1) * 0.5
    # float64 distances are ~1e-16 relative: a gap below 1e-12 of their scale is a tie (radius 0).
    exact_radius = torch.where(half_gap > 1e-12 * (r2 + 1e-30), half_gap * _RADIUS_SHRINK, 0.0)
    return idx, torch.where(exact, exact_radius, radius), exact
