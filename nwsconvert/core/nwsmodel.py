"""Operations on a converted model: its NWS layers, losses, modes, pools, dense copy."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from .layers import NWSWeight
from .pools import PoolSet

__all__ = [
    "NWSLayer",
    "nws_layers",
    "is_converted",
    "commitment_loss",
    "distillation_loss",
    "set_commitment",
    "set_mode",
    "ema_update",
    "reseed_unused",
    "pool_set",
    "load_pools",
    "materialize",
    "search_stats",
    "conversion_report",
]


@dataclass
class NWSLayer:
    """One NWS layer of a model.

    Attributes:
        name: host module name (``layer1.0.conv1``).
        module: the host module (a Conv2d, Linear, ... with a parametrized weight).
        nws: its :class:`NWSWeight` (pool, indices, search state).
    """

    name: str
    module: nn.Module
    nws: NWSWeight

    @property
    def weight(self) -> nn.Parameter:
        """The temporary weights W (trainable, original shape)."""
        return _original_weight(self.module)


def _original_weight(module: nn.Module) -> nn.Parameter:
    """``module.parametrizations.weight.original`` (casts: ``nn.Module.__getattr__`` is typed ``Tensor | Module``)."""
    weight_list = cast(nn.Module, cast(nn.Module, module.parametrizations).weight)
    return cast(nn.Parameter, weight_list.original)


def nws_layers(model: nn.Module) -> list[NWSLayer]:
    """Every NWS layer of ``model``, in module order."""
    out = []
    for name, m in model.named_modules():
        # parametrize.is_parametrized(m, "weight") without nn.Module.__getattr__: this runs every epoch and
        # more, over every module (a MobileNet has ~400 with the parametrizations), and was 2/3 of the walk
        found = m._modules.get("parametrizations")
        if isinstance(found, nn.ModuleDict) and "weight" in found:
            for p in cast(nn.ModuleList, found["weight"]):
                if isinstance(p, NWSWeight):
                    out.append(NWSLayer(name, m, p))
    return out


def is_converted(model: nn.Module) -> bool:
    return bool(nws_layers(model))


def _require(model: nn.Module) -> list[NWSLayer]:
    layers = nws_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no NWS layers: call nwsconvert.convert(model) first")
    return layers


def conversion_report(model: nn.Module):
    """The :class:`ConversionReport` ``convert`` attached to ``model``."""
    report = getattr(model, "nws_report", None)
    if report is None:
        raise ValueError(
            f"{type(model).__name__} carries no conversion report: was it converted with nwsconvert.convert?"
        )
    return report


def commitment_loss(model: nn.Module) -> torch.Tensor:
    """Sum over NWS layers of ``mean((W - sg[K])^2)`` (paper Eq. 2), differentiable in W.

    Detached (for logging) in layers whose commitment gradient is fused, see :func:`set_commitment`.
    """
    # _require returns at least one layer: the sum is a tensor, never the start value 0
    return cast(torch.Tensor, sum(layer.nws.commitment_loss(layer.weight) for layer in _require(model)))


def set_commitment(model: nn.Module, weight: float) -> nn.Module:
    """Fuse ``weight * commitment`` into the backward of every NWS layer (0 turns it off).

    The gradient ``2 * weight * (W - K) / W.numel()`` is then added in the same
    pass that hands the pool kernels' gradient to W: no MSE graph, no extra
    gradient accumulation. :func:`commitment_loss` then returns the detached
    value, for logging; do not also add it to the loss expecting a gradient.
    """
    for layer in _require(model):
        layer.nws.commitment_weight = float(weight)
    return model


def distillation_loss(model: nn.Module) -> torch.Tensor:
    """Sum over NWS layers of ``mean((sg[W] - K)^2)`` (paper Eq. 4), differentiable in the pools."""
    # _require returns at least one layer: the sum is a tensor, never the start value 0
    return cast(torch.Tensor, sum(layer.nws.distillation_loss(layer.weight) for layer in _require(model)))


def set_mode(model: nn.Module, mode: str) -> nn.Module:
    """``'task'``: pools frozen buffers (learning a task). ``'pool'``: pools are parameters (weight distillation).

    Build the optimizer after switching: the pools' parameter objects change.
    """
    for layer in _require(model):
        layer.nws.set_mode(mode)
    return model


def ema_update(model: nn.Module, decay: float = 0.99) -> None:
    """EMA pool update of every layer (the official code's alternative to the distillation gradient)."""
    for layer in _require(model):
        layer.nws.ema_update(layer.weight, decay)


def reseed_unused(model: nn.Module) -> int:
    """Reseed pool entries no kernel selects; returns how many were moved."""
    return sum(layer.nws.reseed_unused(layer.weight) for layer in _require(model))


def search_stats(model: nn.Module, layers: list[NWSLayer] | None = None) -> dict:
    """Kernels re-searched by the last training forward: ``{'searched', 'total', 'fraction', 'exact_rows',
    'paired'}`` (``paired``: of those searched, how many their entry and runner-up settled, on a CPU).

    ``layers``: ``nws_layers(model)`` when the caller holds it (a training loop, once per epoch, not per step).
    """
    layers = layers or _require(model)
    engine = layers[0].nws._engine() if layers[0].nws._engine is not None else None
    if engine is not None and engine.manages(layers):
        return {**engine.stats(), "paired": 0}  # the engine searches every row past its budget
    searched = sum(layer.nws.stats["searched"] for layer in layers)
    total = sum(layer.nws.stats["total"] for layer in layers)
    exact = int(sum(layer.nws.stats["exact_rows"] for layer in layers))  # a device count (fused search): one sync
    paired = sum(int(layer.nws.stats.get("paired", 0)) for layer in layers)
    return {
        "searched": searched,
        "total": total,
        "fraction": searched / max(total, 1),
        "exact_rows": exact,
        "paired": paired,
    }


def pool_set(model: nn.Module) -> PoolSet:
    """The model's pools (detached, CPU copies) as a :class:`PoolSet`.

    A pool loaded from a float16 pool file comes back in float16 while it still holds exactly
    the file's values (the model computes in float32), so its hash is the file's.
    """
    out = {}
    for layer in _require(model):
        p = layer.nws.pool.detach().cpu().clone()
        stored = getattr(layer.nws, "pool_file_dtype", p.dtype)
        if stored != p.dtype:
            low = p.to(stored)
            p = low if torch.equal(low.to(p.dtype), p) else p
        out[layer.name] = p
    return PoolSet(out)


@torch.no_grad()
def load_pools(model: nn.Module, pools: PoolSet) -> None:
    """Replace every layer's pool with the one in ``pools``; indices follow at the next training forward.

    Raises:
        ValueError: a layer has no pool in ``pools`` or its pool has another vector size.
    """
    layers = _require(model)
    for layer in layers:
        if layer.name not in pools:
            raise ValueError(f"pool set has no pool for layer {layer.name!r}")
        p = pools[layer.name]
        if p.ndim != 2 or p.shape[1] != layer.nws.vector_size:
            raise ValueError(
                f"pool for layer {layer.name!r} is {tuple(p.shape)}, expected (n, {layer.nws.vector_size})"
            )
    for layer in layers:
        nws = layer.nws
        p = pools[layer.name].to(device=nws.pool.device, dtype=nws.pool.dtype)
        if p.shape == nws.pool.shape:
            nws.pool.copy_(p)
        elif nws.mode == "pool":
            nws.pool = nn.Parameter(p.clone())
        else:
            nws.pool = p.clone()
        nws.pool_file_dtype = pools[layer.name].dtype
        nws.full_search(layer.weight)


def _to_dense(module: nn.Module, weight: torch.Tensor) -> None:
    """Turn a parametrized host back into its original class holding ``weight``.

    ``parametrize.remove_parametrizations`` is not used: a deep copy shares its
    dynamically created ``Parametrized*`` class with the original model, and
    removing the parametrization deletes the ``weight`` property from that
    shared class, breaking the original.
    """
    requires_grad = _original_weight(module).requires_grad
    base = type(module).__bases__[0]
    del module._modules["parametrizations"]
    module.__class__ = base
    module.register_parameter("weight", nn.Parameter(weight.detach().clone(), requires_grad=requires_grad))


@torch.no_grad()
def materialize(model: nn.Module) -> nn.Module:
    """A dense copy of ``model``: ordinary layers holding the gathered pool kernels.

    The copy's outputs equal the NWS model's exactly (same modules, same
    forward code, same weight values). ``model`` itself is unchanged.
    """
    dense = copy.deepcopy(model)
    for layer in nws_layers(dense):
        _to_dense(layer.module, layer.nws.gather().to(layer.weight.dtype))
    if hasattr(dense, "nws_report"):
        del dense.nws_report
    return dense
