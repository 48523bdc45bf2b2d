"""The parts of a training stage that know nothing of run directories: data loaders, the optimiser,
one training step (:class:`TrainStep`) and one epoch (:func:`train_one_epoch`).

    step = TrainStep(model, net, optimizer, cfg, device, pool=False)
    sums = train_one_epoch(step, loader, engine=None, desc="task 0 1/3", progress=True, check=check)
    sums.read()   # {"train_loss", "train_acc", "searched"}: one read of the device sums
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler
from tqdm.auto import tqdm

from ..core.nwsmodel import (
    commitment_loss,
    distillation_loss,
    ema_update,
    nws_layers,
    search_stats,
    set_commitment,
)
from .config import TrainConfig
from .distributed import DistInfo
from .heads import feature_weights

if TYPE_CHECKING:
    from .graphs import GraphedStep

__all__ = [
    "Data",
    "amp_dtype",
    "autocast_for",
    "make_loader",
    "make_optimizer",
    "TrainStep",
    "EpochSums",
    "train_one_epoch",
    "READ_EVERY",
]

Data = Dataset | DataLoader

#: Training steps between reads of the running loss and accuracy (progress bar, divergence check).
READ_EVERY = 25


def use_deterministic() -> Callable[[], None]:
    """Make this process's kernels deterministic (``TrainConfig.deterministic``); returns what restores
    the settings it found. cuBLAS needs a fixed workspace before its first call; cuDNN fixed
    algorithms and no autotuning."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]

    return restore


def amp_dtype(device: torch.device, amp: str) -> torch.dtype | None:
    """The autocast dtype ``amp`` gives on ``device`` (see :func:`autocast_for`), None for none."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return None
    if amp == "auto" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.float16 if amp == "fp16" else torch.bfloat16


def autocast_for(device: torch.device, amp: str):
    """``(autocast context, GradScaler or None)`` for ``amp`` = ``off`` / ``auto`` / ``bf16`` / ``fp16``.

    ``auto``: bfloat16 (float16 where the GPU lacks bfloat16) on CUDA, off elsewhere. ``bf16`` and
    ``fp16`` given explicitly run on a CPU too (``torch.autocast("cpu")``), which is how the tests
    check the AMP path without a GPU; float16 comes with a GradScaler."""
    dtype = amp_dtype(device, amp)
    if dtype is None:
        return contextlib.nullcontext(), None
    kind = "cuda" if device.type == "cuda" else "cpu"
    scaler = torch.amp.GradScaler(kind) if dtype == torch.float16 else None
    return torch.autocast(kind, dtype=dtype), scaler


def make_loader(
    data: Data, cfg: TrainConfig, train: bool, seed: int, dist: DistInfo, device: torch.device
) -> DataLoader:
    """A loader over ``data`` (a given ``DataLoader`` is used as it is): shuffled by ``seed`` for
    training, split over the ranks under torchrun, sequential for evaluation."""
    if isinstance(data, DataLoader):
        return data
    sampler: torch.utils.data.Sampler
    if train and dist.enabled:
        sampler = DistributedSampler(
            data, dist.world_size, dist.rank, shuffle=True, seed=seed, drop_last=len(data) >= 2 * dist.world_size
        )
    elif train:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = SequentialSampler(data)
    return DataLoader(
        data,
        batch_size=cfg.batch_size if train else max(cfg.batch_size, 256),
        sampler=sampler,
        num_workers=cfg.num_workers,
        drop_last=train and len(data) > cfg.batch_size,  # no batch of one through BatchNorm
        pin_memory=device.type == "cuda",
    )


def param_groups(model: nn.Module, params: list, cfg: TrainConfig) -> list[dict]:
    """``params`` as optimiser groups, each with its ``lr_scale`` (the factor on the schedule's rate):
    one group at 1 unless ``cfg.head_lr_scale`` is set; then :func:`~nwsconvert.train.heads.feature_weights`
    at 1 and the rest (head, normalisation layers, biases) at ``head_lr_scale``. Empty groups are left out."""
    if cfg.head_lr_scale == 1.0:
        return [{"params": params, "lr_scale": 1.0}]
    features = {id(p) for p in feature_weights(model)}
    groups = [
        {"params": [p for p in params if id(p) in features], "lr_scale": 1.0},
        {"params": [p for p in params if id(p) not in features], "lr_scale": cfg.head_lr_scale},
    ]
    return [g for g in groups if g["params"]]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD (momentum, Nesterov, weight decay) or Adam over the model's trainable parameters, in
    :func:`param_groups` (each group's ``lr`` is set per epoch from its ``lr_scale``)."""
    params = param_groups(model, [p for p in model.parameters() if p.requires_grad], cfg)
    if cfg.optimizer == "adam":
        # capturable: Adam keeps its step count on the device, which a CUDA graph's step needs.
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, capturable=cfg.cuda_graph)
    return torch.optim.SGD(
        params,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov and cfg.momentum > 0,
        weight_decay=cfg.weight_decay,
    )


