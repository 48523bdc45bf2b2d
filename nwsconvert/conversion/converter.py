"""The conversion pass: every Conv2d / Linear of a model becomes an NWS layer.

``NWSConverter(config).apply(model)`` (or :func:`convert`) plans every layer once
(:mod:`nwsconvert.conversion.planner`), then registers an
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

import os
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..core.layers import NWSWeight
from ..core.pools import PoolSet, init_pool
from ..errors import UsageError
from .budget import state_bytes
from .config import NWSConfig
from .planner import ConversionError, LayerPlan, check_convertible, config_from_plans, plan, require_a_converted_layer
from .report import ConversionReport, LayerRecord, SkippedRecord

__all__ = ["NWSConverter", "convert", "ConversionError"]


def _pools_from(init) -> PoolSet | None:
    """The pool set an ``init`` option names (a :class:`PoolSet` or a pool file), else ``None``."""
    if isinstance(init, PoolSet):
        return init
    if isinstance(init, (str, os.PathLike)) and str(init) not in ("kmeans", "random"):
        if not os.path.exists(init):
            raise UsageError(f"init={str(init)!r} is neither 'kmeans', 'random' nor an existing pool file")
        return PoolSet.load(init)
    return None


class NWSConverter:
    """The conversion pass: :meth:`plan` decides every layer, :meth:`apply` converts as planned.

    Args:
        config: an :class:`~nwsconvert.NWSConfig` (default: its defaults; an int is taken as
            ``pool_size``, as ``NWSConverter(512)`` always meant).
        **overrides: config fields (``pool_size``, ``group_size``, ``seed``, ``kmeans_iters``,
            ``layers``; the older ``skip``, ``layer_pool_size``, ``layer_group_size``) and
            ``init``: ``"kmeans"``, ``"random"``, a :class:`PoolSet` or a pool file path.

    Attributes:
        config: the resolved :class:`NWSConfig` (``init="pools"`` when a pool set was given).
        pools: that pool set, or ``None``.
        report: the :class:`ConversionReport` of the last ``apply``.
    """

    def __init__(self, config: NWSConfig | int | None = None, **overrides):
        if isinstance(config, int) and not isinstance(config, bool):
            overrides = {"pool_size": config, **overrides}
            config = None
        if config is not None and not isinstance(config, NWSConfig):
            raise UsageError(f"config must be an NWSConfig, got {type(config).__name__}")
        self.pools = _pools_from(overrides.get("init"))
        if self.pools is not None:
            overrides["init"] = "pools"
        self.config = (config or NWSConfig()).replace(**overrides)
        if self.config.init == "pools" and self.pools is None:
            raise UsageError(
                "config.init is 'pools': pass the pool set to convert as init=PoolSet or init='pools.safetensors'"
            )
        self.report: ConversionReport | None = None

    def plan(self, model: nn.Module) -> list[LayerPlan]:
        """Every weight layer's :class:`LayerPlan` under this config (traces ``model``; converts nothing)."""
        return plan(model, self.config, self.pools)

    def apply(self, model: nn.Module, plans: list[LayerPlan] | None = None, *, search: bool = True) -> nn.Module:
        """Convert ``model`` in place as ``plans`` say (default :meth:`plan`) and return it.

        ``search=False`` skips every layer's first nearest-entry search and leaves its indices 0:
        only for a caller that loads a task pack into the model next (:func:`~nwsconvert.apply_task`).

        Its report is ``model.nws_report``; ``report.options`` is the config, with one entry per
        layer whose plan was edited away from it (what a run manifest records).

        Raises:
            ConversionError: ``model`` is a TorchScript module (scripted or traced) or holds
                one, has parameters on the meta device, is already converted, or has no
                layer to convert (every Conv2d / Linear skipped, or none at all); a plan
                names a layer ``model`` does not have.
        """
        if plans is None:
            plans = self.plan(model)
        else:
            check_convertible(model)
        modules = dict(model.named_modules())
        missing = [p.name for p in plans if p.name not in modules]
        if missing:
            raise ConversionError(f"plan names layers {type(model).__name__} does not have: {missing[:5]}")
        require_a_converted_layer(model, plans)
        config = config_from_plans(plans, self.config)
        gen = torch.Generator().manual_seed(config.seed)
        trace = getattr(plans, "trace", None) or (
            "torch.fx" if any(p.found_by == "torch.fx" for p in plans) else "module walk"
        )
        report = ConversionReport(trace=trace, options=config.to_dict(), state_bytes=state_bytes(model, plans))
        for p in plans:
            if p.skipped:
                # p.skipped means p.skip is set
                report.skipped.append(SkippedRecord(p.name, p.module, p.shape, cast(str, p.skip)))
                continue
            module = modules[p.name]
            weight = module.weight
            if self.pools is not None:
                pool = self.pools[p.name].to(device=weight.device, dtype=torch.float32)
            else:
                pool = init_pool(
                    weight.detach().reshape(-1, p.vector_size), p.pool_size, config.init, gen, config.kmeans_iters
                )
            nws = NWSWeight(weight, p.vector_size, pool, role=p.role, search=search)
            if self.pools is not None:
                nws.pool_file_dtype = self.pools[p.name].dtype  # a float16 pool file keeps its hash
            # Registration calls the parametrization once, in the host module's mode; in training mode
            # that call would search the kernels search=False leaves unsearched, so the host's flag
            # (only its own, not its children's) reads eval while it registers: the call is a gather.
            training = module.training
            module.training = training and search
            try:
                parametrize.register_parametrization(module, "weight", nws)
            finally:
                module.training = training
            nws.train(training)
            report.layers.append(
                LayerRecord(
                    p.name,
                    p.role,
                    p.module,
                    p.kind,
                    p.shape,
                    nws.num_vectors,
                    p.vector_size,
                    p.pool_size,
                    p.bits,
                    p.found_by,
                    p.note,
                )
            )
        self.report = report
        cast(Any, model).nws_report = report  # nn.Module.__setattr__ is typed Tensor | Module; it takes any value
        return model


def convert(model: nn.Module, config: NWSConfig | int | None = None, **overrides) -> nn.Module:
    """Convert every Conv2d / Linear of ``model`` into an NWS layer, in place.

    Args:
        model: any timm or torchvision CNN (or other ``nn.Module``).
        config: an :class:`~nwsconvert.NWSConfig`, or the pool size (``convert(model, 512)``).
        **overrides: config fields (``pool_size=512``, ``group_size``, ``seed``, ``kmeans_iters``,
            ``layers``, and ``skip`` / ``layer_pool_size`` / ``layer_group_size``) and ``init``
            (``"kmeans"``, ``"random"``, a :class:`PoolSet` or a pool file). A budget,
            ``bits_per_weight=2`` or ``budget=200_000`` (bytes a task), lets the planner choose
            every non-head layer's vector and pool size (:mod:`nwsconvert.conversion.budget`).

    Returns:
        The same model object, converted. ``model.nws_report`` (or
        :func:`nwsconvert.conversion_report`) is the printable
        :class:`ConversionReport`.

    Raises:
        ConversionError: the model is already converted, or a given pool set
            does not fit a layer (the message names the layer).
    """
    return NWSConverter(config, **overrides).apply(model)
