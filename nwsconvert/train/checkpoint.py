"""Resumable training checkpoints: model, optimizer and progress in one safetensors file.

Tensors are stored under ``model/<state key>`` and ``optim/<param id>/<name>``;
the JSON header holds the stage, completed epochs, the head's class count,
the pool mode and the optimizer's parameter groups. Nothing is pickled.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..formats.storage import read_tensors, write_tensors

__all__ = ["save_checkpoint", "load_checkpoint", "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION"]

CHECKPOINT_FORMAT = "nwsconvert.train.checkpoint"
CHECKPOINT_VERSION = 2  # 2: header_sha256


def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: str, epoch: int, **fields
) -> None:
    """Write ``model`` and ``optimizer`` state after ``epoch`` completed epochs of ``stage``, atomically."""
    tensors = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state = optimizer.state_dict()
    scalars: dict = {}
    for pid, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{pid}/{name}"] = value.detach().clone()
            else:
                scalars.setdefault(str(pid), {})[name] = value
    tensors["rng/torch"] = torch.get_rng_state()
    write_tensors(
        path,
        tensors,
        CHECKPOINT_FORMAT,
        CHECKPOINT_VERSION,
        stage=stage,
        epoch=epoch,
        param_groups=state["param_groups"],
        optim_scalars=scalars,
        **fields,
    )


def load_checkpoint(path: str | os.PathLike) -> tuple[dict, dict, dict]:
    """Read a checkpoint.

    Returns:
        ``(header, model_state, optimizer_state)``; ``optimizer_state`` is
        ready for ``optimizer.load_state_dict``.
    """
    tensors, header = read_tensors(path, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, hashed_since=2)
    model_state = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    opt_state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optim/"):
            _, pid, name = k.split("/", 2)
            opt_state.setdefault(int(pid), {})[name] = v
    for pid, entry in header.get("optim_scalars", {}).items():
        opt_state.setdefault(int(pid), {}).update(entry)
    if "rng/torch" in tensors:
        header["rng_state"] = tensors["rng/torch"]
    return header, model_state, {"state": opt_state, "param_groups": header["param_groups"]}
