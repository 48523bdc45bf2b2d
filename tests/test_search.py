"""The search equals brute force exactly: one-shot, lazily across optimiser steps, in both modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import nwsconvert as nc
from nwsconvert.core.layers import NWSWeight, _rows_not_below
from nwsconvert.core.rounding import round_f32, shifted_drift_sq
from nwsconvert.core.search import (
    FLOAT64_ROWS,
    brute_force,
    flat_nonzero,
    index_sum,
    nearest_scalar,
    nearest_scalar_from,
    nearest_two,
    round_down_f32,
    scalar_cells,
)


def test_brute_force_matches_numpy_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3000, 9, generator=g)
    p = torch.randn(300, 9, generator=g)
    ref = np.argmin(((x.double().numpy()[:, None, :] - p.double().numpy()[None]) ** 2).sum(-1), axis=1)
    assert np.array_equal(brute_force(x, p).numpy(), ref)


@pytest.mark.parametrize("dim", [1, 2, 9, 49])
@pytest.mark.parametrize("n", [2, 7, 512])
@pytest.mark.parametrize("rows", [FLOAT64_ROWS + 1000, 600])  # the float32 search, the float64 one
def test_nearest_two_equals_brute_force(dim, n, rows):
    g = torch.Generator().manual_seed(dim * 1000 + n)
    pool = torch.randn(n, dim, generator=g) * 0.05
    x = torch.randn(rows, dim, generator=g) * 0.06
    res = nearest_two(x, pool, chunk=777)  # odd chunk: blocks do not align with anything
    assert torch.equal(res.index, brute_force(x, pool))
    assert (res.radius >= 0).all()


def test_ties_go_to_the_lowest_index():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(20, 9, generator=g)
    pool = torch.cat([base, base, base[:5]])  # every vector present two or three times
    x = torch.cat([base, base[:5] + 1e-3, (base[:10] + base[10:20]) / 2])  # exact hits, near hits, midpoints
    x = torch.cat([x, torch.randn(100, 9, generator=g)])
    big = torch.cat([x, torch.randn(FLOAT64_ROWS, 9, generator=g)])
    for rows in (big, x, x[:20]):  # the float32 search, the float64 one, ties alone
        res = nearest_two(rows, pool)
        assert torch.equal(res.index, brute_force(rows, pool))
        ties = min(20, rows.shape[0])
        assert (res.index[:ties] == torch.arange(ties)).all()  # exact duplicates: lowest index
        assert (res.radius[:ties] == 0).all()  # ties have no safe radius
        assert res.exact_rows >= ties  # ties were decided in float64


def test_near_ties_at_every_scale():
    """Margins from 2^-20 down to 2^-60 of the distance: certified where float64 can tell
    them apart, decided by the definition (ties: lowest index) where it cannot."""
    pool = torch.zeros(8, 9)
    pool[0, 0], pool[1, 0] = -1.0, 1.0  # entry 0, the lower index, is the farther one for x[0] > 0
    pool[2:, 1:] = torch.randn(6, 8, generator=torch.Generator().manual_seed(14)) + 5  # far away
    eps = torch.tensor([2.0**-k for k in range(20, 61)] + [0.0])
    x = torch.zeros(eps.numel(), 9)
    x[:, 0], x[:, 1] = eps, 0.5
    big = torch.cat([x, torch.randn(FLOAT64_ROWS, 9)])
    for rows in (x, big):  # the float64 search, the float32 one
        res = nearest_two(rows, pool)
        expect = brute_force(rows, pool)
        assert torch.equal(res.index, expect)
        assert expect[0] == 1 and expect[eps.numel() - 1] == 0  # resolved, and an exact tie
    assert 0 < nearest_two(x, pool).exact_rows < eps.numel()  # float64 certified some, not all


@pytest.mark.parametrize("rows", [2000, 600])  # the float32 search, the float64 one
def test_radius_is_safe(rows):
    """Any move shorter than the radius keeps the nearest entry."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(64, 9, generator=g)
    x = torch.randn(rows, 9, generator=g)
    res = nearest_two(x, pool)
    direction = torch.randn(rows, 9, generator=g)
    direction /= direction.norm(dim=1, keepdim=True)
    moved = x + direction * (res.radius.float() * 0.999)[:, None]
    assert torch.equal(brute_force(moved, pool), res.index)


def test_round_down_f32_never_rounds_up():
    """Budgets are float32 and must never exceed the float64 value: normal and subnormal
    float32 results, exact float32 inputs and inputs just beside them."""
    g = torch.Generator().manual_seed(12)
    x = torch.exp(torch.empty(200_000, dtype=torch.float64).uniform_(-110, 80, generator=g))  # 1e-48 .. 5e34
    f32 = x.float().double()  # exact float32 values
    x = torch.cat([x, f32, torch.nextafter(f32, torch.tensor(0.0, dtype=torch.float64)), f32 * (1 + 2.0**-40)])
    r = round_down_f32(x)
    assert r.dtype == torch.float32
    assert (r.double() <= x).all()
    assert (r.double() >= x * (1 - 2.0**-21) - 2.0**-148).all()  # and it loses almost nothing
    special = round_down_f32(torch.tensor([0.0, float("nan")], dtype=torch.float64))
    assert special[0] < 0 and special[1].isnan()  # no budget left: the row is searched again


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flat_nonzero_and_rows_not_below(dtype):
    g = torch.Generator().manual_seed(13)
    mask = torch.rand(10_000, generator=g) < 0.1
    assert torch.equal(flat_nonzero(mask), mask.nonzero().squeeze(1))
    assert flat_nonzero(torch.zeros(5, dtype=torch.bool)).dtype == torch.int64
    value = torch.rand(10_000, generator=g).to(dtype)
    bound = torch.rand(10_000, generator=g).float()
    value[::97] = float("nan")
    value[::89] = bound[::89].to(dtype)  # equal: not below
    expect = (~(value.float() < bound)).nonzero().squeeze(1)
    assert torch.equal(_rows_not_below(value, bound), expect)


