"""The planner: one decision per weight layer, made once, before anything is converted.

    plans = plan(model, NWSConfig(pool_size=256))   # traces the model once, changes nothing
    plans = preset.edit(plans)                      # presets (nwsconvert.zoo) only edit plans
    NWSConverter(config).apply(model, plans)        # converts exactly as planned

A :class:`LayerPlan` says, for one ``nn.Conv2d`` / ``nn.Linear`` / ``CondConv2d``, its role,
geometry, vector size, pool size, or why it stays dense. :meth:`NWSConfig.from_plans` turns
edited plans back into a config whose ``layers`` name every layer that differs, which is what a
run's manifest records and ``nwsconvert.load`` rebuilds from.
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..core.layers import NWSWeight
from ..core.pools import PoolSet
from ..errors import NWSError, UsageError
from .budget import fit_budget
from .config import LayerConfig, NWSConfig
from .graph import analyse, is_weight_layer, roles_by_name
from .plans import LayerPlan, Plans

__all__ = [
    "LayerPlan",
    "Plans",
    "plan",
    "layer_family",
    "config_from_plans",
    "check_convertible",
    "require_a_converted_layer",
    "ConversionError",
]


class ConversionError(NWSError, ValueError):
    """A model or layer cannot be converted as asked; the message names it."""


def _geometry(module: nn.Module) -> tuple[int, int, str, str]:
    """``(kernel area, input weights per output, family, kind)`` of a weight layer."""
    if isinstance(module, nn.Linear):
        return 1, module.in_features, "1x1", "linear"
    ks = tuple(module.kernel_size) if isinstance(module.kernel_size, (tuple, list)) else (module.kernel_size,) * 2
    area = math.prod(ks)
    kind = "x".join(map(str, ks))
    groups = getattr(module, "groups", 1)
    in_ch = cast(
        int, module.in_channels
    )  # a conv here (Linear returned above); Module.__getattr__ is typed Tensor | Module
    depthwise = groups > 1 and groups == in_ch
    if depthwise:
        kind += " dw"
    elif groups > 1:
        kind += f" g{groups}"
    dil = getattr(module, "dilation", 1)
    dil = tuple(dil) if isinstance(dil, (tuple, list)) else (dil,)
    if any(d != 1 for d in dil):
        kind += f" dil{dil[0]}"
    if getattr(module, "num_experts", None):
        kind += f" x{module.num_experts} experts"
    family = "1x1" if area == 1 else ("depthwise" if depthwise else "kxk")
    return area, in_ch // groups, family, kind


def layer_family(module: nn.Module) -> str:
    """``kxk``, ``depthwise`` or ``1x1`` (1x1 convs and linear layers) for a weight layer."""
    return _geometry(module)[2]


def _why_dense(module: nn.Module, weight, owners: dict[int, str]) -> str | None:
    """Why a weight layer cannot be converted at all (``None``: it can)."""
    if parametrize.is_parametrized(module, "weight"):
        return "weight already has a parametrization (weight norm, spectral norm...)"
    if isinstance(weight, nn.parameter.UninitializedParameter):
        return "lazy module not initialised yet: run one forward pass before converting"
    if not isinstance(weight, nn.Parameter):
        return "weight is not an nn.Parameter (hook-based weight norm?)"
    if not weight.is_floating_point():
        return f"weight dtype {weight.dtype} is not floating point"
    if id(weight) in owners:
        return f"shares its weight with {owners[id(weight)]} (converted there)"
    return None


def check_convertible(model: nn.Module) -> None:
    """Refuse what no plan can convert: not a module, TorchScript, already converted, meta tensors.

    Raises:
        ConversionError: naming the module or tensor at fault.
    """
    if not isinstance(model, nn.Module):
        raise ConversionError(f"convert() takes an nn.Module, got {type(model).__name__}")
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            where = f" (submodule {name!r})" if name else ""
            raise ConversionError(
                f"{type(m).__name__}{where} is a TorchScript module (torch.jit.script / torch.jit.trace): its layers are "
                "compiled and cannot be replaced; convert the eager nn.Module, then script or export it"
            )
        if isinstance(m, NWSWeight):
            raise ConversionError(f"model is already converted (NWS layer at {name!r})")
    meta = next((n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if meta is not None:
        raise ConversionError(
            f"{meta!r} is on the meta device: k-means pools need the real weights; materialise the model "
            "(model.to_empty(device='cpu') and load its weights) before converting"
        )


def plan(model: nn.Module, config: NWSConfig | None = None, pools: PoolSet | None = None) -> Plans:
    """One :class:`LayerPlan` per weight layer of ``model``, in module order (traces it once; converts nothing).

    Args:
        config: pool and group sizes, per-layer overrides (default :class:`NWSConfig`).
        pools: a pool set to convert with: each converted layer's pool size and vector size
            come from it, and it must hold a pool for exactly the converted layers.

    Raises:
        ConversionError: see :func:`check_convertible`; or ``pools`` does not fit (the message names the layer).
    """
    config = config or NWSConfig()
    check_convertible(model)
    info = analyse(model)
    modules = [(n, m) for n, m in model.named_modules() if is_weight_layer(m)]
    roles = dict(info.roles)
    roles.update(roles_by_name(model, [n for n, _ in modules], info.roles))
    owners: dict[int, str] = {}
    out = Plans()
    out.trace = info.path
    for name, module in modules:
        weight = getattr(module, "weight", None)
        lazy = isinstance(weight, nn.parameter.UninitializedParameter)
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) and not lazy else ()
        area, fan_in, family, kind = _geometry(module)
        size = math.prod(shape) if shape else 0
        base = LayerPlan(
            name, type(module).__name__, roles.get(name, "body"), family, kind, shape, area, fan_in,
            1, area, size // area if shape else 0, config.pool_size, "torch.fx" if name in info.roles else "module walk",
        )  # fmt: skip
        why = _why_dense(module, weight, owners)
        if why is not None:
            out.append(dataclasses.replace(base, skip=why, forced=True))
            continue
        pattern = config.skipped(name)
        if pattern is not None:
            out.append(
                base.dense(
                    f"skipped by the skip option ({pattern!r})" if pattern != name else "skipped by the skip option"
                )
            )
            continue
        owners[id(weight)] = name
        layer: LayerConfig = config.resolve(name)
        # resolve() sets both fields (NWSConfig's own are validated ints)
        p = base.with_group_size(cast(int, layer.group_size))
        p = dataclasses.replace(p, pool_size=cast(int, layer.pool_size))  # as configured (presets clamp to 2)
        if pools is not None:
            p = _fit_pool(p, pools)
        out.append(p)
    if pools is not None:
        extra = sorted(set(pools.pools) - {p.name for p in out if not p.skipped})
        if extra:
            raise ConversionError(f"pool set has pools for layers the model does not convert: {extra[:5]}")
    require_a_converted_layer(model, out)
    budget = config.budget_of()
    if budget is not None:
        if pools is not None:
            raise UsageError(
                f"{budget.describe()} and a given pool set both fix the pool sizes: give one (the pool set's run "
                "recorded its plan)"
            )
        out = fit_budget(
            model, out, budget, seed=config.seed, kmeans_iters=config.kmeans_iters, group_sizes=config.group_sizes
        )
    return out


def require_a_converted_layer(model: nn.Module, plans: list[LayerPlan]) -> None:
    """Refuse plans that leave every layer dense (or a model without weight layers), naming why.

    Raises:
        ConversionError: no plan converts a layer.
    """
    if any(not p.skipped for p in plans):
        return
    first = next(iter(plans), None)
    why = (
        f"all {len(plans)} weight layers were skipped ({first.name}: {first.skip}...)"
        if first is not None
        else "it has no nn.Conv2d, nn.Linear or CondConv2d"
    )
    raise ConversionError(f"{type(model).__name__} has no layer to convert: {why}; NWS needs at least one")


def _fit_pool(p: LayerPlan, pools: PoolSet) -> LayerPlan:
    """``p`` with the pool size of its pool in ``pools``; the pool must hold vectors of ``p``'s size."""
    if p.name not in pools:
        raise ConversionError(f"pool set has no pool for layer {p.name!r} ({p.module} {p.shape})")
    pool = pools[p.name]
    if pool.ndim != 2 or pool.shape[1] != p.vector_size:
        raise ConversionError(
            f"pool for layer {p.name!r} is {tuple(pool.shape)}, the layer needs vectors of {p.vector_size} "
            f"({p.module} {p.shape}): was the pool set made with another group size or model?"
        )
    return dataclasses.replace(p, pool_size=int(pool.shape[0]))


