"""Small, fast training fixtures shared by the trainer tests."""

from __future__ import annotations

import timm
import torch
from torch.utils.data import TensorDataset

import nwsconvert
from nwsconvert import TrainConfig

SPEC = "timm:test_resnet"
KWARGS = {"in_chans": 1}


def blobs(n: int, classes: int, seed: int, size: int = 16) -> TensorDataset:
    """``n`` images ``(1, size, size)`` whose class is a bright square at a class-specific place."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = torch.randn(n, 1, size, size, generator=g) * 0.5
    for i in range(n):
        c = int(y[i])
        r, col = (c * 5) % (size - 4), (c * 3) % (size - 4)
        x[i, 0, r : r + 4, col : col + 4] += 2.0
    return TensorDataset(x, y)


def tiny_model(num_classes: int = 4, pool_size: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    model = timm.create_model("test_resnet", num_classes=num_classes, **KWARGS)
    return nwsconvert.convert(model, pool_size=pool_size, seed=seed)


def tiny_config(**changes) -> TrainConfig:
    base = dict(epochs=2, pool_epochs=1, lr=0.05, batch_size=16, milestones=[1], seed=7)
    base.update(changes)
    return TrainConfig(**base)
