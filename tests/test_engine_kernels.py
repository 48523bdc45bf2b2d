"""The engine's Triton kernels: each step's launches, the per-layer compaction of the flagged rows, float64
ties inside a step, and that every kernel the engine launches compiles for the GPUs users train on.

Without CUDA the kernels run in Triton's interpreter (``conftest.py``). The interpreter accepts programs
the compiler refuses, so the launches of real engine steps are recorded and each is compiled for
sm_90 (H100 / H200) with the ptxas that Triton ships: a kernel that only the interpreter can run fails
here, in CI, not first on a user's GPU.
"""

import copy
from collections import Counter

import pytest
import torch
from test_engine import ENGINE_KERNELS, Recorder, assert_exact, batches, record_engine_kernels, sgd_step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nwsconvert
from nwsconvert.core import fused_search
from nwsconvert.core.engine import SearchEngine
from nwsconvert.core.nwsmodel import nws_layers, set_commitment, set_mode
from nwsconvert.core.search import brute_force

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not fused_search.available(DEVICE),
    reason="needs Triton >= 3.3 (CPU-only torch wheels ship without it; torch 2.7 brings 3.3)",
)

#: aten ops that launch no kernel: views, allocations without a fill, metadata
_NO_LAUNCH = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "set_", "detach", "lift_fresh"}


class _Launches(TorchDispatchMode):
    """Counts the aten ops of a step that launch a kernel (on a GPU: about one launch each)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not Recorder.inside and not func.is_view and name not in _NO_LAUNCH:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """The engine kernels' launches, recorded while the test runs."""
    return record_engine_kernels(monkeypatch)


def _net(dtype=torch.float32) -> nn.Module:
    """Every vector size the engine groups: 7x7 (D = 49, 72 rows: two programs of its elementwise kernels),
    3x3 and depthwise 3x3 (D = 9), 1x1 and linear (D = 1)."""
    net = nn.Sequential(
        nn.Conv2d(1, 72, 7, padding=3),
        nn.ReLU(),
        nn.Conv2d(72, 8, 3, padding=1),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 3),
    )
    return nwsconvert.convert(net, pool_size=16, seed=0).to(device=DEVICE, dtype=dtype)


def _steps(model, n: int, pool_beta: float = 0.0, seed: int = 0):
    """``n`` SGD steps (a fresh optimiser, lr 0.3) on :func:`test_engine.batches`, cast to the model's dtype."""
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    dtype = next(model.parameters()).dtype
    for x, y in batches(n, seed):
        sgd_step(model, opt, x.to(dtype), y, pool_beta)


#: The input of the training-mode forward that brings the indices up to date before they are compared.
PROBE = torch.zeros(1, 1, 8, 8, device=DEVICE)


# ----------------------------------------------------------------------------- compaction
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_compaction_puts_each_layers_flagged_rows_first_in_order(density):
    """``perm`` is a permutation of each layer's rows with its flagged rows first, in row order; the
    search kernel reads a layer's flagged count from ``csum`` at the layer's bounds."""
    sizes = [1, 33, 300, 257, 5, 512]
    wide = fused_search.row_blocks([(n, 4) for n in sizes], DEVICE, fused_search.WIDE_R)
    g = torch.Generator().manual_seed(int(density * 100))
    need = (torch.rand(sum(sizes), generator=g) < density).to(torch.int8)
    need[40] = 2 * int(density > 0)  # searched in float64 counts as searched
    need = need.to(DEVICE)
    csum = torch.zeros(need.numel() + 1, dtype=torch.int32, device=DEVICE)
    perm = torch.full((need.numel(),), -1, dtype=torch.int32, device=DEVICE)
    torch.cumsum(need != 0, 0, dtype=torch.int32, out=csum[1:])
    from nwsconvert.core.triton_kernels import engine_compact_kernel

    engine_compact_kernel[(wide[0].numel(),)](need, csum, perm, wide[0], wide[1], wide[4], BLOCK_R=fused_search.WIDE_R)
    flags, perm, csum = need.cpu() != 0, perm.cpu(), csum.cpu()
    start = 0
    for n in sizes:
        rows = torch.arange(start, start + n)
        flagged, kept = rows[flags[start : start + n]], rows[~flags[start : start + n]]
        assert torch.equal(perm[start : start + n].long(), torch.cat([flagged, kept]))
        assert int(csum[start + n] - csum[start]) == flagged.numel()
        start += n


