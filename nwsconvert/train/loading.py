"""Rebuild a task's model from a run directory, for PyTorch inference, without the training code.

model = nwsconvert.load("runs/mnist", task=2)               # NWS model, eval mode
dense = nwsconvert.load("runs/mnist", task=2, dense=True)   # ordinary Conv2d / Linear layers
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..conversion.config import NWSConfig
from ..conversion.converter import ConversionError, NWSConverter
from ..core.nwsmodel import materialize
from ..core.pools import PoolSet
from ..errors import FormatError, NWSError, PackMismatchError, UntrustedCodeError
from ..formats.packs import TaskPack, apply_task
from .heads import resize_head
from .manifest import Manifest
from .rundir import RunDir
from .specs import build_model

__all__ = ["load", "build_task_model", "build_run_model", "load_task_files", "load_run_pools"]


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


def load_task_files(
    run: RunDir, manifest: Manifest, task: int, pools: PoolSet | None = None
) -> tuple[PoolSet, TaskPack]:
    """The pool set and task ``task``'s pack of a run, each checked against the manifest."""
    pools = pools if pools is not None else load_run_pools(run, manifest)
    entry = run.task_entry(manifest, task)
    try:
        pack = TaskPack.load(
            run.task_path(manifest, task),
            sha256=entry.sha256,
            pool_sha256=pools.sha256,
            run_id=manifest.run_id,
            task=task,
        )
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
        resize_head(model, pack.num_classes)
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
