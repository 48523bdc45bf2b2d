"""Trust and integrity: a run directory or bundle from someone else is data, never code.

Every damaged, edited, swapped or foreign file is refused by name (an
``NWSError`` naming the file), sizes are checked before allocation, one
process writes a run, and ``convert`` never silently does nothing.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from trainer_utils import KWARGS, SPEC, tiny_model, train_run

import nwsconvert
from nwsconvert import Trainer
from nwsconvert.cli.common import run_cli
from nwsconvert.errors import FormatError, NWSError, PackMismatchError, RunLockedError, UntrustedCodeError
from nwsconvert.export import Runtime, export_bundle
from nwsconvert.export.cli import infer_main
from nwsconvert.formats.packs import PACK_FORMAT, PACK_VERSION
from nwsconvert.formats.stfile import read_header
from nwsconvert.formats.storage import atomic_write_bytes, read_tensors, write_tensors
from nwsconvert.train.manifest import model_sha256
from nwsconvert.train.runlock import RunLock


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs of the same architecture (different seeds) and run A's ONNX bundle."""
    root = tmp_path_factory.mktemp("trust")
    a, b = root / "a", root / "b"
    train_run(a, tiny_model(seed=1), seed=1, data_seed=1)
    train_run(b, tiny_model(seed=2), seed=2, data_seed=2)
    export_bundle(a, a / "export", "all", onnx=True)
    return a, b


@pytest.fixture()
def run_a(runs, tmp_path):
    """A private copy of run A (the test may damage it)."""
    return Path(shutil.copytree(runs[0], tmp_path / "a"))


def _edit_manifest(run: Path, edit, rehash: bool = True) -> None:
    """Edit a run's manifest as someone who means it would: the model entry's hash follows the edit
    (``rehash=False``: as a corruption would, leaving the hash behind)."""
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    if rehash and isinstance(manifest.get("model"), dict):
        manifest["model_sha256"] = model_sha256(manifest["model"])
    path.write_text(json.dumps(manifest))


def _names(error: Exception, path: Path) -> bool:
    return path.name in str(error)


# ------------------------------------------------------------------ no code from data
def test_a_manifest_spec_never_runs_code(run_a, tmp_path):
    sentinel = tmp_path / "ran"
    _edit_manifest(run_a, lambda m: m["model"].update(spec="subprocess:getoutput", kwargs={"cmd": f"touch {sentinel}"}))
    with pytest.raises(UntrustedCodeError, match=r"manifest.json: .*'subprocess:getoutput'.*trust_code=True"):
        nwsconvert.load(run_a, task=0)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from nwsconvert.export.cli import export_main; sys.exit(export_main(sys.argv[1:]))",
            str(run_a),
            "--task",
            "0",
            "--onnx",
            "--out",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "--trust-code" in proc.stderr and "Traceback" not in proc.stderr
    job = {"model": "subprocess:getoutput", "model_kwargs": {"cmd": f"touch {sentinel}"}, "out": str(run_a)}
    _edit_manifest(run_a, lambda m: m["data"].update(job=job))
    resumed = subprocess.run(
        [sys.executable, "-m", "nwsconvert.cli.train", "--resume", f"out={run_a}"], capture_output=True, text=True
    )
    assert resumed.returncode != 0 and "--trust-code" in resumed.stderr and "Traceback" not in resumed.stderr
    assert not sentinel.exists()


def test_loading_kwargs_are_refused_whatever_the_trust(run_a):
    _edit_manifest(run_a, lambda m: m["model"]["kwargs"].update(checkpoint_path="/tmp/evil.pth"))
    with pytest.raises(ValueError, match="checkpoint_path"):
        nwsconvert.load(run_a, task=0, trust_code=True)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["model"]["kwargs"].update(act_layer="gelu"),  # builds, but another model
        lambda m: m["model"]["kwargs"].update(drop_rate="x"),  # builds, fails only at forward
        lambda m: m["model"].update(spec="timm:resnet10t"),
        lambda m: m["model"]["convert"]["layers"].update(fc=None),
    ],
    ids=["act_layer", "drop_rate", "spec", "convert"],
)
def test_an_edited_model_entry_is_refused_by_its_hash(run_a, edit):
    """The packs say nothing about activations or dropout: only the manifest's model_sha256 pins them."""
    _edit_manifest(run_a, edit, rehash=False)
    with pytest.raises(FormatError, match=r"manifest.json: field model: .*model_sha256"):
        nwsconvert.load(run_a, task=0)


def test_a_manifest_from_before_conversion_configs_still_loads(run_a):
    """Version 2 recorded loose converter options; it reads as the same NWSConfig and rebuilds the same model."""
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        want = nwsconvert.load(run_a, task=0)(x)

    def to_v2(m):
        conv = m["model"]["convert"]
        m["version"] = 2
        m["model"]["convert"] = {
            "pool_size": conv["pool_size"],
            "group_size": conv["group_size"],
            "skip": [],
            "layer_pool_size": {},
            "layer_group_size": {},
        }

    _edit_manifest(run_a, to_v2)
    with torch.no_grad():
        assert torch.equal(nwsconvert.load(run_a, task=0)(x), want)
    _edit_manifest(run_a, lambda m: m["model"]["convert"].update(layer_pool_size={"*": "x"}))
    with pytest.raises(FormatError, match=r"manifest.json: field model.convert: pool_size must be an integer"):
        nwsconvert.load(run_a, task=0)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m["model"]["kwargs"].update(in_chans=-1), "in_chans"),  # the factory raises RuntimeError
        (lambda m: m["model"]["convert"]["layers"].update({"*": None}), "cannot be converted as recorded"),
        (lambda m: m["model"].update(kwargs=None), "pack weight shape"),  # default in_chans: not the packs' model
    ],
    ids=["factory-error", "convert-error", "kwargs-null"],
)
def test_a_model_entry_that_cannot_be_built_names_the_manifest(run_a, edit, match):
    _edit_manifest(run_a, edit)
    with pytest.raises((FormatError, PackMismatchError), match=match) as e:
        nwsconvert.load(run_a, task=0)
    assert "manifest.json" in str(e.value)


def test_null_and_mistyped_manifest_fields_are_read_or_named(run_a, tmp_path):
    from nwsconvert.analysis.summary import format_summary, run_summary

    _edit_manifest(
        run_a, lambda m: (m.update(data=None), m["tasks"][0]["metrics"].pop("val_acc"), m["pools"].update(bytes=None))
    )
    text = format_summary(run_summary(run_a))
    assert "n/a" in text and "pool set (shared)" in text
    export_bundle(run_a, tmp_path / "b", 0)  # data null: exported with defaults
    _edit_manifest(run_a, lambda m: m["tasks"][1]["metrics"].update(val_acc="x"))
    with pytest.raises(FormatError, match=r"field tasks\[1\].metrics.val_acc"):
        run_summary(run_a)
    _edit_manifest(run_a, lambda m: (m["tasks"][1]["metrics"].update(val_acc=0.5), m.update(data={"mean": ["x"]})))
    with pytest.raises(FormatError, match=r"field data.mean"):
        nwsconvert.load(run_a, task=0)


@pytest.mark.parametrize("where", ["/etc/passwd", "../a/tasks/task_0.nwspack", "tasks/../../x.nwspack", "link"])
def test_manifest_paths_stay_inside_the_run(run_a, tmp_path, where):
    if where == "link":
        outside = tmp_path / "outside.nwspack"
        shutil.copy(run_a / "tasks" / "task_0.nwspack", outside)
        (run_a / "tasks" / "link.nwspack").symlink_to(outside)
        where = "tasks/link.nwspack"
    _edit_manifest(run_a, lambda m: m["tasks"][0].update(file=where))
    with pytest.raises(FormatError, match="(outside the run directory|field tasks\\[0\\].file)"):
        nwsconvert.load(run_a, task=0)


# ------------------------------------------------------------------ swapped and foreign files
def test_swapped_and_foreign_packs_are_refused_by_name(runs, run_a):
    _, b = runs
    tasks = run_a / "tasks"
    shutil.copy(tasks / "task_1.nwspack", tasks / "task_0.nwspack")  # another task's pack
    with pytest.raises(PackMismatchError) as e:
        nwsconvert.load(run_a, task=0)
    assert _names(e.value, tasks / "task_0.nwspack")
    with pytest.raises(PackMismatchError, match="task is 1, expected 0"):
        nwsconvert.TaskPack.load(tasks / "task_0.nwspack", task=0)
    own = nwsconvert.TaskPack.load(b / "tasks" / "task_0.nwspack")  # another run's pack, read on its own
    with pytest.raises(PackMismatchError, match="run is"):
        nwsconvert.TaskPack.load(
            b / "tasks" / "task_0.nwspack", run_id=json.loads((run_a / "manifest.json").read_text())["run_id"]
        )
    with pytest.raises(PackMismatchError, match="pool set"):
        nwsconvert.TaskPack.load(
            b / "tasks" / "task_0.nwspack", pool_sha256=nwsconvert.PoolSet.load(run_a / "pools.safetensors").sha256
        )
    assert own.task == 0 and own.run_id is not None


def test_a_base_pack_never_passes_for_a_task(runs, run_a):
    # A base pack names no task (its header says task: null) and its hash is its own, so only its kind
    # tells it apart: the torch and the torch-free readers, and the Runtime's switch mode, refuse it by name.
    from nwsconvert.formats.packfile import read_pack_arrays

    _, b = runs
    run_id = json.loads((run_a / "manifest.json").read_text())["run_id"]
    for base, whose in ((run_a / "base.nwspack", "the run's"), (b / "base.nwspack", r"run \w+\.\.\.'s")):
        for load, says in (
            (lambda p: nwsconvert.TaskPack.load(p, task=1, run_id=run_id), whose),
            (lambda p: nwsconvert.TaskPack.load(p, task=1), "a run's"),
            (lambda p: read_pack_arrays(p, task=1), "a run's"),
        ):
            with pytest.raises(PackMismatchError, match=f"{base.name} is {says} base pack .* not task 1's pack"):
                load(base)
    assert nwsconvert.TaskPack.load(run_a / "base.nwspack").task is None  # read as what it is, it loads
    # The same file under task 1's name in an exported bundle, read by the switch mode by path: refused
    # (the bundle's hash names the file before its kind is read).
    bundle = run_a / "export"
    target = bundle / json.loads((bundle / "bundle.json").read_text())["tasks"]["1"]["pack"]
    shutil.copy(run_a / "base.nwspack", target)
    x = np.zeros((1, 1, 16, 16), np.float32)
    with pytest.raises(PackMismatchError, match=target.name):
        Runtime(bundle, device="cpu", mode="switch").run(1, x)


def test_another_runs_pool_file_or_base_is_refused(runs, run_a):
    _, b = runs
    shutil.copy(b / "pools.safetensors", run_a / "pools.safetensors")
    with pytest.raises(FormatError, match="pools.safetensors: pool set .* the manifest records"):
        nwsconvert.load(run_a, task=0)
    shutil.copy(runs[0] / "pools.safetensors", run_a / "pools.safetensors")
    shutil.copy(b / "base.nwspack", run_a / "base.nwspack")
    with pytest.raises(FormatError, match="task_0.nwspack: indices are stored as changes against base pack"):
        nwsconvert.load(run_a, task=0)


def _another_base(run: Path, dst: Path) -> str:
    """A base pack on the same pools that the run never wrote (task 1's indices, standalone; the run's base
    state, so that the tasks' state entries coded against it still decode)."""
    other = nwsconvert.TaskPack.load(run / "tasks" / "task_1.nwspack")
    other.state = dict(nwsconvert.TaskPack.load(run / "base.nwspack").state)
    other.base, other.task = None, None
    return other.save(dst)


@pytest.mark.parametrize("pinned", ["file hashes", "manifest before file hashes"])
def test_a_pack_re_pointed_at_another_base_is_refused_through_the_run(run_a, pinned):
    """The attack: ``base.nwspack`` replaced by another base on the same pools, and task 0's pack
    header pointed at it with both its hashes recomputed. The pack's tensors are unchanged, so their
    hash still matches the manifest, and the file alone reads (it would answer as another model).
    Through the run it is refused: by the whole file's hash, and in a manifest from before those
    hashes, by the run's own base hash."""
    original = (run_a / "base.nwspack").read_bytes()
    if pinned != "file hashes":
        _edit_manifest(run_a, lambda m: [e.pop("file_sha256") for e in (m["base"], *m["tasks"])])
    nwsconvert.load(run_a, task=0)  # the run as written loads
    sha = _another_base(run_a, run_a / "base.nwspack")
    path = run_a / "tasks" / "task_0.nwspack"
    _rewrite(path, lambda h: h["base"].update(sha256=sha))
    forged = nwsconvert.TaskPack.load(path)  # consistent on its own
    assert forged.base_sha256 == sha and forged.sha256 == nwsconvert.RunDir(run_a).read().task(0).sha256
    for base in ("forged", "the run's"):
        if base == "the run's":
            (run_a / "base.nwspack").write_bytes(original)
        with pytest.raises(FormatError, match="not the base its run or bundle records") as e:
            nwsconvert.load(run_a, task=0)
        assert _names(e.value, path) and "\n" not in str(e.value)


def test_a_re_signed_pack_header_is_refused_by_the_whole_file_hash(run_a):
    """Any header edit with fresh hashes (here an informative field, the task's name in ``meta``) leaves the
    tensors' hash as the manifest records it; the whole file's hash, recorded since, refuses it."""
    path = run_a / "tasks" / "task_0.nwspack"
    _rewrite(path, lambda h: h["meta"].update(name="renamed"))
    assert nwsconvert.TaskPack.load(path).meta["name"] == "renamed"
    with pytest.raises(FormatError, match="task_0.nwspack: not the pack of task 0 this run wrote"):
        nwsconvert.load(run_a, task=0)
    _edit_manifest(run_a, lambda m: [e.pop("file_sha256") for e in m["tasks"]])  # a run from before the hashes
    nwsconvert.load(run_a, task=0)
    (run_a / "base.nwspack").write_bytes((run_a / "base.nwspack").read_bytes() + b" ")  # trailing bytes
    with pytest.raises(FormatError, match="base.nwspack"):
        nwsconvert.load(run_a, task=1)


