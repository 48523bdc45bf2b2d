"""nws-report: KUR, layer sparsity, selection counts and bytes against a hand-computed run; PNGs, HTML, CLI."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from trainer_utils import tiny_model

from nwsconvert import PoolSet, RunDir, TaskPack, extract_task, pool_set
from nwsconvert.analysis.html import write_report
from nwsconvert.analysis.selection import analyse_run, index_entropy, layer_sparsity, layer_stats, selection_counts
from nwsconvert.analysis.summary import run_summary
from nwsconvert.cli.report import report_main
from nwsconvert.train.manifest import Manifest, ModelEntry, PoolsEntry, TaskEntry

PNG = b"\x89PNG\r\n\x1a\n"

# Hand-made run: two NWS layers, two tasks.
#   "conv": weight (2, 8, 3, 3) -> d = 16 kernels of 9 floats, pool n = 8, 3-bit indices.
#   "fc":   head weight (classes, 4) -> d = 4 * classes scalars, pool n = 4, 2-bit indices.
CONV_T0 = [0] * 5 + [1] * 4 + [2] * 3 + [3] * 2 + [4, 5]  # h = 5,4,3,2,1,1,0,0
CONV_T1 = [7] * 16  # one entry for every kernel
FC_T0 = [0, 1, 2, 3, 0, 1, 2, 3]  # 2 classes: h = 2,2,2,2
FC_T1 = [0] * 9 + [1] * 3  # 3 classes: h = 9,3,0,0


def _layers(classes: int) -> list[dict]:
    return [
        {
            "name": "conv",
            "pool": "conv",
            "shape": [2, 8, 3, 3],
            "groups": 1,
            "vector_size": 9,
            "pool_size": 8,
            "bits": 3,
            "count": 16,
            "role": "stem",
        },
        {
            "name": "fc",
            "pool": "fc",
            "shape": [classes, 4],
            "groups": 1,
            "vector_size": 1,
            "pool_size": 4,
            "bits": 2,
            "count": 4 * classes,
            "role": "head",
        },
    ]


def _state(classes: int) -> dict[str, torch.Tensor]:
    # non-head state: 2 x float32 (8 B) + 2 x float32 (8 B) + int64 scalar (8 B) = 24 B; head bias: 4 * classes B
    return {
        "bn.weight": torch.ones(2),
        "bn.running_mean": torch.zeros(2),
        "bn.num_batches_tracked": torch.tensor(3, dtype=torch.int64),
        "fc.bias": torch.zeros(classes),
    }


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report") / "run"
    run = RunDir(root)
    pools = PoolSet({"conv": torch.randn(8, 9), "fc": torch.randn(4, 1)})  # 288 B + 16 B
    pools.save(run.pool_path)
    tasks = []
    for t, (classes, conv, fc, acc) in enumerate(((2, CONV_T0, FC_T0, 0.75), (3, CONV_T1, FC_T1, 0.5))):
        pack = TaskPack(
            layers=_layers(classes),
            indices={"conv": torch.tensor(conv), "fc": torch.tensor(fc)},
            state=_state(classes),
            pool_sha256=pools.sha256,
            num_classes=classes,
            model_spec="hand:made",
        )
        sha = pack.save(run.pack_path(t))
        tasks.append(TaskEntry(t, f"hand{t}", classes, f"tasks/task_{t}.nwspack", sha, {"val_acc": acc}))
    pools_entry = PoolsEntry(pools.sha256, "pools.safetensors", pools.nbytes)
    run.write(Manifest(ModelEntry("hand:made"), data={"suite": "hand"}, pools=pools_entry, tasks=tasks))
    return root


def _entropy(*counts: int) -> float:
    d = sum(counts)
    return -sum(h / d * math.log2(h / d) for h in counts)


def test_layer_sparsity_reading_of_the_paper():
    # d = 16, sqrt(d) = 4: entries used 4 times or more are "important", h = 3, 2, 1, 1 count (strictly below 4).
    assert layer_sparsity([5, 4, 3, 2, 1, 1, 0, 0]) == 7 / 16
    assert layer_sparsity([16, 0]) == 0.0
    assert layer_sparsity([1] * 9) == 1.0  # d = 9, every h = 1 < 3
    assert layer_sparsity([3, 3, 3]) == 0.0  # d = 9, h = 3 is not < 3
    assert layer_sparsity([0, 0]) == 0.0 and index_entropy([0, 0]) == 0.0
    assert selection_counts(torch.tensor([2, 0, 2]), 4) == [1, 0, 2, 0]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        selection_counts([4], 4)
    s = layer_stats(CONV_T0, 8)
    assert s == {
        "kernels": 16,
        "pool_size": 8,
        "unique": 6,
        "kur": 0.75,
        "ls": 7 / 16,
        "max_rate": 5 / 16,
        "entropy_bits": pytest.approx(_entropy(5, 4, 3, 2, 1, 1), abs=1e-12),
        "counts": [5, 4, 3, 2, 1, 1, 0, 0],
    }


def test_analysis_matches_hand_computed_numbers(hand_run):
    a = analyse_run(hand_run)
    assert [t["id"] for t in a["tasks"]] == [0, 1]
    assert [t["acc"] for t in a["tasks"]] == [0.75, 0.5] and a["avg_acc"] == 0.625
    assert [t["classes"] for t in a["tasks"]] == [2, 3]
    assert [r["name"] for r in a["layers"]] == ["conv", "fc"]
    assert [r["pool_bytes"] for r in a["layers"]] == [8 * 9 * 4, 4 * 1 * 4] and a["pools_bytes"] == 304
    # rows = layers (conv, fc), columns = tasks (0, 1)
    assert a["kernels"] == [[16, 16], [8, 12]]
    assert a["unique"] == [[6, 1], [4, 2]]
    assert a["kur"] == [[6 / 8, 1 / 8], [4 / 4, 2 / 4]]
    # fc t0: d = 8, sqrt 2.83, every h = 2 counts -> 1; fc t1: d = 12, sqrt 3.46, h = 3 counts, 9 does not -> 3/12.
    assert a["ls"] == [[7 / 16, 0.0], [1.0, 3 / 12]]
    assert a["max_rate"] == [[5 / 16, 1.0], [2 / 8, 9 / 12]]
    assert a["counts"] == [[[5, 4, 3, 2, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 16]], [[2, 2, 2, 2], [9, 3, 0, 0]]]
    assert a["entropy_bits"][0][1] == 0.0 and a["entropy_bits"][1][0] == 2.0
    assert a["entropy_bits"][0][0] == pytest.approx(_entropy(5, 4, 3, 2, 1, 1), abs=1e-12)
    assert a["entropy_bits"][1][1] == pytest.approx(_entropy(9, 3), abs=1e-12)
    # Index bytes are what the pack file stores for each layer (3-bit/2-bit packing today).
    stored = [TaskPack.load(hand_run / f"tasks/task_{t}.nwspack").layer_index_bytes() for t in (0, 1)]
    assert a["index_bytes"] == [[stored[0]["conv"], stored[1]["conv"]], [stored[0]["fc"], stored[1]["fc"]]]
    assert a["index_bits"] == [
        [8 * stored[0]["conv"] / 16, 8 * stored[1]["conv"] / 16],
        [8 * stored[0]["fc"] / 8, 8 * stored[1]["fc"] / 12],
    ]
    assert all(isinstance(c, str) for row in a["coding"] for c in row)
    for t, classes in enumerate((2, 3)):
        conv, fc = stored[t]["conv"], stored[t]["fc"]
        assert a["tasks"][t]["bytes"] == {
            "indices": conv,
            "state": 24,
            "head": fc + 4 * classes,
            "total": conv + fc + 24 + 4 * classes,
        }
    # Same accounting as nws-info.
    summary = run_summary(hand_run)
    for row, t in zip(summary["tasks"], a["tasks"]):
        assert {k: row[k] for k in ("indices", "state", "head", "total")} == t["bytes"]
    json.dumps(a)  # JSON-able throughout


def test_task_selection_and_errors(hand_run, tmp_path):
    a = analyse_run(hand_run, tasks=[1])
    assert [t["id"] for t in a["tasks"]] == [1] and a["kur"] == [[1 / 8], [2 / 4]]
    with pytest.raises(KeyError, match=r"no finished task 5; finished tasks: \[0, 1\]"):
        analyse_run(hand_run, tasks=[5])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        analyse_run(tmp_path / "missing")


def test_report_files_are_self_contained(hand_run, tmp_path):
    paths = write_report(hand_run, tmp_path / "rep")
    names = sorted(p.name for p in (tmp_path / "rep").iterdir())
    assert names == sorted(
        [
            "accuracy.png",
            "kur.png",
            "ls.png",
            "bytes_task.png",
            "bytes_layer.png",
            "selection_task_0.png",
            "selection_task_1.png",
            "analysis.json",
            "report.html",
        ]
    )
    for p in paths["figures"]:
        data = open(p, "rb").read()
        assert data.startswith(PNG) and len(data) > 2000
    assert json.loads((tmp_path / "rep" / "analysis.json").read_text())["ls"] == [[7 / 16, 0.0], [1.0, 3 / 12]]
    page = (tmp_path / "rep" / "report.html").read_text()
    images = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert len(images) == 7 and all(src.startswith("data:image/png;base64,") for src in images)
    # No external reference of any kind: no links, scripts, stylesheets or remote URLs.
    assert not re.search(r"(href=|<script|<link|url\(|https?://|src=\"(?!data:))", page)
    for text in ("hand0", "hand1", "0.438", "0.250", "304 B", "62.50%"):
        assert text in page


def test_cli(hand_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key in ("RUN", "--out", "--tasks", "report.html", "kur.png", "selection_task_<id>.png"):
        assert key in out
    assert report_main([str(hand_run), "--tasks", "1"]) == 0  # default out: RUN/report
    assert "report.html" in capsys.readouterr().out
    assert (hand_run / "report" / "selection_task_1.png").is_file()
    assert not (hand_run / "report" / "selection_task_0.png").exists()
    missing = tmp_path / "no_such_run"
    assert report_main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nws-report: ") and str(missing) in err and "does not exist" in err
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert report_main([str(hand_run), "--tasks", "0", "7"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"nws-report: --tasks 7: run {hand_run} has no finished task 7; finished tasks: [0, 1]"
    )
    # A run with no finished task yet (killed in pool learning): one line, exit 2, as nws-export says it.
    RunDir(tmp_path / "young").write(Manifest(ModelEntry("hand:made"), data={"suite": "hand"}))
    assert report_main([str(tmp_path / "young")]) == 2
    assert "has no finished tasks yet: nothing to report" in capsys.readouterr().err
    from nwsconvert.analysis.summary import format_summary, run_summary  # nws-info's table of the same run

    table = format_summary(run_summary(tmp_path / "young"))
    assert (
        f"pool set: not written yet (pool learning has not finished: nws-train --resume out={tmp_path / 'young'})"
        in table
    )
    assert table.endswith("no finished tasks yet") and "0 B" not in table
    (tmp_path / "young" / "checkpoints").mkdir()
    (tmp_path / "young" / "checkpoints" / "base_weights.safetensors").write_bytes(b"\0" * 3000)
    table = format_summary(run_summary(tmp_path / "young"))
    assert table.splitlines()[-1].startswith("also in the run: checkpoints/ 3.00 KB (training state"), table
    # --out naming a file: refused before the analysis runs, in one line (as nws-export refuses it).
    (tmp_path / "a_file.png").write_bytes(b"x")
    assert report_main([str(hand_run), "--out", str(tmp_path / "a_file.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"nws-report: --out {tmp_path / 'a_file.png'} is a file, not a folder: give a folder for the report"
    )


def test_real_model_pack(tmp_path):
    """A pack extracted from a converted timm model: every layer analysed, head bytes as nws-info counts them."""
    model = tiny_model(num_classes=3, pool_size=16)
    with torch.no_grad():
        model(torch.randn(2, 1, 16, 16))
    run = RunDir(tmp_path / "run")
    pool_sha = pool_set(model).save(run.pool_path)
    sha = extract_task(model).save(run.pack_path(0))
    task = TaskEntry(0, "t0", 3, "tasks/task_0.nwspack", sha, {"val_acc": 0.5})
    pools_entry = PoolsEntry(pool_sha, bytes=pool_set(model).nbytes)
    run.write(Manifest(ModelEntry("timm:test_resnet"), pools=pools_entry, tasks=[task]))
    a = analyse_run(run.path)
    pack = TaskPack.load(run.pack_path(0))
    assert [r["name"] for r in a["layers"]] == [r["name"] for r in pack.layers]
    for k, r in enumerate(pack.layers):
        assert a["kur"][k][0] == len(torch.unique(pack.indices[r["name"]])) / 16
        assert a["kernels"][k][0] == r["count"] == sum(a["counts"][k][0])
    assert a["layers"][-1]["role"] == "head"
    assert a["tasks"][0]["bytes"] == {
        k: run_summary(run.path)["tasks"][0][k] for k in ("indices", "state", "head", "total")
    }
    assert sum(r["pool_bytes"] for r in a["layers"]) == a["pools_bytes"]
    paths = write_report(run.path)
    assert paths["html"] == str(run.path / "report" / "report.html")
