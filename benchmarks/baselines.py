"""The continual-learning methods NWS is compared with (issue 16), on any model the trainer accepts.

Every method starts from the same pretrained model, trains with the same
recipe (:class:`nwsconvert.TrainConfig`: optimiser, learning rate, schedule,
batch size, epochs, data-order seeds), stores each task in safetensors files
(:func:`nwsconvert.formats.storage.write_tensors`: atomic, hashed, no pickle) and
evaluates a task by rebuilding the model from those files only, so the memory
a method reports is what it stored and the accuracy is what a reload gives.

``DenseFinetune``
    one full model per task; task t starts from task t-1's weights.
``BNHead``
    the pretrained backbone frozen; per task only BatchNorm affine parameters,
    statistics and the head are trained and stored (the memory floor: NWS stores
    these too).
``PackNet`` (Mallya & Lazebnik, CVPR 2018), the NWS paper's setting
    train the free weights, prune 60 % of them by magnitude, retrain the kept
    ones; weights owned by earlier tasks never change. One shared map of owner
    task ids per weight; per-task BatchNorm, biases and head.
``Piggyback`` (Mallya et al., ECCV 2018)
    the pretrained backbone frozen; per task a learned binary mask over every
    conv / linear weight (real-valued scores, thresholded, straight-through
    gradient), stored at one bit per weight, plus BatchNorm, biases and head.
``LoRA`` (``LoRA4``, ``LoRA16``), with the ``peft`` library
    the pretrained backbone frozen; per task rank-r adapters on every conv and
    linear layer but the head, plus BatchNorm and head.

Memory, two ways (:meth:`Method.memory`): ``disk_bytes``, the files' sizes; and
``paper_bits``, the NWS paper's accounting (32 bits per stored float, the
owner map at ``ceil(log2(T + 1))`` bits per weight).

    method = PackNet(pretrained, folder, cfg, seed=1993)
    for t, task in enumerate(suite.tasks):
        acc = method.learn(t, task)          # trained, stored, re-loaded and evaluated
    method.evaluate(0, suite.tasks[0].test)  # from the files, after every later task
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, RandomSampler

from nwsconvert import evaluate, resize_head
from nwsconvert.formats.storage import read_tensors, write_tensors
from nwsconvert.train.config import TrainConfig, lr_factor
from nwsconvert.train.heads import find_head
from nwsconvert.train.loop import param_groups

__all__ = ["fit", "Method", "DenseFinetune", "BNHead", "PackNet", "Piggyback", "LoRA4", "LoRA16", "METHODS"]

FORMAT = "nwsconvert.baseline"
VERSION = 1
FREE = 255  # PackNet owner map: a weight no task owns yet


def fit(
    model: nn.Module, data, cfg: TrainConfig, epochs: int, lr: float, seed: int, *, params=None, after_step=None
) -> None:
    """Train ``model`` on ``data`` with the recipe of ``cfg`` (optimiser, schedule, batch size,
    ``head_lr_scale``: :func:`~nwsconvert.train.loop.param_groups`).

    Args:
        params: the parameters to optimise (default: every parameter that requires grad).
        after_step: called after each optimiser step (PackNet restores the weights it protects).
        seed: seeds each epoch's data order and the global generator (dropout, drop path) with
            ``seed * 1000 + epoch``, so a method's result does not depend on what ran before it in
            the process.
    """
    params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    groups = param_groups(model, params, cfg)  # the head, norms and biases at lr * head_lr_scale, as NWS's
    opt = (
        torch.optim.Adam(groups, lr=lr, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "adam"
        else torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    )
    sched_cfg = cfg.replace(epochs=epochs)
    for epoch in range(epochs):
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(sched_cfg, epoch) * g["lr_scale"]
        loader = _loader(data, cfg, seed * 1000 + epoch)
        torch.manual_seed(seed * 1000 + epoch)
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after_step is not None:
                with torch.no_grad():
                    after_step()


def _loader(data, cfg: TrainConfig, seed: int) -> DataLoader:
    """One epoch's shuffled training batches, as the NWS trainer draws them."""
    return DataLoader(
        data,
        batch_size=cfg.batch_size,
        sampler=RandomSampler(data, generator=torch.Generator().manual_seed(seed)),
        drop_last=len(data) > cfg.batch_size,
    )


def _bn_keys(model: nn.Module) -> set[str]:
    """State-dict keys of every BatchNorm (affine parameters, running statistics, counter)."""
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            out |= {f"{name}.{k}" if name else k for k in m.state_dict()}
    return out


