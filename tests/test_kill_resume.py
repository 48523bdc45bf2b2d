"""A run of ``nws-train`` stopped at any point and continued writes what the uninterrupted run writes.

Each run is a real ``nws-train`` process stopped at an exact point (``tests/kill_points.py``: a real
SIGKILL of the process, or a full disk), then continued as a user would, and its files are compared
with those of the same job run without interruption:

* the pool file and the base weights, byte for byte;
* every pack (the base pack and each task's), tensor for tensor: the indices and the state it stores
  are equal (its ``sha256``; the files themselves differ in the run's random ``run_id``);
* every task's validation accuracy.

On a GPU machine the job runs with ``deterministic=true``: cuDNN's and cuBLAS's default kernels differ
from run to run on CUDA, so two uninterrupted runs there differ too (seen on an H100: the pool file at
its first tensor); on CPU the job keeps the user's defaults.

The points: before ``job.json`` is written, a full disk and a kill between the pool file's write and
the manifest's (the run must not learn its pools again from the ones it wrote), inside pool learning
and inside a task, with and without a checkpoint to resume from.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nwsconvert
from nwsconvert import RunDir, TaskPack
from nwsconvert.cli.info import info_main

KILL_POINTS = Path(__file__).with_name("kill_points.py")
JOB = ["model=timm:test_resnet", "pool_size=32", "pool_epochs=2", "epochs=2", "tasks=2", "progress=false", "seed=3"]
JOB += ["deterministic=true"] if torch.cuda.is_available() else []


def _train(point: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KILL_POINTS), point, *args], capture_output=True, text=True, timeout=600)


def _killed(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == -signal.SIGKILL, (
        f"not killed ({proc.returncode}):\n{proc.stdout[-1500:]}{proc.stderr[-2500:]}"
    )


def _done(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]


def _written(out: Path) -> dict:
    """What a run wrote, as the comparison with the uninterrupted run reads it."""
    m = RunDir(out).read()
    return {
        "pool file": (out / "pools.safetensors").read_bytes(),
        "base weights": (out / "checkpoints" / "base_weights.safetensors").read_bytes(),
        "pools sha256": m.pools.sha256,
        "base pack sha256": m.base.sha256,
        "task packs sha256": [(t.id, t.sha256) for t in m.tasks],
        "val_correct": [t.metrics["val_correct"] for t in m.tasks],
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ref") / "run"
    _done(_train("none", *JOB, f"out={out}"))
    return _written(out)


def _assert_same_run(out: Path, reference: dict) -> None:
    got = _written(out)
    for key, want in reference.items():
        assert got[key] == want, f"{key} differs from the uninterrupted run's"
    assert [t.id for t in RunDir(out).read().tasks] == [0, 1]
    assert not list(out.rglob(".*.tmp")), "a temporary file of an atomic write was left behind"


@pytest.mark.slow
def test_killed_at_startup_full_disk_and_between_pool_file_and_manifest(tmp_path, uninterrupted, capsys):
    """No checkpoint is written (``checkpoint_interval`` 60 s is longer than any stage here), so each
    stage that is stopped starts again from its start."""
    out = tmp_path / "run"
    # Killed after the lock, before job.json: --resume finds no job to continue, the plain command starts.
    _killed(_train("before-job-file", *JOB, f"out={out}"))
    refused = _train("none", "--resume", f"out={out}")
    assert refused.returncode == 2 and "holds no run" in refused.stderr and refused.stderr.count("\n") == 1
    # A full disk while the base weights are written, after the pool file: one line, exit 1.
    full = _train("disk-full-base-weights", *JOB, f"out={out}")
    assert full.returncode == 1 and full.stderr.count("\n") == 1, full.stderr[-2000:]
    assert (
        "disk full while writing" in full.stderr
        and "base_weights.safetensors" in full.stderr
        and "--resume" in full.stderr
    )
    assert (out / "pools.safetensors").is_file() and RunDir(out).read().pools is None
    # Killed right after the pool file is written again, before the manifest records it.
    _killed(_train("after-pool-file", "--resume", f"out={out}"))
    assert (out / "pools.safetensors").is_file() and RunDir(out).read().pools is None
    # Killed inside task 1, which then starts again.
    _killed(_train("after-log:task:1:1", "--resume", f"out={out}"))
    assert RunDir(out).read().finished == [0]
    _done(_train("none", "--resume", f"out={out}"))
    _assert_same_run(out, uninterrupted)

    # Continuing a finished run changes nothing; the plain command refuses to start over it.
    before = _written(out)
    _done(_train("none", "--resume", f"out={out}"))
    assert _written(out) == before
    again = _train("none", *JOB, f"out={out}")
    assert again.returncode == 2 and "already holds a run" in again.stderr
    # nws-info's table adds up what the run holds.
    assert info_main([str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in summary["tasks"]] == [0, 1]
    pack = TaskPack.load(out / RunDir(out).read().task(1).file)
    row = summary["tasks"][1]
    assert row["indices"] + row["state"] + row["head"] == pack.index_bytes + pack.state_bytes == row["total"]
    base = TaskPack.load(out / "base.nwspack")  # every task is stored against it (pack_base=pools)
    assert summary["base_bytes"] == base.index_bytes + base.state_bytes > 0
    assert summary["total"]["nws_bytes"] == summary["pools_bytes"] + summary["base_bytes"] + sum(
        r["total"] for r in summary["tasks"]
    )
    assert summary["total"]["avg_acc"] == pytest.approx(sum(r["acc"] for r in summary["tasks"]) / 2)


@pytest.mark.slow
def test_killed_inside_pool_learning_and_inside_a_task_resumes_from_checkpoints(tmp_path, uninterrupted):
    out = tmp_path / "run"
    job = [*JOB, "checkpoint_interval=0", f"out={out}"]  # a checkpoint after every epoch
    _killed(_train("after-log:pools:1", *job))
    assert RunDir(out).read().pools is None
    first = _train("after-log:task:0:1", "--resume", f"out={out}")
    _killed(first)
    assert RunDir(out).read().finished == []
    second = _train("none", "--resume", f"out={out}")
    _done(second)
    # Each resumed process says where it picked up (stderr), as metrics.jsonl records it.
    assert re.search(r"^pools: resumed from its checkpoint after epoch 1 of \d+$", first.stderr, re.M), first.stderr
    assert re.search(r"^task:0: resumed from its checkpoint after epoch 1 of \d+$", second.stderr, re.M)
    log = RunDir(out).read_log()
    resumed = [(r["stage"], r["epoch"]) for r in log if r.get("event") == "resumed"]
    assert resumed == [("pools", 1), ("task:0", 1)]  # each continued from its checkpoint, not from its start
    _assert_same_run(out, uninterrupted)
    for t in (0, 1):
        nwsconvert.load(out, task=t)
