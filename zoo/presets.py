"""Conversion presets per architecture family: which layers, vector sizes and pool sizes.

    preset = nwsconvert.zoo.get_preset("inverted-residual")
    config = preset.config(model)                  # an NWSConfig: nwsconvert.convert(model, config)
    model = preset.apply(model)                    # the same, converted in place
    model = nwsconvert.zoo.apply_preset(model)     # family guessed by preset_for(model)

A preset states its rules by layer *family* and *role*, not by module name, so
one preset serves timm, torchvision and other implementations of a family.
It decides nothing the planner decides (:mod:`nwsconvert.conversion.planner`):
:meth:`Preset.edit` only changes the planner's :class:`LayerPlan` s, and
:meth:`Preset.config` turns the edited plans into an ordinary
:class:`~nwsconvert.NWSConfig` whose ``layers`` name the layers it changed,
which is JSON-able and recorded in the run manifest like any other.

Rules every preset shares (see :class:`Preset` for the switches):

* **Rate.** A pool of n entries stores ``ceil(log2 n)`` bits per pool vector
  of D floats: for the paper's n = 512, 1 bit per weight for 3x3 kernels,
  0.36 for 5x5, but 9 bits per weight for 1x1 convs and linear layers taken
  as scalars (g = 1). Grouping g consecutive input weights of a 1x1 / linear
  layer into one vector divides that by g (g = 4: 2.25, g = 8: 1.1 bits per
  weight). Measured on EfficientNet-Lite0's ImageNet weights with k-means
  pools and no training (``benchmarks/zoo_pools.py``, 48 photo crops):
  with this module's depthwise rule, scalar pools of 256-1024 entries keep
  ||W - K|| / ||W|| at 0.7-1 %, the dense top-1 on 90-92 % of the inputs
  (the rest are near-ties on textures and micrographs) and KL 0.01-0.02;
  g = 4 at n = 512 gives 21 % weight error and 10 % top-1 agreement, g = 8
  none. After task training (split-mnist, 5 tasks, 3 epochs each, no pool
  learning) g = 1 matched dense finetune (97.75 % vs 97.25 %) and g = 4
  reached 89.75 %. So g = 1 is the default wherever it is affordable.
* **Budget.** Where it is not (MobileNets, EfficientNets: mostly 1x1 layers),
  ``inverted-residual`` gives a budget in bits a weight instead, and the
  budget planner (:mod:`nwsconvert.conversion.budget`) chooses each layer's g
  and n after the rules here: a task 44-59x below dense on long-mixed-20,
  with the accuracy that preset's docstring gives per model.
* **Cap.** A non-head layer with fewer kernels d than n gets a pool of exactly
  d entries (k-means then keeps every kernel: exact at conversion) and
  ``ceil(log2 d)`` bits per index; a larger pool would only add random
  entries and bytes. Stems (3 input channels) are the usual case.
* **Depthwise.** Depthwise convs (groups == in_channels) have one kernel per
  channel (at most a few thousand) but their kernels differ most from one
  another: at n = 512 the 5x5 depthwise layers of EfficientNet-Lite0 keep
  12-22 % relative error, the largest in the network. Presets for families
  with depthwise convs give them a pool of their own kernel count (up to
  ``depthwise_pool_size``): exact at conversion, the pool costs what one dense
  copy of the layer costs (they are 1-4 % of the weights) and a task still
  stores only ``ceil(log2 d)`` bits per kernel.
* **Head.** The classifier is resized for every task, so its pool must serve
  heads of any width: it keeps the full pool size (no cap) and scalar
  entries (g = 1, as in the paper), whatever the body's group size.
* **Skip.** No preset leaves layers dense by default: a dense layer is stored
  in full by every task, a converted one once (its pool) plus a few bits per
  kernel per task, which is smaller from the second task on for every layer
  shape. ``skip`` / ``skip_roles`` are there for users who want it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from nwsconvert.conversion.budget import fit_budget
from nwsconvert.conversion.config import NWSConfig
from nwsconvert.conversion.converter import convert
from nwsconvert.conversion.graph import is_weight_layer
from nwsconvert.conversion.planner import LayerPlan, Plans, config_from_plans, layer_family, plan

from .registry import Registry

__all__ = [
    "Preset",
    "LayerPlan",
    "register_preset",
    "list_presets",
    "get_preset",
    "preset_for",
    "apply_preset",
]


@dataclass(frozen=True)
class Preset:
    """A family's conversion choices, as rules over layer families and roles.

    Args:
        name: registry name.
        pool_size: n for every layer the rules below do not change.
        group_size: g for 1x1 convs and linear layers other than the head.
        head_group_size: g for the classifier.
        cap_to_layer: a non-head layer with d < n kernels gets n = d.
        depthwise_pool_size: depthwise convs get ``min(d, this)`` entries
            (``None``: the ``pool_size`` / cap rules).
        skip: module names or fnmatch patterns left dense.
        skip_roles: roles left dense (e.g. ``("stem",)``).
        kmeans_iters: Lloyd iterations of the k-means pool initialisation.
        bits_per_weight / budget: a budget (see :class:`~nwsconvert.NWSConfig`): after the rules
            above, the budget planner chooses every non-head layer's vector size and pool size.
            Naming ``group_size`` or ``pool_size`` to :meth:`config` without a budget turns a
            preset's own budget off: the user's g and n then hold everywhere.
        group_sizes: the vector sizes the budget planner may give 1x1 / linear layers (``None``: all it knows).
        doc: the reasoning (the registering function's docstring).
    """

    name: str
    pool_size: int = 512
    group_size: int = 1
    head_group_size: int = 1
    cap_to_layer: bool = True
    depthwise_pool_size: int | None = None
    skip: tuple[str, ...] = ()
    skip_roles: tuple[str, ...] = ()
    kmeans_iters: int = 3
    bits_per_weight: float | None = None
    budget: int | None = None
    group_sizes: tuple[int, ...] | None = None
    doc: str = dataclasses.field(default="", repr=False, compare=False)

    def replace(self, **changes) -> Preset:
        """A copy with some fields changed (``pool_size=256``, ``group_size=4``...)."""
        return dataclasses.replace(self, **changes)

    def base_config(self) -> NWSConfig:
        """The model-wide part of this preset: pool size, group size, k-means iterations, skip patterns."""
        return NWSConfig(
            self.pool_size, self.group_size, kmeans_iters=self.kmeans_iters, layers=dict.fromkeys(self.skip)
        )

    def edit(self, plans: list[LayerPlan]) -> Plans:
        """The planner's plans (made with :meth:`base_config`) with this preset's rules applied.

        Rules, per converted layer: ``skip_roles`` leave it dense; 1x1 / linear layers get
        ``head_group_size`` (the head) or ``group_size``; depthwise convs get ``min(d,
        depthwise_pool_size)`` entries; with ``cap_to_layer`` a non-head layer of d < n kernels
        gets n = d. Layers the planner left dense stay so.
        """
        out = Plans()
        out.trace = getattr(plans, "trace", Plans.trace)
        for p in plans:
            if p.skipped:
                out.append(p)
                continue
            if p.role in self.skip_roles:
                out.append(p.dense(f"skipped by preset {self.name!r} (role {p.role})"))
                continue
            if p.family == "1x1":
                p = p.with_group_size(self.head_group_size if p.role == "head" else self.group_size)
            n = self.pool_size
            if p.family == "depthwise" and self.depthwise_pool_size is not None:
                n = min(p.kernels, self.depthwise_pool_size)
            elif self.cap_to_layer and p.role != "head" and p.kernels < n:
                n = p.kernels
            out.append(p.with_pool_size(n))
        return out

    def config(self, model: nn.Module, **options) -> NWSConfig:
        """The :class:`~nwsconvert.NWSConfig` that converts ``model`` with this preset (traces it once).

        Args:
            **options: preset fields to change first (``pool_size``, ``group_size``,
                ``depthwise_pool_size``...), then any other config field (``seed``, ``init``
                as a string, ``layers``, ``skip``, ``layer_pool_size``, ``layer_group_size``).
                The user's per-layer entries come first in ``layers``, so they win over the
                preset's (first match per field), and ``skip`` patterns add to the preset's.

        Returns:
            The preset's model-wide values with one exact-name ``layers`` entry per layer the
            preset changed, after the user's entries.
        """
        fields = {f.name for f in dataclasses.fields(self)} - {"name", "doc", "skip"}
        chosen = {k: options.pop(k) for k in list(options) if k in fields}
        if {"group_size", "pool_size"} & set(chosen) and not {"bits_per_weight", "budget"} & set(chosen):
            chosen.update(bits_per_weight=None, budget=None)  # the user's g / n, not the preset's budget
        preset = self.replace(**chosen)
        if preset.bits_per_weight is None and preset.budget is None and "group_sizes" not in chosen:
            preset = preset.replace(group_sizes=None)  # the preset's vector sizes bound its budget, now off
        user = NWSConfig().replace(**options)
        base = dataclasses.replace(preset.base_config(), seed=user.seed)
        plans = preset.edit(plan(model, base))
        budgeted = dataclasses.replace(
            base, bits_per_weight=preset.bits_per_weight, budget=preset.budget, group_sizes=preset.group_sizes
        )
        budget = budgeted.budget_of()
        if budget is not None:
            plans = fit_budget(
                model, plans, budget, seed=user.seed, kmeans_iters=preset.kmeans_iters, group_sizes=preset.group_sizes
            )
        edited = config_from_plans(plans, budgeted)
        return dataclasses.replace(edited, init=user.init, seed=user.seed, layers={**user.layers, **edited.layers})

    def apply(self, model: nn.Module, **options) -> nn.Module:
        """Convert ``model`` in place with this preset (``options`` as in :meth:`config`; ``init`` may
        also be a :class:`~nwsconvert.PoolSet` or a pool file)."""
        init = options.pop("init", None)
        if isinstance(init, str) and init in ("kmeans", "random"):
            options["init"] = init
            init = None
        config = self.config(model, **options)
        return convert(model, config) if init is None else convert(model, config, init=init)


_PRESETS: Registry = Registry("preset", "known presets")  # name -> factory () -> Preset


def register_preset(name: str) -> Callable[[Callable[[], Preset]], Callable[[], Preset]]:
    """Decorator: register a preset factory; its docstring becomes the preset's ``doc``."""
    return _PRESETS.register(name)


def list_presets() -> list[str]:
    return _PRESETS.names()


def get_preset(name: str, **changes) -> Preset:
    """A registered preset, with ``changes`` to its fields.

    Raises:
        KeyError: unknown preset (the message lists the known ones).
    """
    fn = _PRESETS.lookup(name)
    preset = dataclasses.replace(fn(), name=name, doc=(fn.__doc__ or "").strip())
    return preset.replace(**changes) if changes else preset


# ------------------------------------------------------------------ presets
@register_preset("paper")
def paper() -> Preset:
    """The paper's setting, unchanged: every layer, n = 512, 1x1 convs and the FC as scalars.

    Use it to reproduce the paper's figures (ResNet-18 on Split-CIFAR-100,
    9 bits per index everywhere). No cap: a stem with fewer kernels than 512
    still gets 512 entries (the rest random), as in the released code.
    """
    return Preset("paper", pool_size=512, group_size=1, cap_to_layer=False)


@register_preset("resnet-basic")
def resnet_basic() -> Preset:
    """ResNet-18/34 and other basic-block ResNets: the paper's choice plus the cap.

    3x3 convs hold ~94 % of ResNet-18's weights and get 1 bit per weight at
    n = 512, the setting the paper trains. The only 1x1 convs are the three
    downsample shortcuts (~1.5 % of the weights), so scalar pools (g = 1)
    cost little and keep the residual paths exact enough; the FC head is
    scalar as in the paper. The 7x7 stem has 64 x 3 = 192 kernels: capped to
    a 192-entry pool (exact, 8-bit indices) instead of 512 entries of which
    320 no kernel would use.
    """
    return Preset("resnet-basic", pool_size=512, group_size=1)


@register_preset("resnet-bottleneck")
def resnet_bottleneck() -> Preset:
    """ResNet-50/101/152, ResNeXt, Wide ResNet: bottleneck blocks, 1x1 convs as scalars.

    In ResNet-50, 1x1 convs hold ~48 % of the weights (3x3: 44 %, FC: 8 %).
    As scalars (g = 1) they cost 9 bits per weight per task: ~14 MB of a
    ~15 MB task, still 7x less than a dense copy (102 MB). Grouped in 4
    (``group_size=4``, 2.25 bits per weight) a task shrinks to ~5 MB, but
    the 1x1 layers then start ~20-25 % away from their weights instead of
    ~1 % (measured on EfficientNet-Lite0's ImageNet 1x1 convs, k-means
    pools), and after short task training without pool learning that model
    stayed 7.5 points below dense finetune on split-mnist where g = 1
    matched it (``benchmarks/zoo_pools.py``). Accuracy first by default;
    g = 4 is the compact option (to try with learned pools or longer task
    training). Head scalar, stem capped.
    """
    return Preset("resnet-bottleneck", pool_size=512, group_size=1)


@register_preset("inverted-residual")
def inverted_residual() -> Preset:
    """MobileNetV2/V3, EfficientNet(-Lite), MnasNet: scalar pools, a budget of 3.25 bits a weight.

    1x1 expand / project convs hold 61-72 % of the weights. As scalars at 512 entries (g = 1, 9 bits
    a weight, this preset's rule until issue 63) a MobileNetV3-small task stored 0.77-0.81 MB on
    long-mixed-20, 7.5x below dense and more than every parameter-efficient peer.

    The preset gives a budget, ``bits_per_weight=3.25``, with scalar pools (``group_sizes=(1,)``),
    and the planner (:mod:`nwsconvert.conversion.budget`) spends it: each 1x1 layer gets the pool
    size that reaches the model's common error at the fewest bits (8-16 entries of single
    weights), depthwise convs and the stem keep pools of their own kernels where that is cheap
    (exact), the head stays scalar. Measured on three suites, 3 seeds, every method beside it
    (``benchmarks/RESULTS.md``, "Mobile networks at NWS's memory" and what follows it): a task
    adds 33-85x less than dense finetuning on MobileNetV3-small, MobileNetV2 and EfficientNet-B0;
    NWS has the highest mean or lies inside the highest's spread on 7 of the 9 network-and-suite
    cells, and on EfficientNet-Lite0 from ImageNet (hard pairs) the highest mean of every method.

    The preset before (2 bits, the planner free to pick 4-vectors for 1x1 layers) stored 8-26 %
    less and met 5 of the 9 cells: MobileNetV2 fell under dense finetuning on all three suites,
    and EfficientNet-Lite0 from ImageNet 0.95 under LoRA r=16. Scalar pools of 8-16 entries also
    search faster (a sorted pool, ``searchsorted``): the NWS job's wall time fell against the
    vector plan's. ``bits_per_weight=2 'group_sizes=[1, 2, 4, 8, 16]'`` gives that plan back.

    ``bits_per_weight=None`` (``nws-train bits_per_weight=off``) gives the old 9-bit scalar rule;
    naming ``group_size`` or ``pool_size`` turns the budget off too.
    """
    return Preset(
        "inverted-residual",
        pool_size=512,
        group_size=1,
        depthwise_pool_size=2048,
        bits_per_weight=3.25,
        group_sizes=(1,),
    )


@register_preset("vgg")
def vgg() -> Preset:
    """VGG-11/13/16/19: 3x3 convs at n = 512, the big hidden FC layers in 8-vectors.

    In torchvision's VGG-16 the hidden linear layers hold 86 % of the 138 M
    weights (classifier.0 alone 103 M): as scalars a task would store 9 bits
    for each, ~134 MB of indices per task. g = 8 brings them to ~1.1 bits per
    weight (~17 MB), the rate the 3x3 convs already have at n = 512 (the paper's
    VGG-16 used a small CIFAR classifier, so it never met this). This is the
    one family where grouping is the default: the FC layers are the task's
    size, and grouped pointwise layers start far from their weights (~25 %
    relative error at g = 4 on EfficientNet-Lite0), so expect to need task
    training (or ``group_size=1``: ~136 MB per task, still 4x below dense).
    timm's VGG turns those layers into a 7x7 conv (49-float kernels, 0.18
    bits per weight) and a 1x1 conv (g = 8). Head scalar, stem capped.
    """
    return Preset("vgg", pool_size=512, group_size=8)


@register_preset("convnext")
def convnext() -> Preset:
    """ConvNeXt: depthwise 7x7 kernels exact, the MLP linears as scalars.

    Every block is a depthwise 7x7 conv (one kernel per channel, <= 1,536:
    own-kernel pools, exact, <= 11-bit indices) followed by a 4x-expansion
    MLP of linear layers (or 1x1 convs) holding ~91 % of ConvNeXt-T's
    weights. As for bottleneck ResNets the MLP stays scalar (g = 1, 9 bits
    per weight: a task is ~27 % of a dense copy) because grouping them costs
    accuracy until pools are learned; ``group_size=4`` brings a task to ~8 %.
    The 2x2 downsampling convs are 4-float kernels at n = 512; the 4x4
    patchify stem (96 x 3 kernels) is capped (exact). Head scalar. LayerNorm
    and layer-scale parameters are per-task state (packs).
    """
    return Preset("convnext", pool_size=512, group_size=1, depthwise_pool_size=2048)


# ------------------------------------------------------- family detection
#: Block class names -> preset, checked in this order (timm, torchvision, efficientnet-lite-pytorch).
FAMILY_BLOCKS: list[tuple[str, tuple[str, ...]]] = [
    ("convnext", ("ConvNeXtBlock", "CNBlock")),
    (
        "inverted-residual",
        ("InvertedResidual", "MBConvBlock", "MBConv", "FusedMBConv", "DepthwiseSeparableConv", "EdgeResidual"),
    ),
    ("resnet-bottleneck", ("Bottleneck",)),
    ("resnet-basic", ("BasicBlock",)),
]


def preset_for(model: nn.Module) -> str:
    """Guess the preset for ``model`` from its block classes, else from its layer geometry.

    Order: ConvNeXt blocks, inverted-residual blocks, ResNet bottleneck then
    basic blocks (by class name); a model class named ``VGG``; otherwise
    ``inverted-residual`` when it has depthwise convs, ``vgg`` when linear
    layers hold most weights, else ``paper``.
    """
    names = {type(m).__name__ for m in model.modules()}
    for preset, blocks in FAMILY_BLOCKS:
        if names & set(blocks):
            return preset
    if type(model).__name__ == "VGG":
        return "vgg"
    depthwise, linear, total = False, 0, 0
    for m in model.modules():
        if not is_weight_layer(m) or not isinstance(getattr(m, "weight", None), nn.Parameter):
            continue
        depthwise |= layer_family(m) == "depthwise"
        total += m.weight.numel()
        linear += m.weight.numel() if isinstance(m, nn.Linear) else 0
    if depthwise:
        return "inverted-residual"
    if total and linear * 2 > total:
        return "vgg"
    return "paper"


def apply_preset(model: nn.Module, name: str | None = None, **options) -> nn.Module:
    """Convert ``model`` in place with preset ``name`` (default :func:`preset_for`).

    Args:
        **options: preset field changes and convert options (see :meth:`Preset.config`).
    """
    return get_preset(name or preset_for(model)).apply(model, **options)
