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

import json
import os
from pathlib import Path

from ..errors import FormatError, TaskNotFoundError
from ..formats.atomic import atomic_write_bytes, disk_error
from ..formats.schema import is_relative_inside
from .manifest import MANIFEST_FORMAT, MANIFEST_VERSION, Manifest, TaskEntry

__all__ = ["RunDir"]


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

    def read(self) -> Manifest:
        """The manifest, every field checked (:meth:`Manifest.from_dict`).

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
        return Manifest.from_dict(manifest, self.manifest_path)

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

    def write(self, manifest: Manifest) -> None:
        """Write the manifest atomically (as the current version, with its ``model_sha256``)."""
        text = json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n"
        atomic_write_bytes(self.manifest_path, text.encode())

    def commit_stage(self, manifest: Manifest, done: dict) -> None:
        """The end of a finished stage, in the order that keeps a killed run consistent: the manifest
        that lists the stage's files (written atomically), then the ``done`` line of the log, then
        the stage's checkpoint is removed (a run killed before that resumes to a finished stage)."""
        self.write(manifest)
        self.log(done)
        self.checkpoint_path.unlink(missing_ok=True)

    def task_entry(self, manifest: Manifest, task: int) -> TaskEntry:
        """The manifest entry of ``task``; a clear error naming the run and listing its finished tasks otherwise.

        Raises:
            TaskNotFoundError: (a ``KeyError``) no such finished task.
        """
        try:
            return manifest.task(task)
        except TaskNotFoundError as e:
            raise TaskNotFoundError(f"run {str(self.path)!r} has {e.args[0]}") from None

    def task_path(self, manifest: Manifest, task: int) -> Path:
        """The pack file of finished task ``task``, inside the run directory (see :meth:`resolve`)."""
        return self.resolve(self.task_entry(manifest, task).file, f"task {task}'s pack")

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
