"""Property-based checks of every file reader (hypothesis): a damaged or edited file ends as a clear
error naming the file, or loads into exactly the original; never a raw exception, never a
silently different model.

Files: a pool set, a standalone base pack and a task pack stored as changes against it (the
codings ``bits``, ``ans``, ``delta+bits``, ``delta+ans`` all occur), and a run manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainer_utils import tiny_model

import nwsconvert
from nwsconvert import PoolSet, RunDir, TaskPack
from nwsconvert.errors import NWSError
from nwsconvert.formats.storage import read_tensors, write_tensors
from nwsconvert.train.loading import load_task_files
from nwsconvert.train.manifest import BaseEntry, Manifest, ModelEntry, PoolsEntry, TaskEntry

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small run directory written by hand: pools, base, one delta-coded task, manifest."""
    root = tmp_path_factory.mktemp("fuzz") / "run"
    run = RunDir(root)
    model = tiny_model(num_classes=3, pool_size=64, seed=3)
    with torch.no_grad():
        model(torch.randn(4, 1, 16, 16))
    pools = nwsconvert.pool_set(model)
    pool_sha = pools.save(run.pool_path)
    base = nwsconvert.extract_task(model, run_id="r" * 32)
    base_sha = base.save(run.base_path)
    g = torch.Generator().manual_seed(0)
    for layer in nwsconvert.nws_layers(model):  # move a tenth of the kernels to other entries
        idx = layer.nws.indices
        pick = torch.rand(idx.shape, generator=g) < 0.1
        idx[pick] = torch.randint(0, layer.nws.pool_size, (int(pick.sum()),), generator=g, dtype=idx.dtype)
    task = nwsconvert.extract_task(model, run_id="r" * 32, task=0)
    task.base = TaskPack.load(run.base_path)
    sha = task.save(run.pack_path(0))
    assert {"delta+bits", "delta+ans"} & set(TaskPack.load(run.pack_path(0)).layer_codings().values())
    manifest = Manifest(
        model=ModelEntry("timm:test_resnet", {"in_chans": 1}),
        run_id="r" * 32,
        pools=PoolsEntry(pool_sha, "pools.safetensors", pools.nbytes),
        base=BaseEntry(base_sha, "base.nwspack", 3),
    )
    manifest.put_task(TaskEntry(0, "t0", 3, "tasks/task_0.nwspack", sha, {"val_acc": 0.5}))
    run.write(manifest)
    return root


def _same_pack(a: TaskPack, b: TaskPack) -> bool:
    return (
        a.layers == b.layers
        and a.indices.keys() == b.indices.keys()
        and all(torch.equal(a.indices[k], b.indices[k]) for k in a.indices)
        and a.state.keys() == b.state.keys()
        and all(torch.equal(a.state[k], b.state[k]) for k in a.state)
        and (a.num_classes, a.pool_sha256, a.run_id, a.task, a.model_spec, a.meta)
        == (b.num_classes, b.pool_sha256, b.run_id, b.task, b.model_spec, b.meta)
    )


def _same_pools(a: PoolSet, b: PoolSet) -> bool:
    return a.pools.keys() == b.pools.keys() and all(torch.equal(a[k], b[k]) for k in a.pools)


READERS = {
    "tasks/task_0.nwspack": (lambda p: TaskPack.load(p, task=0), _same_pack),
    "base.nwspack": (lambda p: TaskPack.load(p), _same_pack),
    "pools.safetensors": (lambda p: PoolSet.load(p), _same_pools),
}


def _check(root: Path, scratch: Path, rel: str, data: bytes) -> None:
    """Write ``data`` as ``rel`` of a copy of the run and read it: a clear error naming it, or the original."""
    copy = scratch / "run"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(root, copy)
    (copy / rel).write_bytes(data)
    read, same = READERS[rel]
    original = read(root / rel)
    try:
        loaded = read(copy / rel)
    except (NWSError, FileNotFoundError) as e:
        named = Path(rel).name in str(e) or (rel.endswith("task_0.nwspack") and "base.nwspack" in str(e))
        assert named, f"error does not name the file: {e}"
        return
    assert same(loaded, original), "loaded without error into something different"


