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


def test_demo_runs_and_continues(demo_run, capsys):
    out, printed = demo_run
    assert "task 1 (task1:2-3): acc" in printed and "rebuilt from pack" in printed
    assert "dense finetune total" in printed and "NWS total (2 tasks)" in printed
    assert RunDir(out).read().finished == [0, 1]
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
