"""The demo `make demo` runs (split-mnist through nws-train), here with a tiny model and two tasks, at the
default pool size (512 entries: 9-bit indices through packs, nws-export and both runtime modes)."""

import contextlib
import io
import json

import numpy as np
import pytest
import torch

import nwsconvert
from nwsconvert import RunDir
from nwsconvert.cli import demo
from nwsconvert.export import Runtime
from nwsconvert.export.cli import export_main
from nwsconvert.zoo import get_suite

DEMO_ARGS = ["model=timm:test_resnet", "epochs=1", "pool_epochs=1", "tasks=2", "progress=false"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One demo run shared by this module's tests (the pipeline is the slow part): its folder and what it printed."""
    out = tmp_path_factory.mktemp("demo") / "d"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert demo.main([*DEMO_ARGS, f"out={out}"]) == 0
    return out, printed.getvalue()


def test_demo_learns_its_tasks_in_a_fraction_of_the_memory_and_continues(demo_run, capsys):
    """What the demo reports, checked against what it wrote: at these sizes (test ResNet, one epoch of
    pools and of each task, 160 test digits per task) on the CPU it reaches 99.4 % and 74.4 % (86.9 %
    on average) in 8.2x less memory than two dense models. The floors leave room for another
    machine's arithmetic (a GPU's bf16) while failing a run that learns nothing (50 % is chance) or
    stores more than it should (pools of 512 entries: 196.6 KB; both tasks' packs: 64 KB)."""
    from nwsconvert.analysis.summary import run_summary

    out, printed = demo_run
    summary = run_summary(out)
    total, tasks = summary["total"], summary["tasks"]
    assert [t["id"] for t in tasks] == [0, 1] and RunDir(out).read().finished == [0, 1]
    assert all(t["acc"] >= 0.65 for t in tasks) and total["avg_acc"] >= 0.78, tasks
    assert total["nws_bytes"] == summary["pools_bytes"] + summary["base_bytes"] + sum(t["total"] for t in tasks)
    assert total["dense_finetune_bytes"] == sum(t["dense"] for t in tasks)
    assert total["ratio"] == total["dense_finetune_bytes"] / total["nws_bytes"] >= 7.0
    assert f"NWS is {total['ratio']:.1f}x smaller; average accuracy {100 * total['avg_acc']:.2f}%" in printed
    for t in tasks:
        assert (
            f"task {t['id']} ({t['name']}): acc {100 * t['acc']:.2f}%  rebuilt from pack {100 * t['acc']:.2f}%"
            in printed
        )
    assert demo.main([*DEMO_ARGS, f"out={out}"]) == 0  # a second run continues the existing one
    assert "continuing it" in capsys.readouterr().out


def test_onnxruntime_top1_agrees_on_the_demo_test_sets(demo_run, tmp_path):
    """Deployment answers like PyTorch on the demo's own test images (split-mnist, 160 per task), in
    both runtime modes (per-task sessions; one session fed from the packs)."""
    out, _ = demo_run
    assert RunDir(out).read().model.convert["pool_size"] == 512  # the default, as a user's run has it
    assert export_main([str(out), "--task", "all", "--onnx", "--out", str(tmp_path / "b")]) == 0
    desc = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert {row["index_dtype"] for row in desc["tasks"].values()} == {"uint8+1bit"}  # 9 bits per index
    runtimes = {mode: Runtime(tmp_path / "b", device="cpu", mode=mode) for mode in ("session", "switch")}
    suite = get_suite("split-mnist")
    for t in (0, 1, 0):  # the switch mode goes back to task 0 after task 1
        test = suite.tasks[t].test
        x = torch.stack([test[i][0] for i in range(len(test))])
        with torch.no_grad():
            ref = nwsconvert.load(out, task=t)(x).numpy()
        for mode, rt in runtimes.items():
            y = rt.run(t, x.numpy())
            assert len(x) == 160 and np.array_equal(y.argmax(1), ref.argmax(1)), mode
