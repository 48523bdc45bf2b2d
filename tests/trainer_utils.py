"""Small, fast training fixtures shared by the trainer tests."""

from __future__ import annotations

import timm
import torch
from torch.utils.data import TensorDataset

import nwsconvert
from nwsconvert import TrainConfig, Trainer

SPEC = "timm:test_resnet"
KWARGS = {"in_chans": 1}
DATA_INFO = {"channels": 1, "input_size": [16, 16], "mean": [0.5], "std": [0.25]}


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
    # checkpoint_interval=0: a checkpoint after every epoch (these epochs take milliseconds), which the
    # kill-and-resume tests need.
    base = dict(epochs=2, pool_epochs=1, lr=0.05, batch_size=16, milestones=[1], seed=7, checkpoint_interval=0)
    base.update(changes)
    return TrainConfig(**base)


def train_run(
    out,
    model=None,
    *,
    learn_pools: bool = True,
    tasks=(3, 2),
    data_seed: int = 0,
    class_names: bool = False,
    size: int = 16,
    model_spec: str = SPEC,
    **config,
) -> Trainer:
    """A finished tiny run in ``out``; returns its (closed) trainer.

    Pool learning on 4 classes of :func:`blobs` (unless ``learn_pools`` is false), then
    task ``t`` with ``tasks[t]`` classes, one epoch each; ``config`` changes
    :func:`tiny_config`, ``data_seed`` shifts every training set's seed, ``size`` is the images' side,
    ``model_spec`` the timm model ``model`` was built as (with :data:`KWARGS`).
    """
    model = tiny_model() if model is None else model
    with Trainer(
        model,
        out,
        tiny_config(epochs=1, **config),
        model_spec=model_spec,
        model_kwargs=KWARGS,
        data_info={**DATA_INFO, "input_size": [size, size]},
        progress=False,
    ) as trainer:
        if learn_pools:
            trainer.fit_pools(blobs(32, 4, 1 + data_seed, size), num_classes=4)
        for t, classes in enumerate(tasks):
            names = [f"c{i}" for i in range(classes)] if class_names else None
            train, val = blobs(32, classes, 10 + t + data_seed, size), blobs(16, classes, 20 + t, size)
            trainer.fit_task(t, train, val, classes, name=f"t{t}", class_names=names)
    return trainer
