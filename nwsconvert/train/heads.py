"""Classifier heads: find them and resize them to a task's class count.

Every task of a task-incremental run has its own class count v_t. Like the
paper's official code, the head is resized by keeping the rows it has (the
first ``min(old, new)`` classes) and initialising new rows as PyTorch
initialises a fresh ``nn.Linear`` (uniform in ``±1/sqrt(fan_in)``). For an NWS
head the pool (a scalar pool shared by all tasks) is untouched: only the
temporary weights, the indices and the bias change size.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..core.layers import NWSWeight
from ..core.nwsmodel import nws_layers

__all__ = ["find_head", "resize_head", "head_classes", "feature_weights"]


def find_head(model: nn.Module) -> tuple[str, nn.Module]:
    """The classifier layer of ``model`` as ``(name, module)``.

    Order of preference: the NWS layer with role ``head``; timm's
    ``get_classifier()``; the last ``nn.Linear``.

    Raises:
        ValueError: no classifier layer found.
    """
    heads = [layer for layer in nws_layers(model) if layer.nws.role == "head"]
    if heads:
        return heads[-1].name, heads[-1].module
    modules = dict(model.named_modules())
    get = getattr(model, "get_classifier", None)
    if callable(get):
        clf = get()
        for name, m in modules.items():
            if m is clf and (
                parametrize.is_parametrized(m, "weight") or isinstance(getattr(m, "weight", None), torch.Tensor)
            ):
                return name, m
    linears = [(n, m) for n, m in modules.items() if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1]
    raise ValueError(f"{type(model).__name__} has no classifier layer (no NWS head, get_classifier() or nn.Linear)")


def _raw_weight(module: nn.Module) -> torch.Tensor:
    """The stored weight tensor; for an NWS host its temporary weights W.

    Reading ``module.weight`` of a parametrized host in training mode runs the
    kernel search (indices follow W): shape queries must not do that.
    """
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original
    return module.weight


def feature_weights(model: nn.Module) -> list[nn.Parameter]:
    """What a linear probe freezes: every trainable parameter of two or more dimensions outside the
    head (conv kernels, the NWS layers' temporary kernels, dense linear layers). Normalisation
    layers, biases and the head stay trainable."""
    head = {id(p) for p in find_head(model)[1].parameters()}
    return [p for p in model.parameters() if p.requires_grad and p.dim() >= 2 and id(p) not in head]


def head_classes(model: nn.Module) -> int:
    """Output classes of the head (dimension 0 of its weight)."""
    return int(_raw_weight(find_head(model)[1]).shape[0])


def _new_rows(old: torch.Tensor, rows: int, generator: torch.Generator | None) -> torch.Tensor:
    fan_in = old[0].numel()
    bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
    out = torch.empty((rows, *old.shape[1:]), dtype=torch.float32)
    out.uniform_(-bound, bound, generator=generator)
    return out.to(device=old.device, dtype=old.dtype)


def _resized(old: torch.Tensor, num_classes: int, generator: torch.Generator | None) -> torch.Tensor:
    keep = min(old.shape[0], num_classes)
    parts = [old.detach()[:keep]]
    if num_classes > keep:
        parts.append(_new_rows(old, num_classes - keep, generator))
    return torch.cat(parts, 0).clone()


@torch.no_grad()
def resize_head(
    model: nn.Module, num_classes: int, generator: torch.Generator | None = None, *, search: bool = True
) -> nn.Module:
    """Give the head ``num_classes`` outputs, keeping existing rows; in place.

    Works for NWS heads (the temporary weights, indices and bias are resized,
    the new rows searched in the head's pool) and dense ``nn.Linear`` /
    ``nn.Conv2d`` heads. Parameters are replaced: build the optimizer after.

    Args:
        num_classes: v_t, at least 1.
        generator: seeds the new rows.
        search: search the resized NWS head's kernels; ``False`` when the caller sets its indices
            next (a task pack, a checkpoint): they are 0 until then, and the next training forward
            searches every kernel.

    Returns:
        ``model``.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    name, head = find_head(model)
    weight = _raw_weight(head)
    if weight.shape[0] == num_classes:
        return model
    if parametrize.is_parametrized(head, "weight"):
        plist = head.parametrizations.weight
        nws = next(p for p in plist if isinstance(p, NWSWeight))
        old = plist.original
        new = _resized(old, num_classes, generator)
        plist.original = nn.Parameter(new, requires_grad=old.requires_grad)
        nws.resize(new, search=search)
    else:
        head.weight = nn.Parameter(_resized(weight, num_classes, generator), requires_grad=weight.requires_grad)
    bias = getattr(head, "bias", None)
    if isinstance(bias, torch.Tensor):
        keep = min(bias.shape[0], num_classes)
        parts = [bias.detach()[:keep]]
        if num_classes > keep:  # like nn.Linear: uniform in ±1/sqrt(fan_in) of the weight
            bound = 1.0 / math.sqrt(_raw_weight(head)[0].numel())
            extra = torch.empty(num_classes - keep).uniform_(-bound, bound, generator=generator)
            parts.append(extra.to(device=bias.device, dtype=bias.dtype))
        head.bias = nn.Parameter(torch.cat(parts).clone(), requires_grad=bias.requires_grad)
    for attr in ("out_features", "out_channels"):
        if hasattr(head, attr):
            setattr(head, attr, num_classes)
    if hasattr(model, "num_classes") and isinstance(model.num_classes, int):
        model.num_classes = num_classes
    return model
