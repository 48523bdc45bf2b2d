"""NWS layer behaviour: forward values, gradients, losses, modes, eval cache, Conv2d subclass semantics."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nwsconvert as nc
from nwsconvert.core.search import brute_force


def _small_net():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 5),
    )


def test_forward_uses_exactly_the_nearest_pool_kernels():
    model = nc.convert(_small_net(), pool_size=32, init="random")
    model.train()
    x = torch.randn(2, 3, 8, 8)
    model(x)
    for layer in nc.nws_layers(model):
        nws = layer.nws
        idx = brute_force(layer.weight.detach().reshape(-1, nws.vector_size), nws.pool)
        assert torch.equal(nws.indices.long(), idx)
        assert torch.equal(layer.module.weight, nws.pool[idx].view_as(layer.weight))


def test_straight_through_gradient_equals_dense_gradient_at_k():
    torch.manual_seed(1)
    model = nc.convert(_small_net(), pool_size=32, init="random").train()
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()
    dense = nc.materialize(model).train()
    dense(x).sum().backward()
    by_name = dict(dense.named_modules())
    for layer in nc.nws_layers(model):
        # W receives exactly dL/dK: the same backward ran on the same weights.
        assert torch.equal(layer.weight.grad, by_name[layer.name].weight.grad), layer.name


def test_commitment_loss_value_and_gradient():
    model = nc.convert(_small_net(), pool_size=32, init="random").train()
    model(torch.randn(2, 3, 8, 8))
    layers = nc.nws_layers(model)
    loss = nc.commitment_loss(model)
    want = sum(F.mse_loss(layer.weight.detach(), layer.module.weight.detach()) for layer in layers)
    assert torch.allclose(loss, want, rtol=1e-6, atol=0)  # same sums, summed in another order
    loss.backward()
    for layer in layers:
        k = layer.nws.gather()
        expect = 2 * (layer.weight.detach() - k) / k.numel()
        # float32 autograd of mean((W-K)^2): 2 roundings per element
        assert torch.allclose(layer.weight.grad, expect, rtol=1e-6, atol=1e-12), layer.name


def test_fused_commitment_gives_the_autograd_gradient():
    torch.manual_seed(2)
    base = nc.convert(_small_net(), pool_size=32, init="random")
    a, b = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    x = torch.randn(2, 3, 8, 8)
    (a(x).sum() + 0.7 * nc.commitment_loss(a)).backward()
    nc.set_commitment(b, 0.7)
    out = b(x).sum()
    assert not nc.commitment_loss(b).requires_grad  # fused: value only, for logging
    out.backward()
    for la, lb in zip(nc.nws_layers(a), nc.nws_layers(b)):
        # Same terms, added in another order (grad + s*W - s*K vs grad + 2c(W-K)/N):
        # a few float32 ulps of the larger term.
        assert torch.allclose(la.weight.grad, lb.weight.grad, rtol=1e-5, atol=1e-7), la.name


def test_distillation_loss_moves_only_selected_pool_entries():
    model = nc.convert(_small_net(), pool_size=64, init="random")
    with pytest.raises(RuntimeError, match="pool-learning mode"):
        nc.distillation_loss(model)
    nc.set_mode(model, "pool").train()
    pools = [p for n, p in model.named_parameters() if n.endswith(".pool")]
    assert len(pools) == len(nc.nws_layers(model))
    model(torch.randn(2, 3, 8, 8))
    nc.distillation_loss(model).backward()
    for layer in nc.nws_layers(model):
        used = torch.zeros(layer.nws.pool_size, dtype=torch.bool)
        used[layer.nws.indices.long()] = True
        grad = layer.nws.pool.grad
        assert grad[~used].abs().sum() == 0
        assert grad[used].abs().sum() > 0
        assert layer.weight.grad is None  # sg[W]: nothing reaches W
    nc.set_mode(model, "task")
    assert not any(n.endswith(".pool") for n, _ in model.named_parameters())


def test_distillation_after_a_forward_reuses_its_kernels_and_gives_the_gathered_gradients(monkeypatch):
    """Pool learning's step: cross-entropy-like loss plus ``beta`` times the distillation. After the training
    forward, the distillation takes that forward's K (no second gather) and every gradient, pools' and
    temporary weights', is bit for bit what gathering K again gives; the pool then changes, and the next
    distillation (no forward between) gathers again."""
    import nwsconvert.core.layers as layers_module

    torch.manual_seed(5)
    base = nc.set_mode(nc.convert(_small_net(), pool_size=64, init="random"), "pool").train()
    x = torch.randn(2, 3, 8, 8)
    fused = []
    real = layers_module._DistillFromK.apply
    monkeypatch.setattr(layers_module._DistillFromK, "apply", lambda *a: (fused.append(1), real(*a))[1])

    def step(model, reuse: bool):
        out = model(x).square().mean()
        if not reuse:
            for layer in nc.nws_layers(model):
                layer.nws._last = None  # as if no forward had gathered K
        # K alive after the forward: the convolutions' (the Linear keeps only a transposed view of its K)
        alive = sum(1 for layer in nc.nws_layers(model) if layer.nws._last and layer.nws._last[1]() is not None)
        (out + 0.5 * nc.distillation_loss(model)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, alive

    a, b = copy.deepcopy(base), copy.deepcopy(base)
    got, alive = step(a, True)
    assert len(fused) == alive == 3
    fused.clear()
    want, _ = step(b, False)
    assert not fused and got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in got)
    with torch.no_grad():
        for layer in nc.nws_layers(a):
            layer.nws.pool.add_(0.01)
    nc.distillation_loss(a).backward()  # the pool moved since the forward: K gathered again
    assert not fused


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pool_size", [512, 4096])
def test_distillation_on_a_cpu_has_the_bits_of_the_gathered_form(threads, pool_size, monkeypatch):
    """Layers with hundreds of kernels an entry (the CPU path sums the gradient transposed, in the shared
    scratch): the distillation's value and every pool gradient are bit for bit those of gathering K
    again and letting autograd differentiate ``mse_loss``, whatever the thread count."""
    net = nn.Sequential(nn.Conv2d(64, 128, 3), nn.Conv2d(128, 96, 1), nn.Flatten(), nn.Linear(96 * 4, 10))
    import nwsconvert.core.layers as layers_module

    scratch = []
    real = layers_module._scratch_form
    monkeypatch.setattr(layers_module, "_scratch_form", lambda k, t: (scratch.append(real(k, t)), real(k, t))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(7)
        model = nc.set_mode(nc.convert(net, pool_size=pool_size, init="random"), "pool").train()
        out = model(torch.randn(2, 64, 4, 4)).square().mean()  # alive: the distillation reuses its K
        fused = nc.distillation_loss(model)
        (out + fused).backward()  # the pools' gradient is the distillation's alone
        got = [layer.nws.pool.grad.clone() for layer in nc.nws_layers(model)]
        model.zero_grad()
        want = []
        for layer in nc.nws_layers(model):
            nws = layer.nws
            k = nws.pool.index_select(0, nws.indices.long()).view(nws.weight_shape)
            value = F.mse_loss(k, layer.weight.detach())
            value.backward()
            want.append((value.detach(), nws.pool.grad.clone()))
    finally:
        torch.set_num_threads(before)
    assert [layer.nws.vector_size for layer in nc.nws_layers(model)] == [9, 1, 1]
    # Forward and backward of both convolutions took the scratch form (the Linear keeps only a transposed
    # view of its K, so its distillation gathers again).
    assert scratch == [True] * 4
    assert torch.equal(fused.detach(), sum(v for v, _ in want))
    for g, (_, w) in zip(got, want):
        assert torch.equal(g, w)


def test_a_moved_pool_never_rewrites_a_weight_still_held():
    """The pool moves at every pool-learning step, so K is gathered again: into a new tensor, since a view
    of the last one can outlive every tensor the layer handed out (a Linear's graph keeps only K.t()), and
    a K a caller holds keeps its values."""
    torch.manual_seed(4)
    model = nc.set_mode(nc.convert(nn.Sequential(nn.Linear(48, 10)), pool_size=16, init="random"), "pool").train()
    layer = nc.nws_layers(model)[0]
    loss = model(torch.randn(2, 48)).square().sum()
    with torch.no_grad():
        layer.nws.pool.add_(0.5)
    model(torch.randn(2, 48))  # gathers the moved pool while the first graph still holds its K.t()
    loss.backward()
    assert layer.weight.grad is not None
    held = layer.module.weight.detach()
    kept = held.clone()
    with torch.no_grad():
        layer.nws.pool.add_(0.1)
    assert torch.equal(layer.module.weight, layer.nws.gather()) and torch.equal(held, kept)


def test_eval_cache_is_reused_and_invalidated():
    model = nc.convert(_small_net(), pool_size=32, init="random").eval()
    layer = nc.nws_layers(model)[0]
    torch.set_grad_enabled(False)  # inference; restored by the finally below
    try:
        _check_cache(layer)
    finally:
        torch.set_grad_enabled(True)


def _check_cache(layer):
    w1 = layer.module.weight
    assert layer.module.weight.data_ptr() == w1.data_ptr()  # cached: no gather per forward
    layer.nws.indices[0] = (layer.nws.indices[0] + 1) % layer.nws.pool_size
    w2 = layer.module.weight
    assert w2 is not w1 and not torch.equal(w1, w2)
    assert torch.equal(w2, layer.nws.gather())
    with torch.no_grad():
        layer.nws.pool.mul_(2)
    assert torch.equal(layer.module.weight, layer.nws.gather())


def test_training_weight_cache_follows_changes_and_never_edits_a_held_tensor():
    """Training forwards reuse the gathered weight and rewrite only changed rows; a weight an
    autograd graph (or a caller) still holds is never modified: it is copied instead."""
    torch.manual_seed(3)
    model = nc.convert(_small_net(), pool_size=32, init="random").train()
    layer = nc.nws_layers(model)[0]
    x = torch.randn(2, 3, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ptrs, start = [], layer.nws.indices.clone()
    for _ in range(4):  # a training loop: the graph is freed by backward before the next forward
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        with torch.no_grad():  # a larger move than these few steps make, so kernels change
            layer.weight.add_(0.2 * torch.randn_like(layer.weight))
        k = layer.module.weight  # this access runs the search for the new W, like a forward
        assert torch.equal(k, layer.nws.gather())
        ptrs.append(k.data_ptr())
        del k
    assert not torch.equal(layer.nws.indices, start)  # the steps changed kernels...
    assert len(set(ptrs)) == 1  # ...in one buffer, rewritten in place
    # Two graphs alive at once, W moved in between: the first keeps its weight and both backward.
    y1 = model(x).sum()
    held = layer.module.weight
    before = held.detach().clone()
    with torch.no_grad():
        layer.weight.add_(torch.randn_like(layer.weight))
    y2 = model(x).sum()
    now = layer.module.weight
    assert not torch.equal(now, before) and torch.equal(now, layer.nws.gather())
    assert torch.equal(held, before) and held.data_ptr() != now.data_ptr()
    (y1 + y2).backward()
    # Pool edits through .data (no version bump) and index edits are followed too.
    layer.nws.pool.data.mul_(3)
    assert torch.equal(layer.module.weight, layer.nws.gather())
    model.eval()
    layer.nws.indices[:] = (layer.nws.indices + 1) % layer.nws.pool_size
    with torch.no_grad():
        assert torch.equal(layer.module.weight, layer.nws.gather())


def test_eval_mode_with_gradients_keeps_indices_and_passes_gradient():
    model = nc.convert(_small_net(), pool_size=32, init="random").eval()
    before = [layer.nws.indices.clone() for layer in nc.nws_layers(model)]
    with torch.no_grad():
        for layer in nc.nws_layers(model):
            layer.weight.add_(0.5)  # far from every pool kernel; eval must not search
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    for layer, idx in zip(nc.nws_layers(model), before):
        assert torch.equal(layer.nws.indices, idx)
        assert layer.weight.grad is not None


def _timm_layers():
    from timm.layers import CondConv2d, Conv2dSame, ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame

    return {
        "Conv2dSame": lambda: Conv2dSame(4, 6, 3, stride=2),
        "StdConv2d": lambda: StdConv2d(4, 6, 3, padding=1),
        "StdConv2dSame": lambda: StdConv2dSame(4, 6, 3, stride=2),
        "ScaledStdConv2d": lambda: ScaledStdConv2d(4, 6, 3, padding=1),
        "ScaledStdConv2dSame": lambda: ScaledStdConv2dSame(4, 6, 3, stride=2),
        "CondConv2d": lambda: CondConv2d(4, 6, 3, padding=1, num_experts=3),
    }


def _effnet_lite_conv():
    from efficientnet_lite_pytorch.utils import Conv2dStaticSamePadding

    return Conv2dStaticSamePadding(4, 6, 3, stride=2, image_size=9)


SUBCLASSES = {**_timm_layers(), "Conv2dStaticSamePadding": _effnet_lite_conv}


@pytest.mark.parametrize("name", sorted(SUBCLASSES))
def test_conv_subclasses_keep_their_semantics(name):
    """The converted layer computes exactly what its own class computes with the pool kernels as weight."""
    layer = SUBCLASSES[name]()
    cls = type(layer)
    original = copy.deepcopy(layer)
    holder = nn.Sequential(layer)
    nc.convert(holder, pool_size=16, init="random")
    assert isinstance(holder[0], cls)
    assert holder.nws_report.layers[0].module == cls.__name__
    x = torch.randn(2, 4, 9, 9)
    if name == "CondConv2d":
        routing = torch.softmax(torch.randn(2, 3), dim=1)
        nws_out, run = holder[0](x, routing), lambda m: m(x, routing)
    else:
        nws_out, run = holder(x), lambda m: m(x)
    k = nc.nws_layers(holder)[0].nws.gather()
    with torch.no_grad():
        original.weight.copy_(k)
    assert torch.equal(nws_out, run(original))
