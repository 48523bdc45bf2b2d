"""nws-train / nws-info as a user runs them: help, errors, YAML, a killed run resumed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import nwsconvert
from nwsconvert import RunDir
from nwsconvert.cli.info import info_main
from nwsconvert.cli.train import train_main
from nwsconvert.errors import UsageError
from nwsconvert.train.job import resolve_job

FAST = ["model=timm:test_resnet", "pool_size=32", "pool_epochs=1", "progress=false", "checkpoint_interval=0"]


def _cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "nwsconvert.cli.train", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key in (
        "suite=NAME",
        "suite.OPTION",
        "model=SPEC",
        "pool_size",
        "group_size",
        "preset=NAME",
        "recipe",
        "--resume",
        "out=DIR",
        "milestones",
        "task_init",
        "torchrun",
    ):
        assert key in out
    from nwsconvert.zoo import list_recipes, list_suites

    help_text = " ".join(out.split())  # wrapped lines joined
    assert all(name in help_text for name in [*list_suites(), *list_recipes()]), help_text
    from nwsconvert.zoo import get_recipe

    for name in list_recipes():  # the help's summary of each recipe is the recipe's own numbers
        cfg = get_recipe(name)
        line = re.search(rf"{name}( \(default\))?: ([^;]*)", help_text)
        assert line and f"{cfg.optimizer} lr {cfg.lr}" in line[2] and f"{cfg.epochs} epochs" in line[2], name
    with pytest.raises(SystemExit):
        info_main(["--help"])
    assert "--json" in capsys.readouterr().out


def test_yaml_config_and_overrides(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: torchvision:resnet18\nepochs: 7\nmilestones: [3, 5]\nsuite_options: {path: /data/c100}\n")
    job = resolve_job([str(cfg), "epochs=9", "suite.train_per_class=5", "model.drop_rate=0.1"])
    assert job["model"] == "torchvision:resnet18" and job["epochs"] == 9 and job["milestones"] == [3, 5]
    assert job["suite_options"] == {"path": "/data/c100", "train_per_class": 5} and job["model_kwargs"] == {
        "drop_rate": 0.1
    }
    with pytest.raises(UsageError, match="unknown key 'epoch'"):
        resolve_job(["epoch=3"])
    with pytest.raises(UsageError, match="neither key=value nor an existing YAML"):
        resolve_job(["missing.yaml"])


def test_clear_errors(tmp_path, capsys):
    for args, message in (
        (["model=torchvision:resnet18"], "torchvision classifiers take 3"),
        (["model=timm:resnet_nope"], "timm has no model 'resnet_nope'"),
        (["suite=nope"], "known suites"),
    ):
        assert train_main([*args, f"out={tmp_path / 'x'}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nws-train: ") and message in err and err.count("\n") == 1, err
    assert info_main([str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_resume_where_no_run_was_started_is_refused_and_starts_nothing(tmp_path, capsys):
    # --resume continues a run: with no manifest and no job.json there is no job to continue, and
    # starting the defaults (split-mnist, ResNet-18, pool 512) in its place would train a job nobody asked for.
    empty = tmp_path / "empty"
    empty.mkdir()
    for out, what in ((tmp_path / "missing", "does not exist"), (empty, "holds no run")):
        assert train_main(["--resume", f"out={out}", "progress=false"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nws-train: ") and err.count("\n") == 1, err
        assert what in err and "nothing to resume" in err and f"out={out} (without --resume)" in err
        assert not (out / "job.json").exists() and not (out / "manifest.json").exists()
    assert not (tmp_path / "missing").exists() and list(empty.iterdir()) == []  # not even a lock file
    # A folder holding only job.json (a run killed before its manifest) restarts exactly that job:
    # test_trust.py::test_resume_before_the_manifest_starts_the_run_and_cleans_temporaries; one with a
    # manifest continues: tests/test_kill_resume.py.


@pytest.mark.slow
def test_same_seed_same_run(tmp_path):
    """A seed reproduces a run bit for bit on one machine: model init, pools, indices, state (on CUDA
    with ``deterministic=true``); the process's deterministic setting is restored afterwards."""
    shas = []
    for name in ("a", "b"):
        torch.manual_seed(len(name) * 1234 + ord(name))  # whatever state the process is in
        # deterministic=true: what makes a CUDA run reproducible (cuDNN and cuBLAS choose fixed algorithms)
        assert (
            train_main([*FAST, "epochs=1", "tasks=1", "seed=11", "deterministic=true", f"out={tmp_path / name}"]) == 0
        )
        m = RunDir(tmp_path / name).read()
        shas.append((m.pools.sha256, m.base.sha256, [t.sha256 for t in m.tasks]))
        assert not torch.are_deterministic_algorithms_enabled()
    assert shas[0] == shas[1]


