"""The generic task trainer: pool learning, then one task after another, into a run directory.

    model = nwsconvert.convert(timm.create_model("resnet18", num_classes=10))
    trainer = nwsconvert.Trainer(model, "runs/r18", TrainConfig(epochs=10),
                                 model_spec="timm:resnet18")
    trainer.fit_pools(pretrain_data, num_classes=10)         # paper Eq. 3-4
    for t, task in enumerate(tasks):                         # paper Algorithm 1
        trainer.fit_task(t, task.train, task.test, task.num_classes, name=task.name)

Every stage checkpoints after an epoch once ``checkpoint_interval`` seconds
(60) have passed since its start or last checkpoint; a new
``Trainer(..., resume=True)`` on the same directory skips finished stages and
continues the interrupted one from its last checkpoint, or from its start. Under ``torchrun`` the model is wrapped in
DDP; every rank ends a task with the same indices (checked).

The parts: :mod:`.stage` runs a stage's epochs (:mod:`.loop` one epoch and one step),
:mod:`.store` reads and writes the run's files, :mod:`.manifest` is the run's record.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch import nn

from ..core.nwsmodel import _require, set_mode
from ..errors import FormatError, RunExistsError
from ..formats.packs import model_spec_of, round_state_
from .config import TrainConfig
from .distributed import setup
from .evaluation import evaluate, pool_usage
from .graphs import check_graphable
from .heads import resize_head
from .loop import Data, use_deterministic
from .manifest import Manifest
from .rundir import RunDir
from .runlock import RunLock, remove_stale_temporaries
from .stage import StageContext, run_stage, stage_checkpoint
from .store import RunStore

__all__ = ["Trainer", "evaluate", "pool_usage"]


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
        self.device, self.progress = device, progress
        if config is not None:
            check_graphable(config, device, self.dist.enabled)  # before the run directory is made
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
            manifest = self._read_run(resume, config, model_spec)
        else:
            manifest = self._create_run(model, len(layers), config, model_kwargs, data_info)
        self.store = RunStore(self.run, manifest, self.dist, pool_dtype=self.config.pool_dtype)
        if self.config.deterministic:
            self._restore = use_deterministic()
        torch.manual_seed(self.config.seed)
        self.model = model.to(self.device)
        self.stages = StageContext(self.model, self.run, self.dist, self.device, progress)

    def _read_run(self, resume: bool, config: TrainConfig | None, model_spec: str | None) -> Manifest:
        """Take the run already in the directory: refused unless resuming it, with the same model."""
        if not resume:
            self.close()
            raise RunExistsError(
                f"{str(self.run.path)!r} already holds a run: resume it (resume=True, --resume) or choose another directory"
            )
        manifest = self.run.read()
        try:
            self.config = config or TrainConfig.from_recorded(manifest.config)
        except ValueError as e:
            raise FormatError(f"{self.run.manifest_path}: field config: {e}") from None
        if model_spec is not None and model_spec != manifest.model.spec:
            raise ValueError(f"run {str(self.run.path)!r} trains {manifest.model.spec!r}, not {model_spec!r}")
        return manifest

    def _create_run(self, model, layers: int, config, model_kwargs, data_info) -> Manifest:
        """Start a new run: its first manifest, written by the main process before any rank goes on."""
        self.config = config or TrainConfig()
        report = getattr(model, "nws_report", None)
        options = dict(report.options) if report is not None else {}
        manifest = Manifest.new(self._own_spec, model_kwargs, options, layers, data_info, self.config.to_dict())
        if self.dist.is_main:
            self.run.write(manifest)
        self.dist.barrier()
        return manifest

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

    @property
    def manifest(self) -> Manifest:
        """The run's manifest as this process last wrote or read it."""
        return self.store.manifest

    @property
    def run_id(self) -> str | None:
        return self.manifest.run_id

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
        if self.manifest.pools is not None:
            self.stages.log({"stage": "pools", "event": "skipped: already done"})
            self.store.enter_task_state(self.model, None)
            return self.manifest.pools.metrics
        cfg = self.config.for_pools()
        ckpt = stage_checkpoint(self.run, "pools")
        if num_classes is not None and ckpt is None:
            resize_head(self.model, num_classes, torch.Generator().manual_seed(cfg.seed))
        set_mode(self.model, "pool" if cfg.pool_update == "gradient" else "task")
        try:
            metrics = run_stage(self.stages, "pools", train, val, cfg, pool=True, seed=cfg.seed, ckpt=ckpt)
        finally:
            set_mode(self.model, "task")
        self.store.write_pools(self.model, metrics, learned=True)
        return metrics

    # ---------------------------------------------------------------- tasks
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
        temporary weights start as ``config.task_init`` says (the weights pool
        learning ended with, or task ``task-1``'s chosen kernels), BatchNorm
        from task ``task-1``, the pools stay frozen, and the loss is
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
        done = self.manifest.finished
        if task in done:
            self.stages.log({"stage": f"task:{task}", "event": "skipped: already done"})
            return self.manifest.task(task).metrics
        if task != len(done):
            raise ValueError(
                f"tasks are learned in order: the run has finished {len(done)} task(s), so the next is {len(done)}, not {task}"
            )
        stage, cfg = f"task:{task}", self.config
        ckpt = stage_checkpoint(self.run, stage)
        self.store.ensure_pools(self.model)
        if ckpt is None:
            # The state the previous task ended in, from its pack; where the weights are set anew below,
            # the model itself holds it when this process just finished that task (the pack was taken of it).
            if task > 0 and cfg.task_init != "previous" and self.store.holds(self.model, task - 1):
                self.store.reenter(self.model)
            else:
                self.store.enter_task_state(self.model, task - 1 if task > 0 else None)
            if cfg.task_init != "previous":
                self.store.init_weights(self.model, cfg.task_init, cfg.seed)
            resize_head(self.model, num_classes, torch.Generator().manual_seed(cfg.seed + task))
        set_mode(self.model, "task")
        tic = time.perf_counter()
        record = run_stage(self.stages, stage, train, val, cfg, pool=False, seed=cfg.seed + 1 + task, ckpt=ckpt)
        seconds = time.perf_counter() - tic
        meta = {"task": task, "name": name or f"task_{task}", "class_names": class_names}
        return self._finish_task(task, val, num_classes, meta, record, seconds)

    def _finish_task(self, task: int, val: Data, num_classes: int, meta: dict, record: dict, seconds: float) -> dict:
        """Round the state to what the pack stores, write the pack, check that the model rebuilt from
        it scores exactly what the trained model scores, and commit the task to the manifest."""
        cfg = self.config
        model = round_state_(self.model, cfg.state_dtype)  # what the pack stores (the last epoch rounded it already)
        val_loader = self.stages.loader(val, cfg, False, 0)  # sequential: both evaluations see the same batches
        if record.get("epoch") == cfg.epochs and record.get("val_correct") is not None:
            # This process's last epoch validated this model as it is now (its state rounded, nothing trained
            # since), with this loader and these settings: its figures, not a second pass.
            ev = {"acc": record["val_acc"], "correct": record["val_correct"], "total": record["val_total"]}
        else:  # a record restored from a checkpoint (run_stage drops its counts): evaluated here
            ev = evaluate(model, val_loader, device=self.device, amp=cfg.amp)
        pack, path, sha = self.store.write_pack(model, task, meta, state_dtype=cfg.state_dtype, pack_base=cfg.pack_base)
        trusted = self.manifest.model.spec == self._own_spec
        rebuilt = self.store.rebuild(path, task, sha, model, trusted=trusted).to(self.device).eval()
        ev2 = evaluate(rebuilt, val_loader, device=self.device, amp=cfg.amp)
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
            "epochs": cfg.epochs,
            "seconds": seconds,
            "pool_usage": pool_usage(model),
        }
        self.store.commit_task(task, meta, num_classes, pack, path, sha, metrics, model=model)
        return metrics
