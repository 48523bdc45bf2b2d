"""The generic task trainer: pool learning, then one task after another, into a run directory.

    model = nwsconvert.convert(timm.create_model("resnet18", num_classes=10))
    trainer = nwsconvert.Trainer(model, "runs/r18", TrainConfig(epochs=10),
                                 model_spec="timm:resnet18")
    trainer.fit_pools(pretrain_data, num_classes=10)         # paper Eq. 3-4
    for t, task in enumerate(tasks):                         # paper Algorithm 1
        trainer.fit_task(t, task.train, task.test, task.num_classes, name=task.name)

Every stage checkpoints after each epoch; a new ``Trainer(..., resume=True)``
on the same directory skips finished stages and continues the interrupted
one from its last checkpoint. Under ``torchrun`` the model is wrapped in
DDP; every rank ends a task with the same indices (checked).
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ..core.engine import search_engine
from ..core.nwsmodel import (
    _require,
    commitment_loss,
    load_pools,
    nws_layers,
    pool_set,
    reseed_unused,
    set_commitment,
    set_mode,
)
from ..core.pools import PoolSet
from ..errors import FormatError, RunExistsError, UntrustedCodeError
from ..formats.packs import TaskPack, apply_task, extract_task, model_spec_of, round_state_
from ..formats.storage import read_tensors, write_tensors
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig, lr_factor
from .distributed import average_buffers, gather_strings, setup
from .heads import head_classes, resize_head
from .loading import build_task_model, load_run_pools
from .loop import Data, TrainStep, autocast_for, make_loader, make_optimizer, train_one_epoch, use_deterministic
from .rundir import RunDir, new_manifest
from .runlock import RunLock, remove_stale_temporaries

__all__ = ["Trainer", "evaluate", "pool_usage"]

BASE_WEIGHTS_FORMAT = "nwsconvert.baseweights"
BASE_WEIGHTS_VERSION = 2  # 2: header_sha256


def pool_usage(model: nn.Module) -> float:
    """Mean over NWS layers of the fraction of pool entries some kernel selects."""
    layers = _require(model)
    used = [torch.unique(layer.nws.indices).numel() / layer.nws.pool_size for layer in layers]
    return sum(used) / len(used)


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Data, *, device: torch.device | str = "cpu", batch_size: int = 256, amp: str = "off"
) -> dict:
    """Top-1 accuracy and mean cross-entropy of ``model`` on ``data`` (eval mode).

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


