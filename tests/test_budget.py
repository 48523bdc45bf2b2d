"""The budget planner: each layer's vector and pool size chosen for bits a weight or bytes a task."""

from __future__ import annotations

import math

import numpy as np
import pytest
import timm
import torch
import torchvision
from trainer_utils import train_run

import nwsconvert
from nwsconvert.conversion import budget as budget_module
from nwsconvert.conversion import planner as planner_module
from nwsconvert.conversion.budget import fit_budget, plan_bytes, state_bytes
from nwsconvert.conversion.config import Budget, NWSConfig
from nwsconvert.conversion.planner import plan
from nwsconvert.errors import UsageError
from nwsconvert.export import Runtime, export_bundle
from nwsconvert.train.job import budget_bytes, resolve_job, validate_job
from nwsconvert.zoo import get_preset

MOBILE = "mobilenetv3_small_050"
#: timm's tiny EfficientNet: depthwise, 1x1 and SE layers as in the real family, 97k weights (fast to plan)
TINY = "test_efficientnet"


def mobile(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model(TINY, num_classes=4, **kwargs)


def weights(plans) -> int:
    return sum(math.prod(p.shape) for p in plans if not p.skipped)


def bits_per_weight(plans) -> float:
    return 8 * plan_bytes(plans) / weights(plans)


@pytest.fixture(scope="module")
def planned():
    """timm's tiny EfficientNet planned for 1 and 3 bits a weight, and the planner's plans without a budget."""
    model = mobile()
    base = plan(model, NWSConfig())
    return model, base, {b: plan(model, NWSConfig(bits_per_weight=b)) for b in (1.0, 3.0)}


def test_a_plan_meets_its_bits_per_weight_within_5_percent_and_spends_more_where_it_may(planned):
    model, base, plans = planned
    for b, p in plans.items():
        assert 0.95 * b <= bits_per_weight(p) <= b  # at fixed width, every layer rounded to whole bytes
    # the planner changed vector sizes, not only pool sizes: large 1x1 layers take long vectors at 1 bit
    low, high = plans[1.0], plans[3.0]
    big = max((p for p in low if p.family == "1x1" and p.role != "head"), key=lambda p: math.prod(p.shape))
    assert big.vector_size >= 4
    # three times the bits buy shorter vectors or more entries (finer pools) on the 1x1 layers
    finer = [
        (h.vector_size, -h.pool_size) < (lo.vector_size, -lo.pool_size)
        for lo, h in zip(low, high)
        if lo.family == "1x1" and lo.role != "head"
    ]
    assert sum(finer) > len(finer) / 2
    # what it never touches: the head keeps the config's scalar 512-entry pool
    assert [p for p in low if p.role == "head"] == [p for p in base if p.role == "head"]
    assert all(p.pool_size <= budget_module.MAX_PLANNED_POOL for p in low)


def test_a_byte_budget_counts_the_tasks_state_and_is_met_within_5_percent(planned):
    model, base, _ = planned
    state = state_bytes(model, base)
    # float16 state: every BatchNorm entry and bias at 2 bytes, the int64 batch counters at 8
    expected = sum(
        t.numel() * (2 if t.dtype == torch.float32 else t.element_size())
        for k, t in model.state_dict().items()
        if k not in {f"{p.name}.weight" for p in base}
    )
    assert state == expected > 0
    target = 30_000
    p = plan(model, NWSConfig(budget=target))
    assert 0.95 * target <= plan_bytes(p) + state <= target


def test_a_budget_below_the_smallest_plan_names_that_plan_and_the_plan_at_it_fits():
    model = mobile()
    with pytest.raises(UsageError, match=r"bits_per_weight=0.01 is below the smallest plan for EfficientNet: ") as e:
        plan(model, NWSConfig(bits_per_weight=0.01))
    floor = float(str(e.value).rsplit(": ", 1)[1].split()[0])
    p = plan(model, NWSConfig(bits_per_weight=floor + 0.001))
    assert bits_per_weight(p) <= floor + 0.001
    with pytest.raises(UsageError, match=r"budget=100 is below the smallest plan .* bytes per task"):
        plan(model, NWSConfig(budget=100))


def test_the_plan_is_the_same_for_the_same_seed_and_weights():
    a = plan(mobile(), NWSConfig(bits_per_weight=1.5, seed=3))
    b = plan(mobile(), NWSConfig(bits_per_weight=1.5, seed=3))
    assert a == b


def test_the_recorded_config_rebuilds_the_plan_without_planning_again(monkeypatch):
    """convert spends the budget into per-layer entries: the manifest's config needs no planner."""
    model = nwsconvert.convert(mobile(), bits_per_weight=1.5)
    options = model.nws_report.options
    assert options["planned_for"] == "bits_per_weight=1.5"
    assert "bits_per_weight" not in options and "budget" not in options
    config = NWSConfig.from_dict(options)
    monkeypatch.setattr(planner_module, "fit_budget", lambda *a, **k: pytest.fail("planned again"))
    again = plan(mobile(seed=1), config)  # other weights: a planner would choose otherwise
    got = {r.name: (r.vector_size, r.pool_size) for r in model.nws_report.layers}
    assert {p.name: (p.vector_size, p.pool_size) for p in again if not p.skipped} == got
    # and the model it converts stores what the plan said
    assert model.nws_report.index_bytes == plan_bytes(again)


def test_group_sizes_bound_the_vector_sizes_the_planner_may_give():
    model = mobile()
    scalar = plan(model, NWSConfig(bits_per_weight=3, group_sizes=(1,)))
    assert {p.vector_size for p in scalar if p.family == "1x1"} == {1}
    assert 0.95 * 3 <= bits_per_weight(scalar) <= 3
    config = NWSConfig(bits_per_weight=3, group_sizes=[1, 4])  # JSON gives a list
    assert config.group_sizes == (1, 4) and NWSConfig.from_dict(config.to_dict()) == config
    assert {p.vector_size for p in plan(model, config) if p.family == "1x1"} <= {1, 4}
    converted = nwsconvert.convert(mobile(), config)
    assert converted.nws_report.options["planned_for"] == "bits_per_weight=3, group_sizes=[1, 4]"
    assert "group_sizes" not in converted.nws_report.options  # spent with the budget
    for bad in ([], [0], "1", [1.5]):
        with pytest.raises(UsageError, match="group_sizes"):
            NWSConfig(bits_per_weight=3, group_sizes=bad)
    with pytest.raises(UsageError, match=r"group_sizes=\[1\] bounds the budget planner's vector sizes: give bits_per"):
        NWSConfig(group_sizes=[1])  # no budget: nothing would read them
    with pytest.raises(UsageError, match=r"group_sizes=\[1\] bounds"):
        get_preset("resnet-basic").config(mobile(), group_sizes=(1,))  # a preset without a budget


def test_a_pool_set_and_a_budget_together_are_refused_in_one_line():
    model = nwsconvert.convert(mobile())
    pools = nwsconvert.pool_set(model)
    with pytest.raises(UsageError, match="bits_per_weight=2 and a given pool set both fix the pool sizes"):
        nwsconvert.convert(mobile(), bits_per_weight=2, init=pools)


def test_budget_values_are_checked_with_one_line_errors():
    for bad in (0, -1, 33, "2", True):
        with pytest.raises(UsageError, match="bits_per_weight must be a number in"):
            NWSConfig(bits_per_weight=bad)
    with pytest.raises(UsageError, match="either bits_per_weight or budget"):
        NWSConfig(bits_per_weight=2, budget=10)
    with pytest.raises(UsageError, match="budget must be a whole number of bytes"):
        Budget(bytes_per_task=1.5)
    assert budget_bytes(200000) == 200000
    assert budget_bytes("200KB") == 200000
    assert budget_bytes("0.2 MB") == 200000
    assert budget_bytes("64KiB") == 65536
    for bad in ("lots", "-3KB", "3XB", "0"):
        with pytest.raises(UsageError, match=r"budget=.*: expected bytes per task, e.g. budget=200000"):
            budget_bytes(bad)


def test_nws_train_takes_a_budget_and_refuses_two(tmp_path):
    job = resolve_job(["bits_per_weight=1.5", "budget=200KB", f"out={tmp_path}"])
    with pytest.raises(UsageError, match="two forms of one budget"):
        validate_job(job)
    with pytest.raises(UsageError, match=r"bits_per_weight='lots': expected a number of bits"):
        validate_job(resolve_job(["bits_per_weight=lots", f"out={tmp_path}"]))
    validate_job(resolve_job(["bits_per_weight=off", "preset=auto", f"out={tmp_path}"]))
    validate_job(resolve_job(["bits_per_weight=4", "group_sizes=[1, 2]", f"out={tmp_path}"]))
    with pytest.raises(UsageError, match=r"group_sizes=4: expected a list of vector sizes"):
        validate_job(resolve_job(["group_sizes=4", f"out={tmp_path}"]))
    with pytest.raises(UsageError, match=r"group_sizes=\[1\] bounds the budget planner, which bits_per_weight=off"):
        validate_job(resolve_job(["bits_per_weight=off", "group_sizes=[1]", f"out={tmp_path}"]))


# ------------------------------------------------------------------ presets
def test_inverted_residual_plans_scalar_pools_for_3_25_bits_a_weight_and_the_users_g_turns_it_off():
    model = mobile()
    preset = get_preset("inverted-residual")
    config = preset.config(model)
    assert config.planned_for == "bits_per_weight=3.25, group_sizes=[1]" and config.bits_per_weight is None
    p = plan(model, config)
    assert 0.95 * 3.25 <= bits_per_weight(p) <= 3.25
    assert {q.vector_size for q in p if q.family == "1x1"} == {1}  # scalar pools, small ones
    assert max(q.pool_size for q in p if q.family == "1x1" and q.role != "head") < 512
    # the user's group size holds everywhere the preset's rule puts it: no budget, no vector sizes
    g4 = plan(model, preset.config(model, group_size=4))
    assert {q.vector_size for q in g4 if q.family == "1x1" and q.role != "head" and q.fan_in % 4 == 0} == {4}
    # the old rule, scalars at 512 entries, on request (the preset's vector sizes go with its budget)
    old = preset.config(model, bits_per_weight=None)
    assert old.planned_for is None and old.group_sizes is None
    assert {q.vector_size for q in plan(model, old) if q.family == "1x1"} == {1}
    # the plan this preset made before: 2 bits, the planner free to pick vectors
    vectors = preset.config(model, bits_per_weight=2, group_sizes=(1, 2, 4, 8, 16))
    assert vectors.planned_for == "bits_per_weight=2, group_sizes=[1, 2, 4, 8, 16]"
    v = plan(model, vectors)
    assert 1.9 <= bits_per_weight(v) <= 2.0 and max(q.vector_size for q in v if q.family == "1x1") > 1


@pytest.mark.parametrize("name", ["resnet-basic", "resnet-bottleneck", "paper", "vgg", "convnext"])
def test_presets_without_a_budget_plan_as_they_did(name):
    """ResNets keep what they had: their presets name no budget, so no layer is re-planned."""
    preset = get_preset(name)
    assert preset.bits_per_weight is None and preset.budget is None
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=4)
    config = preset.config(model)
    assert config.planned_for is None
    assert plan(model, config) == preset.edit(plan(model, preset.base_config()))


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            lambda: torchvision.models.mobilenet_v3_small(num_classes=4, width_mult=0.5),
            id="torchvision-mobilenet_v3_small",
        ),
        pytest.param(lambda: timm.create_model("regnetx_002", num_classes=4), id="timm-regnetx_002-grouped"),
        pytest.param(lambda: timm.create_model("test_resnet", num_classes=4), id="timm-test_resnet-kxk"),
        pytest.param(lambda: timm.create_model("test_byobnet", num_classes=4), id="timm-test_byobnet-reparam"),
    ],
)
def test_the_budget_holds_across_families(build):
    """Depthwise (torchvision's MobileNetV3), grouped (RegNetX), plain k x k (ResNet) and
    re-parameterisable (ByobNet's RepVGG and bottleneck blocks) families: the plan meets the budget,
    every vector size divides its layer's input width, and the model converted from it runs and
    stores what the plan says. (Other families: ``test_models.py``, ``test_export_coverage.py``.)"""
    torch.manual_seed(0)
    model = build()
    converter = nwsconvert.NWSConverter(bits_per_weight=1.25, init="random")  # the plan's proxy is k-means all the same
    p = converter.plan(model)
    assert 0.95 * 1.25 <= bits_per_weight(p) <= 1.25
    assert all(q.fan_in % q.vector_size == 0 for q in p if q.family == "1x1" and not q.skipped)
    converted = converter.apply(model, p).eval()
    assert torch.isfinite(converted(torch.randn(1, 3, 64, 64))).all()
    assert converted.nws_report.index_bytes == plan_bytes(p)
    assert converted.nws_report.options["planned_for"] == "bits_per_weight=1.25"


