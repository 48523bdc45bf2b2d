"""Run ``nws-train`` and stop it at a chosen point: a real SIGKILL of its own process, or a full disk.

    python tests/kill_points.py POINT [nws-train arguments...]

``tests/test_kill_resume.py`` starts this in a subprocess. The point is exact (a patched function
of the library sends the signal), so a test can stop a run inside a window that lasts milliseconds,
such as the one between the pool file's write and the manifest's. Points:

``before-job-file``
    SIGKILL after the run directory's lock is taken, before ``job.json`` is written.
``after-pool-file``
    SIGKILL right after ``pools.safetensors`` is written, before the manifest records it.
``disk-full-base-weights``
    ``checkpoints/base_weights.safetensors`` fails to write with ``ENOSPC`` (the error the atomic
    writer raises on a full disk), after the pool file was written: the process exits 1.
``after-log:STAGE:EPOCH``
    SIGKILL right after ``metrics.jsonl`` records epoch ``EPOCH`` of ``STAGE`` (``pools``,
    ``task:1``...): after that epoch's checkpoint, when the run writes one.
``none``
    run to the end.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str) -> None:
    """Patch the library so that this process stops at ``point`` (see the module docstring)."""
    if point == "none":
        return
    if point == "before-job-file":
        from nwsconvert.train import job

        write = job.atomic_write_bytes

        def write_job(path, data):
            if Path(path).name == job.JOB_FILE:
                _kill()
            write(path, data)

        job.atomic_write_bytes = write_job
    elif point == "after-pool-file":
        from nwsconvert.core.pools import PoolSet

        save = PoolSet.save

        def save_then_kill(self, path):
            sha = save(self, path)
            if Path(path).name == "pools.safetensors":
                _kill()
            return sha

        PoolSet.save = save_then_kill
    elif point == "disk-full-base-weights":
        from nwsconvert.formats import atomic, storage

        write = storage.atomic_write_bytes

        def full_disk(path, data):
            if Path(path).name == "base_weights.safetensors":
                raise atomic.disk_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), path)
            write(path, data)

        storage.atomic_write_bytes = full_disk
    elif point.startswith("after-log:"):
        stage, _, epoch = point[len("after-log:") :].rpartition(":")
        from nwsconvert.train.rundir import RunDir

        log = RunDir.log

        def log_then_kill(self, record):
            log(self, record)
            if record.get("stage") == stage and record.get("epoch") == int(epoch) and "event" not in record:
                _kill()

        RunDir.log = log_then_kill
    else:
        raise SystemExit(f"kill_points.py: unknown point {point!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from nwsconvert.cli.train import train_main

    sys.exit(train_main(sys.argv[2:]))
