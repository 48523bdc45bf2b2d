"""SearchEngine: one search update for the whole model, exact, and with a host work that does not grow with depth.

Both kernels are checked: ``torch`` (the BLAS + NumPy search, CPU) and ``triton`` (the fused kernel; in CI
under Triton's interpreter, which ``conftest.py`` switches on without CUDA).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nwsconvert
from nwsconvert.core import fused_search
from nwsconvert.core.engine import SearchEngine, _UpdateGraph, search_engine
from nwsconvert.core.nwsmodel import distillation_loss, ema_update, nws_layers, set_commitment, set_mode
from nwsconvert.core.search import brute_force

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not fused_search.available(DEVICE),
            reason="needs Triton >= 3.3 (CPU-only torch wheels ship without it; torch 2.7 brings 3.3)",
        ),
    ),
]


def small_net(depth: int = 1, width: int = 8) -> nn.Module:
    """3x3 convs (D = 9), a depthwise conv, 1x1 convs and a linear head (scalar pools, D = 1)."""
    return nwsconvert.convert(_wide_net(depth, width), pool_size=16, seed=0).to(DEVICE)


def _wide_net(depth: int, width: int) -> nn.Module:
    """small_net's layers, unconverted: 3x3, depthwise 3x3 (both D = 9), 1x1 and a linear head."""
    layers = [nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
    for _ in range(depth):
        layers += [
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, groups=width),
            nn.Conv2d(width, width, 1),
            nn.ReLU(),
        ]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 3))


def batches(steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(8, 1, 8, 8, generator=g).to(DEVICE), torch.randint(0, 3, (8,), generator=g).to(DEVICE)


def assert_exact(model, x):
    """After a training-mode forward on ``x`` (which brings the indices up to date), every index is brute force's."""
    with torch.no_grad():
        model.train()(x)
    for layer in nws_layers(model):
        vec = layer.nws._vectors(layer.weight).cpu()
        assert torch.equal(layer.nws.indices.long().cpu(), brute_force(vec, layer.nws.pool.detach().cpu())), layer.name


def sgd_step(model, opt, x, y, pool_beta: float = 0.0):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if pool_beta:
        loss = loss + pool_beta * distillation_loss(model)
    loss.backward()
    opt.step()


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_trains_bitwise_like_the_layers_own_search(kernel):
    """Without commitment the two paths compute the same numbers: same weights, same indices, every step."""
    a = small_net()
    b = copy.deepcopy(a)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (a, b))
    with SearchEngine(b, kernel=kernel) as engine:
        assert engine.kernel == kernel
        searched = []
        for x, y in batches(8):
            sgd_step(a, oa, x, y)
            sgd_step(b, ob, x, y)
            for la, lb in zip(nws_layers(a), nws_layers(b)):
                assert torch.equal(la.nws.indices, lb.nws.indices) and torch.equal(la.weight, lb.weight), la.name
            stats = nwsconvert.search_stats(b)
            searched.append(stats["searched"])
        assert_exact(b, x)
    assert 0 < sum(searched) and max(searched) < stats["total"]  # lazy: some rows searched, never all
    for x, y in batches(3, seed=1):  # handed back: the layers' own search goes on from the engine's state
        sgd_step(a, oa, x, y)
        sgd_step(b, ob, x, y)
    for la, lb in zip(nws_layers(a), nws_layers(b)):
        assert torch.equal(la.nws.indices, lb.nws.indices) and torch.equal(la.weight, lb.weight)
    assert all(layer.nws._engine is None for layer in nws_layers(b))


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_commitment_gradient_is_the_layers_up_to_rounding(kernel):
    """With commitment the gradient is grad + s (W - K) in one pass for all layers: the per-layer path
    computes it in another order, so the weights agree to float32 rounding (a few ulp per step)."""
    a = small_net()
    b = copy.deepcopy(a)
    for m in (a, b):
        set_commitment(m, 1.0)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (a, b))
    start = {layer.name: layer.weight.detach().clone() for layer in nws_layers(a)}
    with SearchEngine(b, kernel=kernel):
        for x, y in batches(4):
            sgd_step(a, oa, x, y)
            sgd_step(b, ob, x, y)
            assert_exact(b, x)
        for la, lb in zip(nws_layers(a), nws_layers(b)):
            torch.testing.assert_close(la.weight, lb.weight, rtol=0, atol=1e-6)
            # Both moved well beyond the tolerance, so agreeing within it says the two paths computed the same steps.
            assert (lb.weight - start[lb.name]).abs().max() > 1e-3, lb.name