def test_a_bundle_pack_re_pointed_at_another_base_is_refused_by_the_runtime(run_a):
    bundle = run_a / "export"
    row = json.loads((bundle / "bundle.json").read_text())["tasks"]["0"]
    sha = _another_base(run_a, bundle / row["base"])
    _rewrite(bundle / row["pack"], lambda h: h["base"].update(sha256=sha))
    with pytest.raises(FormatError, match="not the base its run or bundle records"):
        Runtime(bundle, device="cpu", mode="switch").run(0, np.zeros((1, 1, 16, 16), np.float32))


def test_a_task_pack_in_place_of_the_base_is_refused_without_recursion(run_a):
    shutil.copy(run_a / "tasks" / "task_1.nwspack", run_a / "base.nwspack")
    with pytest.raises(FormatError, match="delta-coded itself"):
        nwsconvert.TaskPack.load(run_a / "tasks" / "task_0.nwspack")
    with pytest.raises(FormatError, match="delta-coded itself"):
        nwsconvert.TaskPack.load(run_a / "base.nwspack")  # its own base lookup finds itself


# ------------------------------------------------------------------ edited headers, bounded sizes
def _rewrite(path: Path, edit, keep_hashes: bool = False) -> None:
    """Edit a file's nwsconvert header: in place (hashes go stale) or re-written with fresh hashes (a crafted file)."""
    data = path.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    outer = json.loads(data[8 : 8 + hlen])
    header = json.loads(outer["__metadata__"]["nwsconvert"])
    if keep_hashes:
        edit(header)
        outer["__metadata__"]["nwsconvert"] = json.dumps(header, sort_keys=True)
        head = json.dumps(outer).encode()
        head += b" " * (-len(head) % 8)
        path.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + hlen :])
        return
    tensors, header = read_tensors(path, header["format"], header["version"])
    fields = {k: v for k, v in header.items() if k not in ("format", "version", "sha256", "header_sha256")}
    edit(fields)
    write_tensors(path, tensors, header["format"], header["version"], **fields)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["layers"][0].update(changes=h["layers"][0].get("changes", 0) + 1), "header_sha256"),
        (lambda h: h.pop("sha256"), "header_sha256"),
        (lambda h: h.pop("header_sha256"), "has no header_sha256"),
        (lambda h: h.update(num_classes=10**6), "header_sha256"),
    ],
)
def test_edited_pack_headers_are_refused(run_a, edit, match):
    path = run_a / "tasks" / "task_0.nwspack"
    _rewrite(path, edit, keep_hashes=True)
    with pytest.raises(FormatError, match=match) as e:
        nwsconvert.TaskPack.load(path)
    assert _names(e.value, path)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda h: h.update(num_classes=10**6), "num_classes"),
        (lambda h: h["layers"][0].update(count=10**12), r"layers\[0\].count"),
        (lambda h: h["layers"][0].update(pool_size=2**62), r"layers\[0\].pool_size"),
        (lambda h: h["layers"][0].update(shape="abc"), r"layers\[0\].shape"),
        (lambda h: h["layers"][2].update(coding="delta+zip"), r"layers\[2\].coding"),
        (lambda h: h.update(base={"sha256": "0" * 64, "file": "../../etc/passwd"}), "base.file"),
        (lambda h: h.update(state_keys=7), "state_keys"),
    ],
)
def test_crafted_pack_headers_are_checked_before_any_allocation(run_a, edit, field):
    """A file whose hashes were recomputed after the edit still fails on the field, before decoding."""
    path = run_a / "tasks" / "task_0.nwspack"
    _rewrite(path, edit)
    with pytest.raises(FormatError, match=field) as e:
        nwsconvert.TaskPack.load(path)
    assert _names(e.value, path)


def test_a_crafted_bits_layer_cannot_claim_more_indices_than_its_bytes(run_a):
    path = run_a / "base.nwspack"  # standalone: every layer in bits or ans
    pack = nwsconvert.TaskPack.load(path)
    bits_layer = next(i for i, c in enumerate(pack.layer_codings().values()) if c == "bits")
    shape = pack.layers[bits_layer]["shape"]
    _rewrite(
        path,
        lambda h: h["layers"][bits_layer].update(
            shape=[shape[0] * 1000, *shape[1:]], count=pack.layers[bits_layer]["count"] * 1000
        ),
    )
    with pytest.raises(FormatError, match=f"indices/{pack.layers[bits_layer]['name']}.*bytes"):
        nwsconvert.TaskPack.load(path)


def test_damaged_manifest_fields_are_named(run_a):
    _edit_manifest(run_a, lambda m: m["tasks"][1].update(num_classes="two"))
    with pytest.raises(FormatError, match=r"manifest.json: field tasks\[1\].num_classes: expected an integer"):
        nwsconvert.RunDir(run_a).read()
    _edit_manifest(run_a, lambda m: (m["tasks"][1].update(num_classes=2), m["tasks"][0].pop("sha256")))
    with pytest.raises(FormatError, match=r"field tasks\[0\].sha256 is missing"):
        nwsconvert.load(run_a, task=0)