def test_scalar_search_and_cells():
    g = torch.Generator().manual_seed(4)
    # Pool values on a 1/1024 grid, so midpoints between neighbours are exact floats.
    pool = torch.randint(-400, 400, (512,), generator=g).float() / 1024
    pool[::9] = pool[5]  # duplicates
    sp = pool.unique()
    mids = (sp[1:] + sp[:-1]) / 2
    x = torch.cat([torch.randn(20000, generator=g) * 0.12, pool, mids])
    idx = nearest_scalar(x, pool)
    assert torch.equal(idx, brute_force(x[:, None], pool[:, None]))
    lo, hi = scalar_cells(pool)
    inside = (lo[idx] < x.double()) & (x.double() < hi[idx])
    # Values strictly inside a cell have that entry as unique nearest (checked above
    # through idx); exact midpoints are ties and lie in no cell.
    assert inside[:20000].float().mean() > 0.9
    assert not inside[-mids.numel() :].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_scalar_walked_from_its_previous_entry_finds_the_nearest(dtype):
    """The lazy update's scalar search walks cell by cell from each value's previous entry: values moved
    0 to 12 cells (beyond the walk's steps), on borders and beside them, infinite or NaN, from their true
    previous entry, from any entry, or from a duplicate's: the answer is always :func:`nearest_scalar`'s."""
    g = torch.Generator().manual_seed(21)
    pool = torch.cat([torch.randint(-300, 300, (200,), generator=g) / 1024, torch.randn(56, generator=g) * 0.3])
    pool[::17] = pool[3]  # duplicates: the lowest index owns the cell
    pool = pool.to(dtype)
    sp = pool.double().unique()
    rank_start = torch.randint(0, sp.numel(), (30_000,), generator=g)
    moved = (rank_start + torch.randint(-12, 13, (30_000,), generator=g)).clamp(0, sp.numel() - 1)
    mids = (sp[1:] + sp[:-1]) / 2
    inf = torch.tensor(float("inf"), dtype=dtype)
    values = torch.cat(
        [
            (sp[moved] + torch.randn(30_000, generator=g, dtype=torch.float64) * 1e-3).to(dtype),
            mids.to(dtype),
            torch.nextafter(mids.to(dtype), inf),
            torch.nextafter(mids.to(dtype), -inf),
            torch.tensor([float("inf"), float("-inf"), float("nan"), 5.0, -5.0], dtype=dtype),
        ]
    )
    want = nearest_scalar(values, pool)
    finite = values.isfinite()
    assert torch.equal(want[finite], brute_force(values[finite, None], pool[:, None]))
    previous = nearest_scalar(torch.cat([sp[rank_start].to(dtype), values[30_000:]]), pool)
    starts = {
        "previous": previous,
        "any": torch.randint(0, pool.numel(), (values.numel(),), generator=g),
        "a duplicate": torch.full((values.numel(),), 17),
    }
    for name, start in starts.items():
        for idx in (start, start.int()):
            got = nearest_scalar_from(values, idx, pool)
            assert got.dtype == torch.int64 and torch.equal(got, want), name
    assert nearest_scalar_from(values[:0], previous[:0], pool).numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scalar_lazy_update_at_cell_borders(dtype):
    """Values just inside, on and just outside every cell border keep or change their entry
    exactly as brute force says (float32 weights use float32-rounded borders). Float64 values beside a border
    sit just outside the band where brute force's rounding decides (the test below has values inside it)."""
    g = torch.Generator().manual_seed(11)
    pool = torch.cat([torch.arange(8) / 64, torch.randn(56, generator=g) * 0.3])  # exact and inexact midpoints
    sp = pool.double().unique()
    mids = ((sp[1:] + sp[:-1]) / 2).to(dtype)  # float32: the border rounded to nearest
    inf = torch.tensor(float("inf"), dtype=dtype)
    if dtype == torch.float32:
        beside = torch.nextafter(mids, inf), torch.nextafter(mids, -inf)
    else:  # 2^-46 of the gap and of the midpoint away: past the band (2^-49 of the one, 2^-50 of the other)
        away = ((sp[1:] - sp[:-1]) + mids.abs()) * 2.0**-46
        beside = mids + away, mids - away
    borders = torch.cat([mids, *beside])
    w = nn.Parameter(torch.randn(borders.numel(), 1, generator=g, dtype=dtype) * 0.3)
    nws = NWSWeight(w, 1, pool.to(dtype)[:, None])
    lo, hi = scalar_cells(pool.to(dtype))
    k = mids.numel()
    for shift in (0, 1, 2, 3):  # rows [0, k) jump between borders; the rest sit beside theirs
        values = borders.clone()
        values[:k] = values[:k].roll(shift)
        with torch.no_grad():
            w.copy_(values[:, None])
        before = nws.indices.long().clone()
        nws(w)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), shift
        # Exactly the rows that left their cell (decided in float64) were searched again.
        x = values.double()
        left = ~((lo[before] < x) & (x < hi[before]))
        assert nws.stats["searched"] == int(left.sum()), shift
        if shift:
            assert 0 < nws.stats["searched"] <= k  # the lazy path decided; no row beside a border moved


