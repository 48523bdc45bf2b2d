"""The fused Triton search equals the float64 definition exactly, on CUDA or (CI) under Triton's interpreter.

``conftest.py`` sets ``TRITON_INTERPRET=1`` on machines without CUDA, before anything imports the
kernel; with CUDA the same tests run the compiled kernel on the GPU.
"""

import pytest
import torch

from nwsconvert.core import fused_search
from nwsconvert.core.search import brute_force, nearest_two

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not fused_search.available(DEVICE),
    reason="needs Triton >= 3.3 (CPU-only torch wheels ship without it; torch 2.7 brings 3.3) and CUDA or TRITON_INTERPRET=1",
)


def _check(x: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Search on DEVICE; the index must equal brute force, and each radius must be safe:
    no other entry is nearer than the winner for any row within ``radius`` of x (float64 check)."""
    x, pool = x.to(DEVICE), pool.to(DEVICE)
    idx, radius, exact = fused_search.fused_nearest_two(x, pool)
    assert idx.device == x.device and idx.dtype == torch.int64 and radius.dtype == torch.float64
    assert torch.equal(idx.cpu(), brute_force(x.cpu(), pool.cpu()))
    d = torch.cdist(x.cpu().double(), pool.cpu().double())  # (N, n) L2 distances, float64
    own = d.gather(1, idx.cpu()[:, None]).squeeze(1)
    others = d.scatter(1, idx.cpu()[:, None], float("inf")).min(dim=1).values
    r = radius.cpu()
    assert bool((r >= 0).all())
    finite = torch.isfinite(own) & torch.isfinite(others)  # one entry: no other to keep away from
    # Moving by r moves the winner's distance up and any other's down by at most r (slack: cdist's rounding).
    o, w, rr = others[finite], own[finite], r[finite]
    assert bool((w + rr <= o - rr + 1e-12 * o).all())
    return idx, radius, exact


@pytest.mark.parametrize("dim", [1, 4, 9, 25, 49])
@pytest.mark.parametrize("n", [2, 37, 512])
def test_random_rows_equal_brute_force(dim, n):
    g = torch.Generator().manual_seed(dim * 1000 + n)
    _, radius, exact = _check(torch.randn(70, dim, generator=g), torch.randn(n, dim, generator=g))
    assert int(exact.sum()) == 0  # random rows are certified in float32
    assert bool((radius > 0).all())


@pytest.mark.parametrize("dim", [1, 9, 25])
def test_exact_and_near_ties_go_to_float64_and_the_lowest_index(dim):
    g = torch.Generator().manual_seed(dim)
    pool = torch.randn(40, dim, generator=g) * 0.1 + 5.0  # a cloud far from the origin
    pool[17] = pool[3]  # a duplicate entry: the lower index wins
    e = torch.zeros(dim)
    e[0] = 1.0
    pool[5], pool[6] = e, -e  # a pair around the origin, 2 apart
    x = torch.stack(
        [pool[3], pool[3] + 1e-7, torch.zeros(dim), 1e-9 * e, -1e-9 * e, *(torch.randn(27, dim, generator=g) + 5)]
    )
    idx, radius, exact = _check(x, pool)
    # Distances differing by 4e-9 of their size: below float32's error bound, resolved in float64.
    assert idx[:5].tolist() == [3, 3, 5, 5, 6]
    assert bool(exact[:5].all())
    assert radius[0].item() == 0.0 and radius[2].item() == 0.0  # exact ties have no safe radius


def test_nan_and_inf_rows_and_a_nan_pool_entry_match_numpy():
    g = torch.Generator().manual_seed(5)
    pool = torch.randn(50, 9, generator=g)
    x = torch.randn(40, 9, generator=g)
    x[2, 4] = float("nan")
    x[7] = float("inf")
    x[9, 0] = -float("inf")
    idx, radius, exact = _check(x, pool)
    assert bool(exact[[2, 7, 9]].all()) and radius[2].item() == 0.0
    pool[31, 2] = float("nan")  # every distance to entry 31 is NaN: NumPy's argmin picks it, and so do we
    idx, _, exact = _check(x, pool)
    expect = torch.full((40,), 31)
    expect[2] = 0  # a NaN row is NaN everywhere: the first entry
    assert torch.equal(idx.cpu(), expect) and bool(exact.all())


@pytest.mark.parametrize("n", [1, 2, 70_000])
def test_pool_sizes_from_one_entry_to_seventy_thousand(n):
    g = torch.Generator().manual_seed(n)
    pool = torch.randn(n, 9, generator=g)
    x = torch.randn(33, 9, generator=g)  # two row blocks, the second with one live row
    idx, radius, exact = _check(x, pool)
    if n == 1:
        assert bool((idx == 0).all()) and bool(torch.isinf(radius).all())


@pytest.mark.parametrize("tile", ["own", 64])
def test_ties_across_pool_tiles_go_to_the_lowest_index(monkeypatch, tile):
    """The kernel walks the pool in tiles (64 entries on a GPU, 1024 under the interpreter) and keeps a
    tie with the earlier tile's lower index. Exact ties straddling tile edges (entries 63 and 64, 127
    and 128, 10 and 191), a row equidistant from entries of two tiles, and a nearest entry in the last,
    partial tile of a 200-entry pool: every index equals brute force. ``own``: the tile of the machine
    (the compiled GPU kernel on CUDA); 64: the GPU's tiling, also under the interpreter."""
    if tile == 64:
        launch = fused_search.search_launch
        monkeypatch.setattr(
            fused_search, "search_launch", lambda exact, interp: {**launch(exact, interp), "BLOCK_P": 64}
        )
    g = torch.Generator().manual_seed(11)
    pool = torch.randn(200, 9, generator=g)
    for a, b in ((63, 64), (127, 128), (10, 191)):
        pool[b] = pool[a]
    centre, e = torch.full((9,), 20.0), torch.zeros(9)
    e[0] = 1.0
    pool[5], pool[150] = centre + e, centre - e  # 2 apart, far from the cloud: the centre is a tie
    pool[199] = torch.full((9,), -20.0)
    x = torch.stack([pool[64], pool[128], pool[191], centre, pool[199] + 1e-3, *torch.randn(28, 9, generator=g)])
    idx, radius, exact = _check(x, pool)
    assert idx[:5].tolist() == [63, 127, 10, 5, 199]
    assert bool(exact[:4].all()) and bool((radius[:4] == 0).all())  # exact ties: float64, no safe radius


