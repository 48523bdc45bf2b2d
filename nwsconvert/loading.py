"""Rebuild a task's model from a run directory, for PyTorch inference, without the training code.

    model = nwsconvert.load("runs/mnist", task=2)               # NWS model, eval mode
    dense = nwsconvert.load("runs/mnist", task=2, dense=True)   # ordinary Conv2d / Linear layers
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .convert import convert
from .heads import resize_head
from .nwsmodel import materialize
from .packs import TaskPack, apply_task
from .pools import PoolSet
from .rundir import RunDir
from .specs import build_model

__all__ = ["load", "build_task_model"]


def build_task_model(
    model_info: dict, pools: PoolSet, pack: TaskPack, model: nn.Module | None = None
) -> nn.Module:
    """A converted model holding ``pack``'s task.

    Args:
        model_info: the manifest's ``model`` entry: ``spec``, ``kwargs``, ``convert`` (converter options).
        pools: the run's pool set.
        pack: the task pack.
        model: an unconverted instance of the architecture to use instead of building ``spec``.
    """
    if model is None:
        model = build_model(model_info["spec"], **model_info.get("kwargs", {}))
    options = {k: v for k, v in model_info.get("convert", {}).items() if k != "pool_size"}
    convert(model, init=pools, **options)
    if pack.num_classes is not None:
        resize_head(model, pack.num_classes)
    apply_task(model, pack)
    return model


def load(
    run_dir: str | os.PathLike,
    task: int,
    *,
    dense: bool = False,
    device: str | torch.device = "cpu",
    model: nn.Module | None = None,
) -> nn.Module:
    """Task ``task`` of a run, in eval mode.

    Args:
        run_dir: a run directory written by :class:`nwsconvert.Trainer`.
        task: task id (see ``nws-info RUN``).
        dense: return ordinary layers holding the chosen kernels (:func:`materialize`);
            outputs equal the NWS model's exactly.
        device: where to put the model.
        model: an unconverted instance of the architecture, for runs whose model
            spec cannot be rebuilt by name (a model class defined in a script).

    Raises:
        FileNotFoundError: no run there. KeyError: no such finished task (the message lists them).
        FormatError: a damaged file (named). ValueError: the spec cannot be built.
    """
    run = RunDir(run_dir)
    manifest = run.read()
    entry = run.task_entry(manifest, task)
    pools = PoolSet.load(run.pool_path)
    pack = TaskPack.load(run.path / entry["file"])
    net = build_task_model(manifest["model"], pools, pack, model=model)
    if dense:
        net = materialize(net)
    return net.to(device).eval()
