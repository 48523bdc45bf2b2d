"""Conversion options, roles, the report, the module-walk fallback and error messages."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from torch import nn

import nwsconvert as nc


def test_resnet_roles_and_report():
    model = torchvision.models.resnet18(num_classes=7)
    nc.convert(model, pool_size=512, init="random")
    roles = {r.name: r.role for r in model.nws_report.layers}
    assert roles["conv1"] == "stem"
    assert roles["fc"] == "head"
    assert roles["layer2.0.downsample.0"] == roles["layer3.0.downsample.0"] == "shortcut"
    assert roles["layer2.0.conv1"] == "body"
    rep = model.nws_report
    assert rep.trace == "torch.fx"
    fc = next(r for r in rep.layers if r.name == "fc")
    assert (fc.kernels, fc.vector_size, fc.bits, fc.kind) == (7 * 512, 1, 9, "linear")
    conv1 = next(r for r in rep.layers if r.name == "conv1")
    assert (conv1.kernels, conv1.vector_size) == (64 * 3, 49)
    text = str(rep)
    assert "layer2.0.downsample.0" in text and "shortcut" in text and "indices per task" in text
    assert rep.index_bytes == sum((r.kernels * 9 + 7) // 8 for r in rep.layers)
    assert rep.to_dict()["totals"]["kernels"] == rep.kernels
    # API kept: torchvision attribute access works and returns converted layers.
    assert model.layer1[0].conv1.weight.shape == (64, 64, 3, 3)


def test_timm_api_is_kept():
    model = timm.create_model("resnet18", num_classes=3)
    nc.convert(model, pool_size=16, init="random")
    assert model.get_classifier() is model.fc
    assert model.pretrained_cfg["architecture"] == "resnet18"
    x = torch.randn(1, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        assert torch.equal(model.forward_head(feats), model(x))
    names = [n for n, _ in model.named_parameters()]
    assert "conv1.parametrizations.weight.original" in names
    assert "fc.parametrizations.weight.original" in names and "fc.bias" in names


def test_skip_pool_size_and_group_size_options():
    model = torchvision.models.mobilenet_v2(num_classes=10)
    nc.convert(
        model,
        pool_size=64,
        init="random",
        skip=["features.0.*"],
        group_size=4,
        layer_pool_size={"classifier.*": 256},
        layer_group_size={"classifier.1": 1},
    )
    rep = model.nws_report
    assert [s.name for s in rep.skipped] == ["features.0.0"]
    assert "skip option" in rep.skipped[0].reason
    by = {r.name: r for r in rep.layers}
    assert by["classifier.1"].pool_size == 256 and by["classifier.1"].vector_size == 1
    pw = by["features.1.conv.1"]  # 1x1 projection 32 -> 16
    assert pw.vector_size == 4 and pw.kernels == 16 * 32 // 4
    dw = by["features.1.conv.0.0"]  # 3x3 depthwise: group size does not apply
    assert dw.vector_size == 9 and "dw" in dw.kind
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        assert torch.equal(nc.materialize(model)(x), model(x))


def test_group_size_falls_back_when_it_does_not_divide():
    model = nn.Sequential(nn.Conv2d(3, 5, 1), nn.Flatten(), nn.Linear(5 * 4, 2))
    nc.convert(model, pool_size=8, init="random", group_size=2)
    by = {r.name: r for r in model.nws_report.layers}
    assert by["0"].vector_size == 1 and "not a multiple" in by["0"].note
    assert by["2"].vector_size == 2


def test_kmeans_pools_recover_clustered_kernels():
    """Kernels drawn around 32 prototypes: a 32-entry k-means pool finds them, a random one cannot."""
    g = torch.Generator().manual_seed(0)
    protos = torch.randn(32, 9, generator=g)
    pick = torch.randint(0, 32, (64 * 16,), generator=g)
    weight = (protos[pick] + 0.01 * torch.randn(64 * 16, 9, generator=g)).reshape(64, 16, 3, 3)
    errs = {}
    for init in ("kmeans", "random"):
        conv = nn.Conv2d(16, 64, 3)
        with torch.no_grad():
            conv.weight.copy_(weight)
        holder = nc.convert(nn.Sequential(conv), pool_size=32, init=init)
        layer = nc.nws_layers(holder)[0]
        errs[init] = float((layer.weight.detach() - layer.nws.gather()).pow(2).mean())
    assert errs["kmeans"] < 2e-4  # noise variance is 1e-4
    assert errs["random"] > 100 * errs["kmeans"]


class _Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3)
        self.body = nn.Conv2d(4, 4, 3, padding=1)
        self.downsample = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = self.stem(x)
        if x.sum() > 0:
            x = self.body(x) + self.downsample(x)
        return self.fc(x.mean((2, 3)))


def test_module_walk_fallback():
    model = _Untraceable()
    nc.convert(model, pool_size=8, init="random")
    rep = model.nws_report
    assert rep.trace.startswith("module walk (fx trace failed")
    assert {r.name: r.role for r in rep.layers} == {
        "stem": "stem",
        "body": "body",
        "downsample": "shortcut",
        "fc": "head",
    }
    assert all(r.found_by == "module walk" for r in rep.layers)


def test_layers_left_dense_with_reasons():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 4, 3)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        shared,
        shared,
        nn.LazyLinear(2),
    )
    nc.convert(model, pool_size=8, init="random")
    reasons = {s.name: s.reason for s in model.nws_report.skipped}
    assert "parametrization" in reasons["0"]
    assert "lazy module" in reasons["5"]
    assert [r.name for r in model.nws_report.layers] == ["3"]  # shared module listed once


def test_errors_name_the_problem(tmp_path):
    model = nc.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1)), pool_size=8, init="random")
    with pytest.raises(nc.ConversionError, match="already converted"):
        nc.convert(model)
    with pytest.raises(ValueError, match="neither 'kmeans', 'random' nor an existing pool file"):
        nc.convert(nn.Conv2d(3, 4, 3), init="k-means")
    nc.pool_set(model).save(tmp_path / "pools.safetensors")
    other = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 8, 1))
    nc.convert(other, pool_size=8, init=tmp_path / "pools.safetensors")  # same layer layout: fine
    wrong = nn.Sequential(nn.Conv2d(3, 4, 5), nn.Conv2d(4, 4, 1))
    with pytest.raises(nc.ConversionError, match=r"layer '0'.*vectors of 25"):
        nc.convert(wrong, init=tmp_path / "pools.safetensors")
    with pytest.raises(ValueError, match="has no NWS layers"):
        nc.commitment_loss(nn.Conv2d(3, 4, 3))
