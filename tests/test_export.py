"""Bundles, ONNX graphs with Gather reconstruction, onnxruntime parity and task switching."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from trainer_utils import train_run

import nwsconvert
from nwsconvert import nws_layers
from nwsconvert.errors import UsageError
from nwsconvert.export import Runtime, StaleBundleError, export_bundle
from nwsconvert.export.cli import export_main, infer_main
from nwsconvert.export.onnx_graph import IR_VERSION, OPSET, index_nodes


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "run"
    train_run(out, learn_pools=False, class_names=True)
    return out


def test_bundle_files_and_graph_structure(run, tmp_path):
    desc = export_bundle(run, tmp_path / "b", "all", onnx=True)
    model = nwsconvert.load(run, task=1)
    layers = nws_layers(model)
    proto = onnx.load(str(tmp_path / "b" / "task_1.onnx"), load_external_data=False)
    gathers = [n for n in proto.graph.node if n.op_type == "Gather"]
    pools = [t for t in proto.graph.initializer if t.name.startswith("pool/")]
    assert len(pools) == len(layers) and all(t.data_location == onnx.TensorProto.EXTERNAL for t in pools)
    assert {e.value for t in pools for e in t.external_data if e.key == "location"} == {"pools.safetensors"}
    assert len([g for g in gathers if g.input[0].startswith("pool/")]) == len(layers)
    idx = {t.name: t for t in proto.graph.initializer if t.name.startswith("indices/")}
    assert set(idx) == {f"indices/{l.name}" for l in layers}  # 32-entry pools: one uint8 per index
    assert all(t.data_type == onnx.TensorProto.UINT8 for t in idx.values())
    # File size is what the stored indices predict (+ small tensors), far below the dense weights.
    index_bytes = sum(l.nws.num_vectors for l in layers)
    dense_bytes = 4 * sum(l.weight.numel() for l in layers)
    size = (tmp_path / "b" / "task_1.onnx").stat().st_size
    pack = nwsconvert.TaskPack.load(tmp_path / "b" / "task_1.nwspack")
    assert index_bytes <= size <= index_bytes + 4 * pack.state_bytes + 64_000
    assert size < dense_bytes
    onnx.checker.check_model(str(tmp_path / "b" / "task_1.onnx"))
    assert proto.ir_version == 10 and proto.opset_import[0].version == 17
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["nwsconvert.class_names"]) == ["c0", "c1"] and json.loads(meta["nwsconvert.mean"]) == [0.5]
    assert json.loads(meta["nwsconvert.input_size"]) == [1, 16, 16]
    assert desc["tasks"]["1"]["gather_nodes"] == len(layers)
    # Task 1 stores what changed against the run's base pack; a bundle of task 1 alone carries
    # that base, and the pack read from the bundle decodes to the run's indices.
    run_pack = nwsconvert.TaskPack.load(run / "tasks" / "task_1.nwspack")
    assert any(c.startswith("delta") for c in run_pack.layer_codings().values())
    assert run_pack.base.source.name == "base.nwspack"
    export_bundle(run, tmp_path / "only1", 1)
    alone = nwsconvert.TaskPack.load(tmp_path / "only1" / "task_1.nwspack")
    assert (tmp_path / "only1" / "base.nwspack").read_bytes() == (run / "base.nwspack").read_bytes()
    assert alone.content_sha256() == run_pack.content_sha256() == pack.content_sha256()


@pytest.mark.parametrize("pool_size", [2, 200, 256, 257, 512, 4096, 65536, 70000])
def test_indices_rebuilt_in_the_graph_are_exact(pool_size):
    """``index_nodes`` stores ceil(log2 n) bits and onnxruntime rebuilds exactly the indices."""
    rng = np.random.default_rng(pool_size)
    count = 1001  # not a multiple of 8: the bit planes' padding must be sliced off
    idx = rng.integers(0, pool_size, count)
    idx[:2] = [0, pool_size - 1]
    inits, nodes, out, kind = index_nodes("indices/layer", idx, pool_size)
    graph = onnx.helper.make_graph(
        nodes, "g", [], [onnx.helper.make_tensor_value_info(out, onnx.TensorProto.INT64, [count])], initializer=inits
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])
    proto.ir_version = IR_VERSION
    onnx.checker.check_model(proto)
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    assert got.dtype == np.int64 and np.array_equal(got, idx)
    stored = sum(
        len(t.raw_data) for t in inits if t.name in ("indices/layer", "indices/layer/low", "indices/layer/high")
    )
    bits = int(np.ceil(np.log2(pool_size)))
    expected = {"uint8": count, "int32": 4 * count}.get(kind, count + (bits - 8) * ((count + 7) // 8))
    assert stored == expected and kind == ("uint8" if bits <= 8 else "int32" if bits > 16 else f"uint8+{bits - 8}bit")


def test_session_mode_matches_pytorch_and_keeps_its_sessions_lru(run, tmp_path):
    export_bundle(run, tmp_path / "b", "all", onnx=True)
    rt = Runtime(tmp_path / "b", device="cpu", mode="session", max_sessions=1)
    x = torch.randn(5, 1, 16, 16)
    for t in (0, 1):
        with torch.no_grad():
            ref = nwsconvert.load(run, task=t)(x).numpy()
        y = rt.run(t, x.numpy())
        # fp32: onnxruntime fuses BatchNorm into the convolution at load and sums in
        # another order; logits here are O(1), so 1e-4 absolute is ~1000 ulp of slack.
        np.testing.assert_allclose(y, ref, atol=1e-4, rtol=1e-4)
        assert (y.argmax(1) == ref.argmax(1)).all()
        assert rt.run(t, x[:1].numpy()).shape == (1, ref.shape[1])  # dynamic batch
    assert list(rt._impl._sessions) == [1]  # LRU bound
    assert rt.session(1).get_providers() == ["CPUExecutionProvider"]
    top = rt.predict(0, x.numpy(), k=2)
    assert len(top) == 5 and {n for n, _ in top[0]} <= {"c0", "c1", "c2"}
    with pytest.raises(KeyError, match="tasks with graphs"):
        rt.run(9, x.numpy())


def test_stale_bundle_and_cli_errors(run, tmp_path, capsys):
    export_bundle(run, tmp_path / "b", 0)
    desc = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert not (tmp_path / "b" / "task_0.onnx").exists() and "onnx" not in desc["tasks"]["0"]
    desc["pool_sha256"] = "0" * 64
    (tmp_path / "b" / "bundle.json").write_text(json.dumps(desc))
    with pytest.raises(StaleBundleError, match="another --out"):
        export_bundle(run, tmp_path / "b", 0)
    assert export_main(["--run", str(run), "--task", "5", "--out", str(tmp_path / "c")]) == 2
    assert "finished tasks: [0, 1]" in capsys.readouterr().err
    assert export_main(["--run", str(tmp_path / "nope"), "--task", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert export_main(["--run", str(run), "--task", "1", "--onnx", "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    assert export_main([str(run), "--task", "1", "--out", str(tmp_path / "e")]) == 0  # RUN as nws-info takes it
    assert (tmp_path / "e" / "task_1.nwspack").is_file()
    assert "base.nwspack" in capsys.readouterr().out  # the shared base the pack needs is listed
    assert json.loads((tmp_path / "e" / "bundle.json").read_text())["tasks"]["1"]["base"] == "base.nwspack"
    # --bench on a one-task bundle: the latency's median inside its quartiles, and no switch invented.
    for mode in ("switch", "session"):
        argv = ["--bundle", str(tmp_path / "d"), "--task", "1", "--bench", "--device", "cpu", "--mode", mode]
        assert infer_main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"mode: {mode}; providers: ['CPUExecutionProvider']")
        lat = re.search(r"latency \(batch 1\): median ([\d.]+) ms \(IQR ([\d.]+)-([\d.]+)\) over 50 runs", out)
        assert lat and 0 < float(lat[2]) <= float(lat[1]) <= float(lat[3]), out
        assert "the bundle holds one task, nothing to switch to" in out
    # -k below 1, a folder given as an image, --cuda-graph where it has no meaning: one line each, exit 2,
    # before the bundle is read.
    for argv, said in (
        (["-k", "0"], "-k 0: give how many classes to print, at least 1"),
        ([str(tmp_path)], f"{tmp_path}: a folder, not an image file"),
        (
            ["--cuda-graph", "--device", "cpu"],
            "--cuda-graph replays the switch mode's session on CUDA; --device cpu has none",
        ),
        (
            ["--cuda-graph", "--mode", "session"],
            "--cuda-graph replays the switch mode's session on CUDA; --mode session has none",
        ),
    ):
        assert infer_main(["--bundle", str(tmp_path / "d"), "--task", "1", *argv]) == 2
        assert capsys.readouterr().err.strip() == f"nws-infer: {said}"
    # A bundle written without --onnx: the one line says how to get graphs.
    assert infer_main(["--bundle", str(tmp_path / "e"), "--task", "1"]) == 2
    assert "holds no ONNX graphs (exported without --onnx): export it again with nws-export" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main(["--help"])


def test_nws_infer_without_a_gpu_names_its_own_option(tmp_path, capsys, monkeypatch):
    import nwsconvert.devices

    monkeypatch.setattr(nwsconvert.devices, "cuda_device_count", lambda: 0)
    assert infer_main(["--bundle", str(tmp_path), "--task", "0", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nws-infer: --device cuda: no CUDA GPU is visible here") and err.endswith(
        "; use --device cpu\n"
    )


def test_nws_infer_warns_in_one_line_where_cuda_graph_has_no_gpu(run, tmp_path, capsys, monkeypatch):
    """``nws-infer --cuda-graph`` where onnxruntime finds no GPU: it runs the plain switch mode and says so on
    stderr in one line, as every command's warnings (``--debug`` keeps Python's own format)."""
    import nwsconvert.export.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "_gpu_present", lambda: False)
    export_bundle(run, tmp_path / "b", "all", onnx=True)
    assert infer_main(["--bundle", str(tmp_path / "b"), "--task", "1", "--cuda-graph"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("mode: switch; providers: ['CPUExecutionProvider']") and "CUDA graph" not in out
    assert err == "nws-infer: warning: cuda_graph=True needs onnxruntime's CUDA provider and a GPU: running without\n"
    with pytest.warns(UserWarning, match="cuda_graph=True needs"):  # Python's own warning, as without the CLI
        assert infer_main(["--bundle", str(tmp_path / "b"), "--task", "1", "--cuda-graph", "--debug"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_session_cache_that_thrashes_warns_once(run, tmp_path):
    export_bundle(run, tmp_path / "b", "all", onnx=True)
    rt = Runtime(tmp_path / "b", device="cpu", max_sessions=1, mode="session")
    x = np.zeros((1, 1, 16, 16), np.float32)
    with pytest.warns(UserWarning, match=r"1 task sessions built again after eviction .*mode='switch'"):
        for t in (0, 1, 0):  # the third call builds task 0's session again
            rt.run(t, x)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        for t in (1, 0, 1):
            rt.run(t, x)
    assert rt.rebuilds == 4 and list(rt.info()["cached_tasks"]) == [1]


# ------------------------------------------------------------------ one session for every task
def test_switch_mode_matches_pytorch_and_never_mixes_tasks(run, tmp_path):
    """switch.onnx is the dense template: every task tensor (gathered weights, convolutions with their
    BatchNorm folded in, the other state) is a placeholder the runtime fills from the task's pack;
    tasks of 3 and 2 classes share it (head padded)."""
    from nwsconvert.export.densify import PLACEHOLDER

    desc = export_bundle(run, tmp_path / "b", "all", onnx=True)
    assert desc["switch"]["max_classes"] == 3 and (tmp_path / "b" / "switch.onnx").is_file()
    proto = onnx.load(str(tmp_path / "b" / "switch.onnx"), load_external_data=False)
    assert [i.name for i in proto.graph.input] == ["input"]
    ops = {n.op_type for n in proto.graph.node}
    assert "Gather" not in ops and "BatchNormalization" not in ops  # dense, every conv + BatchNorm folded
    layers = nws_layers(nwsconvert.load(run, task=0))
    rows = desc["switch"]["tensors"]
    assert sorted(r["layer"] for r in rows if r["kind"] != "state") == sorted(l.name for l in layers)
    assert any(r["kind"] == "fold" for r in rows)
    # No task is baked in: every tensor a recipe row names is external data at the placeholder.
    held = {r["name"] for r in rows} | {r["bias_name"] for r in rows if r["kind"] == "fold"}
    placeholders = {t.name for t in proto.graph.initializer if any(e.value == PLACEHOLDER for e in t.external_data)}
    assert held == placeholders


@pytest.fixture(scope="module")
def bundle3(tmp_path_factory):
    """A run of three tasks (3, 2 and 4 classes) and its bundle (nws-export --task all --onnx)."""
    out = tmp_path_factory.mktemp("exp3") / "run"
    train_run(out, learn_pools=False, tasks=(3, 2, 4))
    export_bundle(out, out / "export", "all", onnx=True)
    return out, out / "export"


def test_one_session_serves_every_task_by_rewriting_its_buffers(bundle3, monkeypatch):
    """The switch mode (the default): one session, built at start-up, runs every task; a switch rewrites
    its bound weight buffers. After an A/B/C/A round robin each task's logits match PyTorch's and the
    session mode's (float32: onnxruntime folds BatchNorm in float32 there, NumPy in float64 rounded once
    here; 1e-4 of the largest logit), A's are bit for bit what A gave before B and C overwrote the
    buffers and what a fresh Runtime gives, and no session was built after start-up."""
    import onnxruntime

    run, bundle = bundle3
    x = np.random.default_rng(0).standard_normal((4, 1, 16, 16)).astype(np.float32)
    rt = Runtime(bundle, device="cpu")
    assert rt.mode == "switch" and rt.info()["layout"] != "plain"  # laid out for this CPU's kernels
    built = []
    real = onnxruntime.InferenceSession
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: (built.append(a), real(*a, **k))[1])
    session = Runtime(bundle, device="cpu", mode="session")
    built.clear()
    seen = {}
    for t in (0, 1, 2, 0):
        y = rt.run(t, x)
        with torch.no_grad():
            ref = nwsconvert.load(run, task=t)(torch.from_numpy(x)).numpy()
        assert y.shape == ref.shape == (4, rt.num_classes(t))
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(y, ref, atol=1e-4 * scale, rtol=0)
        np.testing.assert_allclose(y, session.run(t, x), atol=1e-4 * scale, rtol=0)
        if t in seen:
            assert np.array_equal(y, seen[t])
        seen[t] = y
    assert len(built) == 3  # the session mode's three tasks; the switch mode none
    assert np.array_equal(Runtime(bundle, device="cpu").run(0, x), seen[0])
    info = rt.info()
    assert info["ready_tasks"] == [0] and info["selected"] == 0 and rt.switches == 4
    assert rt.last_switch_seconds is not None and rt.last_switch_seconds > 0
    assert rt.run(2, x[:1]).shape == (1, 4)  # dynamic batch


def test_what_the_switch_mode_keeps_is_one_model_and_each_tasks_indices(bundle3):
    """``Runtime.info()``: the weight buffers are one dense model (``ready`` of them), and each task keeps
    1 byte a kernel where its layer's pool has at most 256 entries, 2 bytes elsewhere (pools of at most
    65,536 entries), plus its folded BatchNorm and state in float32, exactly; ``keep="pack"`` keeps
    nothing. With ``ready=2`` a switch between the two held tasks only rebinds (no buffer written)."""
    _, bundle = bundle3
    desc = json.loads((bundle / "bundle.json").read_text())
    recipe = desc["switch"]["tensors"]
    pools = nwsconvert.PoolSet.load(bundle / "pools.safetensors")
    dense = sum(int(np.prod(r["shape"])) + (r["shape"][0] if r["kind"] == "fold" else 0) for r in recipe)

    def index_bytes(r):
        n, dim = pools[r["layer"]].shape
        return (1 if n <= 256 else 2) * int(np.prod(r["shape"])) // dim

    per_task = sum(
        index_bytes(r) + (8 * r["shape"][0] if r["kind"] == "fold" else 0)
        if r["kind"] != "state"
        else 4 * int(np.prod(r["shape"]))
        for r in recipe
    )
    rt = Runtime(bundle, device="cpu")
    info = rt.info()
    assert info["bytes_per_task"] == {0: per_task, 1: per_task, 2: per_task}
    kept = rt._impl._tasks[0].values
    for r in recipe:
        if r["kind"] != "state":
            assert kept[f"indices/{r['layer']}"].dtype == (np.uint8 if pools[r["layer"]].shape[0] <= 256 else np.uint16)
    assert 4 * dense <= info["weight_buffer_bytes"] <= 4 * dense + 64 * len(recipe) * 2  # aligned to 64 bytes
    assert Runtime(bundle, device="cpu", keep="pack").info()["bytes_per_task"] == {}
    two = Runtime(bundle, device="cpu", ready=2)
    assert two.info()["weight_buffer_bytes"] == 2 * info["weight_buffer_bytes"]
    x = np.zeros((1, 1, 16, 16), np.float32)
    for t in (0, 1, 0, 1, 0):
        two.run(t, x)
    assert two.switches == 2 and two.info()["ready_tasks"] == [1, 0]
    two.run(2, x)  # overwrites the least recently used: task 1's buffers
    assert two.switches == 3 and two.info()["ready_tasks"] == [0, 2]


@pytest.mark.parametrize("keep", ["indices", "pack"])
def test_a_switch_to_a_damaged_pack_leaves_the_previous_task_served(bundle3, tmp_path, keep):
    import shutil

    bundle = Path(shutil.copytree(bundle3[1], tmp_path / "b"))
    pack = bundle / "task_1.nwspack"
    data = bytearray(pack.read_bytes())
    data[-3] ^= 0x01
    pack.write_bytes(bytes(data))
    x = np.random.default_rng(1).standard_normal((2, 1, 16, 16)).astype(np.float32)
    rt = Runtime(bundle, device="cpu", keep=keep)
    y0 = rt.run(0, x)
    with pytest.raises(nwsconvert.FormatError, match="task_1.nwspack") as e:
        rt.run(1, x)
    assert "\n" not in str(e.value)
    assert rt.info()["selected"] == 0 and np.array_equal(rt.run(0, x), y0)
    rt.run(2, x)
    assert np.array_equal(rt.run(0, x), y0)


def test_keeping_packs_only_serves_the_logits_of_kept_indices_exactly(bundle3):
    """``keep="pack"`` decodes each switch's pack straight into the kept index type (uint16 here), from a base
    kept in that type, and writes from the decoded arrays without copying them into blocks: every task's
    logits are those of the kept indices, bit for bit, in any order of switches."""
    _, bundle = bundle3
    x = np.random.default_rng(2).standard_normal((3, 1, 16, 16)).astype(np.float32)
    kept, packs = Runtime(bundle, device="cpu", threads=1), Runtime(bundle, device="cpu", threads=1, keep="pack")
    assert packs._impl._index_dtype == np.uint16
    for t in (0, 2, 1, 0, 1, 2):
        assert np.array_equal(packs.run(t, x), kept.run(t, x))
    base = next(iter(packs._impl._bases.values()))
    assert {v.dtype for v in base.indices.values()} == {np.dtype(np.uint16)}  # decoded once, in the kept type


def test_logits_are_the_callers_own_whatever_the_batch_and_input_kind(bundle3):
    """On a CPU the switch mode binds each buffer set's ``(B, max classes)`` logits once per batch size
    (not one allocation and one copy out of onnxruntime a run): every run still returns an array of its own,
    the task's classes only, bit for bit what a fresh Runtime gives for the same images, across tasks with
    3, 2 and 4 classes, batch sizes that change (0 included) and OrtValue inputs between NumPy ones (which
    bind another output)."""
    import onnxruntime as ort

    _, bundle = bundle3
    rng = np.random.default_rng(3)
    rt = Runtime(bundle, device="cpu", threads=1)
    steps = [(0, 3), (0, 3), (1, 3), (2, 1), (2, 0), (0, 5), (1, 2), (0, 5)]
    got, inputs = [], []
    for i, (task, batch) in enumerate(steps):
        x = rng.standard_normal((batch, 1, 16, 16)).astype(np.float32)
        if i == 6:  # an OrtValue between NumPy runs: its logits an OrtValue of every class column
            out = rt.run(task, ort.OrtValue.ortvalue_from_numpy(x)).numpy()[:, : rt.num_classes(task)]
        else:
            out = rt.run(task, x)
            assert out.flags.owndata and out.shape == (batch, rt.num_classes(task))
        got.append(out)
        inputs.append(x)
    assert rt._impl._slots[0].logits.shape == (5, 4)  # the last batch size's buffer, 4 = the most classes
    fresh = Runtime(bundle, device="cpu", threads=1)
    for (task, _), x, out in zip(steps, inputs, got):  # no run overwrote what an earlier one returned
        assert np.array_equal(out, fresh.run(task, x))


def test_a_switch_writes_one_layer_at_a_time_and_a_failed_write_frees_its_buffer(bundle3, monkeypatch):
    """A switch computes each dense tensor and writes it before computing the next (its temporaries are one
    layer's weights, not a second dense model): the buffers it writes are bit for bit those of the
    all-at-once fill. A write that fails half way leaves no task held in the half-written buffer: the next
    run of that task writes it again and gives the logits it gave before."""
    import nwsconvert.export.switchmode as switchmode
    from nwsconvert.export.densify import dense_tensors

    _, bundle = bundle3
    x = np.random.default_rng(5).standard_normal((2, 1, 16, 16)).astype(np.float32)
    rt = Runtime(bundle, device="cpu", ready=1)
    y1 = rt.run(1, x)
    streamed = rt._impl._slots[0].buffer.copy()
    whole = np.zeros_like(streamed)
    rt._impl._graph.fill(whole, dense_tensors(rt._impl._recipe, rt._impl._pool_arrays, rt._impl._values(1)))
    assert np.array_equal(streamed, whole)
    alive = []
    real = switchmode.iter_dense_tensors
    task0 = np.zeros_like(streamed)
    rt._impl._graph.fill(task0, dense_tensors(rt._impl._recipe, rt._impl._pool_arrays, rt._impl._values(0)))

    def failing(*args):
        for i, pair in enumerate(real(*args)):
            alive.append(i)
            if i == 3:
                # one layer at a time: the three tensors before this one are in the buffer already
                done = [slice(p.offset, p.offset + p.size) for p in rt._impl._graph.placements if p.source in written]
                assert all(np.array_equal(rt._impl._slots[0].buffer[r], task0[r]) for r in done)
                assert any(not np.array_equal(task0[r], whole[r]) for r in done)  # task 1 wrote other values
                raise MemoryError("stand-in for a failure half way through the write")
            written.add(pair[0])
            yield pair

    written: set = set()
    monkeypatch.setattr(switchmode, "iter_dense_tensors", failing)
    with pytest.raises(MemoryError):
        rt.run(0, x)
    info = rt.info()  # task 1's buffer was half overwritten: neither task is held or selected
    assert alive == [0, 1, 2, 3] and info["ready_tasks"] == [] and info["selected"] is None
    monkeypatch.setattr(switchmode, "iter_dense_tensors", real)
    assert np.array_equal(rt.run(1, x), y1)
    with pytest.raises(KeyError, match="no tensor"):
        rt._impl._graph.fill(whole, [])


def test_the_graph_fill_onnxruntime_runs_on_a_gpu_writes_what_numpy_writes(bundle3):
    """On CUDA a switch computes a task's tensors with an onnxruntime graph whose outputs are the bound
    buffers (no copy through the host). The same code on the CPU provider (``fill="onnxruntime"``, the
    template's own layout) gives the NumPy fill's logits, bit for bit, for every task."""
    _, bundle = bundle3
    x = np.random.default_rng(2).standard_normal((3, 1, 16, 16)).astype(np.float32)
    host = Runtime(bundle, device="cpu", layout="plain")
    graph = Runtime(bundle, device="cpu", layout="plain", fill="onnxruntime")
    assert host.info()["layout"] == graph.info()["layout"] == "plain"
    for t in (0, 1, 2, 1):
        assert np.array_equal(graph.run(t, x), host.run(t, x))
    with pytest.raises(ValueError, match="give layout='plain' with it"):
        Runtime(bundle, device="cpu", fill="onnxruntime")


@pytest.mark.gpu  # onnxruntime-gpu's CUDA provider
def test_on_cuda_the_switch_mode_keeps_weights_and_logits_on_the_device(bundle3):
    """With a GPU the switch mode's buffers are device tensors that an onnxruntime graph fills from the
    device-resident pools and indices; images given as a device OrtValue give device logits. Logits match
    the CPU's within float32 (cuDNN sums in other orders: 1e-4 of the largest logit)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu (the CUDA provider) is not installed")
    _, bundle = bundle3
    rt, cpu = Runtime(bundle, device="cuda"), Runtime(bundle, device="cpu")
    assert rt.mode == "switch" and rt.fill == "onnxruntime" and rt.info()["providers"][0] == "CUDAExecutionProvider"
    assert all(v.device_name().lower() == "cuda" for v in rt._impl._slots[0].inputs.values())
    x = np.random.default_rng(5).standard_normal((4, 1, 16, 16)).astype(np.float32)
    for t in (0, 1, 2, 0):
        ref = cpu.run(t, x)
        np.testing.assert_allclose(rt.run(t, x), ref, atol=1e-4 * float(np.abs(ref).max()), rtol=0)
    out = rt.run(1, ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    assert out.device_name().lower() == "cuda"
    ref = cpu.run(1, x)
    np.testing.assert_allclose(out.numpy()[:, : rt.num_classes(1)], ref, atol=1e-4 * float(np.abs(ref).max()), rtol=0)


def test_cuda_arena_takes_own_or_shared_and_names_the_flag_otherwise(bundle3):
    """``cuda_arena`` is validated in one line naming it; a CUDA option, it leaves a CPU Runtime as it was:
    ``info()`` reports no CUDA arena in either mode."""
    _, bundle = bundle3
    with pytest.raises(ValueError, match=r"^cuda_arena must be own or shared, got 'pooled'$"):
        Runtime(bundle, device="cpu", cuda_arena="pooled")
    for mode in ("switch", "session"):
        assert Runtime(bundle, device="cpu", mode=mode, cuda_arena="shared").info()["cuda_arena"] is None


@pytest.mark.gpu  # onnxruntime-gpu's CUDA provider
def test_on_cuda_a_shared_arena_serves_both_modes_with_the_same_logits(bundle3):
    """``cuda_arena='shared'``: the switch mode's graph and fill graph, and the session mode's cached sessions,
    draw from one CUDA arena registered with onnxruntime's environment; the logits are those of sessions with
    their own arenas within float32 (cuDNN picks its algorithms by the workspace it finds free, and they sum
    in other orders: 1e-4 of the largest logit, as against the CPU)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu (the CUDA provider) is not installed")
    _, bundle = bundle3
    x = np.random.default_rng(7).standard_normal((4, 1, 16, 16)).astype(np.float32)
    for mode in ("switch", "session"):
        own = Runtime(bundle, device="cuda", mode=mode)
        shared = Runtime(bundle, device="cuda", mode=mode, cuda_arena="shared")
        assert own.info()["cuda_arena"] == "own" and shared.info()["cuda_arena"] == "shared"
        for t in (0, 1, 2, 0):
            ref = own.run(t, x)
            np.testing.assert_allclose(shared.run(t, x), ref, atol=1e-4 * float(np.abs(ref).max()), rtol=0)


class _RunRecorder:
    """A session standing in for one built with onnxruntime's CUDA graph: runs ``real`` and records each
    run's ``gpu_graph_id``; ``refuse``: a graph id whose run raises, as a capture the provider refuses (-1:
    every run raises, as a run that fails with or without a graph)."""

    def __init__(self, real, refuse: int | None = None):
        self.real, self.refuse, self.ids = real, refuse, []

    def get_inputs(self):
        return self.real.get_inputs()

    def get_outputs(self):
        return self.real.get_outputs()

    def run_with_iobinding(self, binding, options=None):
        graph_id = int(options.get_run_config_entry("gpu_graph_id"))
        self.ids.append(graph_id)
        if graph_id == self.refuse or self.refuse == -1:
            raise RuntimeError("CUDA failure 900: operation not permitted when stream is capturing")
        self.real.run_with_iobinding(binding, options)


def test_graphed_runs_bind_one_buffer_pair_a_shape_and_ask_one_graph_per_buffer_set_and_shape(bundle3):
    """``cuda_graph=True``'s bookkeeping, on the CPU provider (what onnxruntime's CUDA graph needs, and what
    a CUDA run then does: :class:`GraphRuns` as the Runtime drives it; the capture itself is the GPU test's).
    Every run is bit for bit the plain switch mode's; each (buffer set, input shape) asks its own graph id
    and each run the id of the buffer set holding its task; the logits handed out are copies (a later run
    leaves them); a
    fifth input shape, and every run after a graph the provider refused (one warning), say
    ``gpu_graph_id=-1``. A frame the model does not take is refused before any run (not a refused graph)."""
    from nwsconvert.export.graphruns import GRAPH_SHAPES, GraphRuns

    _, bundle = bundle3
    rng = np.random.default_rng(3)
    plain = Runtime(bundle, device="cpu", ready=2)
    rt = Runtime(bundle, device="cpu", ready=2)
    rec = _RunRecorder(rt._impl._session)
    rt._impl._graph_runs, rt._impl.cuda_graph = GraphRuns(ort, rec, "cpu", rt._impl._input, rt._impl._output), True
    xs = {b: rng.standard_normal((b, 1, 16, 16)).astype(np.float32) for b in (4, 1)}
    first = {}
    for t in (0, 1, 2, 0, 1, 2, 1):
        for b, x in xs.items():
            y = rt.run(t, x)
            assert np.array_equal(y, plain.run(t, x))
            slot = rt._impl._slots.index(rt._impl._held[t])
            assert rec.ids[-1] == rt._impl._graph_runs.ids[(slot, x.shape)]
            first.setdefault((t, b), y.copy())
            assert np.array_equal(first[(t, b)], y)
    # Three channels where the model takes one: refused at the door in one line, before any run, the graphs kept.
    runs = len(rec.ids)
    with pytest.raises(UsageError, match=r"^images of shape \(1, 3, 16, 16\): .* takes \(B, 1, 16, 16\)$"):
        rt.run(0, np.zeros((1, 3, 16, 16), np.float32))
    assert len(rec.ids) == runs and rt.cuda_graph and len(rt._impl._graph_runs.buffers) == 2
    assert sorted(rt._impl._graph_runs.ids.values()) == [1, 2, 3, 4] and rt.info()["graphs"] == 4
    assert {slot for slot, _ in rt._impl._graph_runs.ids} == {0, 1}  # three tasks over two buffer sets
    kept = rt.run(0, xs[4])
    rt.run(1, xs[4])
    assert np.array_equal(kept, first[(0, 4)])  # not a view of the output buffer the next run wrote
    out = rt.run(2, ort.OrtValue.ortvalue_from_numpy(xs[1]))
    assert (
        isinstance(out, ort.OrtValue) and out.data_ptr() != rt._impl._graph_runs.buffers[(1, 1, 16, 16)][1].data_ptr()
    )
    assert np.array_equal(out.numpy()[:, : rt.num_classes(2)], plain.run(2, xs[1]))
    probe = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32))
    try:  # onnxruntime 1.31's update_inplace takes an OrtValue (a copy on the device); older ones NumPy only
        probe.update_inplace(ort.OrtValue.ortvalue_from_numpy(np.ones(1, np.float32)))
        copies = True
    except TypeError:
        copies = False
    assert (rec.ids[-1] > 0) == copies == rt._impl._graph_runs.device_copy  # graphed where it can be copied in
    # An onnxruntime whose update_inplace takes NumPy only: an OrtValue runs without the graph, its logits in
    # memory of their own (not the session's arena, where a later replay writes).
    rt._impl._graph_runs.device_copy = False
    out = rt.run(1, ort.OrtValue.ortvalue_from_numpy(xs[4]))
    assert rec.ids[-1] == -1 and np.array_equal(out.numpy()[:, : rt.num_classes(1)], first[(1, 4)])
    rt._impl._graph_runs.device_copy = True
    for b in range(2, GRAPH_SHAPES + 2):
        x = rng.standard_normal((b, 1, 16, 16)).astype(np.float32)
        assert np.array_equal(rt.run(0, x), plain.run(0, x))
    assert len(rt._impl._graph_runs.buffers) == GRAPH_SHAPES and rec.ids[-1] == -1  # the fifth shape: no graph
    # A run that fails with and without its graph: its own error, the graphs kept, the pair's id forgotten.
    pair = (rt._impl._slots.index(rt._impl._held[0]), (4, 1, 16, 16))
    given = set(rt._impl._graph_runs.ids.values())
    rec.refuse = -1
    with pytest.raises(RuntimeError, match="CUDA failure 900"):
        rt.run(0, xs[4])
    assert rt.cuda_graph and rt._impl._graph_runs is not None and pair not in rt._impl._graph_runs.ids
    # A graph the provider refuses (the run works without it): one warning, the logits of the run without
    # it, and the session built again without the option, each buffer set bound to it.
    rec.refuse = None
    assert np.array_equal(rt.run(0, xs[4]), first[(0, 4)])
    assert rt._impl._graph_runs.ids[pair] == max(given) + 1  # a new id: the forgotten one's graph may still exist
    rec.refuse = rt._impl._graph_runs.ids[pair]
    with pytest.warns(UserWarning, match=r"cuda_graph=True: onnxruntime refused the CUDA graph \(RuntimeError"):
        assert np.array_equal(rt.run(0, xs[4]), first[(0, 4)])
    assert rec.ids[-2:] == [rec.refuse, -1] and not rt.cuda_graph and not rt.info()["cuda_graph"]
    assert rt._impl._graph_runs is None and rt._impl._session is not rec and rt._impl._session is not rec.real
    seen = len(rec.ids)
    for t in (1, 2, 0):
        for x in xs.values():
            assert np.array_equal(rt.run(t, x), plain.run(t, x))
    assert len(rec.ids) == seen  # the stand-in is out of the way


def test_cuda_graph_is_a_switch_mode_option_and_off_without_cuda(bundle3):
    """``cuda_graph=True`` in the session mode, or with a shared CUDA arena, is refused in one line naming
    it; on a CPU it warns and runs the plain switch mode (the same logits)."""
    _, bundle = bundle3
    with pytest.raises(ValueError, match=r"^cuda_graph=True runs the switch mode's one session"):
        Runtime(bundle, device="cpu", mode="session", cuda_graph=True)
    with pytest.raises(ValueError, match=r"^cuda_graph=True with cuda_arena='shared': a replay writes"):
        Runtime(bundle, device="cpu", cuda_graph=True, cuda_arena="shared")
    with pytest.warns(UserWarning, match="cuda_graph=True needs onnxruntime's CUDA provider and a GPU"):
        rt = Runtime(bundle, device="cpu", cuda_graph=True)
    assert rt.info()["cuda_graph"] is False and rt._impl._graph_runs is None
    x = np.random.default_rng(4).standard_normal((2, 1, 16, 16)).astype(np.float32)
    assert np.array_equal(rt.run(1, x), Runtime(bundle, device="cpu").run(1, x))


@pytest.mark.gpu  # onnxruntime-gpu's CUDA provider
def test_on_cuda_the_graph_replays_every_task_a_switch_wrote(bundle3):
    """``cuda_graph=True`` on a GPU: two buffer sets, three tasks in turn, two batch sizes: every run (the
    regular runs before a capture, the capture, the replays) gives the plain switch mode's logits within
    float32 (two sessions' cuDNN algorithms: 1e-4 of the largest logit), new images at every run included,
    and a replay of a task gives what its earlier graphed runs gave, bit for bit, after other tasks rewrote
    the buffers. A device OrtValue in
    gives a device OrtValue out, which later replays leave as it was."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu (the CUDA provider) is not installed")
    _, bundle = bundle3
    rt = Runtime(bundle, device="cuda", cuda_graph=True, ready=2)
    plain = Runtime(bundle, device="cuda")
    assert rt.cuda_graph and rt._impl._graph_runs is not None
    rng = np.random.default_rng(8)
    xs = {b: rng.standard_normal((b, 1, 16, 16)).astype(np.float32) for b in (4, 1)}
    seen = {}
    for _ in range(3):
        for t in (0, 1, 2):
            for b, x in xs.items():
                for _ in range(3):  # past onnxruntime's regular runs before its capture
                    y = rt.run(t, x)
                    ref = plain.run(t, x)
                    np.testing.assert_allclose(y, ref, atol=1e-4 * float(np.abs(ref).max()), rtol=0)
                    fresh = rng.standard_normal(x.shape).astype(np.float32)  # a replay reads this run's images
                    ref = plain.run(t, fresh)
                    np.testing.assert_allclose(rt.run(t, fresh), ref, atol=1e-4 * float(np.abs(ref).max()), rtol=0)
                if (t, b) in seen:
                    assert np.array_equal(rt.run(t, x), seen[(t, b)])
                seen[(t, b)] = y
    assert rt.cuda_graph and rt.info()["graphs"] == 4  # no refusal; 2 buffer sets x 2 shapes
    out = rt.run(1, ort.OrtValue.ortvalue_from_numpy(xs[4], "cuda", 0))
    assert out.device_name().lower() == "cuda"
    got = out.numpy()[:, : rt.num_classes(1)]
    np.testing.assert_allclose(got, seen[(1, 4)], atol=1e-4 * float(np.abs(got).max()), rtol=0)
    for t in (0, 2, 1):  # replays after it leave the logits the caller holds as they were
        rt.run(t, xs[4])
    assert np.array_equal(out.numpy()[:, : rt.num_classes(1)], got)


_FLAT = """
import gc, ctypes, json, sys
import numpy as np
from nwsconvert.export import Runtime
def rss():
    gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
x = np.zeros((1, 1, 16, 16), np.float32)
start = rss()
rt = Runtime(sys.argv[1], device="cpu")
for t in rt.tasks:  # every task once: every code path a switch takes has run
    rt.run(t, x)
first = rss()
for _ in range(3):
    for t in rt.tasks:
        rt.run(t, x)
print(json.dumps({"start": first - start, "cycled": rss() - first, "kept": sum(rt.info()["bytes_per_task"].values())}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
def test_memory_stays_flat_however_many_tasks_the_runtime_switches_between(bundle3, tmp_path):
    """In fresh processes: after every task ran once, running them all three times over adds nothing to the
    resident set (a switch rewrites buffers; per-task sessions would each hold a dense model, 1.5 MB here),
    and the 3-task Runtime holds what the 1-task one holds plus the two tasks' kept values (a margin of
    0.5 MB, a third of one per-task dense model, for the allocators' rounding: Python's and glibc's arenas
    grow in steps, and the heap left after decoding a pack's temporaries read up to 0.28 MB over the kept
    values once the process stopped importing onnx, whose 12 MB heap had absorbed them)."""
    import subprocess
    import sys

    run, bundle = bundle3
    export_bundle(run, tmp_path / "one", 0, onnx=True)
    got = {}
    for name, b in (("three", bundle), ("one", tmp_path / "one")):
        done = subprocess.run([sys.executable, "-c", _FLAT, str(b)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        got[name] = json.loads(done.stdout)
    assert got["three"]["cycled"] <= 250_000, got
    added = got["three"]["kept"] - got["one"]["kept"]
    assert got["three"]["start"] - got["one"]["start"] <= added + 500_000, got


def test_the_torch_export_based_exporter_writes_working_bundles(run, tmp_path):
    """exporter='dynamo' (the fallback for architectures TorchScript cannot lower) writes task graphs
    and switch.onnx that match PyTorch in both runtime modes, with a dynamic batch."""
    desc = export_bundle(run, tmp_path / "b", "all", onnx=True, exporter="dynamo")
    assert desc["switch"]["exporter"] == "dynamo" and {row["exporter"] for row in desc["tasks"].values()} == {"dynamo"}
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((3, 1, 16, 16)).astype(np.float32))
    for t in (0, 1):
        model = nwsconvert.load(run, task=t).eval()
        with torch.no_grad():
            ref = model(x).numpy()
        for mode in ("session", "switch"):
            y = Runtime(tmp_path / "b", device="cpu", mode=mode).run(t, x.numpy())
            np.testing.assert_allclose(y, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)  # fp32, other summation order


def test_switch_inputs_are_checked_by_name(run, tmp_path):
    """The one-session mode reads each task's values from its pack: a damaged pack, a missing
    pack or a missing base is refused by name, and the other tasks keep running."""
    export_bundle(run, tmp_path / "b", "all", onnx=True)
    assert not list((tmp_path / "b").glob("*.inputs.safetensors"))  # the pack is the per-task file
    pack = tmp_path / "b" / "task_1.nwspack"
    data = bytearray(pack.read_bytes())
    data[-3] ^= 0x01
    pack.write_bytes(bytes(data))
    rt = Runtime(tmp_path / "b", device="cpu", mode="switch")
    y0 = rt.run(0, np.zeros((1, 1, 16, 16), np.float32))
    with pytest.raises(nwsconvert.FormatError, match="task_1.nwspack"):
        rt.run(1, np.zeros((1, 1, 16, 16), np.float32))
    assert np.array_equal(rt.run(0, np.zeros((1, 1, 16, 16), np.float32)), y0)
    (tmp_path / "b" / "task_0.nwspack").unlink()
    with pytest.raises(FileNotFoundError, match="task_0.nwspack"):
        Runtime(tmp_path / "b", device="cpu", mode="switch").run(0, np.zeros((1, 1, 16, 16), np.float32))
    export_bundle(run, tmp_path / "c", 0)
    with pytest.raises(FileNotFoundError, match="no switch.onnx"):
        Runtime(tmp_path / "c", device="cpu", mode="switch")
    # The recipe of switch.onnx in bundle.json is pinned by its digest: an edited row is refused, not computed with.
    export_bundle(run, tmp_path / "e", "all", onnx=True)
    desc = json.loads((tmp_path / "e" / "bundle.json").read_text())
    fold = next(r for r in desc["switch"]["tensors"] if r["kind"] == "fold")
    fold["eps"] *= 10
    (tmp_path / "e" / "bundle.json").write_text(json.dumps(desc))
    with pytest.raises(nwsconvert.FormatError, match=r"bundle.json: field switch.tensors does not match its SHA-256"):
        Runtime(tmp_path / "e", device="cpu", mode="switch").run(0, np.zeros((1, 1, 16, 16), np.float32))
    assert (
        Runtime(tmp_path / "e", device="cpu", mode="session").run(0, np.zeros((1, 1, 16, 16), np.float32)).shape[0] == 1
    )
    export_bundle(run, tmp_path / "d", "all", onnx=True)
    desc = json.loads((tmp_path / "d" / "bundle.json").read_text())
    base = desc["tasks"]["0"]["base"]  # packs are stored as changes against the run's base.nwspack
    (tmp_path / "d" / base).unlink()  # without it they cannot be decoded, and the error says which file
    with pytest.raises(nwsconvert.FormatError, match=base):
        Runtime(tmp_path / "d", device="cpu", mode="switch").run(0, np.zeros((1, 1, 16, 16), np.float32))


_TORCHLESS = """
import sys, json, contextlib, io
import numpy as np
class Block:  # as on a machine without them
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'timm', 'torchvision', 'safetensors', 'yaml', 'matplotlib'):
            raise ModuleNotFoundError('No module named ' + repr(name), name=name)