def _layer(weight: torch.Tensor, dim: int, n: int, seed: int = 0) -> tuple[nn.Parameter, NWSWeight]:
    g = torch.Generator().manual_seed(seed)
    w = nn.Parameter(weight)
    pool = torch.randn(n, dim, generator=g) * weight.std()
    return w, NWSWeight(w, dim, pool)


@pytest.mark.parametrize("dim", [1, 9])
def test_lazy_search_across_optimizer_steps_task_mode(dim):
    g = torch.Generator().manual_seed(dim)
    w, nws = _layer(torch.randn(4096, dim, generator=g) * 0.1, dim, 128)
    opt = torch.optim.SGD([w], lr=1.0)
    partial = 0
    for step in range(60):
        k = nws(w)  # training mode: lazy update
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), step
        assert torch.equal(k, nws.pool[nws.indices.long()].view_as(w))
        searched = nws.stats["searched"]
        partial += 0 < searched < nws.num_vectors
        # Gradients of very different sizes: most rows stay, some cross cell borders.
        scale = 2e-5 if step % 3 else 2e-3
        w.grad = torch.randn(w.shape, generator=g) * scale
        opt.step()
    assert partial > 30  # the lazy path (not full searches) did the work


def test_lazy_search_pool_mode_gradient_and_ema():
    g = torch.Generator().manual_seed(7)
    w, nws = _layer(torch.randn(3000, 9, generator=g) * 0.1, 9, 64)
    nws.set_mode("pool")
    assert isinstance(nws.pool, nn.Parameter)
    opt = torch.optim.SGD([w, nws.pool], lr=0.5)
    for step in range(40):
        nws(w)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), step
        opt.zero_grad()
        (nws.distillation_loss(w) * 100).backward()
        w.grad = torch.randn(w.shape, generator=g) * 1e-3
        opt.step()
        if step % 10 == 5:
            nws.ema_update(w, decay=0.9)
        if step % 10 == 9:
            nws.reseed_unused(w)
    nws(w)
    assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool))


def test_whole_model_indices_equal_brute_force_after_training_steps():
    import timm

    model = timm.create_model("resnet18", num_classes=4)
    nc.convert(model, pool_size=128, init="random")
    nc.set_commitment(model, 1.0)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model(x)
    for layer in nc.nws_layers(model):
        want = brute_force(layer.weight.detach().reshape(-1, layer.nws.vector_size), layer.nws.pool)
        assert torch.equal(layer.nws.indices.long(), want), layer.name


def test_updates_through_data_are_seen():
    """Code that edits ``param.data`` (no version bump) still gets exact indices."""
    g = torch.Generator().manual_seed(9)
    w, nws = _layer(torch.randn(500, 9, generator=g) * 0.1, 9, 32)
    for _ in range(5):
        w.data.add_(torch.randn(w.shape, generator=g) * 0.05)
        nws(w)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool))


def test_pool_edits_through_data_are_seen():
    g = torch.Generator().manual_seed(10)
    for dim in (1, 9):
        w, nws = _layer(torch.randn(500, dim, generator=g) * 0.1, dim, 32)
        nws.set_mode("pool")
        for _ in range(4):
            nws.pool.data.add_(torch.randn(nws.pool.shape, generator=g) * 0.03)
            nws(w)
            assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), dim


def test_shifted_drift_is_never_below_the_exact_value_and_barely_above():
    """The drift a row is tested with under a pool shift: at least ``(sqrt(d) + s)^2`` for the float32
    ``d`` (else a row could keep a stale index), at most ``2^-19`` above it (else the budget is wasted)."""
    g = torch.Generator().manual_seed(11)
    d = torch.exp(torch.empty(200_000).uniform_(-70, 7, generator=g)).float()  # 4e-31 .. 1e3
    d[:4] = torch.tensor([0.0, 1e-45, 2.0**-126, 1.0])  # zero, the smallest subnormal, the smallest normal
    for s in (2.0**-70, 1e-12, 3e-7, 1e-3, 0.37, 5.0):
        got = shifted_drift_sq(d.clone(), s).double()
        exact = (d.double().sqrt() + max(s, 2.0**-60)) ** 2
        assert bool((got >= exact).all()), s
        assert bool((got <= exact * (1 + 2.0**-19)).all()), s