def _search_flagged(sizes, pools, need, x, pool, programs):
    """``engine_search`` on flat rows of layers ``sizes`` (pools of ``pools`` entries) with ``programs``
    programs; returns ``(ref, budget, index, need)`` on the CPU."""
    dim = x.shape[1]
    segments = list(zip(sizes, pools))
    wide = fused_search.row_blocks(segments, DEVICE, fused_search.wide_rows(dim))
    table = (*fused_search.layer_table(segments, DEVICE)[:4], programs)
    rows = x.shape[0]
    state = (
        torch.zeros(rows, dim, device=DEVICE),  # ref
        torch.full((rows,), -1.0, device=DEVICE),  # budget
        torch.full((rows,), -7, dtype=torch.int32, device=DEVICE),  # index: -7 where nothing searched
        need.clone().to(DEVICE),
        fused_search.engine_consts(dim, DEVICE),
    )
    csum = torch.zeros(rows + 1, dtype=torch.int32, device=DEVICE)
    perm = torch.empty(rows, dtype=torch.int32, device=DEVICE)
    fused_search.engine_search(state, wide, table, x.to(DEVICE), pool.to(DEVICE), csum, perm)
    return tuple(t.cpu() for t in state[:4])


@pytest.mark.parametrize("density", [0.0, 0.02, 0.4, 1.0])
def test_the_persistent_search_takes_every_flagged_block_once_whatever_its_program_count(density):
    """The search's programs share the flagged rows' blocks, counted on the device: with 1, 2, 3 or more
    programs than blocks, every flagged row (layers with none flagged between them, layers of one
    row, blocks cut by a layer's end) gets brute force's index and its reference and budget, every other row
    is left as it was, and the state is the same bit for bit."""
    sizes, pools, dim = [70, 5, 1, 40, 3, 129], [16, 8, 4, 32, 2, 64], 9
    g = torch.Generator().manual_seed(int(density * 100))
    x = torch.randn(sum(sizes), dim, generator=g)
    pool = torch.randn(sum(pools), dim, generator=g)
    need = (torch.rand(sum(sizes), generator=g) < density).to(torch.int8)
    need[70:75] = 0  # a layer with nothing flagged between two with flagged rows
    need[75] = int(density > 0)  # a layer of one row
    runs = [_search_flagged(sizes, pools, need, x, pool, programs) for programs in (1, 2, 3, 64)]
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert torch.equal(got, want)
    ref, budget, index, need_after = runs[0]
    flagged = need != 0
    assert torch.equal(need_after == 0, ~flagged)  # searched rows are marked 1 or 2, the others kept
    assert (index[~flagged] == -7).all() and (budget[~flagged] == -1).all() and (ref[~flagged] == 0).all()
    assert torch.equal(ref[flagged], x[flagged])
    assert (budget[flagged] >= 0).all()
    row = off = 0
    for n, p in zip(sizes, pools):
        rows = torch.arange(row, row + n)[flagged[row : row + n]]
        assert torch.equal(index[rows].long(), brute_force(x[rows], pool[off : off + p]))
        row, off = row + n, off + p


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_rows_on_tied_pool_entries_are_searched_in_float64_and_take_the_lowest_index(kernel):
    """Kernels equal to a pool entry that appears twice, or half way between two entries: the float32
    pass cannot certify them, the float64 pass takes brute force's lowest index, and the step counts them."""
    model = _net()
    layer = next(l for l in nws_layers(model) if l.nws.vector_size == 9)
    with torch.no_grad():
        pool = layer.nws.pool
        pool[5] = pool[2]  # a duplicate entry: the lower index wins
        w = layer.weight.view(-1, 9)
        w[:4] = pool[2]  # on both duplicates
        w[4:8] = (pool[0] + pool[1]) * 0.5  # on the bisector of two entries, up to rounding
    with SearchEngine(model, kernel=kernel) as engine:
        assert_exact(model, PROBE)
        stats = engine.stats()
        assert stats["exact_rows"] >= 4, stats
        assert layer.nws.indices[:4].tolist() == [2, 2, 2, 2]
        _steps(model, 3)
        assert_exact(model, PROBE)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("dim, entry, move, start", [(9, 4e-23, 2.1e-23, 0.0), (49, 7.88e-22, 1.8e-23, 3.79e-22)])
def test_drifts_near_1e_23_are_searched_again_by_the_engine(kernel, dim, entry, move, start):
    """Pool entries 0 and ``entry`` in every component, rows at ``start``; row 0 then moves ``move`` a component,
    past the bisector. Each component's float32 square underflows to 0, so the drift reads 0: the budgets are
    less what D squares can lose (D x 2^-149), and the row is searched again. The first case's budget comes
    from the float64 pass, the second's from the float32 certification."""
    k = 3 if dim == 9 else 7
    model = nwsconvert.convert(nn.Sequential(nn.Conv2d(1, 4, k, padding=k // 2)), pool_size=16, seed=0).to(DEVICE)
    layer = nws_layers(model)[0]
    with torch.no_grad():
        layer.nws.pool[0], layer.nws.pool[1] = 0.0, entry
        layer.weight.fill_(start)
    x = torch.zeros(1, 1, 8, 8, device=DEVICE)
    with SearchEngine(model.train(), kernel=kernel):
        model(x)
        assert (layer.nws.indices == 0).all()
        with torch.no_grad():
            layer.weight.view(-1, dim)[0] = start + move
        model(x)
        expect = brute_force(layer.weight.detach().reshape(-1, dim).cpu(), layer.nws.pool.detach().cpu())
        assert expect[0] == 1 and torch.equal(layer.nws.indices.long().cpu(), expect)


def _one_conv_at(entries: tuple[float, float], row: float):
    """A 3x3 convolution of 4 rows converted with a pool of two entries, all zero but their first elements
    (``entries``), every row zero but its first element (``row``): its model and NWS layer on ``DEVICE``."""
    model = nwsconvert.convert(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1)), pool_size=2, seed=0).to(DEVICE)
    layer = nws_layers(model)[0]
    with torch.no_grad():
        layer.nws.pool.zero_()
        layer.nws.pool[0, 0], layer.nws.pool[1, 0] = entries
        layer.weight.zero_()
        layer.weight.view(-1, 9)[:, 0] = row
    return model, layer


@pytest.mark.filterwarnings("ignore:overflow encountered")  # (the interpreter's NumPy)
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_runner_up_whose_float32_distance_overflows_leaves_a_finite_budget(kernel):
    """Rows at 1.1e19 beside entries at 1.2e19 and -1.1e19 (the runner-up's square overflows float32): their
    budgets are finite, so rows that then jump to -0.1e19, nearer the second entry, are searched again."""
    model, layer = _one_conv_at((1.2e19, -1.1e19), 1.1e19)
    x = torch.zeros(1, 1, 8, 8, device=DEVICE)
    with SearchEngine(model.train(), kernel=kernel) as engine:
        model(x)
        assert (layer.nws.indices == 0).all()
        group = engine.groups[0]
        assert group.budget is not None and bool(torch.isfinite(group.budget).all())
        with torch.no_grad():
            layer.weight.view(-1, 9)[:2, 0] = -0.1e19
        model(x)
        expect = brute_force(layer.weight.detach().reshape(-1, 9).cpu(), layer.nws.pool.detach().cpu())
        assert expect[:2].tolist() == [1, 1] and torch.equal(layer.nws.indices.long().cpu(), expect)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # (the interpreter's NumPy)
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_budget_beyond_float32s_range_is_clamped_so_that_a_pool_move_shrinks_it(kernel):
    """Rows at 4e20 between entries at 0 and 1e21: the squared budget, 1e40, is beyond float32's range. Stored as
    +inf, no pool movement could shrink it (inf - move is inf); clamped to float32's largest value, the
    second entry's move to 5e20 (now the nearer) leaves none, and the rows are searched again (found by
    benchmarks/harnesses/search_fuzz.py --kinds engine on the Triton kernels)."""
    model, layer = _one_conv_at((0.0, 1e21), 4e20)
    x = torch.zeros(1, 1, 8, 8, device=DEVICE)
    with SearchEngine(model.train(), kernel=kernel) as engine:
        model(x)
        assert (layer.nws.indices == 0).all()
        assert bool(torch.isfinite(engine.groups[0].budget).all())
        with torch.no_grad():
            layer.nws.pool[1, 0] = 5e20
        model(x)
        expect = brute_force(layer.weight.detach().reshape(-1, 9).cpu(), layer.nws.pool.detach().cpu())
        assert (expect == 1).all() and torch.equal(layer.nws.indices.long().cpu(), expect)


def _safe(group) -> None:
    """Every positive budget is below the squared half gap between the row's nearest and second-nearest
    entries (float64 distances from its reference to the pools searched): moving less keeps the entry."""
    for (off, count), (poff, size) in zip(group.rows, group.pools):
        budget = group.budget[off : off + count].double().cpu()
        if size < 2:
            continue
        d = torch.cdist(group.ref[off : off + count].double().cpu(), group.seen[poff : poff + size].double().cpu())
        two = d.topk(2, dim=1, largest=False).values
        half_gap = (two[:, 1] - two[:, 0]) * 0.5
        ok = budget <= 0
        assert bool((ok | (budget.sqrt() <= half_gap)).all())


def test_fused_and_torch_updates_keep_the_same_state_through_moving_pools():
    """Pool learning (every pool moves each step, scalar pools leave their exact intervals): the Triton
    update and the torch one keep equal indices, references and searched rows, and every budget the
    Triton kernels write is safe (the two searches certify differently, so budgets are not compared)."""
    a = _net()
    set_mode(a, "pool")
    b = copy.deepcopy(a)
    with SearchEngine(a, kernel="torch") as ea, SearchEngine(b, kernel="triton") as eb:
        for seed in range(4):
            _steps(a, 1, pool_beta=0.5, seed=seed)
            _steps(b, 1, pool_beta=0.5, seed=seed)
            for ga, gb in zip(ea.groups, eb.groups):
                assert torch.equal(ga.index, gb.index) and torch.equal(ga.need != 0, gb.need != 0), ga.dim
                assert (ga.ref is None) == (gb.ref is None) and torch.equal(ga.seen, gb.seen)
                if gb.ref is not None:
                    assert torch.equal(ga.ref, gb.ref)
                    _safe(gb)
        # Certified rows in every group; the scalar pools' budgets were started when their pools first moved.
        assert all(g.budget is not None and int((g.budget > 0).sum()) > 0 for g in eb.groups)
        assert sum(g.stale.sum() for g in eb.groups if g.dim == 1) > 0  # the scalar pools did move
        assert_exact(b, PROBE)


# ----------------------------------------------------------------------------- launches
def _step_launches(model, launches: list, engine: bool) -> tuple[int, list[str]]:
    """Kernel launches of one SGD step after a warm-up step: (Triton launches, launching aten ops)."""
    ctx = SearchEngine(model, kernel="triton") if engine else None
    try:
        _steps(model, 1)
        launches.clear()
        with _Launches() as count:
            _steps(model, 1, seed=1)
    finally:
        if ctx is not None:
            ctx.close()
    return len(launches), count.ops


def test_scalar_pools_keep_no_reference_or_budget_until_one_moves():
    """Task training leaves the scalar pools (1x1 convolutions, linear layers) as they are: their
    intervals decide alone, and the engine keeps no 8 bytes a row for them; a pool that moves starts them."""
    model = _net()
    with SearchEngine(model, kernel="triton") as engine:
        scalar = {g.dim: g for g in engine.groups}[1]
        _steps(model, 3)
        assert scalar.ref is None and scalar.budget is None
        assert {g.dim: g for g in engine.groups}[9].ref is not None
        assert_exact(model, PROBE)
        layer = next(l for l in nws_layers(model) if l.nws.vector_size == 1)
        with torch.no_grad():
            layer.nws.pool[3] += 0.05  # an in-place edit: the version counter sees it
        _steps(model, 2)
        assert scalar.ref is not None and int(scalar.stale.sum()) == 1
        assert_exact(model, PROBE)


@pytest.mark.parametrize("depth", [1, 12])
def test_an_nws_step_launches_a_fixed_few_kernels_more_than_dense(launches, depth):
    """Task training (frozen pools, commitment on): the engine adds per vector size six Triton kernels
    (flags, compaction, float32 and float64 search, gather; the commitment gradient) and three torch ops,
    whatever the depth, and one copy for the linear head:
    at most 60 launches a step (issue 38's target) for any model with three vector sizes."""
    model = _net()
    if depth > 1:  # the same vector sizes, 12 times the layers
        body = [m for _ in range(depth) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.ReLU())]
        model = nwsconvert.convert(
            nn.Sequential(nn.Conv2d(1, 8, 7, padding=3), *body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)),
            pool_size=16,
            seed=0,
        ).to(DEVICE)
    set_commitment(model, 1.0)
    dense = nwsconvert.materialize(model)
    triton_launches, nws_ops = _step_launches(model, launches, engine=True)
    _, dense_ops = _step_launches(dense, launches, engine=False)
    extra = Counter(nws_ops)
    extra.subtract(Counter(dense_ops))
    groups = 3
    assert triton_launches == 6 * groups
    total = triton_launches + len(nws_ops) - len(dense_ops)
    # Per group: csum zeroed, its cumulative sum, the indices copied to the layers. W is read where the layers
    # keep it (float32 W: an address table), neither concatenated for the search nor for the commitment
    # gradient (a sixth Triton kernel), which adds its term to the layers' own gradients in place through a
    # table of theirs: no join, only the linear head's gradient (a transposed product, a view the backward
    # may not write) copied. On CUDA a gradient table is copied to the device when the gradients' addresses
    # changed since the last step (the caching allocator mostly hands out the same): at most one a group.
    copies = extra.pop("_to_copy", 0) if DEVICE.type == "cuda" else 0
    assert copies <= groups, copies
    assert +extra == Counter({"zeros": groups, "cumsum": groups, "_foreach_copy_": groups, "clone": 1}), +extra  # fmt: skip
    assert total - copies == 9 * groups + 1 <= 60, total


