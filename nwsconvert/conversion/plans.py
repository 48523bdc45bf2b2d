"""What the planner decides for one weight layer (:class:`LayerPlan`), and the list of them (:class:`Plans`).

Its own module so that the planner (:mod:`.planner`) and the budget planner (:mod:`.budget`), which
both make plans, import it and not each other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..core.layers import index_bits

__all__ = ["LayerPlan", "Plans"]


@dataclass(frozen=True)
class LayerPlan:
    """What conversion does to one weight layer.

    Attributes:
        name: module name. module: its class name. role: ``stem`` / ``body`` / ``shortcut`` / ``head``.
        family: ``kxk``, ``depthwise`` (k x k, groups == in_channels) or ``1x1`` (1x1 convs, linear layers).
        kind: what the report prints (``3x3``, ``5x5 dw``, ``1x1 g4 vec4``, ``linear``...).
        shape: the weight's shape. area: kernel area. fan_in: input weights per output.
        group_size: g (1 unless ``family == "1x1"``). vector_size: D, floats per pool vector.
        kernels: d, pool vectors that build the layer. pool_size: n.
        found_by: ``torch.fx`` or ``module walk``. note: what the user should know (group fallback...).
        skip: why the layer stays dense (``None``: it is converted).
        forced: the layer cannot be converted (lazy, shared or non-float weight...), as opposed to
            left dense by choice (``skip`` patterns, a preset's ``skip_roles``).
    """

    name: str
    module: str
    role: str
    family: str
    kind: str
    shape: tuple[int, ...]
    area: int
    fan_in: int
    group_size: int
    vector_size: int
    kernels: int
    pool_size: int
    found_by: str
    note: str = ""
    skip: str | None = None
    forced: bool = False

    @property
    def skipped(self) -> bool:
        return self.skip is not None

    @property
    def bits(self) -> int:
        return index_bits(self.pool_size)

    def with_group_size(self, g: int) -> LayerPlan:
        """This plan with group size ``g`` (1x1 / linear layers; a width not a multiple of ``g`` falls back to 1)."""
        if self.family != "1x1":
            return self
        note = ""
        if self.fan_in % g:
            note, g = f"input width {self.fan_in} is not a multiple of group size {g}: using 1", 1
        base = self.kind.split(" vec")[0]
        size = math.prod(self.shape)
        return dataclasses.replace(
            self, group_size=g, vector_size=g, kernels=size // g, note=note, kind=base + (f" vec{g}" if g > 1 else "")
        )

    def with_pool_size(self, n: int) -> LayerPlan:
        return dataclasses.replace(self, pool_size=max(2, int(n)))

    def dense(self, reason: str) -> LayerPlan:
        """This layer left dense, for ``reason``."""
        return dataclasses.replace(self, skip=reason)


class Plans(list):
    """The list of :class:`LayerPlan` that :func:`plan` returns, plus ``trace``: how roles were found
    (``torch.fx``, or ``module walk (fx trace failed: ...)``)."""

    trace: str = "torch.fx"
