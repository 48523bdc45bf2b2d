"""What a trainer reads from and writes to its run directory: pools, base, task packs, the
manifest that lists them, and the check that a task rebuilt from its files is the trained task.

    store = RunStore(run, manifest, dist)
    store.write_pools(model, metrics, learned=True)      # pools.safetensors, base.nwspack, manifest
    store.enter_task_state(model, 1)                      # the model as task 1 ended
    pack, path, sha = store.write_pack(model, 2, meta, state_dtype="float16", pack_base="pools")
    store.commit_task(entry, metrics)

Only the main process writes; every write ends with the ranks reading the same manifest.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from torch import nn

from ..core.nwsmodel import load_pools, nws_layers, pool_set
from ..core.pools import POOL_DTYPES, PoolSet
from ..errors import FormatError, UntrustedCodeError
from ..formats.packs import TaskPack, apply_task, extract_task
from ..formats.stfile import file_sha256
from ..formats.storage import read_tensors, write_tensors
from .distributed import DistInfo, gather_strings
from .heads import resize_head
from .loading import build_task_model, check_run_pack, load_run_pack, load_run_pools, run_bases
from .manifest import BaseEntry, Manifest, PoolsEntry, TaskEntry
from .rundir import RunDir

__all__ = ["RunStore", "BASE_WEIGHTS_FORMAT", "BASE_WEIGHTS_VERSION"]


def _state_version(model: nn.Module) -> tuple:
    """The version counters of ``model``'s state entries and indices: any in-place change to them since a
    reading changes it (the temporary weights excluded: a pack does not hold them)."""
    skip = {f"{layer.name}.parametrizations.weight.original" for layer in nws_layers(model)}
    return tuple(t._version for k, t in model.state_dict(keep_vars=True).items() if k not in skip)


BASE_WEIGHTS_FORMAT = "nwsconvert.baseweights"
BASE_WEIGHTS_VERSION = 2  # 2: header_sha256


class RunStore:
    """A run directory's files as one training process sees them.

    Args:
        run: the run directory.
        manifest: its manifest (this object keeps it current).
        dist: the process group (only the main process writes).
        pool_dtype: what a pool file this store writes holds (``float32``, ``float16``); a run's
            existing pool file is read as it is.
    """

    def __init__(self, run: RunDir, manifest: Manifest, dist: DistInfo, pool_dtype: str = "float32"):
        self.run, self.manifest, self.dist = run, manifest, dist
        self.pool_dtype = pool_dtype
        # What every task start and rebuild check would otherwise read, decode or search again:
        self._base_weights: dict[str, torch.Tensor] | None = None  # checkpoints/base_weights.safetensors
        self._init_search: tuple[str, dict[str, tuple]] | None = None  # (pool-set hash, layer -> search state)
        self._base_pack: TaskPack | None = None  # base.nwspack, decoded
        self._skeleton: tuple[str, nn.Module] | None = None  # (pool-set hash, the model the rebuild check builds)
        self._holding: tuple | None = None  # (model id, task, state version): the model a pack was just taken of

    @property
    def run_id(self) -> str | None:
        return self.manifest.run_id

    def commit(self, done: dict) -> None:
        """Main process: write the manifest, log ``done``, drop the stage's checkpoint (:meth:`RunDir.commit_stage`)."""
        self.run.commit_stage(self.manifest, done)

    def sync(self) -> None:
        """After the main process committed a stage: every rank waits for it and reads its manifest."""
        self.dist.barrier()
        if not self.dist.is_main:
            self.manifest = self.run.read()

    # ---------------------------------------------------------------- pools
    def write_pools(self, model: nn.Module, metrics: dict, learned: bool) -> None:
        """The pool file, the base pack and the base weights of ``model`` as pool learning left it.

        The file stores the pools in :attr:`pool_dtype`; ``model``'s pools are rounded to it first
        (and its indices searched again), so the base pack and every later task see exactly the
        pools a model rebuilt from the file holds.
        """
        current = pool_set(model)
        pools = current.astype(POOL_DTYPES[self.pool_dtype])
        if pools.sha256 != current.sha256:
            # Rounded values (or pools a model took from a file of another dtype): the model takes
            # the file's, so that it and every pack built from it share the file's hash; a new search.
            load_pools(model, pools)
        base = extract_task(model, model_spec=self.manifest.model.spec, meta={"stage": "pools"}, run_id=self.run_id)
        self._base_weights = self._init_search = self._base_pack = self._skeleton = None
        if self.dist.is_main:
            sha = pools.save(self.run.pool_path)
            base_sha = base.save(self.run.base_path)
            base_file_sha = file_sha256(self.run.base_path)
            weights: dict[str, torch.Tensor] = {layer.name: layer.weight for layer in nws_layers(model)}
            write_tensors(self.run.base_weights_path, weights, BASE_WEIGHTS_FORMAT, BASE_WEIGHTS_VERSION)
            self.manifest.pools = PoolsEntry(sha, self.run.pool_path.name, pools.nbytes, learned, metrics)
            self.manifest.base = BaseEntry(base_sha, self.run.base_path.name, base.num_classes, base_file_sha)
            self.commit({"stage": "pools", "event": "done", "pool_sha256": sha, **metrics})
        self.sync()

    def pools(self) -> PoolSet:
        """The run's pool file, checked against the manifest's hash."""
        return load_run_pools(self.run, self.manifest)

    def ensure_pools(self, model: nn.Module) -> None:
        """Make sure the run has a pool file (pools as converted when none was learned) and ``model``
        holds it (a float16 file: exactly its values, in the model's float32)."""
        if self.manifest.pools is None:
            self.write_pools(model, {}, learned=False)
            return
        if pool_set(model).sha256 != self.manifest.pools.sha256:
            load_pools(model, self.pools())

    # ---------------------------------------------------------------- packs
    def load_pack(self, task: int | None) -> TaskPack:
        """A finished task's pack (``None``: the base pack, read once), pinned to what the manifest records
        (:func:`~nwsconvert.train.loading.load_run_pack`: file, tensors, run, task, base)."""
        if self.manifest.pools is None or self.manifest.base is None:
            missing = "pools" if self.manifest.pools is None else "base"
            raise FormatError(f"{self.run.manifest_path}: field {missing}: the run records no {missing} entry")
        if task is None and self._base_pack is not None and self._base_pack.sha256 == self.manifest.base.sha256:
            return self._base_pack
        pack = load_run_pack(self.run, self.manifest, task, self.manifest.pools.sha256)
        if task is None:
            self._base_pack = pack
        return pack

    def enter_task_state(self, model: nn.Module, task: int | None) -> None:
        """Load the state a task ended in (``None``: the end of pool learning) into ``model``."""
        self.ensure_pools(model)
        pack = self.load_pack(task)
        if pack.num_classes is not None:
            resize_head(model, pack.num_classes, search=False)  # apply_task sets its indices
        apply_task(model, pack)

    def reenter(self, model: nn.Module) -> None:
        """:meth:`enter_task_state` for a model that :meth:`holds` that task: its indices and state are the
        pack's already; its temporary weights become the chosen kernels, as the pack would set them."""
        with torch.no_grad():
            for layer in nws_layers(model):
                layer.weight.copy_(layer.nws.gather().to(layer.weight.dtype))
                layer.nws.reset_search()

    def holds(self, model: nn.Module, task: int) -> bool:
        """Whether ``model`` is the model task ``task``'s pack was taken of, unchanged since (its indices and
        state are the pack's; its temporary weights are not, they are whatever training left)."""
        return self._holding is not None and self._holding == (id(model), task, _state_version(model))

    def init_weights(self, model: nn.Module, how: str, seed: int) -> None:
        """Set the temporary weights as ``task_init`` says: ``original`` (the weights pool learning
        ended with), ``random`` (PyTorch's default init); anything else leaves them. Search restarts."""
        layers = nws_layers(model)
        if how == "original":
            if self._base_weights is None:  # read once per run and process; a task start copies from memory
                self._base_weights, _ = read_tensors(
                    self.run.base_weights_path, BASE_WEIGHTS_FORMAT, BASE_WEIGHTS_VERSION, hashed_since=2
                )
            copied = []
            with torch.no_grad():
                for layer in layers:
                    saved = self._base_weights[layer.name]
                    if tuple(saved.shape) == tuple(layer.weight.shape):  # the head is resized afterwards
                        layer.weight.copy_(saved)
                        copied.append(layer)
                    else:
                        layer.nws.reset_search()
            self._start_search(copied, pool_set(model).sha256)
            return
        if how == "random":
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for layer in layers:
                    w = layer.weight
                    bound = 1.0 / math.sqrt(max(w[0].numel(), 1))  # PyTorch's default conv / linear init
                    w.copy_(torch.empty(w.shape).uniform_(-bound, bound, generator=gen))
        for layer in layers:
            layer.nws.reset_search()

    def _start_search(self, layers: list, pools: str) -> None:
        """The search state of ``layers`` holding the weights pool learning ended with: searched the first
        time (what the first training forward would do), restored from that search at every later task
        start (the same weights, the same pools: the same indices, references and budgets). ``pools``:
        the pool set's hash."""
        if self._init_search is None or self._init_search[0] != pools:
            states = {}
            for layer in layers:
                layer.nws.full_search(layer.weight)
                states[layer.name] = layer.nws.search_state()
            self._init_search = (pools, states)
            return
        states = self._init_search[1]
        for layer in layers:
            state = states.get(layer.name)
            if state is None:
                layer.nws.full_search(layer.weight)
            else:
                layer.nws.restore_search(state)

    def write_pack(
        self, model: nn.Module, task: int, meta: dict, *, state_dtype: str, pack_base: str
    ) -> tuple[TaskPack, Path, str | None]:
        """Task ``task``'s pack, checked equal on every rank and written by the main process, its indices
        stored against ``pack_base`` (``pools``: the base pack; ``task0``; ``none``).

        Returns:
            ``(pack, path, its SHA-256 on the main process else None)``.
        """
        pack = extract_task(
            model,
            model_spec=self.manifest.model.spec,
            meta=meta,
            run_id=self.run_id,
            task=task,
            state_dtype=state_dtype,
        )
        digests = gather_strings(pack.content_sha256(), self.dist)
        if len(set(digests)) != 1:
            raise RuntimeError(f"task {task}: ranks ended with different indices or state (pack digests {digests})")
        path, sha = self.run.pack_path(task), None
        if self.dist.is_main:
            pack.base = self._pack_base(task, pack_base)  # store what changed against it (see nwsconvert.formats.packs)
            sha = pack.save(path)
        self.dist.barrier()
        return pack, path, sha

    def _pack_base(self, task: int, how: str) -> TaskPack | None:
        if how == "pools":
            return self.load_pack(None)
        if how == "task0" and task != 0 and 0 in self.manifest.finished:
            return self.load_pack(0)
        return None

    def rebuild(self, path: Path, task: int, sha256: str | None, model: nn.Module, *, trusted: bool) -> nn.Module:
        """Task ``task``'s model rebuilt from the files alone: by the manifest's spec (its code imported
        only when ``trusted``), else from a copy of ``model``'s architecture, never its weights."""
        pools = self.pools()
        bases = run_bases(self.run, self.manifest)  # coded against one of the run's own bases
        pack = TaskPack.load(path, bases, sha256=sha256, pool_sha256=pools.sha256, run_id=self.run_id, task=task)
        check_run_pack(self.run, self.manifest, pack, None, f"pack of task {task}")  # its base's bytes
        if self._skeleton is not None and self._skeleton[0] == pools.sha256:
            # The model built for an earlier task's check: every index and state entry comes from this pack.
            net = self._skeleton[1]
            if pack.num_classes is not None:
                resize_head(net, pack.num_classes, search=False)
            return apply_task(net, pack)
        try:
            net = build_task_model(self.manifest.model.to_dict(), pools, pack, trust_code=trusted)
            self._skeleton = (pools.sha256, net)
            return net
        except (ValueError, UntrustedCodeError):  # spec not buildable by name
            net = copy.deepcopy(model)
            apply_task(net, pack)
            return net

    def commit_task(
        self, task: int, meta: dict, num_classes: int, pack: TaskPack, path: Path, sha, metrics, model=None
    ) -> None:
        """Main process: record the finished task in the manifest and commit it; every rank then syncs.
        ``model``: the model the pack was taken of (see :meth:`holds`)."""
        self._holding = (id(model), task, _state_version(model)) if model is not None else None
        if self.dist.is_main:
            nbytes = {"indices": pack.index_bytes, "state": pack.state_bytes, "file": path.stat().st_size}
            file = str(path.relative_to(self.run.path))
            entry = TaskEntry(
                task, meta["name"], num_classes, file, sha, metrics, meta["class_names"], nbytes, file_sha256(path)
            )
            self.manifest.put_task(entry)
            self.commit({"stage": f"task:{task}", "event": "done", **metrics})
        self.sync()