@pytest.mark.filterwarnings("ignore:overflow encountered")  # (the interpreter's NumPy)
def test_a_runner_up_whose_float32_distance_overflows_certifies_nothing():
    """Rows at 1.1e19 beside entries at 1.2e19 and -1.1e19: the runner-up's squared distance (4.8e38) overflows
    float32. It is no certificate: the rows go to float64 and get a finite radius (an infinite one let a later
    jump of the row past the bisector go unsearched). A pool of one entry keeps its infinite radius."""
    x = torch.tensor([[1.1e19, 0.0]], device=DEVICE).repeat(8, 1)
    pool = torch.tensor([[1.2e19, 0.0], [-1.1e19, 0.0]], device=DEVICE)
    idx, radius, exact = fused_search.fused_nearest_two(x, pool)
    assert torch.equal(idx.cpu(), brute_force(x.cpu(), pool.cpu())) and exact.all()
    assert torch.isfinite(radius).all() and (radius > 0).all()
    idx, radius, exact = fused_search.fused_nearest_two(x, pool[:1])
    assert (idx == 0).all() and torch.isposinf(radius).all()


def test_empty_batch_and_bad_shapes():
    idx, radius, exact = fused_search.fused_nearest_two(
        torch.zeros(0, 9, device=DEVICE), torch.randn(4, 9, device=DEVICE)
    )
    assert idx.shape == radius.shape == exact.shape == (0,)
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        fused_search.fused_nearest_two(torch.zeros(3, 9, device=DEVICE), torch.randn(4, 4, device=DEVICE))


@pytest.mark.gpu  # nearest_two takes the fused path for CUDA tensors
def test_nearest_two_uses_the_fused_search_on_cuda_without_host_syncs():
    g = torch.Generator().manual_seed(0)
    x, pool = torch.randn(5000, 9, generator=g).cuda(), torch.randn(512, 9, generator=g).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        idx, radius, exact = fused_search.fused_nearest_two(x, pool)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    res = nearest_two(x, pool)
    assert torch.equal(res.index, idx) and torch.equal(res.radius, radius)
    assert torch.equal(idx.cpu(), brute_force(x.cpu(), pool.cpu()))