# ----------------------------------------------------------------------------- compilation for the GPU
_DTYPES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
}

#: Compiles the variants it reads (JSON on stdin) for sm_90 and prints one line per cubin. A process of
#: its own: under TRITON_INTERPRET=1 the kernels are interpreter functions, which the compiler cannot take.
_COMPILE = """
import json, sys
from concurrent.futures import ProcessPoolExecutor

def build(variant):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from nwsconvert.core import triton_kernels
    name, signature, constexprs, options = variant
    src = ASTSource(fn=getattr(triton_kernels, name), signature=signature, constexprs=constexprs)
    return name, len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"])

if __name__ == "__main__":
    with ProcessPoolExecutor(int(sys.argv[1])) as pool:
        for name, size in pool.map(build, json.load(sys.stdin)):
            print(name, size, flush=True)
"""


def _recorded_variants(log) -> list:
    """One ``[name, signature, constexprs, options]`` per distinct launch among the recorded ones."""
    variants = {}
    for name, kernel, _, args, kwargs in log:
        arg_names = list(kernel.arg_names)
        constexprs = {k: v for k, v in kwargs.items() if k in arg_names}
        options = {k: v for k, v in kwargs.items() if k not in arg_names}
        assert all(isinstance(v, (bool, int)) for v in constexprs.values()), constexprs
        if "BLOCK_P" in constexprs:  # the interpreter's tile and options are not the GPU's
            gpu = fused_search.search_launch(constexprs["EXACT"], interpreting=False)
            constexprs["BLOCK_P"] = gpu.pop("BLOCK_P")
            options = gpu
        signature = {  # tensors are pointers; a Python int (a count) is an i32 scalar
            arg: "i32" if isinstance(value, int) else "*" + _DTYPES[value.dtype] for arg, value in zip(arg_names, args)
        }
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        variants[repr((name, signature, constexprs, options))] = [name, signature, constexprs, options]
    return list(variants.values())