def config_from_plans(plans: list[LayerPlan], base: NWSConfig) -> NWSConfig:
    """A config that plans ``model`` exactly as ``plans`` say: ``base`` plus one exact-name entry per layer that differs.

    A budget in ``base`` is spent: the result has none, and records it as ``planned_for``, so that
    rebuilding from it gives these plans without planning again.

    The entries are fnmatch patterns too, so a layer whose name holds ``*``, ``?`` or ``[`` cannot
    be named exactly and is refused.
    """
    budget = base.budget_of()
    if budget is not None:
        sizes = "" if base.group_sizes is None else f", group_sizes={list(base.group_sizes)}"
        base = base.replace(bits_per_weight=None, budget=None, group_sizes=None, planned_for=budget.describe() + sizes)
    layers: dict[str, LayerConfig | None] = {}
    for p in plans:
        default = base.resolve(p.name)
        if p.skipped:
            if not p.forced and base.skipped(p.name) is None:
                layers[p.name] = None
            continue
        # What the planner would give this layer from ``base`` (resolve() sets both fields).
        planned = p.with_group_size(cast(int, default.group_size))
        group = p.group_size if p.group_size != planned.group_size else None
        pool = p.pool_size if p.pool_size != default.pool_size else None
        if pool is not None or group is not None:
            layers[p.name] = LayerConfig(pool, group)
    unnamable = [name for name in layers if any(c in name for c in "*?[")]
    if unnamable:
        raise UsageError(f"module names with fnmatch characters cannot be recorded exactly: {unnamable[:3]}")
    return base.replace(layers={**layers, **base.layers})
