"""Accuracy of a model on data, and how much of its pools a model uses.

evaluate(model, test_set, device="cuda")   # {"acc", "loss", "correct", "total"}
pool_usage(model)                           # mean fraction of pool entries selected, 0..1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ..core.nwsmodel import _require
from .loop import Data, autocast_for

__all__ = ["evaluate", "pool_usage"]


def pool_usage(model: nn.Module) -> float:
    """Mean over NWS layers of the fraction of pool entries some kernel selects."""
    layers = _require(model)
    # A count per entry (one pass) rather than torch.unique's sort: the same entries, 5-10x faster on a CPU.
    used = [
        int(torch.bincount(layer.nws.indices, minlength=layer.nws.pool_size).count_nonzero()) / layer.nws.pool_size
        for layer in layers
    ]
    return sum(used) / len(used)


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Data, *, device: torch.device | str = "cpu", batch_size: int = 256, amp: str = "off"
) -> dict:
    """Top-1 accuracy and mean cross-entropy of ``model`` on ``data`` (eval mode).

    Args:
        model: any classifier returning logits ``(N, classes)``.
        data: a Dataset of ``(image, label)`` or a DataLoader of ``(N, C, H, W)``, ``(N,)`` batches.
        device: where ``model`` lives; batches are moved there.
        batch_size: for a Dataset.
        amp: ``off``, ``bf16`` or ``fp16`` (as :class:`~nwsconvert.TrainConfig.amp`).

    Returns:
        ``{'acc', 'loss', 'correct', 'total'}``.
    """
    device = torch.device(device)
    loader = data if isinstance(data, DataLoader) else DataLoader(data, batch_size=batch_size, shuffle=False)
    was_training = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    ctx, _ = autocast_for(device, amp)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with ctx:
            out = model(x)
        loss_sum += float(F.cross_entropy(out.float(), y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
        total += y.numel()
    model.train(was_training)
    return {"acc": correct / max(total, 1), "loss": loss_sum / max(total, 1), "correct": correct, "total": total}