@pytest.mark.slow  # about 20 compilations of a second each
def test_every_kernel_a_training_run_launches_compiles_for_sm90(launches, tmp_path):
    """Task and pool training with commitment, float32 and bfloat16 weights: every distinct launch compiles to a cubin for
    sm_90 (Triton's own ptxas; no GPU needed)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (with ptxas) is not installed")
    # bfloat16 weights change the dtypes of the gather's and the commitment gradient's kernels only
    # (the searches take W in float32): its task step launches both.
    for dtype, mode in ((torch.float32, "task"), (torch.float32, "pool"), (torch.bfloat16, "task")):
        model = _net(dtype)
        set_mode(model, mode)
        set_commitment(model, 1.0)
        with SearchEngine(model, kernel="triton"):
            _steps(model, 2, pool_beta=0.5 if mode == "pool" else 0.0)
    variants = _recorded_variants(launches)
    assert {v[0] for v in variants} == set(ENGINE_KERNELS)
    assert len(variants) >= 12, len(variants)  # three vector sizes, both passes, moved and frozen pools, two dtypes
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here, not read from an earlier run's cache
    script = tmp_path / "compile_sm90.py"
    script.write_text(_COMPILE)
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    done = subprocess.run(
        [sys.executable, str(script), workers], input=json.dumps(variants), env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")[:-1]
    assert len(lines) == len(variants) and all(int(line.split()[1]) > 0 for line in lines), done.stdout