def _head_keys(model: nn.Module) -> set[str]:
    name, head = find_head(model)
    return {f"{name}.{k}" for k in head.state_dict()}


class Method:
    """One continual-learning method: learn tasks in order, store each, evaluate any from its files.

    Args:
        pretrained: the model after pretraining (not modified; each method works on a copy).
        folder: where the method writes its files (created).
        cfg: the recipe, the same as the NWS run's.
        seed: as the NWS run's; task t's data order uses ``seed + 1 + t``.
    """

    name = "method"
    restart = False  # True: every task starts from the pretrained model; False: from the previous task's

    def __init__(self, pretrained: nn.Module, folder: str | os.PathLike, cfg: TrainConfig, seed: int):
        self.skeleton = copy.deepcopy(pretrained).cpu().eval()
        self.model = copy.deepcopy(pretrained).cpu()
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.seed = seed
        self.classes: dict[int, int] = {}
        self.files: set[str] = set()

    # ------------------------------------------------------------- files
    def _write(self, name: str, tensors: dict, **fields) -> None:
        write_tensors(
            self.folder / name,
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            FORMAT,
            VERSION,
            method=self.name,
            **fields,
        )
        self.files.add(name)

    def _read(self, name: str) -> dict:
        tensors, header = read_tensors(self.folder / name, FORMAT, VERSION)
        if header.get("method") != self.name:
            raise ValueError(f"{self.folder / name}: a {header.get('method')} file, expected {self.name}")
        return tensors

    def _fresh(self, t: int) -> nn.Module:
        model = copy.deepcopy(self.skeleton)
        resize_head(model, self.classes[t])
        return model

    # ------------------------------------------------------------- API
    def learn(self, t: int, task) -> float:
        """Train task ``t`` (a :class:`nwsconvert.zoo.Task`), store it, and return its accuracy re-loaded from the files."""
        self.classes[t] = task.num_classes
        start = copy.deepcopy(self.skeleton) if self.restart else self.model
        self.model = resize_head(start, task.num_classes, torch.Generator().manual_seed(self.seed + t))
        self._train(t, task)
        if self.cfg.recalibrate_bn:  # as the NWS trainer does: the statistics of the weights the task ends with
            update_bn(DataLoader(task.train, batch_size=max(self.cfg.batch_size, 256)), self.model)
        self._store(t)
        return self.evaluate(t, task.test)

    def evaluate(self, t: int, test) -> float:
        """Top-1 accuracy of task ``t`` on ``test``, with the model rebuilt from the stored files alone."""
        return evaluate(self.load(t), test)["acc"]

    def load(self, t: int) -> nn.Module:
        raise NotImplementedError

    def _train(self, t: int, task) -> None:
        raise NotImplementedError

    def _store(self, t: int) -> None:
        raise NotImplementedError

    def memory(self) -> dict:
        """``{'disk_bytes': the files' sizes, 'paper_bits': the paper's accounting}`` for the tasks learnt so far."""
        return {
            "disk_bytes": sum((self.folder / f).stat().st_size for f in self.files),
            "paper_bits": self._paper_bits(),
        }

    def _paper_bits(self) -> int:
        raise NotImplementedError


def _numel(tensors: dict) -> int:
    return sum(int(v.numel()) for k, v in tensors.items() if not k.endswith("num_batches_tracked"))


class DenseFinetune(Method):
    """One full model per task; task t starts from task t-1's weights."""

    name = "dense"

    def _train(self, t, task):
        fit(self.model, task.train, self.cfg, self.cfg.epochs, self.cfg.lr, self.seed + 1 + t)

    def _store(self, t):
        self._write(f"task_{t}.safetensors", self.model.state_dict(), task=t)

    def load(self, t):
        model = self._fresh(t)
        model.load_state_dict(self._read(f"task_{t}.safetensors"))
        return model.eval()

    def _paper_bits(self):
        return sum(32 * _numel(self._read(f"task_{t}.safetensors")) for t in self.classes)