def test_fit_budget_keeps_skipped_layers_and_counts_them_in_the_state():
    model = mobile()
    base = plan(model, NWSConfig(layers={"conv_stem": None}))
    out = fit_budget(model, base, Budget(bits_per_weight=1.0))
    assert [p for p in out if p.skipped] == [p for p in base if p.skipped]
    # the dense stem's weights are task state (float16), not indices
    assert state_bytes(model, base) - state_bytes(model, plan(model, NWSConfig())) == 2 * model.conv_stem.weight.numel()


# ------------------------------------------------------------------ report
def test_the_report_shows_bits_a_weight_and_bytes_a_task_layer_by_layer():
    model = nwsconvert.convert(mobile(), bits_per_weight=1.5)
    report = model.nws_report
    assert report.state_bytes == state_bytes(mobile(), plan(mobile(), NWSConfig()))
    text = str(report)
    assert "bits/w" in text and "task bytes" in text
    assert "planned for bits_per_weight=1.5" in text
    assert report.task_bytes == report.index_bytes + report.state_bytes
    assert report.to_dict()["totals"]["bits_per_weight"] == pytest.approx(
        8 * report.index_bytes / (report.dense_bytes / 4)
    )
    assert sum(r.index_bytes for r in report.layers) == report.index_bytes


