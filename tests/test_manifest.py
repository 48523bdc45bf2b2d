"""The run manifest as typed objects: round trips, older versions, errors that name the field."""

from __future__ import annotations

import copy
import json

import pytest

from nwsconvert import Manifest, RunDir
from nwsconvert.errors import FormatError, TaskNotFoundError
from nwsconvert.train.manifest import MANIFEST_VERSION, BaseEntry, PoolsEntry, TaskEntry, model_sha256

SHA = "ab" * 32


def _manifest() -> Manifest:
    m = Manifest.new(
        "timm:resnet18", {"in_chans": 1}, {"version": 1, "pool_size": 32}, 21, {"suite": "s"}, {"epochs": 2}
    )
    m.pools = PoolsEntry(SHA, "pools.safetensors", 1234, True, {"val_acc": 0.5})
    m.base = BaseEntry(SHA, "base.nwspack", 10)
    m.put_task(TaskEntry(0, "t0", 2, "tasks/task_0.nwspack", SHA, {"val_acc": 0.75}, ["a", "b"], {"indices": 3}))
    return m


def test_round_trip_is_exact():
    m = _manifest()
    d = m.to_dict()
    assert d["format"] == "nwsconvert.run" and d["version"] == MANIFEST_VERSION
    assert d["model_sha256"] == model_sha256(d["model"])
    again = Manifest.from_dict(json.loads(json.dumps(d)))
    assert again == m
    assert again.to_dict() == d


def test_rundir_writes_and_reads_the_same_manifest(tmp_path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    m = _manifest()
    run.write(m)
    assert run.read() == m
    assert json.loads(run.manifest_path.read_text()) == m.to_dict()


def test_put_task_replaces_an_entry_of_the_same_id_and_task_finds_it():
    m = _manifest()
    m.put_task(TaskEntry(1, "t1", 3, "tasks/task_1.nwspack", SHA, {}))
    m.put_task(TaskEntry(0, "again", 2, "tasks/task_0.nwspack", SHA, {}))
    assert [t.id for t in m.tasks] == [1, 0] and m.finished == [0, 1]
    assert m.task(0).name == "again"
    with pytest.raises(TaskNotFoundError, match=r"no finished task 5; finished tasks: \[0, 1\]"):
        m.task(5)


def test_rundir_task_errors_name_the_run(tmp_path):
    run = RunDir(tmp_path / "r")
    with pytest.raises(TaskNotFoundError, match=r"run '.*r' has no finished task 3; finished tasks: \[0\]"):
        run.task_entry(_manifest(), 3)


def test_version_1_without_optional_fields_reads():
    """The oldest manifests had no model_sha256, kwargs, convert, pools or base: they read with defaults."""
    d = {
        "format": "nwsconvert.run",
        "version": 1,
        "model": {"spec": "timm:resnet18"},
        "tasks": [{"id": 0, "name": "t", "num_classes": 2, "file": "tasks/t.nwspack", "sha256": SHA, "metrics": {}}],
    }
    m = Manifest.from_dict(d)
    assert m.version == 1 and m.model.kwargs == {} and m.model.convert is None and m.pools is None
    assert m.tasks[0].class_names is None and m.tasks[0].bytes is None
    assert m.model.config().pool_size == 512  # NWSConfig's defaults
    assert m.to_dict()["version"] == MANIFEST_VERSION  # written back as the current version


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d["model"].update(spec="nocolon"), "model.spec"),
        (lambda d: d["tasks"][0].update(id=-1), r"tasks\[0\].id"),
        (lambda d: d["tasks"].append(copy.deepcopy(d["tasks"][0])), r"tasks\[1\].id"),
        (lambda d: d["pools"].update(sha256="x"), "pools.sha256"),
        (lambda d: d.update(created=5), "created"),
        (lambda d: d.update(versions=[]), "versions"),
        (lambda d: d["model"].update(layers=-1), "model"),  # model.layers, or the hash that pins the entry
        (lambda d: d["data"].update(weights_sha256=7), "data.weights_sha256"),
    ],
)
def test_bad_fields_are_named(edit, field):
    d = _manifest().to_dict()
    edit(d)
    with pytest.raises(FormatError, match=f"field {field}"):
        Manifest.from_dict(d, "RUN/manifest.json")