# The test's own environment has this checkout installed in editable mode; its finder would
# supply the modules the wheel leaves out. Without it, the wheel is all there is.
sys.meta_path[:] = [Block()] + [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '') and 'editable' not in repr(f)]
import nwsconvert
from nwsconvert.export import Runtime
from nwsconvert.export.cli import infer_main
x = np.load(sys.argv[2])
out = {'file': nwsconvert.__file__}
for mode in ('session', 'switch'):
    rt = Runtime(sys.argv[1], device='cpu', mode=mode)
    out[mode] = {t: rt.run(t, x).tolist() for t in rt.tasks}
rt = Runtime(sys.argv[1], device='cpu', precision='float16')  # onnxruntime's own float16 converter, no torch
out['float16'] = {t: rt.run(t, x).tolist() for t in rt.tasks}
text = io.StringIO()
with contextlib.redirect_stdout(text):
    out['infer_rc'] = infer_main(['--bundle', sys.argv[1], '--task', '1', '--device', 'cpu', '--mode', 'switch', '--bench', sys.argv[3]])
out['infer'] = text.getvalue()
try:
    nwsconvert.convert
except ImportError as e:
    out['convert'] = str(e)
assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'timm', 'torchvision', 'safetensors')]
print(json.dumps(out))
"""


def test_the_runtime_wheel_needs_neither_torch_nor_timm(run, tmp_path):
    """The nwsconvert-runtime wheel, installed alone and run where importing torch, timm,
    safetensors or onnx fails, gives the same logits as the full install, in both modes,
    and nws-infer works from it."""
    import subprocess
    import sys

    from PIL import Image

    sys.path.insert(0, str(Path(__file__).parents[1] / "export" / "dist"))
    try:
        from build_runtime import build
    finally:
        sys.path.pop(0)
    wheel = build(tmp_path / "wheel")
    site = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    export_bundle(run, tmp_path / "b", "all", onnx=True)
    x = np.random.default_rng(0).standard_normal((3, 1, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    Image.fromarray((np.random.default_rng(1).random((16, 16)) * 255).astype(np.uint8)).save(tmp_path / "img.png")
    env = {**os.environ, "PYTHONPATH": str(site)}
    args = [sys.executable, "-c", _TORCHLESS, str(tmp_path / "b"), str(tmp_path / "x.npy"), str(tmp_path / "img.png")]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path)  # not the checkout's folder
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert Path(got["file"]).is_relative_to(site)  # the wheel's modules ran, not this checkout's
    assert "img.png" in got["infer"] and "needs the full nwsconvert install" in got["convert"]
    assert got["infer_rc"] == 0, proc.stderr[-2000:]
    assert "latency (batch 1)" in got["infer"] and "task switch (first run after it" in got["infer"]  # --bench
    for mode in ("session", "switch"):
        rt = Runtime(tmp_path / "b", device="cpu", mode=mode)
        for t in (0, 1):
            assert np.array_equal(
                np.asarray(got[mode][str(t)], dtype=np.float32), rt.run(t, x)
            )  # same code, same floats
    half = Runtime(tmp_path / "b", device="cpu", precision="float16")
    for t in (0, 1):
        assert np.array_equal(np.asarray(got["float16"][str(t)], dtype=np.float32), half.run(t, x))


@pytest.mark.parametrize(
    ("available", "gpu", "device", "providers", "warned"),
    [
        (["CPUExecutionProvider"], False, "auto", ["CPUExecutionProvider"], False),
        (
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            True,
            "auto",
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            False,
        ),
        (["CUDAExecutionProvider", "CPUExecutionProvider"], False, "auto", ["CPUExecutionProvider"], False),
        (["CUDAExecutionProvider", "CPUExecutionProvider"], True, "cpu", ["CPUExecutionProvider"], False),
        (["CPUExecutionProvider"], True, "cuda", ["CPUExecutionProvider"], True),  # onnxruntime without CUDA
        (["CUDAExecutionProvider", "CPUExecutionProvider"], False, "cuda", ["CPUExecutionProvider"], True),  # no GPU
    ],
)
def test_the_runtime_picks_its_providers_from_what_onnxruntime_and_the_machine_offer(
    bundle3, monkeypatch, available, gpu, device, providers, warned
):
    """The provider choice, with onnxruntime's list and the GPU's presence faked (the suite runs without a GPU).
    Every session is asked for the CUDA provider with TF32 off (onnxruntime's default is on: logits 1e-3
    from the CPU's), or on with ``tf32=True``."""
    import warnings

    import onnxruntime

    import nwsconvert.export.runtime as runtime

    _, bundle = bundle3
    preloaded, asked = [], []
    session = onnxruntime.InferenceSession

    def recording(*args, providers=None, **kwargs):
        asked.append(providers)
        return session(*args, providers=["CPUExecutionProvider"], **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", recording)
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: list(available))
    monkeypatch.setattr(onnxruntime, "preload_dlls", lambda *a, **k: preloaded.append(1), raising=False)
    monkeypatch.setattr(runtime, "_gpu_present", lambda: gpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = Runtime(bundle, device=device, mode="session")  # the switch mode would put buffers on a GPU
        rt.session(0)
    assert rt.providers == providers
    assert rt.requested_cuda == (device == "cuda" or providers[0] == "CUDAExecutionProvider")
    assert bool(preloaded) == (providers[0] == "CUDAExecutionProvider")  # CUDA / cuDNN loaded only when used
    assert any("CUDA requested but" in str(w.message) for w in caught) == warned
    cuda = ("CUDAExecutionProvider", {"use_tf32": "0"})
    want = [cuda, "CPUExecutionProvider"] if providers[0] == "CUDAExecutionProvider" else ["CPUExecutionProvider"]
    assert asked and all(p == want for p in asked), asked
    if providers[0] == "CUDAExecutionProvider":
        asked.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the faked CUDA provider falls back to the CPU's, and says so
            Runtime(bundle, device=device, mode="session", tf32=True).session(0)
        assert asked and all(p == [("CUDAExecutionProvider", {"use_tf32": "1"}), "CPUExecutionProvider"] for p in asked)