# ------------------------------------------------------- trained, exported, run
def test_a_planned_mobile_run_exports_and_the_switch_mode_matches_pytorch(tmp_path):
    """Every plan runs through the product unchanged: training, packs, nws-export, the switch mode."""
    torch.manual_seed(0)
    model = timm.create_model(MOBILE, num_classes=4, in_chans=1)
    nwsconvert.convert(model, bits_per_weight=1.5, pool_size=64)
    assert {r.vector_size for r in model.nws_report.layers if r.kind.startswith("1x1")} - {1}  # grouped layers
    run = tmp_path / "run"
    train_run(run, model, tasks=(3, 2), size=32, model_spec=f"timm:{MOBILE}")
    export_bundle(run, tmp_path / "b", "all", onnx=True)
    x = torch.randn(2, 1, 32, 32)
    rt = Runtime(tmp_path / "b", device="cpu")
    assert rt.mode == "switch"
    for task in (0, 1, 0):
        want = nwsconvert.load(run, task=task).eval()(x).detach().numpy()
        got = rt.run(task, x.numpy())
        # float32 on both sides, BatchNorm folded in the graph: rounding only
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_nws_train_without_a_preset_says_what_preset_auto_gives_a_mobile_network(capsys):
    """A MobileNet converted by nws-train's plain rule (no preset, no budget, the default sizes) gets one line
    naming ``preset=auto`` and what it saves; naming the preset ``none``, a budget or a size, or a ResNet,
    gets none."""
    from nwsconvert.train.job import DEFAULT_JOB, convert_job

    def said(**keys) -> str:
        build = keys.pop("build", mobile)
        convert_job({**DEFAULT_JOB, **keys}, build(), "random", 0)
        return capsys.readouterr().out

    note = "preset=auto stores a task about 8x smaller"
    assert note in said()
    assert note not in said(preset="none")
    assert note not in said(bits_per_weight=2)
    assert note not in said(group_size=4)
    assert note not in said(build=lambda: timm.create_model("test_resnet", num_classes=4))
