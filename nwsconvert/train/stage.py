"""One training stage (pool learning, or one task) over its epochs, checkpointed after an epoch once
``TrainConfig.checkpoint_interval`` seconds have passed since the stage started or last checkpointed.

    ctx = StageContext(model, run, dist, device, progress=True)
    record = run_stage(ctx, "task:2", train, val, cfg, pool=False, seed=cfg.seed + 3, ckpt=stage_checkpoint(run, "task:2"))

A stage resumed from its checkpoint continues at the next epoch with the model, optimiser and RNG
state it had, a stage killed before its first checkpoint starts again, and a stage killed after its
last checkpoint returns that epoch's record, as the uninterrupted stage would. Knows the run directory only as a place for the checkpoint and the log.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.swa_utils import update_bn
from torch.utils.data import DistributedSampler

from ..core.engine import search_engine
from ..core.nwsmodel import commitment_loss, nws_layers, reseed_unused, set_commitment
from ..formats.packs import round_state_
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig, lr_factor
from .distributed import DistInfo, average_buffers
from .evaluation import evaluate, pool_usage
from .graphs import GraphedStep, check_graphable
from .heads import feature_weights, head_classes, resize_head
from .loop import Data, TrainStep, make_loader, make_optimizer, train_one_epoch
from .rundir import RunDir

__all__ = ["StageContext", "run_stage", "stage_checkpoint"]


@dataclass
class StageContext:
    """What every stage of a run shares: the model, the run it logs and checkpoints to, the process
    group, the device, and whether the main process shows progress bars."""

    model: nn.Module
    run: RunDir
    dist: DistInfo
    device: torch.device
    progress: bool = True
    #: ``time.perf_counter()`` when the stage running now started or last wrote its checkpoint
    #: (``TrainConfig.checkpoint_interval``).
    last_checkpoint: float = 0.0

    def log(self, record: dict) -> None:
        if self.dist.is_main:
            self.run.log(record)

    def loader(self, data: Data, cfg: TrainConfig, train: bool, seed: int):
        return make_loader(data, cfg, train, seed, self.dist, self.device)


def stage_checkpoint(run: RunDir, stage: str):
    """``(header, model_state, optimizer_state)`` of the run's checkpoint if it belongs to ``stage``, else None."""
    path = run.checkpoint_path
    if not path.is_file():
        return None
    ckpt = load_checkpoint(path)
    return ckpt if ckpt[0].get("stage") == stage else None


def _restore(ctx: StageContext, ckpt) -> int:
    """Load a checkpoint's model and RNG state; returns the epochs it had completed."""
    header, state, _ = ckpt
    if header.get("num_classes") is not None:
        resize_head(ctx.model, int(header["num_classes"]), search=False)  # the state dict holds its indices
    ctx.model.load_state_dict(state)
    ctx.model.to(ctx.device)
    for layer in nws_layers(ctx.model):
        layer.nws.reset_search()
    if "rng_state" in header:
        torch.set_rng_state(header["rng_state"])
    return int(header["epoch"])


def _check_loss(stage: str, epoch: int, loss_sum: torch.Tensor) -> None:
    """One line for a diverged stage: a NaN or infinite loss makes the running sum non-finite."""
    value = float(loss_sum)
    if not math.isfinite(value):
        raise FloatingPointError(f"{stage}: loss is {value} at epoch {epoch + 1}: lower the learning rate")


def run_stage(
    ctx: StageContext, stage: str, train: Data, val: Data | None, cfg: TrainConfig, *, pool: bool, seed: int, ckpt
) -> dict:
    """Train ``ctx.model`` for ``cfg.epochs`` epochs (from the checkpoint's epoch when ``ckpt`` is given).

    Args:
        stage: ``pools`` or ``task:<t>`` (checkpoints and log lines carry it).
        train, val: the stage's data; ``val`` None skips validation.
        cfg: the stage's recipe (``TrainConfig.for_pools()`` for pool learning).
        pool: pool learning (pool update, reseeding) rather than a task.
        seed: the data-order seed (epoch ``e`` shuffles with ``seed * 1000 + e``).
        ckpt: :func:`stage_checkpoint`'s result, or None.

    Returns:
        The last epoch's record: ``stage, epoch, lr, train_loss, train_acc, searched, commitment,
        pool_usage, seconds`` and ``val_acc, val_loss, val_correct, val_total`` with ``val`` (a task's
        last epoch validates its state rounded to the pack's ``state_dtype``).
    """
    start = _restore(ctx, ckpt) if ckpt is not None else 0
    ctx.last_checkpoint = time.perf_counter()
    optimizer = make_optimizer(ctx.model, cfg)
    if ckpt is not None:
        scales = [g["lr_scale"] for g in optimizer.param_groups]
        optimizer.load_state_dict(ckpt[2])
        for group, scale in zip(optimizer.param_groups, scales):  # the run's config, not the file's
            group["lr_scale"] = scale
    set_commitment(ctx.model, cfg.commitment)
    if not pool:
        check_graphable(cfg, ctx.device, ctx.dist.enabled)
    engine = search_engine(ctx.model, cfg.search, graph=cfg.engine_graph and not pool)  # pools move every step
    try:
        record = _epochs(ctx, stage, train, val, cfg, pool, seed, optimizer, start, engine)
        set_commitment(ctx.model, 0.0)
    finally:
        if engine is not None:
            engine.close()  # the layers' own lazy search goes on from the engine's state
    if record is None:  # killed after its last checkpoint: that epoch's record, as the uninterrupted stage returned
        saved = ckpt[0].get("record") if ckpt is not None else None
        record = (
            dict(saved) if isinstance(saved, dict) and saved.get("epoch") == start else {"stage": stage, "epoch": start}
        )
        # Its validation ran in the killed process, under that process's settings (amp, device): the trainer
        # evaluates again rather than reuse its counts (Trainer._finish_task).
        record.pop("val_correct", None)
        record.pop("val_total", None)
    return record


