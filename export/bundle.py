"""Deployment bundles: the shared pool file, index packs and ONNX graphs of a run's tasks.

Layout of a bundle folder::

    pools.safetensors    the run's pool set, written once; ONNX graphs read it as external data
    task_<t>.nwspack     the task's index pack (for PyTorch: nwsconvert.load / apply_task)
    base.nwspack         the base the packs' indices are stored as changes against (the run's
                         model after pool learning; task_0.nwspack for runs with pack_base=task0):
                         the bundle always carries the base a pack needs
    task_<t>.onnx        the task's graph (with --onnx): Reshape(Gather(pool, Cast(indices)))
    switch.onnx          (with --onnx) one graph for every task, indices and state as inputs: the
                         one-session runtime mode feeds it each task's values from its pack
    bundle.json          pool-set hash, data geometry, tasks (name, classes, files and their SHA-256s)

Every file a run names is checked before it is copied (manifest fields, pool
file and packs against the manifest's hashes); ``bundle.json`` records the
hashes the runtime checks in turn (:mod:`nwsconvert.export.bundlefile`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from nwsconvert import PoolSet, RunDir
from nwsconvert.errors import FormatError, NWSError
from nwsconvert.formats.storage import atomic_write_bytes
from nwsconvert.train.loading import build_run_model, load_run_pools, load_task_files
from nwsconvert.train.manifest import Manifest

from .bundlefile import BUNDLE_FORMAT, BUNDLE_VERSION, file_sha256, read_bundle, recipe_sha256
from .onnx_graph import export_onnx
from .switch import SWITCH_FILE, export_switch

__all__ = ["export_bundle", "StaleBundleError", "BUNDLE_FORMAT"]


class StaleBundleError(NWSError, ValueError):
    """The output folder holds a bundle built on another pool set."""


def export_bundle(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    tasks="all",
    *,
    onnx: bool = False,
    trust_code: bool = False,
    exporter: str = "auto",
) -> dict:
    """Write (or extend) the deployment bundle of ``tasks`` of a run.

    Args:
        run_dir: a run directory.
        out_dir: bundle folder (default ``RUN/export``).
        tasks: ``"all"``, a task id or a list of ids.
        onnx: also write ``task_<t>.onnx``.
        trust_code: let a ``<module>:<callable>`` model spec import its code (see
            :func:`nwsconvert.load`); only the ONNX export builds the model.
        exporter: torch's ONNX exporter: ``auto`` (TorchScript, else the torch.export-based one),
            ``torchscript`` or ``dynamo`` (see :func:`nwsconvert.export.export_onnx`).

    Returns:
        The bundle description (also written as ``bundle.json``).

    Raises:
        KeyError: a task the run has not finished (the message lists the finished ones).
        StaleBundleError: ``out_dir`` holds a bundle of another pool set.
        ExportError: torch cannot export the architecture (names the operator).
    """
    run = RunDir(run_dir)
    manifest = run.read()
    out = Path(out_dir) if out_dir is not None else run.path / "export"
    finished = [e.id for e in manifest.tasks]
    ids = finished if tasks == "all" else [tasks] if isinstance(tasks, int) else list(tasks)
    entries = [run.task_entry(manifest, t) for t in ids]
    pools = load_run_pools(run, manifest)
    pool_sha = pools.sha256
    desc_path = out / "bundle.json"
    desc = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "pool_sha256": pool_sha,
        "model": manifest.model.to_dict(),
        "data": {k: v for k, v in manifest.data.items() if k != "job"},
        "tasks": {},
    }
    if desc_path.is_file():
        old = read_bundle(out)
        if old.get("pool_sha256") != pool_sha:
            raise StaleBundleError(
                f"{out} holds a bundle of pool set {str(old.get('pool_sha256'))[:12]}..., this run has {pool_sha[:12]}...: "
                "choose another --out or delete the old bundle"
            )
        desc["tasks"] = old.get("tasks", {})
    out.mkdir(parents=True, exist_ok=True)
    pool_dst = out / "pools.safetensors"
    if not _holds_pools(pool_dst, pool_sha):
        tmp = out / ".pools.safetensors.tmp"
        shutil.copyfile(run.pool_path, tmp)
        os.replace(tmp, pool_dst)
    data = manifest.data
    shape = (data.get("channels", 3), *(data.get("input_size") or [224, 224]))
    common = {  # every graph's metadata
        "nwsconvert.mean": data.get("mean"),
        "nwsconvert.std": data.get("std"),
        "nwsconvert.input_size": list(shape),
        "nwsconvert.pool_sha256": pool_sha,
        "nwsconvert.model": manifest.model.spec,
    }
    for entry in entries:
        t = entry.id
        pack_dst = out / f"task_{t}.nwspack"
        _, src = load_task_files(run, manifest, t, pools)  # checks the file against the manifest (and finds its base)
        if src.base is not None:  # delta-coded: the bundle needs the base file under its name
            base_dst = out / src.base.source.name
            base_bytes = src.base.source.read_bytes()
            if not base_dst.is_file() or base_dst.read_bytes() != base_bytes:
                atomic_write_bytes(base_dst, base_bytes)
        atomic_write_bytes(pack_dst, src.source.read_bytes())
        row = {
            "name": entry.name,
            "num_classes": entry.num_classes,
            "class_names": entry.class_names,
            "pack": pack_dst.name,
            "pack_bytes": pack_dst.stat().st_size,
            "pack_sha256": src.sha256,
        }
        if src.base is not None:
            row.update(base=base_dst.name, base_bytes=base_dst.stat().st_size, base_sha256=src.base.sha256)
        if onnx:
            model = build_run_model(run, manifest, pools, src, trust_code=trust_code).eval()
            meta = {
                "nwsconvert.task": t,
                "nwsconvert.task_name": entry.name,
                "nwsconvert.class_names": entry.class_names or [str(i) for i in range(entry.num_classes)],
                **common,
            }
            info = export_onnx(
                model, out / f"task_{t}.onnx", pool_dst, input_shape=shape, metadata=meta, exporter=exporter
            )
            row.update(
                onnx=f"task_{t}.onnx",
                onnx_bytes=info["bytes"],
                onnx_sha256=file_sha256(out / f"task_{t}.onnx"),
                index_dtype=info["index_dtype"],
                gather_nodes=info["gather_nodes"],
                exporter=info["exporter"],
            )
        desc["tasks"][str(t)] = row
    if onnx:
        desc["switch"] = _export_switch(
            run, manifest, pools, desc, out / SWITCH_FILE, pool_dst, shape, common, trust_code, exporter
        )
    desc["pool_bytes"] = pool_dst.stat().st_size
    atomic_write_bytes(desc_path, (json.dumps(desc, indent=2) + "\n").encode())
    return desc


def _export_switch(
    run: RunDir,
    manifest: Manifest,
    pools: PoolSet,
    desc: dict,
    path: Path,
    pool_dst: Path,
    shape,
    common: dict,
    trust_code: bool,
    exporter: str,
) -> dict:
    """(Re)write ``switch.onnx`` for every task the bundle now holds: its head takes the largest class count."""
    rows = {int(t): row for t, row in desc["tasks"].items() if "onnx" in row}
    widest = max(rows, key=lambda t: (rows[t]["num_classes"], -t))
    _, src = load_task_files(run, manifest, widest, pools)  # may be a task an earlier call exported
    model = build_run_model(run, manifest, pools, src, trust_code=trust_code).eval()
    meta = {"nwsconvert.mode": "switch", "nwsconvert.max_classes": rows[widest]["num_classes"], **common}
    info = export_switch(model, path, pool_dst, input_shape=shape, metadata=meta, exporter=exporter)
    return {
        "onnx": path.name,
        "onnx_bytes": info["bytes"],
        "onnx_sha256": file_sha256(path),
        "max_classes": rows[widest]["num_classes"],
        "gather_nodes": info["gather_nodes"],
        "exporter": info["exporter"],
        "tensors": info["tensors"],
        "tensors_sha256": recipe_sha256(info["tensors"]),
    }


def _holds_pools(path, sha: str) -> bool:
    """Whether ``path`` is an intact pool file of pool set ``sha`` (a damaged one is rewritten)."""
    if not path.is_file():
        return False
    try:
        return PoolSet.load(path).sha256 == sha
    except FormatError:
        return False
