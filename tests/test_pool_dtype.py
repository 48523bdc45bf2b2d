"""``pool_dtype=float16``: a pool file of half the bytes, with every task trained, rebuilt and
deployed against exactly the pools the file holds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import timm
import torch
from trainer_utils import KWARGS, SPEC, blobs, tiny_config, tiny_model, train_run

import nwsconvert
from nwsconvert import PoolSet, TrainConfig, Trainer, nws_layers
from nwsconvert.analysis.summary import format_summary, run_summary
from nwsconvert.errors import UsageError
from nwsconvert.export import Runtime, export_bundle
from nwsconvert.train.rundir import RunDir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooldtype")
    for dtype in ("float32", "float16"):
        train_run(root / dtype, pool_dtype=dtype)
    return root


@pytest.mark.parametrize("learn_pools", [True, False])
def test_the_pool_file_is_float16_and_the_model_holds_its_values(tmp_path, learn_pools):
    """Pools as learned (or as converted) are rounded once, before anything is searched against them."""
    trainer = train_run(tmp_path / "r", pool_dtype="float16", learn_pools=learn_pools, tasks=(3,))
    manifest = RunDir(tmp_path / "r").read()
    pools = PoolSet.load(tmp_path / "r" / manifest.pools.file)
    assert pools.dtype == torch.float16 and manifest.pools.bytes == pools.nbytes
    for layer in nws_layers(trainer.model):
        assert layer.nws.pool.dtype == torch.float32
        assert torch.equal(layer.nws.pool.detach().cpu(), pools[layer.name].float())  # exactly the file's values
    task = manifest.task(0).metrics
    assert task["rebuilt_acc"] == task["val_acc"]  # the trainer's own rule, rebuilt from the float16 file


def test_a_model_converted_from_a_float16_file_trains_into_a_float32_run(runs, tmp_path):
    """``convert(init=<float16 pool file>)`` then ``pool_dtype=float32`` without pool learning: the run
    stores the same values in float32, and its base pack and tasks name that file's hash."""
    torch.manual_seed(0)
    model = nwsconvert.convert(
        timm.create_model("test_resnet", num_classes=4, **KWARGS),
        pool_size=32,
        init=runs / "float16" / "pools.safetensors",
    )
    trainer = Trainer(
        model, tmp_path / "r", tiny_config(epochs=1), model_spec=SPEC, model_kwargs=KWARGS, progress=False
    )
    trainer.fit_task(0, blobs(32, 3, 10), blobs(16, 3, 20), 3)
    trainer.close()
    manifest = RunDir(tmp_path / "r").read()
    stored = PoolSet.load(tmp_path / "r" / manifest.pools.file)
    given = PoolSet.load(runs / "float16" / "pools.safetensors")
    assert stored.dtype == torch.float32 and all(torch.equal(stored[k], v.float()) for k, v in given.pools.items())
    assert manifest.task(0).metrics["rebuilt_acc"] == manifest.task(0).metrics["val_acc"]


def test_float16_halves_the_pool_file_and_rebuilds_exactly(runs):
    files = {d: PoolSet.load(runs / d / RunDir(runs / d).read().pools.file) for d in ("float32", "float16")}
    assert files["float16"].nbytes * 2 == files["float32"].nbytes
    assert files["float16"].table() == files["float32"].table()
    manifest = RunDir(runs / "float16").read()
    for t in (0, 1):
        model = nwsconvert.load(runs / "float16", task=t)
        for layer in nws_layers(model):
            assert torch.equal(layer.nws.pool, files["float16"][layer.name].float())
        assert manifest.task(t).metrics["rebuilt_acc"] == manifest.task(t).metrics["val_acc"]
    info = {d: run_summary(runs / d) for d in ("float32", "float16")}  # what nws-info prints
    assert [i["pools_dtype"] for i in info.values()] == ["float32", "float16"]
    assert info["float16"]["pools_bytes"] == files["float16"].nbytes
    assert "; float16)" in format_summary(info["float16"])


def test_a_resumed_run_trains_against_the_file_not_its_fresh_pools(runs, tmp_path):
    """A new process converts the model again (unrounded k-means pools): the next task must still
    use the float16 file's values, or its pack would not rebuild the trained model."""
    import shutil

    shutil.copytree(runs / "float16", tmp_path / "r")
    trainer = Trainer(tiny_model(), tmp_path / "r", resume=True, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    assert trainer.config.pool_dtype == "float16"
    trainer.fit_task(2, blobs(32, 2, 12), blobs(16, 2, 22), 2)
    pools = PoolSet.load(tmp_path / "r" / "pools.safetensors")
    for layer in nws_layers(trainer.model):
        assert torch.equal(layer.nws.pool.detach().cpu(), pools[layer.name].float())
    metrics = RunDir(tmp_path / "r").read().task(2).metrics
    assert metrics["rebuilt_acc"] == metrics["val_acc"]
    trainer.close()


def test_onnx_graphs_gather_float16_pools_and_match_pytorch(runs, tmp_path):
    desc = export_bundle(runs / "float16", tmp_path / "b", "all", onnx=True)
    desc32 = export_bundle(runs / "float32", tmp_path / "b32", "all")

    def tensor_bytes(bundle, desc):  # the file less its 8-byte length and JSON header (safetensors)
        head = (bundle / "pools.safetensors").read_bytes()[:8]
        return desc["pool_bytes"] - 8 - int.from_bytes(head, "little")

    assert 2 * tensor_bytes(tmp_path / "b", desc) == tensor_bytes(tmp_path / "b32", desc32)
    proto = onnx.load(str(tmp_path / "b" / "task_0.onnx"), load_external_data=False)
    pools = [t for t in proto.graph.initializer if t.name.startswith("pool/")]
    assert pools and all(t.data_type == onnx.TensorProto.FLOAT16 for t in pools)
    gathers = [n for n in proto.graph.node if n.op_type == "Gather" and n.input[0].startswith("pool/")]
    casts = {n.input[0] for n in proto.graph.node if n.op_type == "Cast"}
    assert len(gathers) == len(pools) and all(g.output[0] in casts for g in gathers)  # Gather float16, then Cast
    x = np.random.default_rng(5).standard_normal((4, 1, 16, 16)).astype(np.float32)
    for t in (0, 1):
        with torch.no_grad():
            ref = nwsconvert.load(runs / "float16", task=t)(torch.from_numpy(x)).numpy()
        for mode in ("session", "switch"):
            y = Runtime(tmp_path / "b", device="cpu", mode=mode).run(t, x)
            # fp32 after an exact float16 -> float32 cast; onnxruntime folds BatchNorm and sums in
            # another order: logits are O(1), 1e-4 is ~1000 ulp.
            np.testing.assert_allclose(y, ref, atol=1e-4, rtol=1e-4)


def test_pool_dtype_is_checked_and_recorded():
    with pytest.raises(UsageError, match="pool_dtype='bfloat16': choose one of float32, float16"):
        TrainConfig(pool_dtype="bfloat16")
    assert TrainConfig.from_recorded({}).pool_dtype == "float32"  # runs from before the option: float32 files
    with pytest.raises(ValueError, match="pool of layer 'big'"):
        PoolSet({"big": torch.tensor([[1e6, 0.0]])}).astype(torch.float16)
