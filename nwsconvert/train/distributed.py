"""torch.distributed glue for the trainer (DDP under ``torchrun``).

``torchrun --nproc_per_node N ...`` sets ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK``; :func:`setup` joins the process group (nccl on GPU, gloo on
CPU). Without those variables everything runs in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistInfo", "setup", "average_buffers", "gather_strings"]


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def setup(device: torch.device | None = None) -> DistInfo:
    """Join the process group ``torchrun`` describes (no-op in a single process).

    Args:
        device: the training device; decides the backend (nccl for CUDA, gloo otherwise).
    """
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


@torch.no_grad()
def average_buffers(model: nn.Module, info: DistInfo, skip: set[str]) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over ranks.

    DDP runs with ``broadcast_buffers=False`` (broadcasting every layer's
    indices at each step would cost more than the step); the statistics are
    averaged once per epoch instead, so every rank holds the same task state.
    Buffers named in ``skip`` (pools, indices: identical by construction) are left alone.
    """
    if not info.enabled:
        return
    for name, buf in model.named_buffers():
        if name in skip or not buf.is_floating_point():
            continue
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        buf.div_(info.world_size)


def gather_strings(value: str, info: DistInfo, length: int = 128) -> list[str]:
    """``value`` (at most ``length`` ASCII bytes, e.g. a hex digest) from every rank."""
    if not info.enabled:
        return [value]
    raw = value.encode("ascii")
    if len(raw) > length:
        raise ValueError(f"gather_strings: value longer than {length} bytes")
    buf = torch.zeros(length, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    if dist.get_backend() == "nccl":
        buf = buf.cuda()
    out = [torch.zeros_like(buf) for _ in range(info.world_size)]
    dist.all_gather(out, buf)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode("ascii") for t in out]