def test_preset_key_converts_with_the_family_preset_and_the_run_reloads(tmp_path, capsys):
    out = tmp_path / "p"
    assert train_main([*FAST, "epochs=1", "tasks=1", "preset=auto", f"out={out}"]) == 0
    assert "conversion preset 'resnet-bottleneck'" in capsys.readouterr().out  # timm test_resnet: Bottleneck blocks
    manifest = RunDir(out).read()
    options = manifest.model.convert
    assert manifest.data["job"]["preset"] == "auto"
    # The preset capped the small layers' pools at their kernel count: recorded, and load() rebuilds them.
    capped = {name: e["pool_size"] for name, e in options["layers"].items() if e and "pool_size" in e}
    assert capped and all(n < 32 for n in capped.values()) and options["version"] == 1
    model = nwsconvert.load(out, task=0)
    sizes = {l.name: l.nws.pool_size for l in nwsconvert.nws_layers(model)}
    assert all(sizes[name] == n for name, n in capped.items())
    assert train_main([*FAST, "preset=nope", f"out={tmp_path / 'q'}"]) == 2
    assert re.search("unknown preset 'nope'.*preset=auto", capsys.readouterr().err)


def test_resume_keeps_the_training_options_the_run_started_with(tmp_path, monkeypatch):
    """A default that changes between the start of a run and its --resume (task_init did: previous, then
    original; recalibrate_bn did: absent, then on) does not change the run half-way; an option given on
    the --resume command line still wins."""
    from nwsconvert.train import stage
    from nwsconvert.train.store import RunStore

    recalibrated = []
    real_update_bn = stage.update_bn
    monkeypatch.setattr(stage, "update_bn", lambda *a: (recalibrated.append(1), real_update_bn(*a)))
    out = tmp_path / "r"
    assert train_main([*FAST, "epochs=1", "tasks=1", f"out={out}"]) == 0
    assert recalibrated == [1]  # on by default
    run = RunDir(out)
    manifest = run.read()
    assert manifest.config["task_init"] == "original" and "task_init" not in manifest.data["job"]
    manifest.config["task_init"] = "previous"  # as a run started under the old default recorded it
    del manifest.config["recalibrate_bn"]  # as a run started before the option existed recorded it
    run.write(manifest)
    calls = []
    real = RunStore.init_weights
    monkeypatch.setattr(
        RunStore, "init_weights", lambda self, model, how, seed: (calls.append(how), real(self, model, how, seed))
    )
    assert train_main(["--resume", f"out={out}", "tasks=2"]) == 0
    assert calls == [] and run.read().finished == [0, 1]  # task 1 started from task 0's kernels
    assert train_main(["--resume", f"out={out}", "tasks=3", "task_init=random"]) == 0
    assert calls == ["random"] and run.read().finished == [0, 1, 2]
    assert recalibrated == [1]  # tasks 1 and 2 ran as the run started: without recalibration


def test_resume_compares_what_a_run_trains_not_where_its_files_lie(tmp_path, monkeypatch):
    from nwsconvert.train.job import resume_changes

    monkeypatch.setenv("HOME", str(tmp_path))
    from nwsconvert.zoo import get_recipe

    recorded = {  # as recorded_job reads a manifest: the recipe's options, then the job
        **get_recipe("demo").to_dict(),
        **resolve_job(["suite=split-fashion-mnist", "suite.root=/data/a", f"init={tmp_path}/p.safetensors"]),
    }
    same = resolve_job(["suite.root=/mnt/moved", "init=~/p.safetensors", "preset=none"], recorded)
    assert resume_changes(recorded, same, "m.json") == []  # data moved, a path spelled otherwise, none as null
    changed = resolve_job(["suite.classes_per_task=5", "lr=0.5"], recorded)
    with pytest.raises(
        UsageError, match=r"--resume: suite.classes_per_task=5 \(the run's: suite.classes_per_task unset\)"
    ):
        resume_changes(recorded, changed, "m.json")
    assert resume_changes(recorded, resolve_job(["lr=0.5", "out=/x"], recorded), "m.json") == [
        "lr=0.5 (the run's: 0.02)"
    ]


