"""Rebuild a task's model from a run directory, for PyTorch inference, without the training code.

model = nwsconvert.load("runs/mnist", task=2)               # NWS model, eval mode
dense = nwsconvert.load("runs/mnist", task=2, dense=True)   # ordinary Conv2d / Linear layers
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import nn

from ..conversion.config import NWSConfig
from ..conversion.converter import ConversionError, NWSConverter
from ..core.nwsmodel import materialize
from ..core.pools import PoolSet
from ..errors import FormatError, NWSError, PackMismatchError, UntrustedCodeError
from ..formats.packfile import STANDALONE
from ..formats.packs import TaskPack, apply_task
from ..formats.stfile import file_sha256
from .heads import resize_head
from .manifest import Manifest
from .rundir import RunDir
from .specs import build_model

__all__ = [
    "load",
    "build_task_model",
    "build_run_model",
    "load_task_files",
    "load_run_pack",
    "load_run_pools",
    "run_bases",
    "check_run_pack",
    "check_file_pin",
]


def load_run_pools(run: RunDir, manifest: Manifest) -> PoolSet:
    """The run's pool file, checked against the manifest's pool-set hash.

    Raises:
        FormatError: the run has no pools yet, or the file is not the one the manifest records.
    """
    if manifest.pools is None:
        raise FormatError(f"{run.manifest_path}: the run has no pool set yet (killed before its pools were written?)")
    pools = PoolSet.load(run.pool_path)
    want = manifest.pools.sha256
    if pools.sha256 != want:
        raise FormatError(
            f"{run.pool_path}: pool set {pools.sha256[:12]}..., the manifest records {want[:12]}... (a pool file of another run?)"
        )
    return pools


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    return file_sha256(path)


def check_file_pin(path: Path, want: str | None, what: str, manifest_path: Path) -> None:
    """Refuse ``path`` unless its bytes have the SHA-256 ``want`` (``None``: the manifest predates whole-file
    hashes; nothing to check). Digests are kept per path, modification time and size."""
    if want is None:
        return
    st = path.stat()
    if _file_digest(str(path.resolve()), st.st_mtime_ns, st.st_size) != want:
        raise FormatError(
            f"{path}: not the {what} this run wrote (its bytes do not match the file SHA-256 {manifest_path} "
            "records): edited, or a file of another run"
        )


def _base_entries(run: RunDir, manifest: Manifest) -> dict[str, tuple[Path, str | None, str]]:
    """Content hash -> ``(file, whole-file hash or None, what)`` of each base a pack of this run may be coded
    against: the run's base pack and, once written, task 0's pack (``pack_base=task0``)."""
    entries: dict[str, tuple[Path, str | None, str]] = {}
    if manifest.base is not None:
        path = run.resolve(manifest.base.file, "the base pack") if manifest.base.file else run.base_path
        entries[manifest.base.sha256] = (path, manifest.base.file_sha256, "base pack")
    if 0 in manifest.finished:
        entry = manifest.task(0)
        entries.setdefault(entry.sha256, (run.task_path(manifest, 0), entry.file_sha256, "pack of task 0"))
    return entries


def run_bases(run: RunDir, manifest: Manifest) -> dict[str, Path]:
    """The bases a pack of this run may be coded against, by content hash (``TaskPack.load``'s ``base``)."""
    return {sha: path for sha, (path, _, _) in _base_entries(run, manifest).items()}


def check_run_pack(run: RunDir, manifest: Manifest, pack: TaskPack, pin: str | None, what: str) -> None:
    """After ``pack`` was read through :func:`run_bases`: its file and its base's file are the bytes the run
    wrote (where the manifest records their whole-file hashes)."""
    assert pack.source is not None
    check_file_pin(pack.source, pin, what, run.manifest_path)
    if pack.base is not None and pack.base_sha256 is not None:
        path, base_pin, base_what = _base_entries(run, manifest)[pack.base_sha256]
        check_file_pin(path, base_pin, base_what, run.manifest_path)


def load_run_pack(run: RunDir, manifest: Manifest, task: int | None, pool_sha256: str) -> TaskPack:
    """Task ``task``'s pack of a run (``None``: the base pack), pinned to what the run wrote: the tensors,
    the run, the task, the pool set, the base its indices are changes against (only one of this run's,
    :func:`run_bases`), and the bytes of both files where the manifest records their hashes.

    Raises:
        FileNotFoundError: the file is missing. FormatError: its bytes or its base are not the run's.
        PackMismatchError: the pack of another task, run or pool set.
    """
    if task is None:
        if manifest.base is None:
            raise FormatError(f"{run.manifest_path}: field base: the run records no base pack")
        path = run.resolve(manifest.base.file, "the base pack") if manifest.base.file else run.base_path
        sha, pin, what = manifest.base.sha256, manifest.base.file_sha256, "base pack"
    else:
        entry = run.task_entry(manifest, task)
        path, sha, pin, what = run.task_path(manifest, task), entry.sha256, entry.file_sha256, f"pack of task {task}"
    base = STANDALONE if task is None else run_bases(run, manifest)
    pack = TaskPack.load(path, base, sha256=sha, pool_sha256=pool_sha256, run_id=manifest.run_id, task=task)
    check_run_pack(run, manifest, pack, pin, what)
    return pack


def load_task_files(
    run: RunDir, manifest: Manifest, task: int, pools: PoolSet | None = None
) -> tuple[PoolSet, TaskPack]:
    """The pool set and task ``task``'s pack of a run, each checked against the manifest (:func:`load_run_pack`)."""
    pools = pools if pools is not None else load_run_pools(run, manifest)
    try:
        pack = load_run_pack(run, manifest, task, pools.sha256)
    except PackMismatchError as e:
        raise PackMismatchError(f"{e} [as task {task} of {run.manifest_path}]") from None
    return pools, pack


def build_task_model(
    model_info: dict, pools: PoolSet, pack: TaskPack, model: nn.Module | None = None, *, trust_code: bool = False
) -> nn.Module:
    """A converted model holding ``pack``'s task.

    Args:
        model_info: the manifest's ``model`` entry: ``spec``, ``kwargs``, ``convert`` (the :class:`~nwsconvert.NWSConfig` as a dict).
        pools: the run's pool set.
        pack: the task pack.
        model: an unconverted instance of the architecture to use instead of building ``spec``.
        trust_code: allow a ``<module>:<callable>`` spec (see :mod:`nwsconvert.train.specs`).
    """
    if model is None:
        kwargs = model_info.get("kwargs") or {}
        try:
            model = build_model(model_info["spec"], trust_code=trust_code, **kwargs)
        except NWSError:
            raise
        except Exception as e:  # a factory given recorded kwargs may raise anything (RuntimeError, AssertionError...)
            raise ValueError(
                f"model spec {model_info['spec']!r} cannot be built with kwargs {kwargs} ({type(e).__name__}: {e})"
            ) from None
    # No search at conversion: apply_task sets every index from the pack (checked layer by layer).
    NWSConverter(NWSConfig.from_dict(model_info.get("convert") or {}), init=pools).apply(model, search=False)
    if pack.num_classes is not None:
        resize_head(model, pack.num_classes, search=False)  # apply_task sets its indices
    apply_task(model, pack)
    return model


def build_run_model(
    run: RunDir,
    manifest: Manifest,
    pools: PoolSet,
    pack: TaskPack,
    model: nn.Module | None = None,
    *,
    trust_code: bool = False,
) -> nn.Module:
    """:func:`build_task_model` for a run's manifest; every failure names the manifest.

    Raises:
        UntrustedCodeError: a ``<module>:<callable>`` spec without ``trust_code``.
        FormatError: the recorded model entry cannot be built or converted.
    """
    try:
        return build_task_model(manifest.model.to_dict(), pools, pack, model=model, trust_code=trust_code)
    except UntrustedCodeError as e:
        raise UntrustedCodeError(f"{run.manifest_path}: {e}") from None
    except ConversionError as e:
        raise FormatError(
            f"{run.manifest_path}: field model: the model cannot be converted as recorded ({e})"
        ) from None
    except PackMismatchError as e:
        raise PackMismatchError(f"{e} [model built as {run.manifest_path} records it]") from None
    except NWSError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise FormatError(
            f"{run.manifest_path}: field model: {manifest.model.spec!r} cannot be rebuilt with its recorded "
            f"kwargs and conversion options ({type(e).__name__}: {e})"
        ) from None


def load(
    run_dir: str | os.PathLike,
    task: int,
    *,
    dense: bool = False,
    device: str | torch.device = "cpu",
    model: nn.Module | None = None,
    trust_code: bool = False,
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
        trust_code: let a ``<module>:<callable>`` model spec in the manifest import
            and call its code. Off by default: a run directory from someone else
            is data; ``timm:`` and ``torchvision:`` specs need no trust.

    Every file is checked before it is used: the manifest's fields, the pool file
    against the manifest's hash, the pack against the manifest's hash, the run,
    the task and the pool set; files named by the manifest must lie inside the run.

    Raises:
        FileNotFoundError: no run there. TaskNotFoundError: (a ``KeyError``) no such
        finished task (the message lists them). FormatError: a damaged or edited file
        (named, with the field). PackMismatchError: a pack of another task, run or pool
        set. UntrustedCodeError: a ``<module>:<callable>`` spec without ``trust_code``.
        ValueError: the spec cannot be built.
    """
    run = RunDir(run_dir)
    manifest = run.read()
    pools, pack = load_task_files(run, manifest, task)
    net = build_run_model(run, manifest, pools, pack, model=model, trust_code=trust_code)
    if dense:
        net = materialize(net)
    return net.to(device).eval()