class BNHead(Method):
    """The pretrained backbone frozen; per task, BatchNorm (affine + statistics) and the head trained and stored."""

    name = "bn_head"
    restart = True

    def __init__(self, pretrained, folder, cfg, seed):
        super().__init__(pretrained, folder, cfg, seed)
        self.task_keys = _bn_keys(self.skeleton) | _head_keys(self.skeleton)
        shared = {k: v for k, v in self.skeleton.state_dict().items() if k not in self.task_keys}
        self._write("backbone.safetensors", shared)

    def _train(self, t, task):
        trainable = [p for n, p in self.model.named_parameters() if n in self.task_keys]
        for p in self.model.parameters():
            p.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)
        fit(self.model, task.train, self.cfg, self.cfg.epochs, self.cfg.lr, self.seed + 1 + t, params=trainable)

    def _store(self, t):
        self._write(
            f"task_{t}.safetensors", {k: v for k, v in self.model.state_dict().items() if k in self.task_keys}, task=t
        )

    def load(self, t):
        model = self._fresh(t)
        model.load_state_dict({**self._read("backbone.safetensors"), **self._read(f"task_{t}.safetensors")})
        return model.eval()

    def _paper_bits(self):
        return 32 * _numel(self._read("backbone.safetensors")) + sum(
            32 * _numel(self._read(f"task_{t}.safetensors")) for t in self.classes
        )