def test_a_budget_is_finite_whatever_its_radius_and_shift():
    """Budgets beyond float32's range are clamped to its largest value, not +inf: a settled shift must be
    able to take something off every finite budget."""
    from nwsconvert.core.rounding import budget_sq

    big = torch.tensor([1e19, 3e30, float("inf")], dtype=torch.float64)
    rows = torch.zeros(3, 9)
    top = torch.finfo(torch.float32).max
    got = budget_sq(big, rows, rows, 0.0).tolist()
    assert 0.99e38 < got[0] <= 1e38 and got[1:] == [top, top]  # 1e19 squared fits; the rest is clamped
    assert budget_sq(big, rows, rows, 1e19).tolist() == [top] * 3  # (1e19 + 1e19)^2 would round to +inf
    assert budget_sq(torch.tensor([float("nan")], dtype=torch.float64), rows[:1], rows[:1], 1.0).isnan().all()


def test_a_moving_pool_is_one_shift_and_every_index_stays_exact():
    """Pool learning: the pool's movement is kept as one number per layer (not taken off every row's
    budget at every step) until SHIFT_STEPS changes or the pool stops; the indices equal brute force at
    every step, with the lazy path (not full searches) doing the work under a shift."""
    g = torch.Generator().manual_seed(12)
    w, nws = _layer(torch.randn(4096, 9, generator=g) * 0.1, 9, 64)
    nws.set_mode("pool")
    opt = torch.optim.SGD([w, nws.pool], lr=1.0)
    lazy_under_shift, settled = 0, 0
    for step in range(80):
        shift_before = nws._shift
        nws(w)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), step
        lazy_under_shift += nws._shift > 0 and 0 < nws.stats["searched"] < nws.num_vectors
        settled += shift_before > 0 and nws._shift == 0 and nws.stats["searched"] < nws.num_vectors
        assert nws._shift_steps < NWSWeight.SHIFT_STEPS
        # Small pool moves (the pool learns slowly) and weight steps of two sizes.
        nws.pool.grad = torch.randn(nws.pool.shape, generator=g) * 2e-5
        w.grad = torch.randn(w.shape, generator=g) * (2e-5 if step % 3 else 2e-3)
        opt.step()
    assert lazy_under_shift > 40 and settled >= 2  # settled every SHIFT_STEPS changes
    nws.set_mode("task")  # the pool stops moving (after the last step's move): the shift is settled
    for step in range(5):
        nws(w)
        assert (step == 0 or nws._shift == 0) and torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool))
        w.data.add_(torch.randn(w.shape, generator=g) * 2e-4)


def test_a_restored_search_state_goes_on_exactly_and_is_not_changed_by_what_follows():
    """Task starts restore the search state the first one took (``search_state`` / ``restore_search``):
    written into the layer's own buffers, so training after a restore leaves the saved state as it was,
    and a second restore goes on exactly as the first."""
    g = torch.Generator().manual_seed(13)
    w, nws = _layer(torch.randn(2048, 9, generator=g) * 0.1, 9, 64)
    start = w.detach().clone()
    state = nws.search_state()
    saved = [t.clone() if isinstance(t, torch.Tensor) else t for t in state]
    for _ in range(2):  # two "tasks", each from the same start
        w.data.copy_(start)
        nws.restore_search(state)
        for step in range(6):
            nws(w)
            assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), step
            w.data.add_(torch.randn(w.shape, generator=g) * 3e-3)
        assert 0 < nws.stats["searched"] < nws.num_vectors  # the restored budgets did the work
    for kept, before in zip(state, saved):
        assert kept == before if not isinstance(kept, torch.Tensor) else torch.equal(kept, before)