def test_a_bad_item_when_restarting_a_run_stopped_before_its_manifest_keeps_its_job(tmp_path, capsys):
    """--resume of a run stopped before its manifest starts it again from job.json; an item that turns out
    bad once torch is loaded (more tasks than the suite has) leaves job.json as the run recorded it."""
    import json

    out = tmp_path / "r"
    out.mkdir()
    recorded = (json.dumps(resolve_job([*FAST, "epochs=1", f"out={out}"]), indent=2) + "\n").encode()
    (out / "job.json").write_bytes(recorded)
    assert train_main(["--resume", f"out={out}", "tasks=99"]) == 2
    assert "tasks=99: suite split-mnist has 5 tasks" in capsys.readouterr().err
    assert (out / "job.json").read_bytes() == recorded and not (out / "manifest.json").exists()


def test_an_empty_out_and_more_tasks_than_the_suite_are_usage_errors_that_leave_no_job(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run directory would be runs/<suite>-<model> here
    assert train_main([*FAST, "out="]) == 2
    assert "out= in argument 'out=' is empty: give the run directory" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # Found once the suite is loaded (after job.json is written): the job is taken back, so --resume
    # does not start the bad job again.
    assert train_main([*FAST, "tasks=99", f"out={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert err == "nws-train: tasks=99: suite split-mnist has 5 tasks; give at most that\n"
    assert not (tmp_path / "r").exists()  # nor the folder this command made (its lock file included)
    # A folder that was there before keeps what it holds.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    assert train_main([*FAST, "tasks=99", f"out={tmp_path / 'mine'}"]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == [".lock", "notes.txt"]
    assert train_main(["--resume", f"out={tmp_path / 'r'}"]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_resume_announces_changed_options_and_refuses_another_suite_model_or_pools(tmp_path, capsys):
    """--resume's command line wins for training options: said on stderr and in metrics.jsonl, not silently.
    Another suite, model or pool size would mix two runs in one directory: refused in one line, exit 2,
    before anything runs."""
    out = tmp_path / "r"
    assert train_main([*FAST, "epochs=1", "tasks=1", f"out={out}"]) == 0
    capsys.readouterr()
    run = RunDir(out)
    before = run.log_path.read_text()
    for items, said in (
        (["suite.classes_per_task=5"], "suite.classes_per_task=5 (the run's: suite.classes_per_task unset)"),
        (["model=timm:resnet18"], 'model="timm:resnet18" (the run\'s: model="timm:test_resnet")'),
        (["pool_size=64", "lr=0.5"], "pool_size=64 (the run's: pool_size=32)"),
        (["recipe=paper-adam"], 'recipe="paper-adam" (the run\'s: recipe="demo")'),  # its options are the run's
    ):
        assert train_main(["--resume", f"out={out}", "tasks=2", *items]) == 2, items
        err = capsys.readouterr().err
        assert said in err and "keeps the tasks, model, pools and recipe" in err and "out=OTHER_DIR" in err, err
        assert len(err.strip().splitlines()) == 1 and run.log_path.read_text() == before  # nothing ran
    assert run.read().finished == [0]
    # An option given again with the value it has is no change; a new one is announced and logged.
    # How a preset's absence is spelled is no change either (more such cases: the test below).
    items = ["tasks=2", "epochs=1", "progress=false", "preset=none"]
    assert train_main(["--resume", f"out={out}", *items]) == 0
    said = capsys.readouterr()
    assert "resuming" not in said.err
    # What the resumed run had finished before is said so: its figures are the recorded ones.
    lines = [line for line in said.out.splitlines() if re.match(r"pools:|task \d+ \(", line)]
    assert [line.endswith("(finished before this --resume)") for line in lines] == [True, True, False], lines
    assert train_main(["--resume", f"out={out}", "tasks=3", "lr=0.05"]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err and "lr=0.05 (the run's: " in err and "finished stages keep theirs" in err
    logged = [line for line in run.log_path.read_text().splitlines() if "changed options" in line]
    assert len(logged) == 1 and "lr=0.05" in logged[0] and run.read().finished == [0, 1, 2]
