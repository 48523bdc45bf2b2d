"""benchmarks/export_coverage.py's check: activations at a trained network's scale, and a pass rule
that fails near-zero logits and wrong kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from export_coverage import MIN_LOGIT, calibrate_norms, onnx_parity, passes  # noqa: E402

import nwsconvert  # noqa: E402


def _deep_net(depth: int = 12) -> torch.nn.Module:
    """Conv + BatchNorm blocks whose small weights shrink activations about tenfold per layer in eval mode
    while BatchNorm keeps its initial statistics (12 blocks: logits near 1e-14)."""
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(depth):
        conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        torch.nn.init.normal_(conv.weight, 0, 0.02)
        layers += [conv, torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5, bias=False)]
    return torch.nn.Sequential(*layers)


def test_calibrated_norms_keep_logits_at_unit_scale():
    torch.manual_seed(0)
    model = nwsconvert.convert(_deep_net(), pool_size=16, init="random").eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        before = model(x).abs().max().item()
        calibrate_norms(model, 16)
        after = model(x).abs().max().item()
    assert before < MIN_LOGIT  # the initial statistics: outputs vanish with depth
    assert after >= MIN_LOGIT
    assert all(not m.training for m in model.modules())  # eval mode restored everywhere
    bn = model[2]
    assert bn.momentum is None and int(bn.num_batches_tracked) == 4


def test_graph_of_a_calibrated_model_passes(tmp_path):
    torch.manual_seed(0)
    model = nwsconvert.convert(_deep_net(4), pool_size=16, init="random").eval()
    calibrate_norms(model, 16)
    r = onnx_parity(model, 16)
    assert passes(r), r
    assert r["rel"] <= 1e-4 and r["rel_torch_fp64"] < 1e-5


def test_pass_rule():
    good = {"rel": 2e-6, "rel_onnx_fp64": 2e-6, "rel_torch_fp64": 1e-6, "max_logit": 1.0}
    assert passes(good)
    # Beyond 1e-4 of PyTorch's float32, but as close to float64 as PyTorch's float32 is: passes.
    assert passes({**good, "rel": 1.2e-4, "rel_onnx_fp64": 9e-5, "rel_torch_fp64": 8e-5})
    # A wrong kernel: far from both.
    assert not passes({**good, "rel": 0.3, "rel_onnx_fp64": 0.3})
    # Exact, but on logits near zero: says little, fails.
    assert not passes({**good, "max_logit": 1e-9})