def test_pool_file_header_must_describe_its_tensors(run_a):
    path = run_a / "pools.safetensors"
    _rewrite(path, lambda h: h["layers"][0].update(pool_size=2**40))
    with pytest.raises(FormatError, match=r"field layers\[0\].pool_size"):
        nwsconvert.PoolSet.load(path)


# ------------------------------------------------------------------ the runtime checks what it loads
def _bundle(run_a: Path) -> Path:
    return run_a / "export"


def test_runtime_refuses_another_runs_pool_file_and_corrupted_floats(runs, run_a):
    bundle = _bundle(run_a)
    x = np.random.default_rng(0).standard_normal((2, 1, 16, 16)).astype(np.float32)
    good = Runtime(bundle, device="cpu").run(0, x)
    assert np.isfinite(good).all()
    shutil.copy(runs[1] / "pools.safetensors", bundle / "pools.safetensors")
    with pytest.raises(FormatError, match="pools.safetensors: its content does not match the pool set"):
        Runtime(bundle, device="cpu")
    shutil.copy(runs[0] / "pools.safetensors", bundle / "pools.safetensors")
    data = bytearray((bundle / "pools.safetensors").read_bytes())
    data[-4:] = np.array([np.nan], dtype=np.float32).tobytes()  # the last pool float becomes NaN
    (bundle / "pools.safetensors").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="pools.safetensors"):
        Runtime(bundle, device="cpu")
    assert infer_main(["--bundle", str(bundle), "--task", "0", "--bench"]) == 1


