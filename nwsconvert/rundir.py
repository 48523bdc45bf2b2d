"""Run directories: the unit users hand around after training.

Layout::

    RUN/
      manifest.json            format, model spec + kwargs + conversion options, data info,
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
file, and the manifest only lists files that are complete.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from .storage import FormatError, atomic_write_bytes

__all__ = ["RunDir", "MANIFEST_FORMAT", "MANIFEST_VERSION", "library_versions"]

MANIFEST_FORMAT = "nwsconvert.run"
MANIFEST_VERSION = 1


def library_versions() -> dict:
    """Versions of the libraries a run depends on (recorded in the manifest)."""
    import numpy
    import timm
    import torch
    import torchvision

    from . import __version__

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
            raise FileNotFoundError(f"run directory {str(self.path)!r} does not exist")
        if not self.exists():
            raise FileNotFoundError(f"{str(self.path)!r} is not a run directory: it has no manifest.json")
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FormatError(f"{self.manifest_path}: not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise FormatError(f"{self.manifest_path}: not an nwsconvert run manifest")
        if int(manifest.get("version", 0)) > MANIFEST_VERSION:
            raise FormatError(
                f"{self.manifest_path}: manifest version {manifest['version']} is newer than this nwsconvert "
                f"reads ({MANIFEST_VERSION}): upgrade nwsconvert"
            )
        return manifest

    def write(self, manifest: dict) -> None:
        """Write the manifest atomically."""
        manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, **manifest}
        atomic_write_bytes(self.manifest_path, (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode())

    def task_entry(self, manifest: dict, task: int) -> dict:
        """The manifest entry of ``task``; a clear error listing the finished tasks otherwise."""
        for entry in manifest.get("tasks", []):
            if entry["id"] == task:
                return entry
        done = [e["id"] for e in manifest.get("tasks", [])]
        raise KeyError(f"run {str(self.path)!r} has no finished task {task}; finished tasks: {done or 'none'}")

    # --------------------------------------------------------------- log
    def log(self, record: dict) -> None:
        """Append one JSON line to ``metrics.jsonl`` (flushed and synced: survives a kill)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

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