class Trainer:
    """Pool learning and task learning for a converted model, writing a run directory.

    Args:
        model: a model converted with :func:`nwsconvert.convert`.
        run_dir: where the run lives (see :mod:`nwsconvert.train.rundir`).
        config: hyperparameters; on resume, ``None`` takes the run's own.
        model_spec: how to rebuild the architecture (``timm:resnet18``,
            ``torchvision:resnet18``, ``package.module:factory``); default from the model.
        model_kwargs: keyword arguments of that factory (``in_chans``...).
        data_info: what deployment must know of the input (size, channels,
            normalisation, suite name); stored in the manifest.
        device: default CUDA when present, else CPU (under torchrun: ``cuda:LOCAL_RANK``).
        resume: continue the run already in ``run_dir``.
        progress: show tqdm progress bars (main process only).

    The trainer holds the run's lock (``RUN/.lock``, :mod:`nwsconvert.train.runlock`)
    from construction until :meth:`close` or the end of the process: a second
    process that tries to write the same run is refused.

    Raises:
        RunExistsError: (a ``FileExistsError``) ``run_dir`` holds a run and ``resume`` is false.
        RunLockedError: another process is writing ``run_dir``.
    """

    def __init__(
        self,
        model: nn.Module,
        run_dir: str | os.PathLike,
        config: TrainConfig | None = None,
        *,
        model_spec: str | None = None,
        model_kwargs: dict | None = None,
        data_info: dict | None = None,
        device: str | torch.device | None = None,
        resume: bool = False,
        progress: bool = True,
    ):
        layers = _require(model)
        self.run = RunDir(run_dir)
        device = (
            torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dist = setup(device)
        if self.dist.enabled and device.type == "cuda":
            device = torch.device("cuda", self.dist.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        self.progress = progress
        self.lock = None
        self._restore: Callable[[], None] | None = None  # undoes deterministic=true's process settings
        if self.dist.is_main:
            self.lock = RunLock.acquire(self.run.path)
            remove_stale_temporaries(self.run.path)  # a killed writer's; none is in flight under the lock
        # A spec this process derived from the caller's own model or arguments may be imported to
        # rebuild the model; one read from a manifest only if it is the same (see nwsconvert.train.specs).
        self._own_spec = model_spec or model_spec_of(model)
        existed = self.run.exists()
        self.dist.barrier()  # every rank looks before rank 0 may create the run below
        if existed:
            self._read_run(resume, config, model_spec)
        else:
            self._create_run(model, len(layers), config, model_spec, model_kwargs, data_info)
        if self.config.deterministic:
            self._restore = use_deterministic()
        torch.manual_seed(self.config.seed)
        self.model = model.to(self.device)

    def _read_run(self, resume: bool, config: TrainConfig | None, model_spec: str | None) -> None:
        """Take the run already in the directory: refused unless resuming it, with the same model."""
        if not resume:
            self.close()
            raise RunExistsError(
                f"{str(self.run.path)!r} already holds a run: resume it (resume=True, --resume) or choose another directory"
            )
        self.manifest = self.run.read()
        try:
            self.config = config or TrainConfig.from_dict(self.manifest.get("config") or {})
        except ValueError as e:
            raise FormatError(f"{self.run.manifest_path}: field config: {e}") from None
        recorded = self.manifest["model"]
        if model_spec is not None and model_spec != recorded["spec"]:
            raise ValueError(f"run {str(self.run.path)!r} trains {recorded['spec']!r}, not {model_spec!r}")

    def _create_run(self, model, layers: int, config, model_spec, model_kwargs, data_info) -> None:
        """Start a new run: its first manifest, written by the main process before any rank goes on."""
        self.config = config or TrainConfig()
        report = getattr(model, "nws_report", None)
        self.manifest = new_manifest(
            model_spec or model_spec_of(model),
            model_kwargs,
            dict(report.options) if report is not None else {},
            layers,
            data_info,
            self.config.to_dict(),
        )
        if self.dist.is_main:
            self.run.write(self.manifest)
        self.dist.barrier()

    def close(self) -> None:
        """Release the run's lock (also released when the process ends) and restore the process's
        determinism settings where ``deterministic=true`` changed them."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self._restore is not None:
            self._restore()
            self._restore = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers
    def _log(self, record: dict) -> None:
        if self.dist.is_main:
            self.run.log(record)

    def _sync_manifest(self) -> None:
        """After the main process committed a stage: every rank waits for it and reads its manifest."""
        self.dist.barrier()
        if not self.dist.is_main:
            self.manifest = self.run.read()

    @property
    def run_id(self) -> str | None:
        return self.manifest.get("run_id")

    def _loader(self, data: Data, cfg: TrainConfig, train: bool, seed: int) -> DataLoader:
        return make_loader(data, cfg, train, seed, self.dist, self.device)

    def _nws_buffer_names(self) -> set[str]:
        names = set()
        for layer in nws_layers(self.model):
            for key in ("pool", "indices"):
                names.add(f"{layer.name}.parametrizations.weight.0.{key}")
        return names

    def _checkpoint_for(self, stage: str):
        path = self.run.checkpoint_path
        if not path.is_file():
            return None
        ckpt = load_checkpoint(path)
        return ckpt if ckpt[0].get("stage") == stage else None

    # ------------------------------------------------------------- the loop
    def _train(self, stage: str, train: Data, val: Data | None, cfg: TrainConfig, pool: bool, seed: int, ckpt) -> dict:
        model = self.model
        start = 0
        if ckpt is not None:
            header, state, opt_state = ckpt
            if header.get("num_classes") is not None:
                resize_head(model, int(header["num_classes"]))
            model.load_state_dict(state)
            model.to(self.device)
            for layer in nws_layers(model):
                layer.nws.reset_search()
            start = int(header["epoch"])
            if "rng_state" in header:
                torch.set_rng_state(header["rng_state"])
        optimizer = make_optimizer(self.model, cfg)
        if ckpt is not None:
            optimizer.load_state_dict(ckpt[2])
        set_commitment(model, cfg.commitment)
        engine = search_engine(model, cfg.search)
        try:
            return self._epochs(stage, train, val, cfg, pool, seed, ckpt, optimizer, start, engine)
        finally:
            if engine is not None:
                engine.close()  # the layers' own lazy search goes on from the engine's state

    @staticmethod
    def _check_loss(stage: str, epoch: int, loss_sum: torch.Tensor) -> None:
        """One line for a diverged stage: a NaN or infinite loss makes the running sum non-finite."""
        value = float(loss_sum)
        if not math.isfinite(value):
            raise FloatingPointError(f"{stage}: loss is {value} at epoch {epoch + 1}: lower the learning rate")

    def _epochs(self, stage, train, val, cfg, pool, seed, ckpt, optimizer, start, engine) -> dict:
        """The epochs of a stage from ``start``, on the model as :meth:`_train` prepared it."""
        model = self.model
        net = model
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            net = nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
        step = TrainStep(model, net, optimizer, cfg, self.device, pool)
        record: dict = {"stage": stage, "epoch": start}
        if ckpt is not None and isinstance(ckpt[0].get("record"), dict) and ckpt[0]["record"].get("epoch") == start:
            record = dict(ckpt[0]["record"])  # the checkpointed epoch's metrics: a stage killed after its last
            # checkpoint returns them on resume, as the uninterrupted stage would
        if start:
            self._log({"stage": stage, "event": "resumed", "epoch": start})
        for epoch in range(start, cfg.epochs):
            lr = cfg.lr * lr_factor(cfg, epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loader = self._loader(train, cfg, True, seed * 1000 + epoch)
            if isinstance(getattr(loader, "sampler", None), DistributedSampler):
                loader.sampler.set_epoch(epoch)
            net.train()
            tic = time.perf_counter()
            sums = train_one_epoch(
                step,
                loader,
                engine=engine,
                desc=f"{stage} {epoch + 1}/{cfg.epochs}",
                progress=self.progress and self.dist.is_main,
                check=lambda loss_sum, epoch=epoch: self._check_loss(stage, epoch, loss_sum),
            )
            self._check_loss(stage, epoch, sums.loss_sum)
            record = {
                "stage": stage,
                "epoch": epoch + 1,
                "lr": lr,
                **sums.read(),
                "commitment": float(commitment_loss(model).detach()),
                "pool_usage": pool_usage(model),
                "seconds": time.perf_counter() - tic,
            }
            self._end_epoch(stage, epoch, record, val, cfg, pool, optimizer)
        set_commitment(model, 0.0)
        return record

    def _end_epoch(self, stage: str, epoch: int, record: dict, val, cfg: TrainConfig, pool: bool, optimizer) -> None:
        """After an epoch: reseed unused pool entries (pool learning), average buffers over the ranks,
        validate, checkpoint, then log the epoch's ``record`` (completed in place)."""
        model = self.model
        if pool and cfg.reseed_every and (epoch + 1) % cfg.reseed_every == 0 and epoch + 1 < cfg.epochs:
            record["reseeded"] = reseed_unused(model)
        average_buffers(model, self.dist, self._nws_buffer_names())
        if val is not None:
            ev = evaluate(model, self._loader(val, cfg, False, 0), device=self.device, amp=cfg.amp)
            record.update(val_acc=ev["acc"], val_loss=ev["loss"])
        if self.dist.is_main and ((epoch + 1) % cfg.checkpoint_every == 0 or epoch + 1 == cfg.epochs):
            save_checkpoint(
                self.run.checkpoint_path,
                model,
                optimizer,
                stage=stage,
                epoch=epoch + 1,
                num_classes=head_classes(model),
                record=record,
            )
        self._log(record)  # after the checkpoint: a logged epoch can always be resumed from
        self.dist.barrier()

    # ---------------------------------------------------------------- pools
    def fit_pools(self, train: Data, val: Data | None = None, *, num_classes: int | None = None) -> dict:
        """Learn the pools together with the temporary weights (paper Eq. 3-4).

        Loss: cross-entropy + commitment + ``beta`` x weight distillation
        (``pool_update='gradient'``), or cross-entropy + commitment with an EMA
        pool update (``'ema'``). Unused pool entries are reseeded every
        ``reseed_every`` epochs. Writes the pool file and the base pack.

        Args:
            train, val: the pretraining data (a Dataset of ``(image, label)`` or a DataLoader).
            num_classes: classes of the pretraining data (the head is resized to it).

        Returns:
            The last epoch's metrics (the recorded ones when the run already has pools).
        """
        if self.manifest["pools"] is not None:
            self._log({"stage": "pools", "event": "skipped: already done"})
            self._enter_task_state(None)
            return self.manifest["pools"]["metrics"]
        cfg = self.config.for_pools()
        ckpt = self._checkpoint_for("pools")
        if num_classes is not None and ckpt is None:
            resize_head(self.model, num_classes, torch.Generator().manual_seed(cfg.seed))
        set_mode(self.model, "pool" if cfg.pool_update == "gradient" else "task")
        try:
            metrics = self._train("pools", train, val, cfg, pool=True, seed=cfg.seed, ckpt=ckpt)
        finally:
            set_mode(self.model, "task")
        self._write_pools(metrics, learned=True)
        return metrics

    def _write_pools(self, metrics: dict, learned: bool) -> None:
        pools = pool_set(self.model)
        base = extract_task(
            self.model, model_spec=self.manifest["model"]["spec"], meta={"stage": "pools"}, run_id=self.run_id
        )
        if self.dist.is_main:
            sha = pools.save(self.run.pool_path)
            base_sha = base.save(self.run.base_path)
            write_tensors(
                self.run.base_weights_path,
                {layer.name: layer.weight for layer in nws_layers(self.model)},
                BASE_WEIGHTS_FORMAT,
                BASE_WEIGHTS_VERSION,
            )
            self.manifest["pools"] = {
                "file": self.run.pool_path.name,
                "sha256": sha,
                "bytes": pools.nbytes,
                "learned": learned,
                "metrics": metrics,
            }
            self.manifest["base"] = {
                "file": self.run.base_path.name,
                "sha256": base_sha,
                "num_classes": base.num_classes,
            }
            self.run.commit_stage(self.manifest, {"stage": "pools", "event": "done", "pool_sha256": sha, **metrics})
        self._sync_manifest()

    def _ensure_pools(self) -> None:
        """Make sure the run has a pool file and that the model holds those pools."""
        if self.manifest["pools"] is None:
            self._write_pools({}, learned=False)  # pools as converted (k-means, random or given)
            return
        want = self.manifest["pools"]["sha256"]
        if pool_set(self.model).sha256 != want:
            load_pools(self.model, self._run_pools())

    def _run_pools(self) -> PoolSet:
        """The run's pool file, checked against the manifest's hash."""
        return load_run_pools(self.run, self.manifest)

    def _load_pack(self, task: int | None) -> TaskPack:
        """A finished task's pack (``None``: the base pack), checked against the manifest: hash, run, task."""
        want = {"pool_sha256": self.manifest["pools"]["sha256"], "run_id": self.run_id}
        if task is None:
            return TaskPack.load(self.run.base_path, sha256=self.manifest["base"]["sha256"], **want)
        entry = self.run.task_entry(self.manifest, task)
        return TaskPack.load(self.run.task_path(self.manifest, task), sha256=entry["sha256"], task=task, **want)

    def _enter_task_state(self, task: int | None) -> None:
        """Load the state a task ends in (``None``: the end of pool learning) into the model."""
        self._ensure_pools()
        pack = self._load_pack(task)
        if pack.num_classes is not None:
            resize_head(self.model, pack.num_classes)
        apply_task(self.model, pack)

    # ---------------------------------------------------------------- tasks
    def _init_weights(self, how: str) -> None:
        layers = nws_layers(self.model)
        if how == "original":
            tensors, _ = read_tensors(
                self.run.base_weights_path, BASE_WEIGHTS_FORMAT, BASE_WEIGHTS_VERSION, hashed_since=2
            )
            with torch.no_grad():
                for layer in layers:
                    saved = tensors[layer.name]
                    if tuple(saved.shape) == tuple(layer.weight.shape):  # the head is resized afterwards
                        layer.weight.copy_(saved)
        elif how == "random":
            gen = torch.Generator().manual_seed(self.config.seed)
            with torch.no_grad():
                for layer in layers:
                    w = layer.weight
                    bound = 1.0 / math.sqrt(max(w[0].numel(), 1))  # PyTorch's default conv / linear init
                    w.copy_(torch.empty(w.shape).uniform_(-bound, bound, generator=gen))
        for layer in layers:
            layer.nws.reset_search()

    def fit_task(
        self,
        task: int,
        train: Data,
        val: Data,
        num_classes: int,
        *,
        name: str | None = None,
        class_names: list[str] | None = None,
    ) -> dict:
        """Learn task ``task`` (paper Algorithm 1) and write its pack.

        The head gets ``num_classes`` outputs (existing rows kept), the
        temporary weights start from task ``task-1``'s chosen kernels (or as
        ``config.task_init`` says), the pools stay frozen, and the loss is
        cross-entropy + commitment. Afterwards the pack is written and the
        model rebuilt from the files is evaluated: its accuracy must equal the
        training-time evaluation exactly.

        Args:
            task: 0, 1, ... in order; a task the run already finished is skipped.
            train, val: the task's data, labels in ``0..num_classes-1``.
            num_classes: v_t.
            name, class_names: recorded in the manifest (deployment shows them).

        Returns:
            Metrics: ``val_acc``, ``rebuilt_acc``, ``train_acc``, ``epochs``, bytes...
        """
        done = {e["id"]: e for e in self.manifest["tasks"]}
        if task in done:
            self._log({"stage": f"task:{task}", "event": "skipped: already done"})
            return done[task]["metrics"]
        if task != len(done):
            raise ValueError(
                f"tasks are learned in order: the run has finished {len(done)} task(s), so the next is {len(done)}, not {task}"
            )
        stage = f"task:{task}"
        cfg = self.config
        ckpt = self._checkpoint_for(stage)
        self._ensure_pools()
        if ckpt is None:
            self._enter_task_state(task - 1 if task > 0 else None)
            if cfg.task_init != "previous":
                self._init_weights(cfg.task_init)
            resize_head(self.model, num_classes, torch.Generator().manual_seed(cfg.seed + task))
        set_mode(self.model, "task")
        tic = time.perf_counter()
        record = self._train(stage, train, val, cfg, pool=False, seed=cfg.seed + 1 + task, ckpt=ckpt)
        seconds = time.perf_counter() - tic
        return self._finish_task(task, val, num_classes, name, class_names, record, seconds)

    def _finish_task(self, task, val, num_classes, name, class_names, record, seconds) -> dict:
        """Round the state to what the pack stores, write the pack, check that the model rebuilt from
        it scores exactly what the trained model scores, and commit the task to the manifest."""
        model = round_state_(self.model, self.config.state_dtype)  # what the pack stores, before it is evaluated
        ev = evaluate(model, self._loader(val, self.config, False, 0), device=self.device, amp=self.config.amp)
        meta = {"task": task, "name": name or f"task_{task}", "class_names": class_names}
        pack, path, sha = self._write_pack(task, meta)
        rebuilt = self._rebuild(path, task, sha)
        ev2 = evaluate(rebuilt, self._loader(val, self.config, False, 0), device=self.device, amp=self.config.amp)
        if ev2["correct"] != ev["correct"]:
            raise RuntimeError(
                f"task {task}: the model rebuilt from {path} scores {ev2['correct']}/{ev2['total']}, "
                f"the trained model {ev['correct']}/{ev['total']}: the pack does not reproduce the task"
            )
        metrics = {
            "val_acc": ev["acc"],
            "val_correct": ev["correct"],
            "val_total": ev["total"],
            "rebuilt_acc": ev2["acc"],
            "train_acc": record.get("train_acc"),
            "train_loss": record.get("train_loss"),
            "epochs": self.config.epochs,
            "seconds": seconds,
            "pool_usage": pool_usage(model),
        }
        if self.dist.is_main:
            entry = {
                "id": task,
                "name": meta["name"],
                "num_classes": num_classes,
                "class_names": class_names,
                "file": str(path.relative_to(self.run.path)),
                "sha256": sha,
                "bytes": {"indices": pack.index_bytes, "state": pack.state_bytes, "file": path.stat().st_size},
                "metrics": metrics,
            }
            self.manifest["tasks"] = [e for e in self.manifest["tasks"] if e["id"] != task] + [entry]
            self.run.commit_stage(self.manifest, {"stage": f"task:{task}", "event": "done", **metrics})
        self._sync_manifest()
        return metrics

    def _write_pack(self, task: int, meta: dict) -> tuple[TaskPack, Path, str | None]:
        """Task ``task``'s pack, checked equal on every rank and written by the main process:
        ``(pack, path, its SHA-256 on the main process else None)``."""
        pack = extract_task(
            self.model,
            model_spec=self.manifest["model"]["spec"],
            meta=meta,
            run_id=self.run_id,
            task=task,
            state_dtype=self.config.state_dtype,
        )
        digests = gather_strings(pack.content_sha256(), self.dist)
        if len(set(digests)) != 1:
            raise RuntimeError(f"task {task}: ranks ended with different indices or state (pack digests {digests})")
        path, sha = self.run.pack_path(task), None
        if self.dist.is_main:
            pack.base = self._pack_base(task)  # store what changed against it (see nwsconvert.formats.packs)
            sha = pack.save(path)
        self.dist.barrier()
        return pack, path, sha

    def _pack_base(self, task: int) -> TaskPack | None:
        """The pack task ``task``'s indices are delta-coded against (``config.pack_base``)."""
        how = self.config.pack_base
        if how == "pools":
            return self._load_pack(None)
        if how == "task0" and task != 0 and any(e["id"] == 0 for e in self.manifest["tasks"]):
            return self._load_pack(0)
        return None

    def _rebuild(self, pack_path, task: int, sha256: str | None) -> nn.Module:
        """The task's model rebuilt from the files alone (by spec; from a copy of the architecture if it has none)."""
        pools = self._run_pools()
        pack = TaskPack.load(pack_path, sha256=sha256, pool_sha256=pools.sha256, run_id=self.run_id, task=task)
        trusted = self.manifest["model"]["spec"] == self._own_spec
        try:
            net = build_task_model(self.manifest["model"], pools, pack, trust_code=trusted)
        except (
            ValueError,
            UntrustedCodeError,
        ):  # spec not buildable by name: reuse the architecture, never the weights
            net = copy.deepcopy(self.model)
            apply_task(net, pack)
        return net.to(self.device).eval()