class PackNet(Method):
    """Iterative pruning: each task keeps ``1 - prune`` of the weights still free, which later tasks never change.

    Args:
        prune: fraction of the free weights released after each task (the paper's setting: 0.6).
        retrain_epochs: epochs of retraining the kept weights after pruning (default ``max(1, epochs // 2)``).
    """

    name = "packnet"

    def __init__(self, pretrained, folder, cfg, seed, *, prune: float = 0.6, retrain_epochs: int | None = None):
        super().__init__(pretrained, folder, cfg, seed)
        if not 0 < prune < 1:
            raise ValueError(f"prune must be in (0, 1), got {prune}")
        self.prune = prune
        self.retrain_epochs = retrain_epochs if retrain_epochs is not None else max(1, cfg.epochs // 2)
        head = _head_keys(self.skeleton)
        self.prunable = [n for n, p in self.model.named_parameters() if p.dim() >= 2 and n not in head]
        self.owner = {
            n: torch.full_like(dict(self.model.named_parameters())[n], FREE, dtype=torch.uint8) for n in self.prunable
        }

    def _protect(self, trained: int | None = None):
        """``after_step``: put back every prunable weight the phase may not change: the weights earlier
        tasks own (``trained=None``: training the free weights), or every weight but task ``trained``'s
        (retraining after pruning: the released ones stay zero)."""
        params = dict(self.model.named_parameters())
        frozen = {}
        for n in self.prunable:
            owner = self.owner[n]
            fixed = (owner != FREE) if trained is None else (owner != trained)
            frozen[n] = (fixed, params[n].detach().clone())

        def restore():
            for n, (fixed, saved) in frozen.items():
                params[n].data[fixed] = saved[fixed]

        return restore

    def _train(self, t, task):
        if len(self.classes) > FREE:
            raise ValueError(f"PackNet's owner map holds at most {FREE} tasks")
        # 1. train the free weights (and this task's BatchNorm, biases and head); earlier tasks' weights stay.
        fit(
            self.model,
            task.train,
            self.cfg,
            self.cfg.epochs,
            self.cfg.lr,
            self.seed + 1 + t,
            after_step=self._protect(),
        )
        # 2. keep the largest (1 - prune) of the free weights per layer for task t; release and zero the rest.
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n in self.prunable:
                free = self.owner[n] == FREE
                k = int(round((1 - self.prune) * int(free.sum())))
                if k:  # exactly k: the k largest magnitudes (ties at zero included) by index
                    where = free.flatten().nonzero().squeeze(1)
                    top = torch.topk(params[n].detach().abs().flatten()[where], k).indices
                    self.owner[n].view(-1)[where[top]] = t
                params[n].data[self.owner[n] == FREE] = 0.0
        # 3. retrain task t's weights only (earlier tasks' fixed, released ones at zero).
        fit(
            self.model,
            task.train,
            self.cfg,
            self.retrain_epochs,
            self.cfg.lr,
            self.seed + 1 + t,
            after_step=self._protect(trained=t),
        )

    def free_fraction(self) -> float:
        """The share of the prunable weights no task owns yet: what later tasks can still train."""
        free = sum(int((o == FREE).sum()) for o in self.owner.values())
        return free / sum(o.numel() for o in self.owner.values())

    def _store(self, t):
        state = self.model.state_dict()
        shared = {n: state[n] for n in self.prunable}
        shared.update({f"owner/{n}": self.owner[n] for n in self.prunable})
        self._write("shared.safetensors", shared, tasks=sorted(self.classes))  # rewritten: only free weights changed
        self._write(f"task_{t}.safetensors", {k: v for k, v in state.items() if k not in self.prunable}, task=t)

    def load(self, t):
        model = self._fresh(t)
        shared = self._read("shared.safetensors")
        weights = {}
        for n in self.prunable:
            owner = shared[f"owner/{n}"]
            weights[n] = torch.where((owner <= t) & (owner != FREE), shared[n], torch.zeros((), dtype=shared[n].dtype))
        model.load_state_dict({**weights, **self._read(f"task_{t}.safetensors")})
        return model.eval()

    def _paper_bits(self):
        shared = self._read("shared.safetensors")
        n = sum(int(shared[name].numel()) for name in self.prunable)
        mask_bits = math.ceil(math.log2(len(self.classes) + 1))
        return 32 * n + mask_bits * n + sum(32 * _numel(self._read(f"task_{t}.safetensors")) for t in self.classes)


class _Mask(nn.Module):
    """Parametrization ``weight = W * (score > threshold)``, gradient to ``score`` straight through (``W * grad``)."""

    def __init__(self, shape, init: float, threshold: float):
        super().__init__()
        self.score = nn.Parameter(torch.full(shape, init))
        self.threshold = threshold

    def binary(self) -> torch.Tensor:
        return (self.score > self.threshold).to(self.score.dtype)

    def forward(self, weight):
        hard = self.binary()
        return weight * (hard + (self.score - self.score.detach()))  # == weight * hard in value, exactly


class Piggyback(Method):
    """Learned binary masks over the frozen pretrained weights: one bit per weight per task.

    Args:
        init, threshold: mask scores start at ``init`` (all weights on), a weight is on while its score
            exceeds ``threshold`` (the paper's 1e-2 and 5e-3).
    """

    name = "piggyback"
    restart = True

    def __init__(self, pretrained, folder, cfg, seed, *, init: float = 1e-2, threshold: float = 5e-3):
        super().__init__(pretrained, folder, cfg, seed)
        self.init, self.threshold = init, threshold
        head = _head_keys(self.skeleton)
        self.masked = [n for n, p in self.skeleton.named_parameters() if p.dim() >= 2 and n not in head]
        shared = {n: p for n, p in self.skeleton.state_dict().items() if n in self.masked}
        self._write("backbone.safetensors", shared)

    def _train(self, t, task):
        head = _head_keys(self.model)
        for n, p in self.model.named_parameters():  # per task: BatchNorm, biases, head; the weights only through masks
            p.requires_grad_(p.dim() < 2 or n in head)
        for n in self.masked:
            owner, _, attr = n.rpartition(".")
            module = self.model.get_submodule(owner)
            module.weight.requires_grad_(False)
            parametrize.register_parametrization(module, attr, _Mask(module.weight.shape, self.init, self.threshold))
        fit(self.model, task.train, self.cfg, self.cfg.epochs, self.cfg.lr, self.seed + 1 + t)

    def _masks(self) -> dict:
        out = {}
        for n in self.masked:
            owner, _, attr = n.rpartition(".")
            mask = self.model.get_submodule(owner).parametrizations[attr][0].binary().to(torch.uint8)
            out[f"mask/{n}"] = torch.from_numpy(np.packbits(mask.flatten().numpy(), bitorder="little"))
        return out

    def _store(self, t):
        state = self.model.state_dict()
        own = {k: v for k, v in state.items() if ".parametrizations." not in k}
        self._write(f"task_{t}.safetensors", {**own, **self._masks()}, task=t)

    def load(self, t):
        model = self._fresh(t)
        backbone, stored = self._read("backbone.safetensors"), self._read(f"task_{t}.safetensors")
        state = {k: v for k, v in stored.items() if not k.startswith("mask/")}
        for n in self.masked:
            bits = np.unpackbits(stored[f"mask/{n}"].numpy(), count=backbone[n].numel(), bitorder="little")
            state[n] = backbone[n] * torch.from_numpy(bits.astype(np.float32)).view(backbone[n].shape)
        model.load_state_dict(state)
        return model.eval()

    def _paper_bits(self):
        backbone = self._read("backbone.safetensors")
        weights = sum(int(v.numel()) for v in backbone.values())
        bits = 32 * weights
        for t in self.classes:
            stored = self._read(f"task_{t}.safetensors")
            bits += weights + 32 * _numel({k: v for k, v in stored.items() if not k.startswith("mask/")})
        return bits


_PEFT_SHIMS: dict = {}


def _peft_constructible(module: nn.Module) -> None:
    """Let peft build adapter layers of ``module``'s class.

    peft makes a conv adapter's layers with ``type(base)(in, out, kernel, stride, padding)``. A Conv2d
    subclass with another constructor (``efficientnet_lite_pytorch``'s ``Conv2dStaticSamePadding``
    takes ``image_size`` there and pads in its forward with ``static_padding``) gets a subclass that
    is built like ``nn.Conv2d`` with no padding of its own; ``module`` itself keeps its forward and state.
    """
    cls = type(module)
    if not isinstance(module, nn.Conv2d) or cls is nn.Conv2d or cls.__init__ is nn.Conv2d.__init__:
        return
    if cls not in _PEFT_SHIMS:

        def __init__(self, *args, **kwargs):
            nn.Conv2d.__init__(self, *args, **kwargs)
            self.static_padding = nn.Identity()

        _PEFT_SHIMS[cls] = type(f"{cls.__name__}ForPeft", (cls,), {"__init__": __init__})
    module.__class__ = _PEFT_SHIMS[cls]


class LoRA(Method):
    """Rank-``r`` LoRA adapters (``peft``) on every conv and linear layer but the head; per task the
    adapters, BatchNorm and head are trained and stored, the pretrained backbone is shared."""

    name = "lora"
    restart = True
    rank = 4

    def __init__(self, pretrained, folder, cfg, seed):
        super().__init__(pretrained, folder, cfg, seed)
        self.head_name, _ = find_head(self.skeleton)
        # Grouped convolutions (depthwise) are left out: peft gives the up-projection the base layer's
        # groups, which the rank must divide.
        self.targets = [
            n
            for n, m in self.skeleton.named_modules()
            if isinstance(m, (nn.Conv2d, nn.Linear)) and n != self.head_name and getattr(m, "groups", 1) == 1
        ]
        self._write(
            "backbone.safetensors",
            {k: v for k, v in self.skeleton.state_dict().items() if k not in _head_keys(self.skeleton)},
        )

    def _key(self, key: str) -> str:
        """The peft model's state-dict key of the plain model's ``key`` (adapted layers keep theirs in ``base_layer``)."""
        owner, _, attr = key.rpartition(".")
        return f"base_model.model.{owner}.base_layer.{attr}" if owner in self.targets else f"base_model.model.{key}"

    def _adapted(self, model: nn.Module, seed: int | None):
        """``model`` (the pretrained one, head sized for the task) with adapters: ``(peft model, keys a task stores)``."""
        from peft import LoraConfig, get_peft_model

        if seed is not None:
            torch.manual_seed(seed)  # peft draws lora_A from the global generator
        config = LoraConfig(
            r=self.rank, lora_alpha=self.rank, lora_dropout=0.0, target_modules=self.targets, bias="none"
        )
        for name in self.targets:
            _peft_constructible(model.get_submodule(name))
        model = get_peft_model(model, config)
        for name in self.targets:  # the down-projection pads its input as the layer it adapts does
            layer = model.get_submodule(f"base_model.model.{name}")
            if isinstance(getattr(layer.base_layer, "static_padding", None), nn.Module):
                for down in layer.lora_A.values():
                    down.static_padding = layer.base_layer.static_padding
        own = {self._key(k) for k in _bn_keys(self.skeleton)} | {
            f"base_model.model.{k}" for k in _head_keys(self.skeleton)
        }
        for n, p in model.named_parameters():
            if n in own:
                p.requires_grad_(True)
        keys = {n for n, p in model.named_parameters() if p.requires_grad} | (own & set(model.state_dict()))
        return model, keys

    def _train(self, t, task):
        self.model, self.task_keys = self._adapted(self.model, self.seed + t)
        fit(self.model, task.train, self.cfg, self.cfg.epochs, self.cfg.lr, self.seed + 1 + t)

    def _store(self, t):
        self._write(
            f"task_{t}.safetensors", {k: v for k, v in self.model.state_dict().items() if k in self.task_keys}, task=t
        )

    def load(self, t):
        model, keys = self._adapted(self._fresh(t), None)
        stored = self._read(f"task_{t}.safetensors")
        if set(stored) != keys:
            raise ValueError(
                f"{self.folder / f'task_{t}.safetensors'}: holds {len(stored)} tensors, the adapted model takes {len(keys)}"
            )
        state = {self._key(k): v for k, v in self._read("backbone.safetensors").items()}
        state.update(stored)
        model.load_state_dict(state)
        return model.eval()

    def _paper_bits(self):
        bits = 32 * _numel(self._read("backbone.safetensors"))
        return bits + sum(32 * _numel(self._read(f"task_{t}.safetensors")) for t in self.classes)


class LoRA4(LoRA):
    name, rank = "lora4", 4


class LoRA16(LoRA):
    name, rank = "lora16", 16


METHODS = {m.name: m for m in (DenseFinetune, BNHead, PackNet, Piggyback, LoRA4, LoRA16)}