@pytest.mark.parametrize("threads", [1, 2])
def test_index_sum_has_the_bits_of_index_add_along_dim_0(threads):
    """The pool gradient's, the EMA update's and k-means' sums by index: equal bit for bit to
    ``index_add_`` along dim 0 (each entry's rows added in ascending order), for scalar, 3x3 and 7x7 rows,
    pools of 1 to 4096 entries, int32 and int64 indices, one or two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(11)
        for rows, size, n in [(70_000, 9, 512), (50_000, 1, 512), (3_000, 49, 64), (20_000, 9, 4096), (100, 9, 1)]:
            x = torch.randn(rows, size, generator=gen) * torch.logspace(-3, 3, rows)[:, None]  # magnitudes apart
            index = torch.randint(0, n, (rows,), generator=gen)
            want = torch.zeros(n, size).index_add_(0, index, x)
            for idx in (index, index.int()):
                got = index_sum(x, idx, n)
                assert got.shape == (n, size) and got.is_contiguous()
                assert torch.equal(got, want), (rows, size, n, idx.dtype)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("moving_pool", [False, True])
def test_rows_past_their_budget_are_settled_by_their_two_entries_exactly(moving_pool):
    """A row past its budget is first settled by comparing its entry and its runner-up, with the bound the
    last search left on every other entry. Rows sitting on the border of two entries (exact ties among
    them, on a 1/64 grid) go back and forth, a few jump far: at every step every index equals brute force,
    most rows past their budget are settled without a search, and the jumps are searched."""
    g = torch.Generator().manual_seed(31)
    pool = torch.randint(-40, 40, (64, 9), generator=g).float() / 64
    pick = torch.randint(0, 64, (3000, 2), generator=g)
    pick = pick[pick[:, 0] != pick[:, 1]]
    mid = (pool[pick[:, 0]] + pool[pick[:, 1]]) / 2  # equidistant from two entries (exact: a 1/128 grid)
    w = nn.Parameter(mid.clone())
    nws = NWSWeight(w, 9, pool)
    if moving_pool:
        nws.set_mode("pool")
    assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool))
    side = pool[pick[:, 1]] - pool[pick[:, 0]]
    settled = searched = 0
    for step in range(40):
        with torch.no_grad():
            # Across the border and back: on it (a tie, the lower index wins), 1/256 of the gap to either side.
            w.copy_(mid + side * ((step % 5) - 2) / 256)
            w[step * 50 : step * 50 + 20] += torch.randn(20, 9, generator=g)  # a few rows jump far
            if moving_pool:
                nws.pool.add_(torch.randn(nws.pool.shape, generator=g) * 1e-6)
        nws(w)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), step
        settled += nws.stats["paired"]
        searched += nws.stats["searched"] - nws.stats["paired"]
    assert settled > 2 * searched > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_weights_not_in_float32_are_searched_past_their_budget_without_pairs(dtype):
    """Settling by pairs needs the float32 reference copy to be exact: other weight dtypes search every row
    past its budget, as before (bfloat16, which NumPy lacks, included)."""
    g = torch.Generator().manual_seed(5)
    w = nn.Parameter((torch.randn(3000, 9, generator=g) * 0.1).to(dtype))
    nws = NWSWeight(w, 9, (torch.randn(64, 9, generator=g) * 0.1).to(dtype))
    assert nws._pair is None
    for _ in range(3):
        with torch.no_grad():
            w.add_((torch.randn(3000, 9, generator=g) * 0.002).to(dtype))
        nws(w)
        assert nws.stats["searched"] >= NWSWeight.PAIR_ROWS and nws.stats["paired"] == 0


@pytest.mark.parametrize("rows", [300, 5000])  # the float64 path (up to FLOAT64_ROWS) and the float32 one
@pytest.mark.parametrize("n", [1, 2, 3, 512])
def test_a_pair_search_gives_the_runner_up_and_a_bound_on_every_other_entry(rows, n):
    """``nearest_two(pair=True)``: the index and radius as without it; ``second`` is a nearest entry once
    ``index`` is set aside, and ``third`` is at most the distance to every entry but those two (``inf``
    when there is none)."""
    g = torch.Generator().manual_seed(41)
    pool = torch.randn(n, 9, generator=g)
    x = torch.randn(rows, 9, generator=g)
    x[:20] = pool[torch.arange(20) % n]  # on an entry
    plain, res = nearest_two(x, pool), nearest_two(x, pool, pair=True)
    assert torch.equal(res.index, plain.index) and torch.equal(res.radius, plain.radius)
    dist = torch.cdist(x.double(), pool.double())
    rows_at = torch.arange(rows)
    rest = dist.clone()
    rest[rows_at, res.index] = float("inf")
    if n > 1:
        assert torch.allclose(dist[rows_at, res.second], rest.min(1).values, rtol=1e-6, atol=1e-6)
        rest[rows_at, res.second] = float("inf")
    else:
        assert torch.equal(res.second, res.index)
    assert bool((res.third <= rest.min(1).values).all())
    if n <= 2:
        assert bool(res.third.isinf().all())
    else:
        assert bool((res.third > rest.min(1).values * (1 - 1e-4)).all())  # and barely below it (float32: 1e-5)


# --- every weight dtype: the lazy search equals brute force for float16, bfloat16 and float64 weights too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-3, 1e-2])
def test_lazy_updates_of_half_precision_weights_equal_brute_force(dtype, scale):
    """The drift test runs in float32 for float16 and bfloat16 weights: in their own dtype the squared drift of
    float16 weights of 1e-3 underflowed to 0 (the rows moved, no row was searched: 50-124 stale indices a step)."""
    g = torch.Generator().manual_seed(2)
    w = nn.Parameter((torch.randn(4000, 9, generator=g) * scale).to(dtype))
    nws = NWSWeight(w, 9, (torch.randn(64, 9, generator=g) * scale).to(dtype))
    searched = 0
    for _ in range(6):
        with torch.no_grad():
            w.add_((torch.randn(4000, 9, generator=g) * scale / 100).to(dtype))
        nws(w)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool))
        assert 0 < nws.stats["searched"] < nws.num_vectors  # the lazy path decided, and it searched some rows
        searched += nws.stats["searched"]
    assert searched < 6 * nws.num_vectors // 4


def _near_bisectors(pool: torch.Tensor, g: torch.Generator, count: int) -> torch.Tensor:
    """``count`` float64 rows 1e-13 .. 1e-10 of a gap from the bisector of two random pool entries, on both
    sides, and on it: the rows float32 rounding (of the rows or of the pool) puts on the wrong side."""
    i = torch.randint(0, pool.shape[0], (count,), generator=g)
    j = (i + torch.randint(1, pool.shape[0], (count,), generator=g)) % pool.shape[0]
    eps = torch.tensor([0.0, 1e-13, -1e-13, 1e-10, -1e-10], dtype=torch.float64)[torch.arange(count) % 5]
    return (pool[i] + pool[j]) / 2 + eps[:, None] * (pool[j] - pool[i])


@pytest.mark.parametrize("rows", [300, FLOAT64_ROWS + 1000])  # one chunk, and more rows than the float32 search takes
def test_float64_vectors_and_pools_are_searched_in_float64(rows):
    """A float64 pool (values float32 cannot hold) or float64 vectors: the search runs in float64 only and equals
    brute force, where a search in float32 puts rows near a bisector on the wrong side."""
    g = torch.Generator().manual_seed(21)
    pool = torch.randn(64, 9, generator=g, dtype=torch.float64)
    x = _near_bisectors(pool, g, rows)
    expect = brute_force(x, pool)
    assert not torch.equal(brute_force(x.float(), pool.float()), expect)  # float32 would differ
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for chunk in (2048, 97):
        res = nearest_two(x.to(device), pool.to(device), chunk=chunk, pair=True)
        assert torch.equal(res.index.cpu(), expect) and res.index.device.type == device
        assert res.exact_rows > 0
    res = nearest_two(x, pool, pair=True)  # on a CPU: the runner-up too, and the bound on every other entry
    dist = torch.cdist(x, pool)  # the runner-up is an entry at the second distance, the bound below the third
    # (cdist's own rounding: 1e-9 relative; the rows on a bisector tie for the first two places)
    near = dist.sort(dim=1).values
    assert (dist.gather(1, res.second[:, None])[:, 0] <= near[:, 1] * (1 + 1e-9)).all()
    assert (res.second != res.index).all() and (res.third <= near[:, 2] * (1 + 1e-9)).all()
    # float32-exact pool values, float64 rows: still float64
    assert torch.equal(nearest_two(x, pool.float().double()).index, brute_force(x, pool.float().double()))
    assert nearest_two(x[:0], pool).index.shape == (0,)


def test_a_float64_layer_follows_its_pool_below_float32_resolution():
    """A float64 layer whose pool moves by less than float32 can see (1e-12): the move is tracked in float64, and
    the rows it carries over a bisector are searched again (tracked in float32, the pool looked unchanged)."""
    g = torch.Generator().manual_seed(22)
    pool = torch.randn(32, 9, generator=g, dtype=torch.float64)
    w = nn.Parameter(_near_bisectors(pool, g, 2000))
    nws = NWSWeight(w, 9, pool)
    nws(w)
    assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool))
    changed = 0
    for step in range(4):
        before = nws.indices.clone()
        with torch.no_grad():
            nws.pool.add_(torch.randn(32, 9, generator=g, dtype=torch.float64) * 1e-12)
        nws(w)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), step
        changed += int((nws.indices != before).sum())
    assert changed > 0  # the moves carried rows over: the test sees a stale index


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scalar_cells_hold_only_what_brute_force_picks(dtype):
    """Inside its cell a value has the entry brute force picks, near a border too, where float64's rounding of
    ``(x - m)^2`` ties or reorders entries (1e-17 between -1 and 1 is a tie there, picked by the lowest index);
    the lazy update equals brute force on the values just inside each cell and in the band around each border."""
    g = torch.Generator().manual_seed(23)
    pool = torch.cat([
        torch.tensor([1.0, -1.0, 3.0, -3.0, 1e6, 1e6 + 2.0**-29, 2.0**-140, -(2.0**-140)], dtype=torch.float64),
        torch.randn(40, generator=g, dtype=torch.float64),
    ]).to(dtype)  # fmt: skip
    lo, hi = scalar_cells(pool)
    ok = torch.isfinite(lo) & torch.isfinite(hi)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    # float64 values: one ulp inside each bound; float32 values: the nearest float32 inside each bound
    inside64 = torch.cat([torch.nextafter(lo[ok], inf), torch.nextafter(hi[ok], -inf)])
    lo32, hi32 = round_f32(lo[ok], up=True), round_f32(hi[ok], up=False)
    inf32 = inf.float()
    inside32 = torch.cat([torch.where(lo32.double() > lo[ok], lo32, torch.nextafter(lo32, inf32)),
                          torch.where(hi32.double() < hi[ok], hi32, torch.nextafter(hi32, -inf32))])  # fmt: skip
    owner = torch.arange(pool.numel())[ok].repeat(2)
    for x in (inside64, inside32.double()):
        keep = (x > lo[owner]) & (x < hi[owner])
        assert keep.all()
        assert torch.equal(brute_force(x[:, None], pool[:, None]), owner)
    # Values in the bands around the borders and tiny ones between the symmetric pairs, through the lazy update
    sp = pool.double().unique()
    mids = (sp[1:] + sp[:-1]) / 2
    near = torch.cat([mids + k * (sp[1:] - sp[:-1]) * 2.0**-52 for k in range(-8, 9)])
    tiny = torch.tensor([1e-17, -1e-17, 1e-20, 2.0**-200, 1e-9], dtype=torch.float64)
    values = torch.cat([near, tiny, x]).to(dtype)
    w = nn.Parameter(torch.zeros(values.numel(), 1, dtype=dtype))
    nws = NWSWeight(w, 1, pool[:, None])
    nws(w)
    with torch.no_grad():
        w.copy_(values[:, None])
    nws(w)
    assert 0 < nws.stats["searched"] < values.numel()
    assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool))


def test_the_engine_refuses_float64_weights():
    from nwsconvert.core.engine import SearchEngine

    model = nc.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)), pool_size=16).double()
    with pytest.raises(ValueError, match="layer '0' holds float64 weights or pools.*search='layer'"):
        SearchEngine(model)


@pytest.mark.gpu  # search=auto picks the engine on CUDA only
def test_auto_search_on_cuda_leaves_float64_models_to_the_layers():
    from nwsconvert.core.engine import SearchEngine, search_engine

    model = nc.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)), pool_size=16).cuda()
    engine = search_engine(model, "auto")
    assert isinstance(engine, SearchEngine)
    engine.close()
    assert search_engine(model.double(), "auto") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nearest_scalar_counts_entries_that_rounding_ties_beyond_the_neighbours(dtype):
    """0.01 is nearer to 1e-20 than to 0, but float64 rounds both squared distances to the same value: brute
    force then takes the lowest index (0), though 0 is not a neighbour of 0.01 in sorted order."""
    pool = torch.tensor([0.0, 1e-20, 0.5, -0.5, 0.5 + 2.0**-23], dtype=dtype)
    x = torch.tensor([0.01, -0.01, 0.3, 0.25, 0.5 + 2.0**-24, 1e-21, 7.0, -7.0], dtype=dtype)
    expect = brute_force(x[:, None], pool[:, None])
    assert expect[0] == 0 and expect[1] == 0
    assert torch.equal(nearest_scalar(x, pool), expect)
    assert torch.equal(nearest_scalar_from(x, torch.tensor([1, 0, 2, 3, 4, 1, 4, 3]), pool), expect)
    lo, hi = scalar_cells(pool)
    assert not (lo[1] < 0.01 < hi[1])  # 0.01 lies outside 1e-20's cell: it is searched


# --- extreme magnitudes: squares that underflow to subnormals or overflow to inf


_F64 = torch.float64


@pytest.mark.parametrize(
    "pool, value",
    [
        ([-2e154, 2e154], 1e150),  # both squares overflow: a tie, the lowest index
        ([1e-160, 0.0], 0.5e-160 - 1e-166),  # both squares subnormal
        ([0.0, 1e-170, 1e-160], 0.4e-160),
        ([2e-170, -1e-170, 1.5e-170], 0.0),
        ([3e160, -1e160, 1e160], 0.0),  # gaps of 2e160 squared overflow: nearest_scalar may not return early
    ],
)
def test_scalar_searches_where_squares_underflow_or_overflow(pool, value):
    """Brute force's float64 squares tie where they overflow or go subnormal: the scalar cells end before
    either can happen, so the lazy update searches such values, and the search lets brute force decide."""
    p, x = torch.tensor(pool, dtype=_F64), torch.tensor([value], dtype=_F64)
    expect = brute_force(x[:, None], p[:, None])
    assert torch.equal(nearest_scalar(x, p), expect)
    for start in range(len(pool)):
        assert torch.equal(nearest_scalar_from(x, torch.tensor([start]), p), expect), start
    w = nn.Parameter(p[-1:, None].clone())
    nws = NWSWeight(w, 1, p[:, None])
    nws(w)
    with torch.no_grad():
        w.fill_(value)
    nws(w)
    assert torch.equal(nws.indices.long(), expect)


@pytest.mark.parametrize("rows", [1, 1025])  # the float64 search, and float32 with its certification
def test_nearest_two_at_subnormal_distances(rows):
    """Distances near 1e-45 (float32) or 1e-323 (float64) round by an absolute amount the relative bound
    misses: the bound has an absolute term, and such rows go to the definition."""
    p32 = torch.tensor(
        [[3.407226880358334e-23, -3.6806438612974023e-23], [2.1416542141116894e-24, 1.0140522157829322e-23]]
    )
    x32 = torch.tensor([[3.033567766471022e-23, -7.280381517066614e-24]]).repeat(rows, 1)
    p64 = torch.tensor([[-4.843717639001652e-162, 1.3056821212338296e-162],
                        [-1.5108219510238873e-162, 1.7598046208912367e-162]], dtype=_F64)  # fmt: skip
    x64 = torch.tensor([[-3.0885058410843943e-162, 2.6544949216826032e-162]], dtype=_F64).repeat(rows, 1)
    for x, p in ((x32, p32), (x64, p64)):
        expect = brute_force(x, p)
        assert (expect == 0).all()
        assert torch.equal(nearest_two(x, p).index, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drifts_near_1e_23_are_not_lost_to_underflow(dtype):
    """A row's squared drift of 2.5e-23 per component underflows in float32: the budget is smaller by what
    that can lose, so the moved rows are searched again."""
    pool = torch.stack([torch.zeros(9), torch.full((9,), 1e-22 / 3)]).to(dtype)
    w = nn.Parameter(torch.zeros(10, 9, dtype=dtype))
    nws = NWSWeight(w, 9, pool)
    nws(w)
    with torch.no_grad():
        w.fill_(2.5e-23)  # now nearer to entry 1
    nws(w)
    assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)) and (nws.indices == 1).all()


@pytest.mark.parametrize("scale", [1e-26, 1.0, 1e19])
def test_rows_settled_by_pairs_at_tiny_and_huge_scales(scale):
    """300 rows jump from beside entry 0 to beside entry 2 (neither their index nor their runner-up): the pair
    test must not settle them, whether the drift underflows (1e-26) or the third distance overflowed (1e19)."""
    pool = torch.tensor([[1.2, 0.0], [0.0, 1.2], [-1.1, 0.0]]) * scale
    w = nn.Parameter(torch.tensor([[1.1, 0.0]]).repeat(2048, 1) * scale)
    nws = NWSWeight(w, 2, pool)
    nws(w)
    with torch.no_grad():
        w[:300] = torch.tensor([-0.1, 0.0]) * scale
    nws(w)
    expect = brute_force(w.detach(), nws.pool)
    assert (expect[:300] == 2).all() and torch.equal(nws.indices.long(), expect)


def test_pairs_settle_no_row_whose_tiny_drift_underflowed_beside_a_pool_shift():
    """Rows move 2.6e-23 a component (their float32 squared drift underflows to 0) while the third entry moves
    2^-61 a component toward them: the pair test's movement must count the underflow beside the shift."""
    a, k, m = np.float32(1e-16), np.float32(1.2e-18), 2.0**-61
    settled = 0
    for off in range(40):
        c = np.float32(np.float64(a) + m + off * 2.0**-77)
        first = torch.full((9,), float(-a))
        second = first.clone()
        second[0] -= float(k)
        second[1] += float(k)
        w = nn.Parameter(torch.zeros(300, 9))
        nws = NWSWeight(w, 9, torch.stack([first, second, torch.full((9,), float(c))]))  # (searches every row)
        with torch.no_grad():
            w.fill_(2.6e-23)
            nws.pool[2] -= m
        nws(w)
        settled += nws.stats.get("paired", 0)
        assert torch.equal(nws.indices.long(), brute_force(w.detach(), nws.pool)), off
    assert settled > 0  # the pair test ran


