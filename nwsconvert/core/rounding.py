"""Float32 rounding bounds shared by the exact searches and the lazy drift test.

The searches (:mod:`.search`, :mod:`.fused_search`) and the layers' and engine's movement
budgets (:mod:`.layers`, :mod:`.engine`) all certify float32 results against exact arithmetic
with these bounds; one module keeps them in one place (and the modules that use them free of
imports of each other).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

__all__ = [
    "U32",
    "RADIUS_SHRINK",
    "round_f32",
    "round_down_f32",
    "round_up_f32",
    "budget_sq",
    "shrunk_budget_sq",
    "shifted_drift_sq",
    "full_precision",
]

#: Unit roundoff of float32.
U32 = 2.0**-24
#: Relative shrink applied to every radius, so that the float32 drift test made
#: by the caller (error << 1e-5 relative for vectors of <= 1024 elements) never
#: lets a row through that exact arithmetic would re-search.
RADIUS_SHRINK = 1.0 - 1e-4


def round_f32(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float64 -> float32, rounded toward +inf (``up``) or -inf instead of to nearest."""
    r32 = x.float()
    bad = r32.double() < x if up else r32.double() > x
    toward = torch.tensor(float("inf") if up else float("-inf"), device=x.device)
    return torch.where(bad, torch.nextafter(r32, toward), r32)


def round_down_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x >= 0`` -> float32 never above it, in three cheap ops (:func:`round_f32` takes six).

    ``x * (1 - 2^-22) - 2^-149`` rounds to a float32 below ``x``: the relative
    rounding of a normal float32 (at most 2^-24) is covered by the first term, the
    absolute rounding of a subnormal one (at most 2^-150) by the second. Costs
    ``x`` 2^-22 of its value; 0 maps to a negative number, NaN to NaN, values
    beyond float32's range to +inf (which a float32 drift, finite or not,
    compares with as with the true value or more cautiously).
    """
    return (x * (1.0 - 2.0**-22) - 2.0**-149).float()


def budget_sq(radius: torch.Tensor, vec: torch.Tensor, ref: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
    """Squared movement budget per row, float32, never rounded up; <= 0 (or NaN) where none is left.

    Args:
        radius: ``(b,)`` float64 safe radii from the search. vec: ``(b, D)`` the
            searched rows. ref: ``(b, D)`` their stored copies (drift is measured
            from ``ref``, so any rounding of the copy is spent here).
        shift: the layer's pool movement not yet taken off its rows' budgets (see
            :func:`shifted_drift_sq`); ``(radius + shift)^2`` is stored, so that the shift
            at the next test, less this one, is what the pools moved since this search.
    """
    if ref.dtype == vec.dtype:  # an exact copy: no rounding to spend
        left = radius
    else:
        left = radius - torch.linalg.vector_norm(vec.double() - ref.double(), dim=1) * (1 + 1e-6)
    # Less sqrt(D x 2^-149): the float32 drift's squares of tiny differences round by up to 2^-150 each
    # (absolute), which no relative slack covers (drifts near 1e-23 read as 0); a drift computed below
    # budget^2 is then truly below the radius, shift or not.
    left = (left - math.sqrt(vec.shape[1] * 2.0**-149)).clamp_min(0)
    # Clamped to float32's largest value: a budget beyond it (a radius plus a shift above 1.8e19) would
    # otherwise become +inf, which no later pool movement could shrink (inf - shift is inf).
    return round_down_f32((left + shift).square() if shift else left.square()).clamp_(max=_F32_MAX)


def shrunk_budget_sq(budget: torch.Tensor, by) -> torch.Tensor:
    """Squared budgets ``budget`` (float32) less a movement ``by`` (a float or per-row float64 tensor, slack
    already in it), in float64 and rounded down; a budget with none left (``<= 0`` or NaN) stays none."""
    left = (budget.double().clamp_min(0).sqrt() - by).clamp_min(0)
    return torch.where(budget > 0, round_down_f32(left.square()), budget.clamp_max(0))


def round_up_f32(x: float) -> float:
    """The smallest float32 value ``>= x`` (a Python float), for ``x >= 0``."""
    r = float(np.float32(x))
    return r if r >= x else float(np.nextafter(np.float32(x), np.float32(np.inf)))


_F32_MAX = float(np.finfo(np.float32).max)

#: Drift factor of :func:`shifted_drift_sq`: covers its four float32 roundings (see there).
_SHIFT_SLACK = 1.0 + 2.0**-21


def shifted_drift_sq(drift_sq: torch.Tensor, shift: float) -> torch.Tensor:
    """``(sqrt(drift_sq) + shift)^2`` in place, never rounded down: what a row's budget from
    :func:`budget_sq` (given the shift at its search) is compared with.

    A layer whose pool moves keeps the movement as one number (the shift, rounded up) instead of
    taking it off every row's budget at every step: a row searched when the shift was ``s0`` may
    move ``radius`` less what the pools moved since, so ``drift + shift < radius + s0``.

    float32 ``sqrt``, ``+ shift`` (a float32 value: rounded up here), square and the product with
    ``1 + 2^-21`` each lose at most a factor ``1 - 2^-24``; ``(1 - 2^-24)^6 (1 + 2^-21) > 1``, so
    the result is at least the exact value of the computed ``drift_sq``.

    Args:
        drift_sq: ``(b,)`` float32 squared drifts, overwritten. shift: ``> 0``.
    """
    # A shift of at least 2^-60 keeps every intermediate a normal float32 (the bound above is relative).
    return drift_sq.sqrt_().add_(round_up_f32(max(shift, 2.0**-60))).square_().mul_(_SHIFT_SLACK)


def full_precision(fn):
    """Run ``fn`` with autocast off on CPU and CUDA: the searches and the drift test certify float32 (and
    float64) arithmetic, and an ``addmm`` or ``mv`` that autocast ran in bfloat16 or float16 would break
    their bounds (a training step under ``amp`` calls them from inside its autocast region)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper
