"""Head resizing: existing rows kept exactly, new rows initialised, NWS and dense heads."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision

import nwsconvert
from nwsconvert import find_head, nws_layers, resize_head
from nwsconvert.core.search import brute_force
from nwsconvert.train.heads import head_classes


def _head_layer(model):
    return [l for l in nws_layers(model) if l.nws.role == "head"][-1]


@pytest.mark.parametrize("new", [3, 5, 10])
def test_nws_head_resize_keeps_rows_and_indices(new):
    torch.manual_seed(0)
    model = nwsconvert.convert(timm.create_model("test_resnet", num_classes=5), pool_size=16)
    head = _head_layer(model)
    w, idx, b = head.weight.detach().clone(), head.nws.indices.clone(), head.module.bias.detach().clone()
    pool = head.nws.pool.clone()
    resize_head(model, new, torch.Generator().manual_seed(1))
    head = _head_layer(model)
    keep = min(5, new)
    assert head.weight.shape == (new, w.shape[1]) and head.module.bias.shape == (new,)
    assert torch.equal(head.weight[:keep], w[:keep]) and torch.equal(head.module.bias[:keep], b[:keep])
    per_row = w.shape[1]  # scalar pool: one index per weight
    assert torch.equal(head.nws.indices[: keep * per_row], idx[: keep * per_row])
    assert torch.equal(head.nws.pool, pool)  # the shared pool is untouched
    assert head.module.out_features == new and model.num_classes == new
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, new)
    # Every index is the exact nearest entry of its (new) weight.
    assert torch.equal(head.nws.indices.long(), brute_force(head.weight.reshape(-1, 1), head.nws.pool))
    if new > 5:  # new rows like a fresh nn.Linear: |w| <= 1/sqrt(fan_in)
        assert head.weight[5:].abs().max() <= 1 / w.shape[1] ** 0.5


def test_resized_head_round_trips_through_a_pack():
    torch.manual_seed(0)
    model = nwsconvert.convert(timm.create_model("test_resnet", num_classes=5), pool_size=16)
    resize_head(model, 7)
    pack = nwsconvert.extract_task(model)
    other = nwsconvert.convert(timm.create_model("test_resnet", num_classes=5), init=nwsconvert.pool_set(model))
    with pytest.raises(nwsconvert.PackMismatchError, match="class count"):
        nwsconvert.apply_task(other, pack)
    resize_head(other, 7)
    nwsconvert.apply_task(other, pack)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model.eval()(x), other.eval()(x))


def test_dense_heads_torchvision_and_conv_classifier():
    tv = torchvision.models.mobilenet_v2(num_classes=4)
    name, head = find_head(tv)
    assert name == "classifier.1"
    w = head.weight.detach().clone()
    resize_head(tv, 2)
    assert torch.equal(tv.classifier[1].weight, w[:2]) and tv.classifier[1].out_features == 2
    assert head_classes(tv) == 2
    with pytest.raises(ValueError, match="no classifier"):
        find_head(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3)))
    with pytest.raises(ValueError, match="at least 1"):
        resize_head(tv, 0)
