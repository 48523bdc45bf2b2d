"""Training hyperparameters: :class:`TrainConfig` and its learning-rate schedule.

Named recipes with the paper's settings live in ``nwsconvert.zoo.recipes``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..errors import UsageError

__all__ = ["TrainConfig", "lr_factor", "BEFORE_OPTION"]

#: Options added since run directories and results were first recorded, with the behaviour a
#: recorded configuration that predates them ran (``TrainConfig.from_recorded`` fills them in): a
#: default chosen later must not change a run half-way.
BEFORE_OPTION = {
    "head_epochs": 0,
    "recalibrate_bn": False,
    "pool_dtype": "float32",
    "cuda_graph": False,
    "engine_graph": False,
}

# field -> (kind, lower bound, upper bound); None bounds are open. "float" accepts integers too.
_RANGES = {
    "lr": ("float", 0.0, None),
    "momentum": ("float", 0.0, 1.0),
    "nesterov": ("bool", None, None),
    "weight_decay": ("float", 0.0, None),
    "epochs": ("int", 1, None),
    "head_epochs": ("int", 0, None),
    "head_lr_scale": ("float", 0.0, None),
    "recalibrate_bn": ("bool", None, None),
    "cuda_graph": ("bool", None, None),
    "engine_graph": ("bool", None, None),
    "milestones": ("ints", 0, None),
    "gamma": ("float", 0.0, None),
    "batch_size": ("int", 1, None),
    "commitment": ("float", 0.0, None),
    "beta": ("float", 0.0, None),
    "ema_decay": ("float", 0.0, 1.0),
    "pool_epochs": ("int?", 1, None),
    "pool_lr": ("float?", 0.0, None),
    "reseed_every": ("int", 0, None),
    "seed": ("int", 0, 2**63 - 1),
    "deterministic": ("bool", None, None),
    "num_workers": ("int", 0, None),
    "checkpoint_every": ("int", 1, None),
    "checkpoint_interval": ("float", 0.0, None),
}
_POSITIVE = ("lr", "gamma", "pool_lr", "head_lr_scale")  # strictly above their lower bound


def _check_types(config) -> None:
    """Every field of the right type and in range, with a message a command-line user can act on."""
    for key, (kind, lo, hi) in _RANGES.items():
        value = getattr(config, key)
        if kind.endswith("?"):
            if value is None:
                continue
            kind = kind[:-1]
        if kind == "ints":
            if isinstance(value, int) and not isinstance(value, bool):
                raise UsageError(f"{key}={value!r}: give a list of epochs, e.g. {key}=[{value}]")
            ok = isinstance(value, (list, tuple)) and all(type(v) is int and v >= lo for v in value)
            what = "a list of whole epochs >= 0, e.g. [50, 80]"
        elif kind == "bool":
            ok, what = type(value) is bool, "true or false"
        elif kind == "int":
            ok = type(value) is int and (lo is None or value >= lo) and (hi is None or value <= hi)
            what = f"a whole number >= {lo}" if hi is None or hi > 2**62 else f"a whole number in [{lo}, {hi}]"
        else:
            ok = type(value) in (int, float) and math.isfinite(value)
            ok = ok and (value > lo if key in _POSITIVE else value >= lo) and (hi is None or value <= hi)
            what = f"a number {'>' if key in _POSITIVE else '>='} {lo:g}" + (
                f" and <= {hi:g}" if hi is not None else ""
            )
        if not ok:
            raise UsageError(f"{key}={value!r}: expected {what}")


@dataclass
class TrainConfig:
    """Hyperparameters of pool learning and task learning.

    Attributes:
        optimizer: ``sgd`` or ``adam``.
        lr: learning rate of task learning.
        momentum, nesterov, weight_decay: SGD / Adam options.
        epochs: epochs per task.
        head_epochs: the first this many of a task's ``epochs`` train only the head, the
            normalisation layers and the biases: the kernels (and any weight of two or more
            dimensions outside the head) stay where ``task_init`` put them, so no index changes;
            the remaining epochs train everything (linear probing, then fine-tuning). 0: every
            epoch trains everything. Pool learning is not affected.
        head_lr_scale: task learning trains the head, the normalisation layers and the biases
            (what ``head_epochs`` leaves trainable) at ``lr * head_lr_scale``, the kernels and other
            weights of two or more dimensions at ``lr``, as transfer learning often gives a fresh
            head a larger rate. 1: one rate for everything. Pool learning is not affected.
        recalibrate_bn: after a task's last epoch, recompute every BatchNorm layer's running
            statistics in one pass over every training image of the task, in batches of
            ``max(batch_size, 256)`` (``torch.optim.swa_utils.update_bn``, no gradient), so that
            they describe the kernels the task ends with rather than a moving average over the
            kernels it switched through and the previous task's. On by default since 2026-11-25:
            +0.4 to +11 points for NWS on the measured sequences (``benchmarks/RESULTS.md``);
            ``false`` is the earlier behaviour.
        schedule: ``step`` (÷``gamma`` at each milestone), ``cosine`` or ``constant``.
        milestones: epochs at which ``step`` divides the learning rate.
        gamma: factor applied at each milestone (0.1: ÷10).
        batch_size: per process.
        commitment: weight of the commitment loss ``||W - sg[K]||²`` (paper Eq. 2: 1).
        beta: weight of the weight-distillation loss (paper Eq. 4: 0.5 CIFAR, 0.1 CUB).
        pool_update: ``gradient`` (β-weighted distillation loss) or ``ema`` (the official code's update).
        ema_decay: decay of the EMA update.
        pool_epochs: epochs of pool learning (``None``: ``epochs``).
        pool_lr: learning rate of pool learning (``None``: ``lr``).
        reseed_every: reseed unused pool entries every this many pool-learning epochs (0: never).
        task_init: temporary weights of task t start from ``original`` (the weights after pool
            learning, the same for every task), ``previous`` (task t-1's chosen kernels, the
            paper's choice) or ``random``. BatchNorm and the head start from task t-1's in every
            case (starting them from the end of pool learning too did not help:
            ``benchmarks/probe_task_state.py``).
            ``original`` is the default: it scored higher than ``previous`` in every measured
            comparison (4 sequences x 3 seeds at 3 epochs per task, 1 seed at 15;
            ``benchmarks/RESULTS.md``). A resumed run keeps the value it started with.
        pack_base: what a task pack's indices may be stored as changes against (the smaller of
            that and a standalone coding is kept, per layer): ``pools`` (``base.nwspack``, the
            model at the end of pool learning, shared like the pool file: every task is small
            and independent of the others), ``task0`` (task 0's pack, for tasks 1, 2, ...: the
            smallest total when every task is kept, but every pack then needs task 0) or
            ``none`` (every pack standalone).
        state_dtype: what a task pack stores its float32 non-pool state in (BatchNorm
            affine parameters and statistics, the head's bias, the weights of layers left
            dense, LayerNorm...): ``float16`` (half the
            bytes; the model is rounded to it before the evaluation the pack's accuracy
            is recorded from) or ``float32``.
        pool_dtype: what the pool file stores the pools in: ``float32`` or ``float16`` (half
            the shared pool file; the pools are rounded to it when pool learning ends, before
            the base pack and every task are searched against them, so each task is trained,
            evaluated and rebuilt with the same pools). A resumed run keeps the value it
            started with.
        amp: ``auto`` (bfloat16/float16 autocast on CUDA, off on CPU), ``off``, ``bf16``, ``fp16``
            (given explicitly, also on CPU).
        search: how training keeps indices exact. ``engine``: one update for the whole model
            (:class:`~nwsconvert.core.engine.SearchEngine`: flat buffers, fused Triton search, no host
            sync); ``layer``: each layer's own lazy search (BLAS + NumPy, fastest on CPU);
            ``auto``: ``engine`` on CUDA with Triton, else ``layer``. Both give the same indices.
        cuda_graph: capture each task's training step in a CUDA graph once its shapes and learning
            rate are fixed, and replay it (:mod:`nwsconvert.train.graphs`): one launch a step, the
            same weights and indices as eager steps. Needs CUDA, the search engine with Triton, one
            process and ``amp`` ``off`` or ``bf16``; refused otherwise in one line. Pool learning runs
            eagerly. Off by default.
        engine_graph: keep the step eager but capture the search engine's update (its searches, gathers
            and index copies: some 20 launches and their Python a step) in a CUDA graph and replay it
            (``SearchEngine(graph=True)``): for eager steps that the host, not the GPU, paces. The same
            weights and indices; the graph's temporaries kept (and, for weights other than float32, one
            W-sized buffer through the step). Needs CUDA and the search
            engine with Triton; not with ``cuda_graph`` (whose graph holds the update already).
            Experimental, off by default.
        seed: seeds model init, data order and head rows.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (slower on GPU).
        num_workers: DataLoader workers.
        checkpoint_every: write a resumable checkpoint every this many epochs.
        checkpoint_interval: seconds of training a checkpoint must cover: an epoch that
            ``checkpoint_every`` selects writes one only when at least this long has passed
            since the stage started (or resumed) or last wrote one; 0: every selected epoch.
            A run killed in between resumes from the checkpoint before (or restarts the stage)
            and gives the same result; it loses at most this much training time. A short task
            (a few seconds an epoch) then writes none: its pack follows within seconds, and each
            checkpoint of ResNet-18 (temporary weights + momentum, 90 MB) costs about a third
            of such an epoch.
    """

    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    epochs: int = 100
    head_epochs: int = 0
    head_lr_scale: float = 1.0
    recalibrate_bn: bool = True
    schedule: str = "step"
    milestones: list[int] = field(default_factory=lambda: [50, 80])
    gamma: float = 0.1
    batch_size: int = 32
    commitment: float = 1.0
    beta: float = 0.5
    pool_update: str = "gradient"
    ema_decay: float = 0.99
    pool_epochs: int | None = None
    pool_lr: float | None = None
    reseed_every: int = 1
    task_init: str = "original"
    pack_base: str = "pools"
    state_dtype: str = "float16"
    pool_dtype: str = "float32"
    amp: str = "auto"
    search: str = "auto"
    cuda_graph: bool = False
    engine_graph: bool = False
    seed: int = 1993
    deterministic: bool = False
    num_workers: int = 0
    checkpoint_every: int = 1
    checkpoint_interval: float = 60.0

    def __post_init__(self):
        _check_types(self)
        choices = {
            "optimizer": ("sgd", "adam"),
            "schedule": ("step", "cosine", "constant"),
            "pool_update": ("gradient", "ema"),
            "task_init": ("previous", "original", "random"),
            "pack_base": ("pools", "task0", "none"),
            "state_dtype": ("float16", "float32"),
            "pool_dtype": ("float32", "float16"),
            "amp": ("auto", "off", "bf16", "fp16"),
            "search": ("auto", "engine", "layer"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise UsageError(f"{key}={getattr(self, key)!r}: choose one of {', '.join(allowed)}")
        self.milestones = [int(m) for m in self.milestones]
        if self.head_epochs > self.epochs:
            raise UsageError(
                f"head_epochs={self.head_epochs} is more than epochs={self.epochs}: give at most {self.epochs}"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_recorded(cls, d: dict) -> TrainConfig:
        """A configuration a run recorded (its manifest); options it predates as :data:`BEFORE_OPTION`."""
        return cls.from_dict({**BEFORE_OPTION, **d})

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def for_pools(self) -> TrainConfig:
        """The configuration of the pool-learning stage."""
        epochs = self.pool_epochs or self.epochs
        scale = epochs / self.epochs
        return self.replace(
            epochs=epochs,
            lr=self.pool_lr or self.lr,
            milestones=[max(1, round(m * scale)) for m in self.milestones],
            head_epochs=0,
            head_lr_scale=1.0,
        )


def lr_factor(config: TrainConfig, epoch: int) -> float:
    """Multiplier of the base learning rate during ``epoch`` (0-based)."""
    if config.schedule == "constant":
        return 1.0
    if config.schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * epoch / config.epochs))
    return config.gamma ** sum(epoch >= m for m in config.milestones)