class _CountCats(TorchDispatchMode):
    """Counts ``aten.cat`` calls while active (a join of the layers' gradients is one)."""

    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func is torch.ops.aten.cat.default
        return func(*args, **(kwargs or {}))


def _random_net(seed: int) -> nn.Module:
    """A small converted net drawn from ``seed``: a stem of kernel 1, 3, 5 or 7, then three of plain, depthwise
    or grouped convolutions of kernel 1, 3 or 5 (with or without bias), and a linear head."""
    import random

    rng = random.Random(seed)
    width = rng.choice([2, 4, 6, 8])
    k = rng.choice([1, 3, 5, 7])
    layers: list[nn.Module] = [nn.Conv2d(1, width, k, padding=k // 2), nn.ReLU()]
    for _ in range(3):
        k = rng.choice([1, 3, 5])
        groups = rng.choice([1, 2, width])
        layers += [nn.Conv2d(width, width, k, padding=k // 2, groups=groups, bias=rng.random() < 0.5), nn.ReLU()]
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 3))
    return nwsconvert.convert(net, pool_size=rng.choice([2, 16, 70]), seed=seed).to(DEVICE)


@pytest.mark.parametrize("net", ["small", *range(6)])
def test_the_commitment_term_goes_into_each_layers_own_gradient_in_place(monkeypatch, net):
    """With the Triton kernels, the commitment term is added to each layer's own float32 weight gradient in
    place, through a table of their addresses (the linear head's, a transposed product the backward may not
    write, copied first, its alone): the backward joins nothing (no ``cat``: no ``(R, D)`` buffer beside the
    layers' gradients at the backward's end), and every gradient, weight, pool and index is bit for bit what
    the joined buffer gives (the same float32 sum per element), step after step. On :func:`small_net` and
    six random nets (:func:`_random_net`: kernels 1 to 7, depthwise and grouped), the odd ones in pool
    learning (the pools move, the distillation loss on)."""
    if not fused_search.available(DEVICE):
        pytest.skip("needs Triton (the engine's address tables)")
    from nwsconvert.core import engine as engine_module

    base = small_net() if net == "small" else _random_net(net)
    set_commitment(base, 1.0)
    pool_beta = 0.5 if net != "small" and net % 2 else 0.0
    if pool_beta:
        set_mode(base, "pool")
    models = {"in place": base, "joined": copy.deepcopy(base)}
    lr = 0.5 if net == "small" else 0.3
    opts = {name: torch.optim.SGD(m.parameters(), lr=lr) for name, m in models.items()}
    real = engine_module._Commit.in_place
    cats = {}
    with SearchEngine(models["in place"], kernel="triton"), SearchEngine(models["joined"], kernel="triton"):
        for x, y in batches(3, seed=4 if net == "small" else net):
            for name, model in models.items():
                joined = name == "joined"
                monkeypatch.setattr(engine_module._Commit, "in_place", (lambda *a: None) if joined else real)
                opts[name].zero_grad()
                loss = F.cross_entropy(model(x), y)
                if pool_beta:
                    loss = loss + pool_beta * distillation_loss(model)
                with _CountCats() as count:
                    loss.backward()
                cats[name] = count.cats
                opts[name].step()
            assert cats["in place"] == 0 and cats["joined"] >= 2  # a join per group
            for a, b in zip(nws_layers(models["in place"]), nws_layers(models["joined"])):
                wa, wb = (m.module.parametrizations.weight.original for m in (a, b))
                assert torch.equal(wa.grad, wb.grad) and torch.equal(wa, wb), a.name
                assert torch.equal(a.nws.pool, b.nws.pool) and torch.equal(a.nws.indices, b.nws.indices), a.name


@pytest.mark.parametrize("path", KERNELS + ["layers"])
def test_a_weight_gradient_autograd_hands_to_two_places_is_left_as_it_came(path):
    """A layer whose weight is used as ``weight + delta`` (a LoRA-style adapter): the sum's backward hands the
    same gradient tensor to the weight's straight-through node and to ``delta``'s backward. The commitment
    term may not be written into it there: ``delta``'s gradient is the same with commitment as without
    (the term belongs to W alone), bit for bit, while W's does take the term. For the engine's kernels and
    the layers' own search."""
    import types

    results = {}
    for commitment in (1.0, 0.0):
        torch.manual_seed(0)
        model = small_net()
        set_commitment(model, commitment)
        conv = model[3]
        torch.manual_seed(1)
        b, a = (
            torch.randn(72, 2, device=DEVICE, requires_grad=True),
            torch.randn(2, 8, device=DEVICE, requires_grad=True),
        )
        delta = {}
        conv.forward = types.MethodType(
            lambda self, x, delta=delta: self._conv_forward(x, self.weight + delta["v"], self.bias), conv
        )
        engine = SearchEngine(model, kernel=path) if path != "layers" else None
        try:
            x, y = next(batches(1, seed=4))
            delta["v"] = (b @ a).t().reshape(8, 8, 3, 3) * 1e-3
            F.cross_entropy(model(x), y).backward()
        finally:
            if engine is not None:
                engine.close()
        results[commitment] = (b.grad, a.grad, conv.parametrizations.weight.original.grad)
    assert torch.equal(results[1.0][0], results[0.0][0]) and torch.equal(results[1.0][1], results[0.0][1])
    assert not torch.equal(results[1.0][2], results[0.0][2])  # W's gradient took the term


@pytest.mark.parametrize("change", ["new storage", "transposed view"])
def test_a_weight_given_new_storage_between_forward_and_backward_is_read_where_it_now_lives(change):
    """The Triton kernels read float32 W through a table of the layers' addresses. A W given new storage (and
    other values), or the same storage in another layout (same address, other strides), after the forward:
    the commitment term's backward reads the weights as they are now, as concatenating them does, never
    through the table's old address (freed memory) or layout."""
    if not fused_search.available(DEVICE):
        pytest.skip("needs Triton (the engine's address table)")
    base = small_net()
    set_commitment(base, 1.0)
    x, y = next(batches(1, seed=9))
    grads = []
    for table in (True, False):
        model = copy.deepcopy(base)
        with SearchEngine(model, kernel="triton") as engine:
            if not table:
                for g in engine.groups:
                    g._w_table = lambda: None  # this engine concatenates W
            loss = F.cross_entropy(model(x), y)
            assert all((g.w_table is not None) == table for g in engine.groups)
            holder = nws_layers(model)[1].module.parametrizations.weight
            w = holder.original.detach()  # .data: no version counter moves
            holder.original.data = w * 2 if change == "new storage" else w.transpose(2, 3)
            loss.backward()
            grads.append(holder.original.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("update", ["gradient", "ema"])
def test_engine_follows_moving_pools_exactly(kernel, update):
    """Pool learning: pools move every step (distillation gradient or EMA); budgets shrink by the movement."""
    model = small_net()
    set_mode(model, "pool")
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    with SearchEngine(model, kernel=kernel):
        for x, y in batches(6):
            sgd_step(model, opt, x, y, pool_beta=0.5 if update == "gradient" else 0.0)
            if update == "ema":
                ema_update(model, 0.9)
            assert_exact(model, x)  # the forward's update brings the indices to the moved pools


def test_engine_choice_and_errors(monkeypatch):
    model = small_net()
    assert search_engine(model, "layer") is None
    engine = search_engine(model, "engine")
    assert isinstance(engine, SearchEngine) and engine.kernel == ("triton" if DEVICE.type == "cuda" else "torch")
    engine.close()
    auto = search_engine(model, "auto")
    assert (auto is not None) == (DEVICE.type == "cuda" and fused_search.available(DEVICE))
    if auto is not None:
        auto.close()
    with pytest.raises(ValueError, match="kernel='nope'"):
        SearchEngine(model, kernel="nope")
    with pytest.raises(ValueError, match="graph=True\\) captures the Triton kernels' update; kernel='torch'"):
        SearchEngine(model, kernel="torch", graph=True)
    if DEVICE.type != "cuda" and fused_search.available(DEVICE):
        with pytest.raises(RuntimeError, match="graph=True\\) captures a CUDA graph; the model is on cpu"):
            SearchEngine(model, kernel="triton", graph=True)
    monkeypatch.setattr(fused_search, "_TRITON_OK", False)
    with pytest.raises(RuntimeError, match="needs Triton"):
        SearchEngine(model, kernel="triton")


def _addresses(engine) -> list[int]:
    """The address of every tensor an engine's update can read or write outside its own memory: each group's
    tensors (its attributes, whatever they are), every layer's W, indices and pool."""
    out = []
    for g in engine.groups:
        for name, value in vars(g).items():
            if name == "pieces":  # the update's output (views of K), made again from it at every update
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    out.append(t.data_ptr())
        for layer, holder in zip(g.layers, g.holders):
            out += [holder.original.data_ptr(), layer.nws.indices.data_ptr(), layer.nws.pool.data_ptr()]
    return out


ENGINE_KERNELS = (
    "engine_flag_kernel",
    "engine_compact_kernel",
    "engine_search_kernel",
    "engine_gather_kernel",
    "engine_commit_kernel",
)


class Recorder:
    """Stands in for one Triton kernel: records each launch (name, kernel, grid, arguments, keywords) in
    ``log``, then launches the real kernel."""

    inside = False  # set while a kernel runs (the interpreter's own tensor ops are not the step's)

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, self.kernel, tuple(grid), args, kwargs))
            Recorder.inside = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                Recorder.inside = False

        return launch


def record_engine_kernels(monkeypatch) -> list:
    """Every engine kernel's launches, recorded (:class:`Recorder`) in the returned list while the test runs."""
    from nwsconvert.core import triton_kernels

    log: list = []
    for name in ENGINE_KERNELS:
        monkeypatch.setattr(triton_kernels, name, Recorder(getattr(triton_kernels, name), name, log))
    return log


def _launched(log: list) -> list:
    """What a real replay could not change of the recorded launches: each kernel, its grid, its arguments'
    dtypes and shapes (values for scalars) and its keywords (constexprs)."""
    return [
        (name, grid, tuple((a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args),
         tuple(sorted(kwargs.items())))
        for name, _, grid, args, kwargs in log
    ]  # fmt: skip


class _StandInGraph(_UpdateGraph):
    """A CUDA graph's contract, on any device. A capture runs nothing and fixes the output buffers; a replay
    writes the update's results into those same buffers without moving any version counter. Checked, not
    trusted, at every replay: every buffer the update touches is where it was at the capture, and the
    Triton launches are the captured ones (grids, constexprs, dtypes and shapes: a real replay cannot make
    other Python decisions). ``fail``: the capture raises, as one a driver refuses would."""

    fail = False
    log: list = []  # the engine kernels' launches (record_engine_kernels)

    def __init__(self, engine):
        self.engine, self.outputs, self.error = engine, None, None
        self.log.clear()
        self.warm = engine._refresh_groups()  # the capture step's eager update (the real one: on a side stream)
        self.launches = _launched(self.log)
        self.captured = _addresses(engine)
        if _StandInGraph.fail:
            self.error = "RuntimeError: operation not permitted when stream is capturing"

    @staticmethod
    def supports(device):
        return True

    def replay(self):
        engine = self.engine
        assert _addresses(engine) == self.captured, "replayed a graph whose buffers moved"
        # The layers' indices written through aliases (same storage, counters of their own): the originals'
        # counters do not move, as under a real replay.
        layers = [layer.nws for g in engine.groups for layer in g.layers]
        held = [nws.indices for nws in layers]
        for nws, t in zip(layers, held):
            nws.indices = t.data
        self.log.clear()
        try:
            outs = engine._refresh_groups()
        finally:
            for nws, t in zip(layers, held):
                nws.indices = t
        assert _launched(self.log) == self.launches, "a replay would launch what was captured, not this"
        if self.outputs is None:
            self.outputs = outs
        else:
            for fixed, new in zip(self.outputs, outs):
                for f, n in zip(fixed, new):
                    f.data.copy_(n)  # behind the counter, as a replay writes
        return self.outputs


@pytest.fixture
def stand_in(monkeypatch):
    """The graphed engine's capture replaced by :class:`_StandInGraph`, the engine's kernels logged."""
    from nwsconvert.core import engine as engine_module

    if not fused_search.available(DEVICE):
        pytest.skip("needs Triton (the engine's graphed update)")
    monkeypatch.setattr(engine_module, "GRAPH_CAPTURE", _StandInGraph)
    monkeypatch.setattr(_StandInGraph, "log", record_engine_kernels(monkeypatch))
    monkeypatch.setattr(_StandInGraph, "fail", False)
    return _StandInGraph


def _graphed_against_eager(stand_in: bool) -> list[tuple[int, int]]:
    """Train two copies of one model, one with the eager engine and one with ``graph=True``, with commitment
    and momentum: frozen pools for 6 steps, a pool edit, 2 steps, a weight given new storage, 4 steps.
    Asserts after every step that weights, indices and search counts are the same bit for bit; returns the
    graphed engine's ``(captures, replays)`` after each step. On CUDA the steps due to replay
    (:data:`GRAPHED_COUNTS`) run in sync-debug mode ``error``: a replayed update reads nothing back
    (a capture synchronises once). ``stand_in``: the stand-in capture is in use (it checks the buffers). A
    deep copy of the graphed model taken after the first capture trains on its own."""
    from nwsconvert.train.loop import use_deterministic

    a = small_net(2)
    b = copy.deepcopy(a)
    for m in (a, b):
        set_commitment(m, 1.0)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (a, b))
    restore = use_deterministic()  # cuDNN's default backward kernels differ from run to run on CUDA
    try:
        with SearchEngine(a, kernel="triton") as ea, SearchEngine(b, kernel="triton", graph=True) as eb:
            counts: list[tuple[int, int]] = []

            def step(x, y):
                i = len(counts)
                check = DEVICE.type == "cuda" and i and GRAPHED_COUNTS[i][1] > GRAPHED_COUNTS[i - 1][1]  # a replay
                if check:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    sgd_step(b, ob, x, y)
                finally:
                    if check:
                        torch.cuda.set_sync_debug_mode(0)
                sgd_step(a, oa, x, y)
                for la, lb in zip(nws_layers(a), nws_layers(b)):
                    assert torch.equal(la.nws.indices, lb.nws.indices) and torch.equal(la.weight, lb.weight), la.name
                assert ea.stats() == eb.stats()
                with torch.no_grad():  # eval forwards read the layers' own weight caches, kept by the indices' versions
                    assert torch.equal(a.eval()(x), b.eval()(x))
                a.train(), b.train()
                counts.append((eb.captures, eb.replays))

            data = list(batches(12, seed=4))
            for x, y in data[:6]:
                step(x, y)
            twin = copy.deepcopy(b)  # a graph is not copied: the copy's engine captures its own
            assert twin._forward_pre_hooks and all(h.__self__._graph is None for h in twin._forward_pre_hooks.values())
            opt_twin = torch.optim.SGD(twin.parameters(), lr=0.5)
            for x, y in data[:4]:
                sgd_step(twin, opt_twin, x, y)
            assert_exact(twin, x)
            with torch.no_grad():  # a pool edit both engines see (the version counter): an eager update
                for m in (a, b):
                    nws_layers(m)[1].nws.pool.mul_(1.01)
            step(*data[6])
            step(*data[7])
            for m in (a, b):  # one W given new storage (same values): the old graph would read the old buffer
                holder = nws_layers(m)[0].module.parametrizations.weight
                holder.original.data = holder.original.data.clone()
            for x, y in data[8:]:
                step(x, y)
        assert_exact(b, data[-1][0])
        assert eb._graph is None  # closed: the graph's memory goes with it
    finally:
        restore()
    return counts


#: (captures, replays) after each step of _graphed_against_eager: the 1st update sees the pools for the first
#: time (eager), the 2nd and 3rd warm up, the 3rd captures; replays; the pool edit's step eager, the next
#: replayed by the same graph; after the new storage a warm-up, a second capture, replays.
GRAPHED_COUNTS = [(0, 0), (0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (1, 3), (1, 4), (1, 4), (2, 4), (2, 5), (2, 6)]


def test_a_graphed_update_trains_bitwise_like_the_eager_engine(stand_in):
    """SearchEngine(graph=True), its capture replaced by a stand-in with a CUDA graph's contract (fixed output
    buffers; replayed only while the buffers and launches it captured stay the same): the eager engine's
    weights, indices and search counts after every step, and a capture, replay or eager update where each
    is due."""
    assert _graphed_against_eager(stand_in=True) == GRAPHED_COUNTS


@pytest.mark.gpu  # a real CUDA graph of the update
def test_a_cuda_graphed_update_trains_bitwise_like_the_eager_engine_without_syncs():
    """The same with the real capture: a CUDA graph per capture, replays without host syncs."""
    assert _graphed_against_eager(stand_in=False) == GRAPHED_COUNTS


def _held_weights() -> None:
    """A weight a replayed update gave out and that something still holds is never rewritten: while it is
    held (a forward not yet backpropagated, a caller's copy) updates run eagerly; once released, replays
    resume."""
    model = small_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = list(batches(9, seed=5))
    with SearchEngine(model, kernel="triton", graph=True) as engine:
        for x, y in data[:4]:
            sgd_step(model, opt, x, y)
        assert (engine.captures, engine.replays) == (1, 1)
        # The gathered weights a training forward reads (the first read updates: a replay), views of the
        # graph's output.
        held = [layer.module.weight.detach() for layer in nws_layers(model)]
        assert engine.replays == 2
        before = [w.clone() for w in held]
        for x, y in data[4:6]:  # W changes: a replay would rewrite what is held
            sgd_step(model, opt, x, y)
        assert engine.replays == 2
        assert all(torch.equal(w, b) for w, b in zip(held, before))
        assert not all(torch.equal(w, layer.module.weight) for w, layer in zip(held, nws_layers(model)))
        del held
        opt.zero_grad()
        loss = F.cross_entropy(model(data[6][0]), data[6][1])  # replayed: nothing held now
        assert engine.replays == 3
        model(data[7][0])  # a second forward before the first one's backward: its weights are held
        assert engine.replays == 3
        loss.backward()
        opt.step()
        sgd_step(model, opt, *data[8])
        assert engine.replays == 4
        assert_exact(model, data[8][0])


def test_a_graphed_update_never_rewrites_a_weight_still_held(stand_in):
    _held_weights()


@pytest.mark.gpu  # a real CUDA graph of the update
def test_a_cuda_graphed_update_never_rewrites_a_weight_still_held():
    _held_weights()


@pytest.mark.parametrize("amp", ["off", "fp16"])
def test_the_trainers_step_holds_no_weight_across_steps_so_every_update_after_the_capture_replays(stand_in, amp):
    """nws-train's task step (TrainStep: autocast, fused commitment or, under float16, commitment in the loss
    with a GradScaler) leaves nothing holding the last update's weights: every update after the capture replays."""
    from nwsconvert.train.config import TrainConfig
    from nwsconvert.train.loop import TrainStep, make_optimizer

    model = small_net()
    cfg = TrainConfig(amp=amp, search="engine", lr=0.1)
    set_commitment(model, cfg.commitment)
    with SearchEngine(model, kernel="triton", graph=True) as engine:
        step = TrainStep(model, model, make_optimizer(model, cfg), cfg, DEVICE, pool=False)
        for x, y in batches(8):
            step(x, y)
        assert (engine.captures, engine.replays) == (1, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_graphed_update_keeps_its_graph_across_pool_edits_in_any_dtype(stand_in, dtype):
    """A pool edit's update runs eagerly and leaves the graph valid: the pools the graph gathers from are
    rewritten in place (a bfloat16 model's too), so the next update replays the same graph."""
    model = small_net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = list(batches(8, seed=8))
    with SearchEngine(model, kernel="triton", graph=True) as engine:
        for i, (x, y) in enumerate(data):
            if i in (4, 6):
                with torch.no_grad():
                    nws_layers(model)[i // 2 - 1].nws.pool.mul_(1.01)
            sgd_step(model, opt, x.to(dtype), y)
        assert (engine.captures, engine.replays) == (1, 3)  # captured at the 3rd update; the 5th and 7th eager
        assert_exact(model, data[-1][0].to(dtype))


def test_a_capture_that_fails_leaves_the_engine_eager_with_one_warning(stand_in):
    """A capture the driver refuses: one warning naming the option, then eager updates, the same training."""
    stand_in.fail = True
    a = small_net()
    b = copy.deepcopy(a)
    oa, ob = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (a, b))
    with SearchEngine(a, kernel="triton"), SearchEngine(b, kernel="triton", graph=True) as eb:
        with pytest.warns(UserWarning, match=r"graph=True\): the update could not be captured .*runs eagerly") as seen:
            for x, y in batches(6, seed=6):
                sgd_step(a, oa, x, y)
                sgd_step(b, ob, x, y)
        assert len(seen) == 1 and (eb.graph, eb.captures, eb.replays) == (False, 0, 0)
        for la, lb in zip(nws_layers(a), nws_layers(b)):
            assert torch.equal(la.nws.indices, lb.nws.indices) and torch.equal(la.weight, lb.weight), la.name


@pytest.mark.parametrize("trained", [False, True])
def test_a_deep_copy_of_an_engine_model_searches_on_its_own(trained):
    """Before the first step, or mid-stage (a best-so-far snapshot: the engine's last weights are autograd
    outputs, which deepcopy refuses, and are left out of the copy)."""
    model = small_net()
    with SearchEngine(model):
        if trained:
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            for x, y in batches(2, seed=7):
                sgd_step(model, opt, x, y)
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(twin.parameters(), lr=0.5)
        for x, y in batches(2):
            sgd_step(twin, opt, x, y)
        assert_exact(twin, x)


#: ops that read a device value back to the host, or whose output size depends on values
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "masked_select", "unique", "_unique2"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:  # views launch nothing
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _step_ops(model, kernel: str | None) -> list[str]:
    """aten ops (views left out) of one SGD step after a warm-up step, with the engine or, for None, a dense model."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = list(batches(2))
    ctx = SearchEngine(model, kernel=kernel) if kernel else None
    try:
        sgd_step(model, opt, *data[0])
        with _Count() as count:
            sgd_step(model, opt, *data[1])
    finally:
        if ctx is not None:
            ctx.close()
    return count.ops


class _ManyToFew(TorchDispatchMode):
    """Records every accumulating scatter of many sources into few destinations: on a GPU each is float or
    integer atomics on a handful of addresses, which serialise (a 12 M-row index_add_ into 37 layer
    counters took 60 % of a resnet50 step on an H200)."""

    SOURCES, DESTINATIONS = 10_000, 1_000
    OPS = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "bincount"}

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        sources = destinations = None
        if name in self.OPS - {"bincount"}:
            out, dim, index = args[0], args[1], args[2]
            sources, destinations = index.numel(), out.shape[dim] if out.dim() else 1
        elif name == "bincount":
            sources, destinations = args[0].numel(), max(int(kwargs.get("minlength", 0)), 1)
        elif name in ("index_put", "index_put_") and (args[3] if len(args) > 3 else kwargs.get("accumulate", False)):
            sources, destinations = args[1][0].numel(), args[0].shape[0]
        if sources is not None and sources >= self.SOURCES and destinations <= self.DESTINATIONS:
            self.found.append((name, sources, destinations))
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    ("kernel", "mode"),
    # The Triton update's only torch reductions are the pool tracking's, which pool learning runs every
    # step (its task-mode step has none).
    [("torch", "task"), ("torch", "pool"), pytest.param(KERNELS[1].values[0], "pool", marks=KERNELS[1].marks)],
)
def test_a_training_step_has_no_many_to_few_atomic_reduction(kernel, mode):
    """The engine's update reduces per layer without scattering many rows into few slots: per-pool-row
    values through a padded (L, Pmax) view (pool learning: the pools move every step), per-row flags
    counted when read. 10,592 kernel rows of D = 9 and 10,752 pool rows in 21 layers: both past the
    rule's 10,000 sources."""
    torch.manual_seed(0)
    model = nwsconvert.convert(_wide_net(depth=10, width=32), pool_size=512, seed=0).to(DEVICE)
    with SearchEngine(model, kernel="torch") as probe:
        group = {g.dim: g for g in probe.groups}[9]
        assert sum(n for _, n in group.rows) >= 10_000 and sum(n for _, n in group.pools) >= 10_000
    set_commitment(model, 1.0)
    set_mode(model, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = list(batches(2))
    beta = 0.5 if mode == "pool" else 0.0
    # The warm-up step by the layers' own search: the engine takes over their search state, so its
    # first step searches the drifted rows only (a full search of 10,592 rows takes 20 s in the
    # interpreter).
    sgd_step(model, opt, *data[0], pool_beta=beta)
    with SearchEngine(model, kernel=kernel) as engine:
        with _ManyToFew() as watch:
            sgd_step(model, opt, *data[1], pool_beta=beta)
            engine.searched_fraction()
        assert watch.found == [], watch.found
        stats = engine.stats()
    # The counts read afterwards are the rows the step searched, layer by layer.
    per_layer = [layer.nws.stats for layer in nws_layers(model)]
    assert sum(s["searched"] for s in per_layer) == stats["searched"] > 0
    assert sum(s["total"] for s in per_layer) == stats["total"]


@pytest.mark.skipif(
    not fused_search.available(DEVICE),
    reason="needs Triton >= 3.3 (CPU-only torch wheels ship without it; torch 2.7 brings 3.3)",
)
def test_host_work_of_a_training_step_has_no_syncs_and_does_not_grow_with_depth():
    """The NWS part of a step (the engine's update, gather and commitment gradient) dispatches no
    sync-class op, and its op count barely grows from 5 to 29 NWS layers (per-layer work: none)."""
    extra = {}
    for depth in (1, 9):
        nws = small_net(depth)
        set_commitment(nws, 1.0)
        dense = nwsconvert.materialize(nws)
        nws_ops, dense_ops = _step_ops(nws, "triton"), _step_ops(dense, None)
        assert not SYNC_OPS & set(nws_ops), sorted(SYNC_OPS & set(nws_ops))
        extra[depth] = len(nws_ops) - len(dense_ops)
        assert len(nws_layers(nws)) == 3 * depth + 2
    assert extra[1] > 0 and extra[9] <= 1.2 * extra[1], extra


def test_trainer_with_search_engine_writes_the_packs_of_the_layer_search(tmp_path):
    """``search=engine`` in a real training stage (CPU: the torch kernel): without commitment the task's
    pack is the one ``search=layer`` writes, index for index, and the stage leaves no engine behind."""
    from trainer_utils import KWARGS, SPEC, blobs, tiny_config, tiny_model

    from nwsconvert.formats.packs import TaskPack
    from nwsconvert.train.trainer import Trainer

    packs = {}
    for search in ("layer", "engine"):
        model = tiny_model()
        cfg = tiny_config(epochs=1, commitment=0.0, search=search)
        trainer = Trainer(model, tmp_path / search, cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
        trainer.fit_task(0, blobs(32, 2, 1), blobs(16, 2, 2), 2)
        packs[search] = TaskPack.load(tmp_path / search / "tasks" / "task_0.nwspack")
        assert all(layer.nws._engine is None for layer in nws_layers(trainer.model))
        trainer.close()
    assert packs["layer"].indices.keys() == packs["engine"].indices.keys()
    for name, idx in packs["layer"].indices.items():
        assert torch.equal(idx, packs["engine"].indices[name]), name


def test_fused_commitment_escapes_loss_scaling_so_fp16_training_puts_it_in_the_loss():
    """Why the trainer adds ``commitment * commitment_loss`` to the loss under float16 autocast: a
    GradScaler multiplies the loss by S and divides the gradients by S; the fused commitment gradient
    is added in the backward, after the scaling, so it comes out divided by S. In the loss it does not."""
    base = small_net()
    grads = {}
    for how in ("reference", "fused", "in_loss"):
        model = copy.deepcopy(base).train()
        set_commitment(model, 1.0 if how != "in_loss" else 0.0)
        x, y = next(batches(1))
        loss = F.cross_entropy(model(x), y)
        if how == "in_loss":
            loss = loss + nwsconvert.commitment_loss(model)
        scale = 1.0 if how == "reference" else 1024.0
        (loss * scale).backward()
        grads[how] = [layer.weight.grad / scale for layer in nws_layers(model)]
    for ref, _fused, in_loss in zip(grads["reference"], grads["fused"], grads["in_loss"]):
        torch.testing.assert_close(in_loss, ref, rtol=1e-4, atol=1e-7)  # float32 rounding of the two sums
    assert any(not torch.allclose(f, r, rtol=1e-3, atol=1e-6) for f, r in zip(grads["fused"], grads["reference"]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_under_bfloat16_autocast_keeps_exact_float32_indices(kernel):
    """Autocast changes the convolutions' compute dtype, not the search: W, pools and indices stay float32."""
    model = small_net()
    set_commitment(model, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with SearchEngine(model, kernel=kernel):
        for x, y in batches(3):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert all(layer.weight.grad.dtype == torch.float32 for layer in nws_layers(model))
            assert_exact(model, x)


@pytest.mark.gpu  # CUDA graphs and the sync debug mode
def test_cuda_graph_replay_of_an_engine_step_equals_eager_steps_without_syncs():
    """A whole training step (engine update, forward, backward, SGD) captured once and replayed gives
    the weights and indices of the same steps run eagerly, and an eager step makes no host sync."""
    eager = small_net()
    graphed = copy.deepcopy(eager)
    for m in (eager, graphed):
        set_commitment(m, 1.0)
    opt_e, opt_g = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, graphed))
    data = list(batches(8))
    with SearchEngine(eager, kernel="triton"), SearchEngine(graphed, kernel="triton"):
        static_x, static_y = (t.clone() for t in data[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, Triton compilation)
            for x, y in data[:3]:
                sgd_step(eager, opt_e, x, y)
                sgd_step(graphed, opt_g, x, y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sgd_step(graphed, opt_g, static_x, static_y)
        torch.cuda.set_sync_debug_mode("error")
        try:
            sgd_step(eager, opt_e, *data[3])  # the captured step's data, eagerly
        finally:
            torch.cuda.set_sync_debug_mode(0)
        static_x.copy_(data[3][0])
        static_y.copy_(data[3][1])
        graph.replay()
        for x, y in data[4:]:
            sgd_step(eager, opt_e, x, y)
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
        torch.cuda.synchronize()
        for le, lg in zip(nws_layers(eager), nws_layers(graphed)):
            assert torch.equal(le.nws.indices, lg.nws.indices) and torch.equal(le.weight, lg.weight), le.name


@pytest.mark.gpu  # 40 real optimiser steps with the compiled kernel
@pytest.mark.parametrize("mode", ["task", "pool"])
def test_forty_cuda_steps_stay_exact(mode):
    """40 SGD steps (momentum, commitment; pool mode: distillation gradient into the pools) on the GPU:
    after every one the indices equal float64 brute force."""
    model = small_net(2)
    set_commitment(model, 1.0)
    if mode == "pool":
        set_mode(model, "pool")
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    with SearchEngine(model, kernel="triton"):
        for x, y in batches(40, seed=3):
            sgd_step(model, opt, x, y, pool_beta=0.5 if mode == "pool" else 0.0)
            assert_exact(model, x)