def _wrap(ctx: StageContext) -> nn.Module:
    """What runs the forward: the model, or under torchrun its DDP wrapper over the parameters that
    train now (built again whenever that set changes)."""
    if not ctx.dist.enabled:
        return ctx.model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(ctx.model, device_ids=ids, broadcast_buffers=False)


def _epochs(ctx: StageContext, stage, train, val, cfg: TrainConfig, pool: bool, seed: int, optimizer, start, engine):
    """The epochs from ``start``; the last one's record (None when there was none left to run).

    A task's first ``cfg.head_epochs`` epochs train with :func:`feature_weights` frozen (their
    gradients stay None, so the optimiser leaves them and their momentum alone)."""
    model = ctx.model
    frozen = feature_weights(model) if not pool and cfg.head_epochs > start else []
    if start:
        ctx.log({"stage": stage, "event": "resumed", "epoch": start})
        if ctx.dist.is_main:  # a resumed run says where it picked up, not only in metrics.jsonl
            print(
                f"{stage}: resumed from its checkpoint after epoch {start} of {cfg.epochs}", file=sys.stderr, flush=True
            )
    record, phase = None, None
    try:
        for epoch in range(start, cfg.epochs):
            head_only = bool(frozen) and epoch < cfg.head_epochs
            if head_only != phase:
                for p in frozen:
                    p.requires_grad_(not head_only)
                net = _wrap(ctx)
                eager = TrainStep(model, net, optimizer, cfg, ctx.device, pool)
                step: TrainStep | GraphedStep = GraphedStep(eager) if cfg.cuda_graph and not pool else eager
                phase = head_only
            lr = cfg.lr * lr_factor(cfg, epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr * group["lr_scale"]
            loader = ctx.loader(train, cfg, True, seed * 1000 + epoch)
            if isinstance(getattr(loader, "sampler", None), DistributedSampler):
                loader.sampler.set_epoch(epoch)
            net.train()
            tic = time.perf_counter()
            sums = train_one_epoch(
                step,
                loader,
                engine=engine,
                desc=f"{stage} {epoch + 1}/{cfg.epochs}" + (" (head)" if head_only else ""),
                progress=ctx.progress and ctx.dist.is_main,
                check=functools.partial(_check_loss, stage, epoch),
            )
            _check_loss(stage, epoch, sums.loss_sum)
            if not pool and cfg.recalibrate_bn and epoch + 1 == cfg.epochs:
                # Running statistics of the kernels the task ends with, not an average over the kernels
                # it switched through (and the previous task's): one pass over every training image
                # (the evaluation loader: in order, no batch dropped, on every rank the whole data).
                # Its forward, in training mode, also brings the indices up to date with the last
                # optimiser step, so the statistics and the stored indices belong together.
                update_bn(ctx.loader(train, cfg, False, 0), model, ctx.device)
            record = {
                "stage": stage,
                "epoch": epoch + 1,
                "lr": lr,
                **sums.read(),
                "commitment": float(commitment_loss(model).detach()),
                "pool_usage": pool_usage(model),
                "seconds": time.perf_counter() - tic,
            }
            if frozen:
                record["head_only"] = head_only
            _end_epoch(ctx, stage, epoch, record, val, cfg, pool, optimizer)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return record


def _nws_buffer_names(model: nn.Module) -> set[str]:
    """The NWS layers' pool and index buffers: equal on every rank, so never averaged."""
    return {
        f"{layer.name}.parametrizations.weight.0.{key}" for layer in nws_layers(model) for key in ("pool", "indices")
    }


def _end_epoch(ctx: StageContext, stage: str, epoch: int, record: dict, val, cfg: TrainConfig, pool: bool, optimizer):
    """After an epoch: reseed unused pool entries (pool learning), average buffers over the ranks,
    validate, checkpoint, then log the epoch's ``record`` (completed in place)."""
    model = ctx.model
    if pool and cfg.reseed_every and (epoch + 1) % cfg.reseed_every == 0 and epoch + 1 < cfg.epochs:
        record["reseeded"] = reseed_unused(model)
    average_buffers(model, ctx.dist, _nws_buffer_names(model))
    if not pool and epoch + 1 == cfg.epochs:
        # The task's last epoch: its state rounded to what the pack stores before it is validated (and
        # checkpointed), so this validation is the stored task's and the trainer's check needs to
        # evaluate only the model rebuilt from the pack (Trainer._finish_task).
        round_state_(model, cfg.state_dtype)
    if val is not None:
        ev = evaluate(model, ctx.loader(val, cfg, False, 0), device=ctx.device, amp=cfg.amp)
        record.update(val_acc=ev["acc"], val_loss=ev["loss"], val_correct=ev["correct"], val_total=ev["total"])
    selected = (epoch + 1) % cfg.checkpoint_every == 0 or epoch + 1 == cfg.epochs
    if ctx.dist.is_main and selected and time.perf_counter() - ctx.last_checkpoint >= cfg.checkpoint_interval:
        save_checkpoint(
            ctx.run.checkpoint_path,
            model,
            optimizer,
            stage=stage,
            epoch=epoch + 1,
            num_classes=head_classes(model),
            record=record,
        )
        ctx.last_checkpoint = time.perf_counter()
    ctx.log(record)  # after the checkpoint: a logged epoch can always be resumed from
    ctx.dist.barrier()
