"""NWSConfig round trips and resolution, the planner, and convert() driven by a config or by edited plans."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from torch import nn

import nwsconvert as nc
from nwsconvert import LayerConfig, NWSConfig
from nwsconvert.conversion.planner import config_from_plans, plan
from nwsconvert.errors import UsageError


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 12, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 3),
    )  # fmt: skip


CONFIGS = [
    NWSConfig(),
    NWSConfig(pool_size=64, group_size=4, init="random", seed=7, kmeans_iters=0),
    NWSConfig(layers={"4": LayerConfig(group_size=2), "*": LayerConfig(pool_size=16), "8": None}),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_config_round_trips_through_json(config):
    d = json.loads(json.dumps(config.to_dict()))
    assert d["version"] == 1
    again = NWSConfig.from_dict(d)
    assert again == config and list(again.layers) == list(config.layers)  # order is part of the config


def test_legacy_options_translate_with_their_old_meaning():
    config = NWSConfig().replace(
        skip=["fc"], layer_pool_size={"layer1.*": 8, "*": 100}, layer_group_size={"layer1.*": 2, "fc": 4}
    )
    assert config.layers == {"fc": None, "layer1.*": LayerConfig(8, 2), "*": LayerConfig(pool_size=100)}
    assert config.skipped("fc") == "fc" and config.skipped("layer1.0") is None
    assert config.resolve("layer1.0") == LayerConfig(8, 2)
    assert config.resolve("layer2.0") == LayerConfig(100, 1)
    # A manifest written before NWSConfig (no version) reads as the same config.
    old = {
        "pool_size": 512,
        "group_size": 1,
        "skip": ["fc"],
        "layer_pool_size": {"layer1.*": 8, "*": 100},
        "layer_group_size": {"layer1.*": 2, "fc": 4},
    }
    assert NWSConfig.from_dict(old) == config


def test_each_field_comes_from_the_first_entry_that_sets_it():
    config = NWSConfig(
        pool_size=32, layers={"a.*": LayerConfig(pool_size=8), "a.b": LayerConfig(pool_size=4, group_size=2)}
    )
    assert config.resolve("a.b") == LayerConfig(8, 2)
    assert config.resolve("c") == LayerConfig(32, 1)
    assert (
        NWSConfig(layers={"a.*": LayerConfig(pool_size=8), "a.*b": None}).skipped("a.b") == "a.*b"
    )  # None wins anywhere


@pytest.mark.parametrize(
    "data, message",
    [
        ({"version": 1, "pool_size": 1}, "pool_size must be an integer in"),
        ({"version": 1, "init": "zeros"}, "init must be one of"),
        ({"version": 1, "bogus": 1}, "unknown conversion config key 'bogus'"),
        ({"version": 9}, "version 9 is newer"),
        ({"version": 1, "layers": {"x": {"pool_size": 8, "colour": 1}}}, r"layers\['x'\] must be null or an object"),
        ({"version": 1, "layers": {"x": {"group_size": 0}}}, "group_size must be an integer in"),
        ({"skip": ["x"], "init": "kmeans"}, "unknown conversion option 'init'"),  # legacy dicts never held init
        ([], "a conversion config is a JSON object"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(data, message):
    with pytest.raises(UsageError, match=message):
        NWSConfig.from_dict(data)


def test_unknown_override_names_the_known_options():
    with pytest.raises(UsageError, match="unknown conversion option 'pool'.*pool_size"):
        nc.convert(_net(), pool=8)


def test_planner_decides_every_layer_without_converting():
    model = _net()
    before = {n: p.clone() for n, p in model.named_parameters()}
    plans = plan(model, NWSConfig(pool_size=16, group_size=4, layers={"8": None}))
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys() and not nc.is_converted(model)
    by = {p.name: p for p in plans}
    assert [p.name for p in plans] == ["0", "3", "4", "8"]
    assert (by["0"].role, by["0"].family, by["0"].vector_size, by["0"].kernels, by["0"].pool_size) == (
        "stem",
        "kxk",
        9,
        24,
        16,
    )
    assert (by["3"].family, by["3"].kind, by["3"].kernels) == ("depthwise", "3x3 dw", 8)
    assert (by["4"].family, by["4"].group_size, by["4"].vector_size, by["4"].kernels, by["4"].kind) == (
        "1x1",
        4,
        4,
        24,
        "1x1 vec4",
    )
    assert by["8"].skipped and not by["8"].forced and by["8"].role == "head"
    # A width that g does not divide falls back to 1, with a note.
    fell = plan(_net(), NWSConfig(group_size=5))
    assert {p.name: p.group_size for p in fell if p.family == "1x1"} == {"4": 1, "8": 1} and "not a multiple" in fell[
        2
    ].note


def test_convert_applies_edited_plans_and_records_them_in_the_config():
    model = _net()
    converter = nc.NWSConverter(NWSConfig(pool_size=16, init="random"))
    plans = converter.plan(model)
    edited = [
        p.with_pool_size(4) if p.name == "3" else p.dense("skipped by the user") if p.name == "4" else p for p in plans
    ]
    converter.apply(model, edited)
    sizes = {layer.name: layer.nws.pool_size for layer in nc.nws_layers(model)}
    assert sizes == {"0": 16, "3": 4, "8": 16}
    recorded = NWSConfig.from_dict(model.nws_report.options)
    assert recorded.layers == {"3": LayerConfig(pool_size=4), "4": None}
    # The recorded config alone plans the same model again.
    assert [(p.name, p.pool_size, p.skipped) for p in plan(_net(), recorded)] == [
        (p.name, p.pool_size, p.skipped) for p in edited
    ]


def test_config_from_plans_records_only_what_differs():
    base = NWSConfig(pool_size=16, group_size=4)
    plans = plan(_net(), base)
    assert config_from_plans(plans, base) == base
    head_scalar = [p.with_group_size(1) if p.role == "head" else p for p in plans]
    assert config_from_plans(head_scalar, base).layers == {"8": LayerConfig(group_size=1)}


def test_a_config_converts_the_same_as_its_keywords():
    torch.manual_seed(0)
    a, b = _net(), _net()
    b.load_state_dict(a.state_dict())
    nc.convert(a, pool_size=8, group_size=4, skip=["8"], seed=3)
    nc.convert(b, NWSConfig(pool_size=8, group_size=4, seed=3, layers={"8": None}))
    for la, lb in zip(nc.nws_layers(a), nc.nws_layers(b)):
        assert (
            la.name == lb.name and torch.equal(la.nws.pool, lb.nws.pool) and torch.equal(la.nws.indices, lb.nws.indices)
        )
    assert a.nws_report.options == b.nws_report.options


def test_pool_set_fixes_the_pool_sizes_and_must_fit():
    src = nc.convert(_net(), pool_size=8, init="random", layers={"3": LayerConfig(pool_size=4)})
    pools = nc.pool_set(src)
    again = nc.convert(_net(), init=pools)
    assert {l.name: l.nws.pool_size for l in nc.nws_layers(again)} == {"0": 8, "3": 4, "4": 8, "8": 8}
    assert again.nws_report.options["init"] == "pools"
    with pytest.raises(nc.ConversionError, match="pool for layer '4' is \\(8, 1\\), the layer needs vectors of 4"):
        nc.convert(_net(), init=pools, group_size=4)
    with pytest.raises(UsageError, match="config.init is 'pools'"):
        nc.convert(_net(), NWSConfig(init="pools"))


def test_presets_only_edit_plans_and_their_config_reconverts_identically():
    from nwsconvert.zoo import get_preset

    model = torchvision.models.mobilenet_v3_small(num_classes=4, width_mult=0.5).eval()
    preset = get_preset("inverted-residual")
    config = preset.config(model, pool_size=16, group_size=4, init="random")
    planned = plan(model, config)
    small = preset.replace(pool_size=16, group_size=4)
    edited = small.edit(plan(model, small.base_config()))
    assert [(p.name, p.pool_size, p.group_size, p.skipped) for p in planned] == [
        (p.name, p.pool_size, p.group_size, p.skipped) for p in edited
    ]
    # Every exact-name entry is a layer the preset changed; the user's patterns come first and win.
    user = preset.config(model, pool_size=16, layer_pool_size={"features.*": 3})
    assert next(iter(user.layers)) == "features.*"
    assert all(p.pool_size == 3 for p in plan(model, user) if p.name.startswith("features.") and not p.skipped)


def test_plans_that_leave_every_layer_dense_are_refused_naming_why():
    model = _net()
    converter = nc.NWSConverter(NWSConfig(pool_size=8, init="random"))
    dense = [p.dense("skipped by the user") for p in converter.plan(model)]
    with pytest.raises(
        nc.ConversionError,
        match=r"Sequential has no layer to convert: all 4 weight layers were skipped \(0: skipped by the user",
    ):
        converter.apply(model, dense)
    assert not nc.is_converted(model)