FILES = st.sampled_from(sorted(READERS))


@SETTINGS
@given(rel=FILES, flips=st.lists(st.integers(0, 2**40), min_size=1, max_size=8))
def test_bit_flips(files, tmp_path, rel, flips):
    data = bytearray((files / rel).read_bytes())
    for f in flips:
        bit = f % (8 * len(data))
        data[bit // 8] ^= 1 << (bit % 8)
    _check(files, tmp_path, rel, bytes(data))


@SETTINGS
@given(rel=FILES, cut=st.floats(0, 1, exclude_max=True), tail=st.binary(max_size=64))
def test_truncation_and_garbage(files, tmp_path, rel, cut, tail):
    data = (files / rel).read_bytes()
    _check(files, tmp_path, rel, data[: int(cut * len(data))] + tail)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.sampled_from([10**6, 10**12, 2**62, -1, 0])
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(obj, prefix=()):
    """Every key path in a JSON value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _edit(obj, path, value, delete: bool):
    target = obj
    for k in path[:-1]:
        target = target[k]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value


@SETTINGS
@given(rel=FILES, pick=st.integers(0, 10**6), value=JSON, delete=st.booleans(), rehash=st.booleans())
def test_header_edits(files, tmp_path, rel, pick, value, delete, rehash):
    """Edits of the JSON header. Kept hashes: the edit is caught. Re-computed hashes (a crafted file): the
    reader's field checks catch it, or the file is a valid one of other content; never a raw exception."""
    kind = "nwsconvert.poolset" if rel.endswith("safetensors") else "nwsconvert.taskpack"
    tensors, header = read_tensors(files / rel, kind, 9)
    paths = [p for p in _paths(header) if p[0] not in ("format", "version")]
    path = paths[pick % len(paths)]
    _edit(header, path, value, delete)
    out = tmp_path / "edited"
    if rehash:
        fields = {k: v for k, v in header.items() if k not in ("format", "version", "sha256", "header_sha256")}
        write_tensors(out, tensors, kind, header["version"], **fields)
        try:
            READERS[rel][0](out)
        except (NWSError, FileNotFoundError) as e:
            assert out.name in str(e) or "base.nwspack" in str(e), f"error does not name the file: {e}"
        return
    write_tensors(out, tensors, kind, header["version"])  # a valid file, then its header replaced as edited
    raw = out.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    outer = json.loads(raw[8 : 8 + hlen])
    outer["__metadata__"]["nwsconvert"] = json.dumps(header, sort_keys=True)
    head = json.dumps(outer).encode()
    head += b" " * (-len(head) % 8)
    _check(files, tmp_path, rel, len(head).to_bytes(8, "little") + head + raw[8 + hlen :])


@SETTINGS
@given(pick=st.integers(0, 10**6), value=JSON, delete=st.booleans())
def test_manifest_edits(files, tmp_path, pick, value, delete):
    """A manifest edit ends as a clear error naming a file, or the task loads exactly as before."""
    manifest = json.loads((files / "manifest.json").read_text())
    paths = list(_paths(manifest))
    path = paths[pick % len(paths)]
    _edit(manifest, path, value, delete)
    copy = tmp_path / "run"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(files, copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    run = RunDir(copy)
    original = load_task_files(RunDir(files), RunDir(files).read(), 0)
    try:
        loaded = load_task_files(run, run.read(), 0)
    except (NWSError, FileNotFoundError) as e:
        assert any(
            name in str(e)
            for name in ("manifest.json", "task_0.nwspack", "pools.safetensors", "base.nwspack", str(copy))
        ), str(e)
        return
    assert _same_pools(loaded[0], original[0]) and _same_pack(loaded[1], original[1])
