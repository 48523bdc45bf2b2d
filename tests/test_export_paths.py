"""The ONNX exporters behind export_onnx: which one writes a graph, and what a user sees when none can.

Each case is a small converted model whose one unusual operator is the subject:
the TorchScript exporter cannot lower it (torch.export-based fallback), or it
takes a path TorchScript has no symbolic for (MultiheadAttention's inference
fast path), or onnxruntime rewrites it wrongly (Pad + MaxPool), or no exporter
can lower it (the error names the operator and checks the dense model).
Parity is judged as in tests/test_models.py: 1e-4 of the largest logit (fp32,
onnxruntime sums in other orders; a wrong kernel moves logits by O(their size)).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import nwsconvert as nc
from nwsconvert.export import ExportError, export_onnx
from nwsconvert.export.runtime import DISABLED_OPTIMIZERS


class _Net(nn.Module):
    """conv -> ``middle`` -> global pool -> linear; ``middle`` holds the operator under test."""

    def __init__(self, middle: nn.Module, channels: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.middle = middle
        self.head = nn.Linear(channels, 4)

    def forward(self, x):
        return self.head(self.middle(self.conv(x)).mean((2, 3)))


class _Attention(nn.Module):
    """Self-attention over the spatial positions, as ViT-style hybrids do (nn.MultiheadAttention)."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.attn = nn.MultiheadAttention(channels, 2, batch_first=True)

    def forward(self, x):
        b, c, h, w = x.shape
        seq = x.flatten(2).transpose(1, 2)
        out, _ = self.attn(seq, seq, seq, need_weights=False)
        return out.transpose(1, 2).reshape(b, c, h, w)


class _TrainingOnlyBranch(nn.Module):
    """A layer only the training forward uses, as GoogLeNet's and Inception's auxiliary heads."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.aux = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return x + self.aux(x) if self.training else x


class _Histogram(nn.Module):
    def forward(self, x):
        return x + torch.histc(x, bins=4).sum()


def _export(middle: nn.Module, tmp_path, size: int = 12, exporter: str = "auto"):
    torch.manual_seed(0)
    model = nc.convert(_Net(middle), pool_size=16, init="random").eval()
    nc.pool_set(model).save(tmp_path / "pools.safetensors")
    info = export_onnx(
        model,
        tmp_path / "m.onnx",
        tmp_path / "pools.safetensors",
        input_shape=(3, size, size),
        metadata={},
        exporter=exporter,
    )
    return model, info


def _assert_parity(model, tmp_path, size: int = 12, disabled=DISABLED_OPTIMIZERS):
    """Outputs of ``m.onnx`` in an onnxruntime session (the Runtime's options; ``disabled=[]``: a plain
    session, every rewrite on, as a user's own session runs it) against PyTorch."""
    x = torch.randn(3, 3, size, size)
    with torch.no_grad():
        ref = model(x).numpy()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(
        str(tmp_path / "m.onnx"), opts, providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled)
    )
    y = sess.run(None, {"input": x.numpy()})[0]
    assert y.shape == ref.shape
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


def test_torchscript_writes_what_it_can(tmp_path):
    model, info = _export(nn.ReLU(), tmp_path)
    assert info["exporter"] == "torchscript" and info["gather_nodes"] == 2
    _assert_parity(model, tmp_path)


def test_what_torchscript_cannot_lower_falls_back_to_torch_export(tmp_path):
    """Adaptive pooling to a size that does not divide the input (torchvision VGG at 96²)."""
    middle = nn.AdaptiveAvgPool2d(5)  # 12 -> 5: no symbolic in the TorchScript exporter
    with pytest.raises(ExportError, match="adaptive_avg_pool2d"):
        _export(middle, tmp_path, exporter="torchscript")
    model, info = _export(middle, tmp_path)
    assert info["exporter"] == "dynamo" and info["gather_nodes"] == 2
    _assert_parity(model, tmp_path)


def test_multihead_attention_exports_off_its_fast_path(tmp_path):
    """Under no_grad, nn.MultiheadAttention takes _native_multi_head_attention (no ONNX symbolic,
    torchvision ViT): the exporter traces the plain path, and the fast-path switch is restored."""
    before = torch.backends.mha.get_fastpath_enabled()
    model, info = _export(_Attention(), tmp_path, size=6)
    assert torch.backends.mha.get_fastpath_enabled() == before
    assert info["exporter"] == "torchscript"
    _assert_parity(model, tmp_path, size=6)


def test_layers_the_eval_forward_skips_are_left_out(tmp_path):
    model, info = _export(_TrainingOnlyBranch(), tmp_path)
    assert len(nc.nws_layers(model)) == 3 and info["gather_nodes"] == 2  # conv and head; aux never runs in eval
    _assert_parity(model, tmp_path)


def test_zero_pad_before_max_pool_keeps_its_zeros(tmp_path):
    """timm's BiT stem pads with 0, then max-pools: onnxruntime's Pad_Fusion folds such a pad into
    MaxPool (whose padding is -inf), so a window that sees only negatives and padding loses its 0. The
    exporter writes ``Max(MaxPool(x, pads), border)`` instead, with no Pad left to fold: the logits
    match PyTorch in a plain onnxruntime session (Pad_Fusion on, as a user's own session has it) as in
    the Runtime's."""
    middle = nn.Sequential(nn.ConstantPad2d(1, 0.0), nn.MaxPool2d(3, 2), nn.Conv2d(8, 8, 1))
    model, _ = _export(middle, tmp_path)
    with torch.no_grad():
        model.conv.bias.fill_(-5.0)  # mostly negative feature maps: the padding's zeros win many windows
    nc.pool_set(model).save(tmp_path / "pools.safetensors")
    export_onnx(model, tmp_path / "m.onnx", tmp_path / "pools.safetensors", input_shape=(3, 12, 12), metadata={})
    graph = onnx.load(tmp_path / "m.onnx", load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert "Pad" not in ops and ops.count("MaxPool") == 1
    (maximum,) = [n for n in graph.node if n.op_type == "Max"]
    assert maximum.input[1].endswith("/zero_pad_border")
    _assert_parity(model, tmp_path, disabled=[])
    _assert_parity(model, tmp_path)


def test_an_operator_no_exporter_lowers_is_named(tmp_path):
    with pytest.raises(ExportError) as info:
        _export(_Histogram(), tmp_path)
    message = str(info.value)
    assert "aten::histc" in message and "torchscript" in message and "dynamo" in message
    assert "the dense model fails too" in message and "\n" not in message
    with pytest.raises(ValueError, match="exporter must be one of"):
        _export(nn.ReLU(), tmp_path, exporter="onnx")