def _move_tensors(path: Path) -> None:
    """Rewrite a safetensors file with the same tensors and metadata, stored in reverse order (other offsets)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    parts = {k: body[slice(*header[k]["data_offsets"])] for k in names}
    new = b""
    for k in reversed(names):
        header[k]["data_offsets"] = [len(new), len(new) + len(parts[k])]
        new += parts[k]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + new)


def test_runtime_uses_the_pool_tensors_its_header_names_not_the_graphs_offsets(run_a):
    """The graphs record external-data offsets into pools.safetensors at export; a pool file holding the
    same tensors at other offsets has the same content hash, so it is accepted, and the logits must be
    the same (the Runtime hands every session the tensors it checked, by name)."""
    bundle = _bundle(run_a)
    x = np.random.default_rng(0).standard_normal((2, 1, 16, 16)).astype(np.float32)
    before = [Runtime(bundle, device="cpu").run(t, x) for t in (0, 1)]
    old = read_header(bundle / "pools.safetensors")
    _move_tensors(bundle / "pools.safetensors")
    moved = read_header(bundle / "pools.safetensors")
    assert {k: t.start for k, t in moved.tensors.items()} != {k: t.start for k, t in old.tensors.items()}
    rt = Runtime(bundle, device="cpu")
    for t in (0, 1):
        assert np.array_equal(rt.run(t, x), before[t])  # same floats, same graph, same provider: bit-identical


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove"])
def test_runtime_refuses_a_damaged_graph_by_name(run_a, damage, capsys):
    graph = _bundle(run_a) / "task_1.onnx"
    data = graph.read_bytes()
    if damage == "truncate":
        graph.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        graph.write_bytes(data[:100] + bytes([data[100] ^ 0x10]) + data[101:])
    else:
        graph.unlink()
    rt = Runtime(_bundle(run_a), device="cpu", mode="session")  # task graphs: the session mode's files
    rt.session(0)  # the other task is untouched
    with pytest.raises((FormatError, FileNotFoundError), match="task_1.onnx"):
        rt.session(1)
    assert infer_main(["--bundle", str(_bundle(run_a)), "--task", "1", "--bench", "--mode", "session"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nws-infer: ") and "task_1.onnx" in err and err.count("\n") == 1


def test_truncated_pool_file_and_bad_bundle_json(run_a):
    pool = _bundle(run_a) / "pools.safetensors"
    pool.write_bytes(pool.read_bytes()[:-100])
    with pytest.raises(FormatError, match="pools.safetensors.*(outside the file|truncated)"):
        Runtime(_bundle(run_a), device="cpu")
    desc = json.loads((_bundle(run_a) / "bundle.json").read_text())
    desc["tasks"]["0"]["onnx"] = "../../task_0.onnx"
    (_bundle(run_a) / "bundle.json").write_text(json.dumps(desc))
    with pytest.raises(FormatError, match=r"bundle.json: field tasks.0.onnx: expected a plain file name"):
        Runtime(_bundle(run_a), device="cpu")
    desc["tasks"]["0"]["onnx"] = "task_0.onnx"
    desc["tasks"]["\u00b2"] = desc["tasks"].pop("1")  # a Unicode digit: str.isdigit() says yes, int() says no
    (_bundle(run_a) / "bundle.json").write_text(json.dumps(desc))
    with pytest.raises(FormatError, match=r"bundle.json: field tasks: key '\u00b2' is not a task id"):
        Runtime(_bundle(run_a), device="cpu")


def test_a_bundle_json_without_the_switch_recipe_names_it(run_a):
    """Found by the file fuzzer (``del switch.tensors``): a raw KeyError before."""
    desc = json.loads((_bundle(run_a) / "bundle.json").read_text())
    del desc["switch"]["tensors"]
    (_bundle(run_a) / "bundle.json").write_text(json.dumps(desc))
    with pytest.raises(FormatError, match=r"switch.onnx: a one-session graph of an earlier kind.*nws-export --onnx"):
        Runtime(_bundle(run_a), device="cpu", mode="switch")


def test_a_delta_pack_whose_base_file_is_null_finds_the_default_base(run_a):
    path = run_a / "tasks" / "task_1.nwspack"
    want = nwsconvert.TaskPack.load(path).content_sha256()
    _rewrite(path, lambda h: h["base"].update(file=None))  # rewritten with fresh hashes
    assert nwsconvert.TaskPack.load(path).content_sha256() == want


# ------------------------------------------------------------------ convert never silently does nothing
def _small():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_convert_refuses_torchscript_meta_and_empty_models():
    x = torch.randn(1, 1, 8, 8)
    with pytest.raises(nwsconvert.ConversionError, match="RecursiveScriptModule is a TorchScript module"):
        nwsconvert.convert(torch.jit.script(_small()), pool_size=4)
    with pytest.raises(nwsconvert.ConversionError, match="TorchScript module"):
        nwsconvert.convert(torch.jit.trace(_small(), x), pool_size=4)
    with pytest.raises(nwsconvert.ConversionError, match="has no layer to convert: it has no nn.Conv2d"):
        nwsconvert.convert(nn.Sequential(nn.ReLU(), nn.Flatten()), pool_size=4)
    with pytest.raises(nwsconvert.ConversionError, match="all 2 weight layers were skipped"):
        nwsconvert.convert(_small(), pool_size=4, skip=["*"])
    with torch.device("meta"):
        meta = _small()
    with pytest.raises(nwsconvert.ConversionError, match="'0.weight' is on the meta device"):
        nwsconvert.convert(meta, pool_size=4)
    with pytest.raises(NWSError, match="pool_size must be an integer"):
        nwsconvert.convert(_small(), pool_size="abc")
    assert nwsconvert.is_converted(nwsconvert.convert(_small(), pool_size=4))


# ------------------------------------------------------------------ one writer per run
_HOLD = "import sys, time; from nwsconvert.train.runlock import RunLock; RunLock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def test_one_writer_per_run_and_a_killed_holder_blocks_nothing(run_a, tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_a)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            RunLock.acquire(run_a)
        with pytest.raises(RunLockedError):
            Trainer(tiny_model(), run_a, resume=True, progress=False)
        from nwsconvert.cli.train import train_main

        job = {"model": SPEC, "model_kwargs": KWARGS, "pool_size": 32, "out": str(run_a)}
        _edit_manifest(run_a, lambda m: m["data"].update(job=job))
        assert train_main(["--resume", f"out={run_a}", "progress=false"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("nws-train: ") and "another process" in err and err.count("\n") == 1
        (run_a / "manifest.json").rename(tmp_path / "manifest.json")  # a run stopped before its manifest:
        (run_a / "job.json").write_text(json.dumps(job))  # its job.json, written first, is all there is
        assert train_main(["--resume", f"out={run_a}", "progress=false"]) == 1
        err = capsys.readouterr().err  # refused before saying it would start the run
        assert err.startswith("nws-train: ") and "another process" in err and err.count("\n") == 1
        (tmp_path / "manifest.json").rename(run_a / "manifest.json")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock.acquire(run_a) as lock:  # the kernel dropped the dead holder's lock
        assert RunLock.acquire(run_a) is lock  # re-entrant within a process
        lock.release()


def test_a_lock_removed_with_its_folder_only_when_nothing_else_is_there(tmp_path):
    """``release_and_remove`` (a command refused before anything started): the lock file and the folder go
    when they are all the folder holds and this is the last hold; otherwise it is a plain release."""
    alone = tmp_path / "alone"
    RunLock.acquire(alone).release_and_remove()
    assert not alone.exists()
    busy = tmp_path / "busy"
    lock = RunLock.acquire(busy)
    (busy / "job.json").write_text("{}")
    lock.release_and_remove()
    assert sorted(p.name for p in busy.iterdir()) == [".lock", "job.json"]
    nested = tmp_path / "nested"
    outer = RunLock.acquire(nested)
    RunLock.acquire(nested).release_and_remove()  # an inner hold: the outer one still needs its lock
    assert (nested / ".lock").exists() and outer.fd is not None
    outer.release_and_remove()
    assert not nested.exists()
    RunLock.acquire(nested).release()  # free again


def test_resume_before_the_manifest_starts_the_run_and_cleans_temporaries(tmp_path, capsys):
    from nwsconvert.cli.train import train_main
    from nwsconvert.train.job import JOB_FILE, resolve_job

    out = tmp_path / "r"
    out.mkdir()
    job = resolve_job(
        [
            "model=timm:test_resnet",
            "pool_size=32",
            "pool_epochs=1",
            "epochs=1",
            "tasks=1",
            "progress=false",
            f"out={out}",
        ]
    )
    (out / JOB_FILE).write_text(json.dumps(job))  # what a run killed during startup leaves
    (out / "checkpoints").mkdir()
    stale = out / "checkpoints" / ".base_weights.safetensors.x1y2.tmp"
    stale.write_bytes(b"partial")
    assert train_main(["--resume", f"out={out}"]) == 0
    assert "stopped before its manifest was written: starting it again" in capsys.readouterr().err
    manifest = nwsconvert.RunDir(out).read()
    assert manifest.finished == [0] and manifest.model.convert["pool_size"] == 32
    assert not stale.exists() and not list(out.rglob("*.tmp"))


def test_disk_full_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "sub" / "file.bin"
    with pytest.raises(OSError) as e:
        atomic_write_bytes(target, b"x" * 100)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert not list(target.parent.iterdir())  # the temporary file is gone

    def job(argv):
        atomic_write_bytes(target, b"x")
        return 0

    assert run_cli("nws-train", job, [], resume_hint="run the same command with --resume") == 1
    assert (
        capsys.readouterr().err
        == f"nws-train: disk full while writing {target}: free space and run the same command with --resume\n"
    )


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.slow
def test_disk_full_on_a_small_tmpfs_then_resume(tmp_path):
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "160k"):
        pytest.skip("no tmpfs can be mounted here (needs root on Linux)")
    try:
        args = [
            "model=timm:test_resnet",
            "pool_size=32",
            "pool_epochs=1",
            "epochs=1",
            "tasks=1",
            "progress=false",
            f"out={mnt / 'r'}",
        ]
        full = subprocess.run([sys.executable, "-m", "nwsconvert.cli.train", *args], capture_output=True, text=True)
        assert full.returncode == 1, full.stderr[-2000:]
        assert "disk full while writing" in full.stderr and "Traceback" not in full.stderr
        assert not [p for p in mnt.rglob("*.tmp")]
        if (mnt / "r" / "manifest.json").exists():
            nwsconvert.RunDir(mnt / "r").read()  # the manifest stayed valid
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        done = subprocess.run(
            [sys.executable, "-m", "nwsconvert.cli.train", "--resume", f"out={mnt / 'r'}"],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert nwsconvert.RunDir(mnt / "r").read().finished == [0]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ------------------------------------------------------------------ bad input: one line, exit 2, before torch loads
_PROBE = (
    "import sys; from nwsconvert.{mod} import {fn}; rc = {fn}(sys.argv[1:]); "
    "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr); sys.exit(rc)"
)


def _probe(mod: str, fn: str, args: list[str]):
    return subprocess.run(
        [sys.executable, "-c", _PROBE.format(mod=mod, fn=fn), *args], capture_output=True, text=True, timeout=120
    )


def _bad_values(tmp_path: Path):
    pack = tmp_path / "x.nwspack"
    pack.write_bytes(b"\0" * 16)
    afile = tmp_path / "afile"
    afile.write_text("x")
    pools = tmp_path / "pools.safetensors"  # what the header of a run's pool file declares
    save_file({"x": torch.zeros(1)}, str(pools), metadata={"nwsconvert": json.dumps({"format": "nwsconvert.poolset"})})
    cases = [
        ("pool_size=abc", "pool_size='abc'"),
        ("pool_size=1", "pool_size=1"),
        ("tasks=abc", "tasks='abc'"),
        ("tasks=-1", "tasks=-1"),
        ("device=gpu", "device='gpu'"),
        ("seed=1.5", "seed=1.5"),
        ("group_size=0", "group_size=0"),
        (f"init={tmp_path / 'missing.safetensors'}", "no such file"),
        (f"init={pack}", "init="),
        (f"out={afile}", "is a file, not a directory"),
        ("epochs=abc", "epochs='abc': expected a whole number"),
        ("lr=abc", "lr='abc': expected a number"),
        ("milestones=5", "milestones=5: give a list"),
        ("head_epochs=-1", "head_epochs=-1: expected a whole number >= 0"),
        ("learn_pools=abc", "learn_pools='abc': expected true or false"),
        ("model=resnet18", "model='resnet18'"),
        ("model.checkpoint_path=/x.pth", "model.checkpoint_path"),
        ("nope=1", "unknown key 'nope'"),
        (f"weights={tmp_path / 'missing.safetensors'}", "weights="),
        (f"weights={afile}", "is not a safetensors file"),
        ("weights=3", "weights=3: expected a file"),
        (f"weights={pools}", "is a pool file (give it as init=FILE), not a model's state dict"),
    ]
    if torch.cuda.device_count() == 0:
        cases.append(("device=cuda", "no CUDA GPU is visible"))
    return cases


def test_every_bad_value_is_one_line_exit_2_before_torch_loads(tmp_path):
    for arg, message in _bad_values(tmp_path):
        proc = _probe("cli.train", "train_main", [arg] if arg.startswith("out=") else [arg, f"out={tmp_path / 'run'}"])
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (arg, proc.stderr)
        assert len(lines) == 2 and lines[0].startswith("nws-train: ") and message in lines[0], (arg, proc.stderr)
        assert lines[1] == "NO-TORCH", (arg, "torch was imported before the value was refused")
    assert not (tmp_path / "run").exists()


def test_resume_with_nothing_to_resume_is_refused_before_torch_loads(tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "never_started", tmp_path / "empty"):
        proc = _probe("cli.train", "train_main", ["--resume", f"out={out}"])
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 2 and "nothing to resume" in lines[0], proc.stderr
        assert lines[1] == "NO-TORCH"
    assert list((tmp_path / "empty").iterdir()) == [] and not (tmp_path / "never_started").exists()


def test_head_epochs_beyond_the_epochs_is_one_line_exit_2(tmp_path):
    """Given with ``epochs``, refused before torch loads; against the recipe's epochs (which need the
    zoo, hence torch), refused when the recipe is read, before any training: one line, exit 2."""
    for args, message, torch_loaded in (
        (["head_epochs=9", "epochs=3"], "head_epochs=9 is more than epochs=3", "NO-TORCH"),
        (["head_epochs=9"], "head_epochs=9 is more than epochs=3", "TORCH"),  # recipe demo: 3 epochs
    ):
        proc = _probe("cli.train", "train_main", [*args, f"out={tmp_path / 'run'}"])
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 2 and lines[0].startswith("nws-train: ") and message in lines[0], (args, proc.stderr)
        assert lines[1] == torch_loaded, args
    assert not (tmp_path / "run").exists()


def test_other_commands_refuse_bad_paths_in_one_line(runs, tmp_path):
    a, _ = runs
    afile = tmp_path / "afile"
    afile.write_text("x")
    for mod, fn, args, message in (
        ("cli.info", "info_main", [str(afile)], "is a file, not a run directory"),
        ("export.cli", "export_main", [str(afile), "--task", "0"], "is a file, not a run directory"),
        ("export.cli", "export_main", [str(a), "--task", "9"], "no finished task 9"),
        ("cli.report", "report_main", [str(tmp_path / "none")], "does not exist"),
        (
            "export.cli",
            "infer_main",
            ["--bundle", str(a / "export"), "--task", "0", str(afile)],
            "cannot read it as an image",
        ),
        (
            "export.cli",
            "infer_main",
            ["--bundle", str(a / "export"), "--task", "0", str(tmp_path / "none.png")],
            "no such image file",
        ),
        ("export.cli", "infer_main", ["--bundle", str(afile), "--task", "0"], "is a file, not a bundle folder"),
    ):
        proc = _probe(mod, fn, args)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert lines[0].startswith("nws-") and message in lines[0] and len(lines) == 2, (args, proc.stderr)


@pytest.mark.parametrize("how", ["--debug", "NWS_DEBUG=1"])
def test_debug_shows_the_traceback(tmp_path, how):
    args = [sys.executable, "-m", "nwsconvert.cli.train", "pool_size=abc", f"out={tmp_path}"]
    env = {**os.environ, "NWS_DEBUG": "1"} if how == "NWS_DEBUG=1" else None
    proc = subprocess.run([*args, how] if how == "--debug" else args, capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "UsageError" in proc.stderr


def test_version_2_packs_still_load_and_verify_their_content(run_a):
    """Files of the previous pack version (no header hash, no identity) load; their content hash is still required."""
    path = run_a / "tasks" / "task_0.nwspack"
    base = nwsconvert.TaskPack.load(run_a / "base.nwspack")
    tensors, header = read_tensors(path, PACK_FORMAT, PACK_VERSION)
    fields = {
        k: v for k, v in header.items() if k not in ("format", "version", "sha256", "header_sha256", "run_id", "task")
    }
    old = run_a / "tasks" / "old.nwspack"
    write_tensors(old, tensors, PACK_FORMAT, 2, **fields)
    _rewrite(old, lambda h: h.pop("header_sha256"), keep_hashes=True)  # as version 2 wrote them
    loaded = nwsconvert.TaskPack.load(old, base=base)
    new = nwsconvert.TaskPack.load(path)
    assert all(torch.equal(loaded.indices[k], new.indices[k]) for k in new.indices) and loaded.task is None
    data = bytearray(old.read_bytes())
    data[-1] ^= 1  # a state tensor bit
    old.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="content does not match its SHA-256"):
        nwsconvert.TaskPack.load(old, base=base)