def test_a_nan_start_entry_walks_from_the_last_cell():
    pool = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    x = torch.tensor([0.5 - 2**-20, 1.7, 2.4])
    assert torch.equal(nearest_scalar_from(x, torch.tensor([2, 2, 2]), pool), nearest_scalar(x, pool))


def test_the_runner_up_is_another_entry_where_every_other_distance_overflows():
    pool = torch.tensor([[0.0, 0.0], [1e300, 0.0], [-1e300, 0.0]], dtype=_F64)
    res = nearest_two(torch.tensor([[1e10, 0.0]], dtype=_F64), pool, pair=True)
    assert res.index.tolist() == [0] and res.second.tolist() == [1] and res.third.tolist() == [0.0]
    # float32, more rows than the float64 search takes: a runner-up at 2.2e19 overflows its float32 square
    pool32, x32 = torch.tensor([[1.2e19, 0.0], [-1.1e19, 0.0]]), torch.tensor([[1.1e19, 0.0]]).repeat(2048, 1)
    res = nearest_two(x32, pool32)
    assert torch.equal(res.index, brute_force(x32, pool32)) and torch.isfinite(res.radius).all()
    assert res.exact_rows == 2048  # redone with the definition


def test_the_search_fuzz_harness_finds_no_wrong_index():
    """benchmarks/harnesses/search_fuzz.py, fixed cases: every dtype pair, D in {1, 2, 9}, scales 1e-30..1e30 and
    then 1e-300..1e300, one-shot searches and lazy updates (at 911cf31 the first run found 87 failures), then a
    model's layers under the search engine (its Triton kernels too where they run: here in Triton's
    interpreter; on a GPU machine on CUDA)."""
    import runpy
    from pathlib import Path

    main = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "harnesses" / "search_fuzz.py"))["main"]
    threads = torch.get_num_threads()
    assert main(["--cases", "400", "--seed", "0"]) == 0
    assert main(["--cases", "200", "--seed", "1", "--max-exponent", "300"]) == 0
    # the model-level engine, its torch kernel and (here, under TRITON_INTERPRET=1) its Triton kernels: before
    # 7a71616 cases 7 and 11 kept stale indices (budgets beyond float32's range stored as +inf)
    assert main(["--cases", "16", "--seed", "0", "--kinds", "engine"]) == 0
    assert torch.get_num_threads() == threads


def _triton_search_runs() -> bool:
    from nwsconvert.core import fused_search

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU under TRITON_INTERPRET=1 (conftest.py)
    return fused_search.available(device)


@pytest.mark.skipif(not _triton_search_runs(), reason="needs Triton >= 3.3 (the oldest supported versions have 3.1)")
def test_the_search_fuzz_harness_finds_no_wrong_index_in_the_triton_search():
    """benchmarks/harnesses/search_fuzz.py's fused cases: one-shot rows through the Triton search the layers take
    on CUDA (here in Triton's interpreter; on a GPU machine on CUDA): at 911cf31 case 87 gave a radius beyond
    half the gap."""
    import runpy
    from pathlib import Path

    main = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "harnesses" / "search_fuzz.py"))["main"]
    assert main(["--cases", "100", "--seed", "0", "--kinds", "fused"]) == 0
