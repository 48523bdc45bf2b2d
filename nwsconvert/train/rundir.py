"""Run directories: the unit users hand around after training.

Layout::

    RUN/
      manifest.json            format, model spec + kwargs + conversion options (and their
                               SHA-256, ``model_sha256``), data info,
                               pool-set hash, tasks (names, classes, metrics, pack hashes),
                               hyperparameters, library versions
      pools.safetensors        the shared pool set
      base.nwspack             the model at the end of pool learning (indices + state); the
                               task packs store their indices as changes against it
      tasks/task_<t>.nwspack   one index pack per task
      metrics.jsonl            one JSON line per epoch and per finished stage
      checkpoints/             resumable state of the stage in progress, base weights

Every file is written atomically (temporary file + rename), the manifest last:
a run killed at any point holds either the old or the new version of each
file, and the manifest only lists files that are complete. One process
writes a run at a time (:class:`nwsconvert.train.runlock.RunLock`, ``RUN/.lock``).

A run directory from someone else is data, never code: :meth:`RunDir.read`
checks every manifest field's type and range, and every file the manifest
names must resolve inside the directory (:meth:`RunDir.resolve`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import uuid
from pathlib import Path

from ..conversion.config import NWSConfig
from ..errors import FormatError, TaskNotFoundError, UsageError
from ..formats.atomic import atomic_write_bytes, disk_error
from ..formats.limits import MAX_FACTORY_INT
from ..formats.schema import Fields, is_relative_inside

__all__ = [
    "RunDir",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "library_versions",
    "check_manifest",
    "TaskNotFoundError",
    "new_run_id",
    "model_sha256",
    "check_data_info",
]

MANIFEST_FORMAT = "nwsconvert.run"
# 2: model_sha256 pins the model entry (spec, kwargs, conversion options); 3: model.convert is a whole
# NWSConfig (nwsconvert.conversion.config); versions 1 and 2 still read.
MANIFEST_VERSION = 3


def model_sha256(model: dict) -> str:
    """SHA-256 of a manifest's ``model`` entry (canonical JSON: sorted keys, no spaces).

    The entry decides the architecture every pack is applied to; an edit to it
    (an ``act_layer``, a ``drop_rate``, a converter option) would rebuild another
    model from the same packs, so readers refuse a manifest whose entry does not
    match the hash written with it.
    """
    text = json.dumps(model, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def new_run_id() -> str:
    """A random identity for a new run; its packs carry it, so a pack of another run is refused."""
    return uuid.uuid4().hex


def new_manifest(spec: str, kwargs: dict | None, convert: dict, layers: int, data: dict | None, config: dict) -> dict:
    """The manifest of a new run, before any stage: a fresh ``run_id``, the model entry (spec, factory
    kwargs, the conversion config as a dict, NWS layer count), data info, the training config and
    library versions. :meth:`RunDir.write` adds the format, version and ``model_sha256``."""
    return {
        "run_id": new_run_id(),
        "model": {"spec": spec, "kwargs": dict(kwargs or {}), "convert": convert, "layers": layers},
        "data": dict(data or {}),
        "config": config,
        "versions": library_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pools": None,
        "base": None,
        "tasks": [],
    }


def check_data_info(f: Fields, key: str = "data") -> None:
    """The ``data`` entry of a manifest or bundle: what the exporter and the runtime read from it."""
    data = f.obj_fields(key, optional=True)
    if data is not None:
        data.int("channels", lo=1, hi=4096, optional=True)
        data.ints("input_size", lo=1, hi=1 << 16, optional=True, max_len=3)
        for name in ("mean", "std"):
            values = data.list(name, optional=True)
            if values is not None and not all(type(v) in (int, float) for v in values):
                raise data.fail(name, "a list of numbers", values)


def check_manifest(manifest: dict, path) -> None:
    """Types and ranges of every manifest field a reader uses (the message names the field).

    Raises:
        FormatError: a field missing, of the wrong type, or out of range.
    """
    f = Fields(manifest, path)
    f.str("run_id", optional=True)
    model = f.obj_fields("model")
    spec = model.str("spec")
    if ":" not in spec:
        raise model.fail("spec", "'timm:<name>', 'torchvision:<name>' or '<module>:<callable>'", spec)
    kwargs = model.dict("kwargs", optional=True) or {}
    for key, value in kwargs.items():  # ints size layers: bounded so a factory cannot be made to allocate gigabytes
        if type(value) is int and abs(value) > MAX_FACTORY_INT:
            raise model.fail(f"kwargs.{key}", f"an integer of at most {MAX_FACTORY_INT} in size", value)
    conv = model.dict("convert", optional=True)
    if conv is not None:
        try:
            NWSConfig.from_dict(conv)
        except UsageError as e:
            raise FormatError(f"{path}: field model.convert: {e}") from None
    model.int("layers", lo=0, optional=True)
    if manifest.get("version", MANIFEST_VERSION) >= 2 and f.sha("model_sha256") != model_sha256(manifest["model"]):
        raise FormatError(
            f"{path}: field model: the model entry (spec, kwargs, conversion options) does not match model_sha256: "
            "it was edited or corrupted; packs would be applied to another architecture"
        )
    check_data_info(f)
    f.dict("config", optional=True)
    pools = f.obj_fields("pools", optional=True)
    if pools is not None:
        pools.filename("file", optional=True)
        pools.sha("sha256")
        pools.int("bytes", lo=0, optional=True)
        pools.bool("learned", optional=True)
        pools.dict("metrics", optional=True)
    base = f.obj_fields("base", optional=True)
    if base is not None:
        base.filename("file", optional=True)
        base.sha("sha256")
        base.int("num_classes", lo=1, optional=True)
    ids = set()
    for i, entry in enumerate(f.list("tasks")):
        e = f.sub(entry, f"tasks[{i}]")
        t = e.int("id", lo=0)
        if t in ids:
            raise e.fail("id", "a task id listed once", t)
        ids.add(t)
        e.str("name")
        e.int("num_classes", lo=1)
        e.strs("class_names", optional=True)
        e.relpath("file")
        e.sha("sha256")
        e.dict("bytes", optional=True)
        metrics = e.obj_fields("metrics")
        for key in ("val_acc", "val_loss", "train_acc", "train_loss"):
            metrics.number(key, optional=True)


def library_versions() -> dict:
    """Versions of the libraries a run depends on (recorded in the manifest)."""
    import numpy
    import timm
    import torch
    import torchvision

    from .. import __version__

    return {
        "nwsconvert": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "timm": timm.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


class RunDir:
    """Paths and manifest of one run directory.

    Args:
        path: the directory (created on the first write).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # ------------------------------------------------------------- paths
    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def pool_path(self) -> Path:
        return self.path / "pools.safetensors"

    @property
    def base_path(self) -> Path:
        return self.path / "base.nwspack"

    @property
    def log_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoints" / "last.safetensors"

    @property
    def base_weights_path(self) -> Path:
        return self.path / "checkpoints" / "base_weights.safetensors"

    def pack_path(self, task: int) -> Path:
        return self.path / "tasks" / f"task_{task}.nwspack"

    # ---------------------------------------------------------- manifest
    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def read(self) -> dict:
        """The manifest.

        Raises:
            FileNotFoundError: no run here (the message names the directory).
            FormatError: not a manifest of this library, or a newer version.
        """
        if not self.path.is_dir():
            what = "is a file, not a run directory" if self.path.exists() else "does not exist"
            raise FileNotFoundError(f"run directory {str(self.path)!r} {what}")
        if not self.exists():
            raise FileNotFoundError(f"{str(self.path)!r} is not a run directory: it has no manifest.json")
        try:
            manifest = json.loads(self.manifest_path.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"{self.manifest_path}: not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise FormatError(f"{self.manifest_path}: not an nwsconvert run manifest")
        version = manifest.get("version")
        if type(version) is not int or version < 1:
            raise FormatError(
                f"{self.manifest_path}: field version: expected an integer >= 1, got {str(version)[:40]!r}"
            )
        if version > MANIFEST_VERSION:
            raise FormatError(
                f"{self.manifest_path}: manifest version {version} is newer than this nwsconvert "
                f"reads ({MANIFEST_VERSION}): upgrade nwsconvert"
            )
        check_manifest(manifest, self.manifest_path)
        return manifest

    def resolve(self, rel: str, what: str = "file") -> Path:
        """``RUN/rel``, refused unless it stays inside the run directory (links followed).

        Raises:
            FormatError: ``rel`` is absolute, climbs out with ``..``, or a link leads outside.
        """
        root = self.path.resolve()
        target = (root / rel).resolve() if is_relative_inside(rel) else None
        if target is None or not target.is_relative_to(root):
            raise FormatError(
                f"{self.manifest_path}: {what} {str(rel)[:80]!r} points outside the run directory {self.path}"
            )
        return target

    def write(self, manifest: dict) -> None:
        """Write the manifest atomically."""
        manifest = {
            "format": MANIFEST_FORMAT,
            **manifest,
            "version": MANIFEST_VERSION,
            "model_sha256": model_sha256(manifest["model"]),
        }
        atomic_write_bytes(self.manifest_path, (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode())

    def commit_stage(self, manifest: dict, done: dict) -> None:
        """The end of a finished stage, in the order that keeps a killed run consistent: the manifest
        that lists the stage's files (written atomically), then the ``done`` line of the log, then
        the stage's checkpoint is removed (a run killed before that resumes to a finished stage)."""
        self.write(manifest)
        self.log(done)
        self.checkpoint_path.unlink(missing_ok=True)

    def task_entry(self, manifest: dict, task: int) -> dict:
        """The manifest entry of ``task``; a clear error listing the finished tasks otherwise.

        Raises:
            TaskNotFoundError: (a ``KeyError``) no such finished task.
        """
        for entry in manifest.get("tasks", []):
            if entry["id"] == task:
                return entry
        done = [e["id"] for e in manifest.get("tasks", [])]
        raise TaskNotFoundError(f"run {str(self.path)!r} has no finished task {task}; finished tasks: {done or 'none'}")

    def task_path(self, manifest: dict, task: int) -> Path:
        """The pack file of finished task ``task``, inside the run directory (see :meth:`resolve`)."""
        entry = self.task_entry(manifest, task)
        return self.resolve(entry["file"], f"task {task}'s pack")

    # --------------------------------------------------------------- log
    def log(self, record: dict) -> None:
        """Append one JSON line to ``metrics.jsonl`` (flushed and synced: survives a kill)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise disk_error(e, self.log_path) from None

    def read_log(self) -> list[dict]:
        """Every complete line of ``metrics.jsonl`` (a line cut by a kill is ignored)."""
        if not self.log_path.is_file():
            return []
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
