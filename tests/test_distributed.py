"""DDP under torchrun: 2 CPU processes (gloo) end with identical indices and the same pack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nwsconvert
from nwsconvert import RunDir, TaskPack

HERE = Path(__file__).parent


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """``cmd``, which must succeed (its output's end in the failure message)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


#: ``torchrun --standalone --nproc_per_node 2``, then the script or ``-m module`` and its arguments.
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.parametrize(("search", "head_epochs"), [("auto", 0), ("engine", 0), ("auto", 1)])
def test_two_gloo_ranks_agree(tmp_path, search, head_epochs):
    _run([*TORCHRUN_2, str(HERE / "ddp_worker.py"), str(tmp_path), search, str(head_epochs)])
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1  # same indices, same pools, same pack content
    assert (tmp_path / "rank0.nwspack").read_bytes() == (tmp_path / "rank1.nwspack").read_bytes()
    manifest = RunDir(tmp_path / "run").read()
    assert [t.id for t in manifest.tasks] == [0, 1]
    # Rank 0 wrote the same task into the run (coded against the base pack: compare decoded content).
    assert TaskPack.load(tmp_path / "run" / manifest.tasks[1].file).content_sha256() == r0["content"]
    assert manifest.pools.sha256 == r0["pools"]
    model = nwsconvert.load(tmp_path / "run", task=1)
    assert nwsconvert.extract_task(model).pool_sha256 == r0["pools"]


def test_two_gloo_ranks_train_what_one_process_trains_on_the_same_global_batch(tmp_path):
    """Two DDP ranks, each with half of every global batch, against one process with the whole of it
    (``ddp_compare.py``, a model without BatchNorm): the temporary weights agree to float32 rounding
    (DDP averages two half-batch mean gradients, one process takes one mean over the batch: the
    same sum in another order, relative differences of a few ulps per step), and so every index does."""
    from safetensors.torch import load_file

    worker = str(HERE / "ddp_compare.py")
    _run([*TORCHRUN_2, worker, str(tmp_path)])
    _run([sys.executable, worker, str(tmp_path), "--single"])
    two, one = load_file(tmp_path / "ddp.safetensors"), load_file(tmp_path / "single.safetensors")
    assert two.keys() == one.keys()
    for key in two:
        if key.endswith(".indices"):
            assert torch.equal(two[key], one[key]), key
        else:
            scale = one[key].abs().max()
            assert (two[key] - one[key]).abs().max() <= 1e-6 * scale, key  # measured: 4.7e-8


def test_ranks_that_end_with_different_packs_stop_the_task(tmp_path, monkeypatch):
    """Before a task's pack is written its digest is compared across ranks; here the gathered digests
    differ (as two diverged ranks' would), and the task stops unwritten and uncommitted."""
    from trainer_utils import KWARGS, SPEC, blobs, tiny_config, tiny_model

    from nwsconvert import Trainer
    from nwsconvert.train import store

    monkeypatch.setattr(store, "gather_strings", lambda digest, dist: [digest, "0" * 64])
    trainer = Trainer(
        tiny_model(), tmp_path / "r", tiny_config(epochs=1), model_spec=SPEC, model_kwargs=KWARGS, progress=False
    )
    with pytest.raises(RuntimeError, match=r"task 0: ranks ended with different indices or state"):
        trainer.fit_task(0, blobs(32, 2, 1), blobs(16, 2, 2), 2)
    trainer.close()
    run = RunDir(tmp_path / "r")
    assert run.read().finished == [] and not run.pack_path(0).exists()


def test_nws_train_under_torchrun(tmp_path):
    """The README's ``torchrun --nproc_per_node N -m nwsconvert.cli.train``: two gloo ranks run the job,
    the run holds its tasks, and the job's lines and summary are printed once, not once per rank."""
    out = tmp_path / "run"
    keys = ["model=timm:test_resnet", "pool_size=32", "pool_epochs=1", "epochs=1", "tasks=2", "progress=false"]
    proc = _run([*TORCHRUN_2, "-m", "nwsconvert.cli.train", *keys, "device=cpu", f"out={out}"])
    assert RunDir(out).read().finished == [0, 1]
    assert proc.stdout.count("NWS conversion (") == 1 and proc.stdout.count("smaller; average accuracy") == 1
