"""One writer per run directory: an advisory lock on ``RUN/.lock``, held for the life of a training process.

    lock = RunLock.acquire("runs/a")     # RunLockedError if another process holds it
    ...
    lock.release()                        # or let the process end

The operating system drops the lock when its process dies (``flock`` on POSIX,
``msvcrt.locking`` on Windows), so a run killed by SIGKILL never blocks its
own ``--resume``. The lock file keeps the holder's pid, host and command line
for the refusal message. Acquiring again in the same process is re-entrant
(the CLI locks before it builds the model, the :class:`~nwsconvert.Trainer`
again). Imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import RunLockedError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None
    import msvcrt

__all__ = ["RunLock", "LOCK_FILE", "remove_stale_temporaries"]

LOCK_FILE = ".lock"


class RunLock:
    """The lock of one run directory (see the module docstring). Use :meth:`acquire`."""

    _held: dict[str, RunLock] = {}

    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.depth = path, fd, 1

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike) -> RunLock:
        """Lock ``run_dir`` for this process (creating the folder), or refuse.

        Raises:
            RunLockedError: another process holds the lock; the message says which.
        """
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        key = str(run_dir.resolve())
        held = cls._held.get(key)
        if held is not None and held.fd is not None:
            held.depth += 1
            return held
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"{run_dir} is being written by another process ({holder}): wait for it to end or stop it; "
                "one process writes a run at a time"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "argv": sys.argv[:6],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        lock = cls(path, fd)
        cls._held[key] = lock
        return lock

    def release(self) -> None:
        """Drop one hold; the last one unlocks (the lock file stays, emptied)."""
        if self.fd is None:
            return
        self.depth -= 1
        if self.depth > 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        _unlock(self.fd)
        os.close(self.fd)
        self.fd = None
        self._held.pop(str(self.path.parent.resolve()), None)

    def release_and_remove(self) -> None:
        """:meth:`release`, and remove what :meth:`acquire` made when nothing else is in the folder: the lock
        file and the folder itself (a command refused before anything started leaves no trace). The file is
        unlinked while still locked, so no other process can be holding it."""
        if self.fd is None or self.depth > 1:
            self.release()
            return
        folder = self.path.parent
        alone = [p.name for p in folder.iterdir()] == [LOCK_FILE]
        if alone:
            self.path.unlink(missing_ok=True)
        self.release()
        if alone:
            try:
                folder.rmdir()  # fails, harmlessly, when another process has written there since
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _lock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:  # pragma: no cover - Windows
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


def _unlock(fd: int) -> None:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:  # pragma: no cover - Windows
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    except OSError:
        pass


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']} since {info['since']}: {' '.join(info.get('argv', []))}".strip(
            ": "
        )
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of atomic writes a killed process left (``.NAME.*.tmp``).

    Call only while holding the run's lock: then no write is in flight.
    Returns the files removed.
    """
    run_dir = Path(run_dir)
    removed = []
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "tasks", run_dir / "export"):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):
                if p.is_file():
                    p.unlink(missing_ok=True)
                    removed.append(p)
    return removed