class TrainStep:
    """One optimiser step of a stage: forward under autocast, loss, backward, step, pool update.

    The loss is the cross-entropy, plus ``beta`` times the distillation loss when pools learn by
    gradient (paper Eq. 3), plus the commitment term under float16 autocast. Elsewhere the
    commitment gradient is fused into the NWS layers' backward (``set_commitment``); a GradScaler
    scales the loss but not that fused gradient, which would come out divided by the loss scale,
    so under float16 it goes into the loss instead (same gradient). With EMA pool updates the
    pools follow the chosen kernels after every step (paper Eq. 4).

    Args:
        model: the converted model. net: what runs the forward (``model`` or its DDP wrapper).
        pool: pool learning (else task learning).
    """

    def __init__(
        self,
        model: nn.Module,
        net: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig,
        device: torch.device,
        pool: bool,
    ):
        self.model, self.net, self.optimizer, self.cfg, self.device = model, net, optimizer, cfg, device
        self.ctx, self.scaler = autocast_for(device, cfg.amp)
        self.gradient_pools = pool and cfg.pool_update == "gradient"
        self.ema_pools = pool and not self.gradient_pools
        self.commitment_in_loss = self.scaler is not None and cfg.commitment > 0
        if self.commitment_in_loss:
            set_commitment(model, 0.0)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Train on one batch ``x`` ``(B, C, H, W)``, ``y`` ``(B,)``; returns ``(logits (B, classes), cross-entropy)``, detached."""
        cfg, model = self.cfg, self.model
        # Before the forward: the last step's gradients are freed before the search update and the
        # activations are allocated, not held beside them.
        self.optimizer.zero_grad(set_to_none=True)
        with self.ctx:
            out = self.net(x)
            loss = F.cross_entropy(out.float(), y)
            total = loss + cfg.beta * distillation_loss(model) if self.gradient_pools else loss
            if self.commitment_in_loss:
                total = total + cfg.commitment * commitment_loss(model)
        if self.scaler is not None:
            self.scaler.scale(total).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            total.backward()
            self.optimizer.step()
        if self.ema_pools:
            ema_update(model, cfg.ema_decay)
        return out.detach(), loss.detach()


@dataclass
class EpochSums:
    """An epoch's running sums, kept on the device: ``loss_sum`` (float64) and ``correct`` (int64)
    are tensors, read back only by :meth:`read` (each read waits for the GPU)."""

    loss_sum: torch.Tensor
    correct: torch.Tensor
    seen: int = 0
    steps: int = 0
    searched: float | torch.Tensor = 0.0

    def read(self) -> dict:
        return {
            "train_loss": float(self.loss_sum) / max(self.seen, 1),
            "train_acc": int(self.correct) / max(self.seen, 1),
            "searched": float(self.searched) / max(self.steps, 1),
        }


def train_one_epoch(
    step: TrainStep | GraphedStep,
    loader: DataLoader,
    *,
    engine,
    desc: str,
    progress: bool,
    check: Callable[[torch.Tensor], None],
) -> EpochSums:
    """Run ``step`` over ``loader`` once, summing loss, accuracy and the re-searched share on the device.

    Args:
        engine: the model's :class:`~nwsconvert.core.engine.SearchEngine`, or ``None`` (per-layer search).
        desc: the progress bar's label. progress: show it.
        check: called with the loss sum every :data:`READ_EVERY` steps (the divergence check).
    """
    device, model = step.device, step.model
    sums = EpochSums(
        torch.zeros((), dtype=torch.float64, device=device), torch.zeros((), dtype=torch.int64, device=device)
    )
    layers = nws_layers(model) if engine is None else None  # one walk over the modules an epoch, not a step
    bar = tqdm(loader, desc=desc, disable=not progress, leave=False, dynamic_ncols=True)
    for x, y in bar:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        out, loss = step(x, y)
        n = y.numel()
        sums.seen += n
        sums.steps += 1
        sums.correct += (out.argmax(1) == y).sum()
        sums.loss_sum += loss.double() * n
        sums.searched = sums.searched + (
            engine.searched_fraction() if engine is not None else search_stats(model, layers)["fraction"]
        )
        if sums.steps % READ_EVERY == 0:
            check(sums.loss_sum)
            now = sums.read()
            bar.set_postfix(
                loss=f"{now['train_loss']:.3f}", acc=f"{now['train_acc']:.3f}", searched=f"{now['searched']:.1%}"
            )
    bar.close()
    return sums
