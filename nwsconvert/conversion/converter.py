"""The conversion pass: every Conv2d / Linear of a model becomes an NWS layer.

``NWSConverter(...).apply(model)`` (or :func:`convert`) registers an
:class:`~nwsconvert.core.layers.NWSWeight` parametrization on the ``weight`` of
every convolution (stem, body, shortcut, depthwise, grouped, dilated, with or
without bias), every linear layer (as 1x1 kernels) and timm ``CondConv2d``.
Modules keep their class and their own ``forward``, so Conv2d subclasses that
change the maths (``Conv2dSame``, ``StdConv2d``, ``ScaledStdConv2d``,
efficientnet-lite's ``Conv2dStaticSamePadding``...) keep their semantics: their
forward reads ``self.weight``, which now returns pool kernels. The model keeps
its class and API (``forward_features``, ``get_classifier``, attribute access).
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..errors import NWSError, UsageError
from .graph import analyse, is_weight_layer, roles_by_name
from ..core.layers import NWSWeight, index_bits
from ..core.pools import PoolSet, init_pool
from .report import ConversionReport, LayerRecord, SkippedRecord

__all__ = ["NWSConverter", "convert", "ConversionError"]


class ConversionError(NWSError, ValueError):
    """A model or layer cannot be converted as asked; the message names it."""


def _match(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _lookup(name: str, table: dict[str, int] | None, default: int) -> int:
    """The value of the first pattern in ``table`` matching ``name`` (fnmatch), else ``default``."""
    for pattern, value in (table or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return int(value)
    return default


def _geometry(module: nn.Module) -> tuple[int, int, str]:
    """``(kernel area, input weights per output, kind)`` of a weight layer."""
    if isinstance(module, nn.Linear):
        return 1, module.in_features, "linear"
    ks = tuple(module.kernel_size) if isinstance(module.kernel_size, (tuple, list)) else (module.kernel_size,) * 2
    area = math.prod(ks)
    kind = "x".join(map(str, ks))
    groups = getattr(module, "groups", 1)
    in_ch = module.in_channels
    if groups > 1 and groups == in_ch:
        kind += " dw"
    elif groups > 1:
        kind += f" g{groups}"
    dil = getattr(module, "dilation", 1)
    dil = tuple(dil) if isinstance(dil, (tuple, list)) else (dil,)
    if any(d != 1 for d in dil):
        kind += f" dil{dil[0]}"
    if getattr(module, "num_experts", None):
        kind += f" x{module.num_experts} experts"
    return area, in_ch // groups, kind


class NWSConverter:
    """The conversion pass (``apply(model) -> model``).

    Args:
        pool_size: n, pool entries per layer (512 in the paper; 9-bit indices).
        init: ``"kmeans"`` (k-means over the layer's own kernels: useful pools
            for a pretrained checkpoint in seconds), ``"random"`` (Gaussian with
            the layer's weight statistics), a :class:`PoolSet`, or a pool file path.
        group_size: g, for 1x1 convs and linear layers: g consecutive input
            weights of one output form one pool vector (g = 1 is the paper: one
            scalar per kernel). Layers whose input width is not a multiple of g
            fall back to g = 1 (noted in the report).
        skip: module names or fnmatch patterns to leave dense.
        layer_pool_size: ``{pattern: n}`` per-layer pool sizes (first match wins).
        layer_group_size: ``{pattern: g}`` per-layer group sizes.
        seed: seeds pool initialisation.
        kmeans_iters: Lloyd iterations for ``init="kmeans"``.

    Attributes:
        report: the :class:`ConversionReport` of the last ``apply``.
    """

    def __init__(
        self,
        pool_size: int = 512,
        *,
        init: str | PoolSet | os.PathLike = "kmeans",
        group_size: int = 1,
        skip: Iterable[str] = (),
        layer_pool_size: dict[str, int] | None = None,
        layer_group_size: dict[str, int] | None = None,
        seed: int = 0,
        kmeans_iters: int = 3,
    ):
        for key, value, low in (("pool_size", pool_size, 2), ("group_size", group_size, 1), ("kmeans_iters", kmeans_iters, 0)):
            if type(value) is not int or value < low:
                raise UsageError(f"{key} must be an integer of at least {low}, got {value!r}")
        if type(seed) is not int:
            raise UsageError(f"seed must be an integer, got {seed!r}")
        self.pool_size = pool_size
        self.init = init
        self.group_size = group_size
        self.skip = tuple([skip] if isinstance(skip, str) else skip)
        self.layer_pool_size = layer_pool_size
        self.layer_group_size = layer_group_size
        self.seed = seed
        self.kmeans_iters = kmeans_iters
        self.report: ConversionReport | None = None

    def options(self) -> dict:
        """The options that decide layer geometry (JSON-able; pool sizes also come from a pool file)."""
        return {
            "pool_size": self.pool_size,
            "group_size": self.group_size,
            "skip": list(self.skip),
            "layer_pool_size": dict(self.layer_pool_size or {}),
            "layer_group_size": dict(self.layer_group_size or {}),
        }

    def _pools_from_init(self) -> PoolSet | None:
        if isinstance(self.init, PoolSet):
            return self.init
        if isinstance(self.init, (str, os.PathLike)) and str(self.init) not in ("kmeans", "random"):
            if not os.path.exists(self.init):
                raise ValueError(f"init={str(self.init)!r} is neither 'kmeans', 'random' nor an existing pool file")
            return PoolSet.load(self.init)
        return None

    def apply(self, model: nn.Module) -> nn.Module:
        """Convert ``model`` in place and return it (its report is ``model.nws_report``).

        Raises:
            ConversionError: ``model`` is a TorchScript module (scripted or traced) or holds
                one, has parameters on the meta device, is already converted, or has no
                layer to convert (every Conv2d / Linear skipped, or none at all).
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
        info = analyse(model)
        modules = [(n, m) for n, m in model.named_modules() if is_weight_layer(m)]
        names = [n for n, _ in modules]
        roles = dict(info.roles)
        roles.update(roles_by_name(model, names, info.roles))
        given = self._pools_from_init()
        method = self.init if given is None else None
        gen = torch.Generator().manual_seed(self.seed)
        report = ConversionReport(trace=info.path, options=self.options())
        owners: dict[int, str] = {}
        for name, module in modules:
            weight = getattr(module, "weight", None)
            lazy = isinstance(weight, nn.parameter.UninitializedParameter)
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) and not lazy else ()
            cls = type(module).__name__
            reason = None
            if _match(name, self.skip):
                reason = "skipped by the skip option"
            elif parametrize.is_parametrized(module, "weight"):
                reason = "weight already has a parametrization (weight norm, spectral norm...)"
            elif lazy:
                reason = "lazy module not initialised yet: run one forward pass before converting"
            elif not isinstance(weight, nn.Parameter):
                reason = "weight is not an nn.Parameter (hook-based weight norm?)"
            elif not weight.is_floating_point():
                reason = f"weight dtype {weight.dtype} is not floating point"
            elif id(weight) in owners:
                reason = f"shares its weight with {owners[id(weight)]} (converted there)"
            if reason is not None:
                report.skipped.append(SkippedRecord(name, cls, shape, reason))
                continue
            owners[id(weight)] = name
            area, fan_in, kind = _geometry(module)
            note = ""
            if area == 1:
                g = _lookup(name, self.layer_group_size, self.group_size)
                if fan_in % g:
                    note = f"input width {fan_in} is not a multiple of group size {g}: using 1"
                    g = 1
                dim = g
                if g > 1:
                    kind += f" vec{g}"
            else:
                dim = area
            n = _lookup(name, self.layer_pool_size, self.pool_size)
            vectors = weight.detach().reshape(-1, dim)
            if given is not None:
                if name not in given:
                    raise ConversionError(f"pool set has no pool for layer {name!r} ({cls} {shape})")
                pool = given[name].to(device=weight.device, dtype=torch.float32)
                if pool.ndim != 2 or pool.shape[1] != dim:
                    raise ConversionError(
                        f"pool for layer {name!r} is {tuple(pool.shape)}, the layer needs vectors of {dim} "
                        f"({cls} {shape}): was the pool set made with another group size or model?"
                    )
                n = pool.shape[0]
            else:
                pool = init_pool(vectors, n, method, gen, self.kmeans_iters)
            role = roles.get(name, "body")
            nws = NWSWeight(weight, dim, pool, role=role)
            nws.train(module.training)
            parametrize.register_parametrization(module, "weight", nws)
            found = "torch.fx" if name in info.roles else "module walk"
            report.layers.append(
                LayerRecord(name, role, cls, kind, shape, nws.num_vectors, dim, n, index_bits(n), found, note)
            )
        if given is not None:
            extra = sorted(set(given.pools) - {r.name for r in report.layers})
            if extra:
                raise ConversionError(f"pool set has pools for layers the model does not convert: {extra[:5]}")
        if not report.layers:
            why = (
                f"all {len(report.skipped)} weight layers were skipped ({report.skipped[0].name}: {report.skipped[0].reason}...)"
                if report.skipped
                else "it has no nn.Conv2d, nn.Linear or CondConv2d"
            )
            raise ConversionError(f"{type(model).__name__} has no layer to convert: {why}; NWS needs at least one")
        self.report = report
        model.nws_report = report
        return model


def convert(model: nn.Module, pool_size: int = 512, **options) -> nn.Module:
    """Convert every Conv2d / Linear of ``model`` into an NWS layer, in place.

    Args:
        model: any timm or torchvision CNN (or other ``nn.Module``).
        pool_size: pool entries per layer.
        **options: see :class:`NWSConverter` (``init``, ``group_size``, ``skip``,
            ``layer_pool_size``, ``layer_group_size``, ``seed``, ``kmeans_iters``).

    Returns:
        The same model object, converted. ``model.nws_report`` (or
        :func:`nwsconvert.conversion_report`) is the printable
        :class:`ConversionReport`.

    Raises:
        ConversionError: the model is already converted, or a given pool set
            does not fit a layer (the message names the layer).
    """
    return NWSConverter(pool_size, **options).apply(model)
