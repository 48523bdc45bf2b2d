"""Atomic file writes: a reader, or a run killed mid-write, sees the old file or the new one, never a part.

Imports only the standard library (the command lines and the run directory use it before torch loads).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "disk_error"]

_UMASK = os.umask(0)  # read once: files get the permissions open() would give (mkstemp makes them 0600)
os.umask(_UMASK)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename.

    A reader (or a run killed mid-write) sees either the old file or the new
    one, never a partial file.

    Raises:
        OSError: with ``filename`` set to ``path`` (a full disk: ``errno.ENOSPC``);
            the temporary file is removed.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise disk_error(e, path) from None
    try:
        if hasattr(os, "fchmod"):  # POSIX
            os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise disk_error(e, path) from None
        raise


def disk_error(e: OSError, path) -> OSError:
    """``e`` with ``path`` as its file name (an error while writing a temporary file names the real one)."""
    return type(e)(e.errno, e.strerror or str(e), str(path)) if e.errno is not None else e
