"""The budget planner: each layer's vector size and pool size, chosen for a memory budget per task.

    plans = plan(model, NWSConfig(bits_per_weight=1.5))    # or NWSConfig(budget=200_000): bytes a task
    plans = fit_budget(model, plans, Budget(bits_per_weight=1.5))   # what plan() does with a budget

A task stores, per converted layer, one index of ``ceil(log2 n)`` bits per pool vector, plus its
state (BatchNorm, biases, layers left dense) in float16 as ``nws-train`` stores it. With the vector
size g (1x1 convs and linear layers) and the pool size n free per layer, the same budget can be
spent in many ways. The planner spends it where it buys the most:

* **Proxy.** For every layer and candidate vector size it runs the conversion's own k-means
  (``init_pool``, the config's iterations and seed) at n = 2, 4, 16, 64 and 256 (``_MEASURED_BITS``)
  on at most 4,096 of the layer's vectors and measures the relative squared reconstruction error
  ``||W - K||^2 / ||W||^2`` (on another 4,096 vectors when the layer has more: held out, so a pool
  is not judged on the vectors it was fitted to). Between those points the error is taken as
  exponential in the index bits (log-linear), and above the last one it follows the last measured
  slope (the high-rate law of vector quantisation, ``D ~ 2^(-2b/g)``). A pool of at least the
  layer's own kernel count is exact (error 0, ``ceil(log2 d)`` bits): k-means keeps every kernel.
* **Choice.** Every weight counts the same: the plan minimises the sum of the layers' errors, each
  weighed by its weight count, under the budget (a Lagrange multiplier found by bisection, then the
  leftover bits spent greedily on the moves that cut the most error per bit). That evens the error
  out across layers at the fewest bits: each layer takes the vector size that reaches it cheapest,
  and layers whose own-kernel pool is cheap become exact.
* **Fixed.** The head (its pool serves every task's width), layers left dense and layers too small
  for any pool below a quarter of their size are not re-planned; their bytes count against the budget.
* **Pools stay small.** A 1x1 / linear layer's pool holds at most a quarter of the layer's floats;
  a k x k or depthwise layer may get a pool of its own kernels (at most 2,048: exact).
* **Dense** is never chosen: a layer left dense stores 16 bits a weight every task, while a pool
  of the layer's own kernels is exact too and stores ``ceil(log2 d) / D`` bits a weight.

The result is ordinary plans: :func:`~nwsconvert.conversion.planner.config_from_plans` records
them as per-layer entries, so a run's manifest rebuilds the same model without planning again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from ..core.pools import init_pool
from ..errors import UsageError
from .config import Budget
from .plans import LayerPlan, Plans

__all__ = ["Budget", "fit_budget", "plan_bytes", "state_bytes", "GROUP_SIZES", "MAX_PLANNED_POOL"]

#: vector sizes the planner tries for 1x1 convs and linear layers (those dividing the input width).
GROUP_SIZES = (1, 2, 4, 8, 16)
#: largest pool the planner gives a layer (11-bit indices), the own-kernel pool included.
MAX_PLANNED_POOL = 2048
#: pool sizes whose error is measured (``2**b``); the rest follow the exponential law between them.
_MEASURED_BITS = (1, 2, 4, 6, 8)
_SAMPLE = 4096
#: a 1x1 / linear layer's pool holds at most 1 / this of the layer's floats.
_POOL_SHARE = 4
#: the planner's bits for state entries: float16, as nws-train stores a task (``state_dtype``).
STATE_BYTES_PER_FLOAT = 2


def state_bytes(model: nn.Module, plans: list[LayerPlan]) -> int:
    """Bytes of one task's state as ``nws-train`` stores it: every state-dict entry but the converted
    layers' weights, float32 entries at float16 (a lazy module's uninitialised entries count 0)."""
    converted = {f"{p.name}.weight" for p in plans if not p.skipped}
    total = 0
    for key, t in model.state_dict().items():
        if key in converted or nn.parameter.is_lazy(t):  # a lazy layer's size is not known yet
            continue
        per = STATE_BYTES_PER_FLOAT if t.dtype == torch.float32 else t.element_size()
        total += t.numel() * per
    return total


def _bits(kernels: int, bits: int) -> int:
    """A layer's task bits as a pack stores them at fixed width: whole bytes."""
    return 8 * ((kernels * bits + 7) // 8)


def plan_bytes(plans: list[LayerPlan]) -> int:
    """Fixed-width index bytes of one task under ``plans`` (each layer rounded up to a byte)."""
    return sum((p.kernels * p.bits + 7) // 8 for p in plans if not p.skipped)


@dataclass
class _Options:
    """One layer's candidate plans: ``(vector size, pool size, bits, task bits, error)`` per option."""

    plan: LayerPlan
    vec: np.ndarray
    pool: np.ndarray
    rate: np.ndarray
    error: np.ndarray  # relative squared error
    weight: float  # what the layer's error weighs: its weight count


def _errors(w: torch.Tensor, g: int, d: int, iters: int, seed: int) -> dict[int, float]:
    """Measured relative squared error of k-means pools of ``2**b`` entries, ``b`` in ``_MEASURED_BITS``."""
    vectors = w.detach().float().reshape(-1, g)
    gen = torch.Generator().manual_seed(seed)
    if d > _SAMPLE:
        order = torch.randperm(d, generator=gen)
        fit, test = vectors[order[:_SAMPLE]], vectors[order[_SAMPLE : 2 * _SAMPLE]]
    else:
        fit = test = vectors
    energy = float(test.square().sum()) or 1.0
    out = {}
    for b in _MEASURED_BITS:
        n = 1 << b
        if n >= fit.shape[0]:
            continue
        pool = init_pool(fit, n, "kmeans", gen, iters)
        dist = torch.cdist(test, pool).min(1).values if g > 1 else (test - pool.T).abs().min(1).values
        out[b] = min(1.0, float(dist.square().sum()) / energy)
    return out


def _curve(measured: dict[int, float], bits: np.ndarray) -> np.ndarray:
    """Error at ``bits`` from the measured points: log-linear between them, the last slope above them
    (never rising with b), ``nan`` below the first (not measured: not offered)."""
    pts = sorted(measured.items())
    xs = np.array([b for b, _ in pts], dtype=float)
    ys = np.log(np.maximum([e for _, e in pts], 1e-12))
    est = np.interp(bits, xs, ys)
    if len(pts) >= 2:
        slope = min(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        est = np.where(bits > xs[-1], ys[-1] + slope * (bits - xs[-1]), est)
    est = np.where(bits < xs[0], np.nan, est)
    return np.minimum(np.exp(est), 1.0)


def _options(p: LayerPlan, weight: torch.Tensor, iters: int, seed: int, group_sizes) -> _Options:
    """Every (vector size, pool size) the planner may give layer ``p``, with task bits and proxy error."""
    sizes = ([g for g in group_sizes if p.fan_in % g == 0] or [1]) if p.family == "1x1" else [p.vector_size]
    vec: list[int] = []
    pool: list[int] = []
    rate: list[int] = []
    error: list[float] = []

    def offer(g: int, n: int, task_bits: int, err: float) -> None:
        vec.append(g)
        pool.append(n)
        rate.append(task_bits)
        error.append(err)

    numel = math.prod(p.shape)
    for g in sizes:
        d = numel // g
        exact_bits = max(1, math.ceil(math.log2(d))) if d > 1 else 1
        measured = _errors(weight, g, d, iters, seed)
        bits = np.arange(1, 12)
        # a shared pool stays well below its layer: at most a quarter of its floats (kernel pools: below d)
        bits = bits[((1 << bits) * g * _POOL_SHARE <= numel) & ((1 << bits) < d)]
        for b, e in zip(bits, _curve(measured, bits.astype(float)) if measured else ()):
            if not np.isnan(e):
                offer(g, 1 << int(b), _bits(d, int(b)), float(e))
        if p.family != "1x1" and d <= MAX_PLANNED_POOL:  # a pool of the layer's own kernels: exact
            offer(g, max(2, d), _bits(d, exact_bits), 0.0)
    # every weight counts the same: a layer's error weighs as much as its weights
    return _Options(p, np.array(vec), np.array(pool), np.array(rate, dtype=float), np.array(error), float(numel))


def _pick(options: list[_Options], lam: float) -> list[int]:
    return [int(np.argmin(o.weight * o.error + lam * o.rate)) for o in options]


def _allocate(options: list[_Options], bits: float) -> list[int]:
    """One option per layer: least total error with total task bits <= ``bits`` (bisection, then greedy)."""
    total = lambda choice: sum(o.rate[c] for o, c in zip(options, choice))  # noqa: E731
    lo, hi = 1e-16, 1e4  # lam: lo spends everything, hi spends the least
    if total(_pick(options, lo)) <= bits:
        return _pick(options, lo)
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if total(_pick(options, mid)) <= bits:
            hi = mid
        else:
            lo = mid
    choice = _pick(options, hi)
    spent = total(choice)
    while True:  # spend what is left on the move that cuts the most error per bit
        best, best_gain = None, 0.0
        for i, o in enumerate(options):
            c = choice[i]
            extra = o.rate - o.rate[c]
            cut = o.weight * (o.error[c] - o.error)
            ok = (extra > 0) & (cut > 0) & (spent + extra <= bits)
            if not ok.any():
                continue
            gain = np.where(ok, cut / np.where(extra > 0, extra, 1), -1)
            j = int(np.argmax(gain))
            if gain[j] > best_gain:
                best, best_gain = (i, j), float(gain[j])
        if best is None:
            return choice
        i, j = best
        spent += options[i].rate[j] - options[i].rate[choice[i]]
        choice[i] = j


def fit_budget(
    model: nn.Module,
    plans: list[LayerPlan],
    budget: Budget,
    *,
    seed: int = 0,
    kmeans_iters: int = 3,
    group_sizes: tuple[int, ...] | None = None,
) -> Plans:
    """``plans`` with every converted non-head layer's vector size and pool size chosen for ``budget``.

    Args:
        model: the model the plans are for (its weights give the proxy errors; nothing is changed).
        plans: the planner's plans (a preset's edits included); skipped layers and the head are kept.
        budget: :class:`Budget`.
        group_sizes: the vector sizes 1x1 and linear layers may get (default :data:`GROUP_SIZES`);
            a layer whose input width none of them divides is planned with g = 1.

    Returns:
        The new plans.

    Raises:
        UsageError: the budget is below the smallest plan (the message gives that plan's figure).
    """
    modules = dict(model.named_modules())
    candidates = [p for p in plans if not p.skipped and p.role != "head"]
    sizes = tuple(group_sizes or GROUP_SIZES)
    options = [
        o for o in (_options(p, modules[p.name].weight, kmeans_iters, seed, sizes) for p in candidates) if o.rate.size
    ]
    planned = {o.plan.name for o in options}
    weights = sum(math.prod(p.shape) for p in plans if not p.skipped)
    fixed_bits = sum(_bits(p.kernels, p.bits) for p in plans if not p.skipped and p.name not in planned)
    state = state_bytes(model, plans) if budget.bytes_per_task is not None else 0
    if budget.bits_per_weight is not None:
        room = budget.bits_per_weight * weights - fixed_bits
    else:
        room = 8 * (cast(int, budget.bytes_per_task) - state) - fixed_bits
    least = sum(float(o.rate.min()) for o in options)
    if room < least:
        lowest = (least + fixed_bits) / max(weights, 1)
        floor = (
            f"{lowest:.3f} bits per weight"
            if budget.bits_per_weight is not None
            else f"{math.ceil((least + fixed_bits) / 8) + state} bytes per task"
        )
        raise UsageError(f"{budget.describe()} is below the smallest plan for {type(model).__name__}: {floor}")
    choice = _allocate(options, room)
    by_name = {}
    for o, c in zip(options, choice):
        p = o.plan.with_group_size(int(o.vec[c])) if o.plan.family == "1x1" else o.plan
        p = dataclasses.replace(p.with_pool_size(int(o.pool[c])), note="")
        by_name[p.name] = p
    out = Plans(by_name.get(p.name, p) for p in plans)
    out.trace = getattr(plans, "trace", Plans.trace)
    return out
