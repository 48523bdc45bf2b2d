"""k-means pool initialisation."""

import torch

from nwsconvert.core.kmeans import assign, kmeans
from nwsconvert.core.search import brute_force


def test_assign_matches_exact_search_on_separated_data():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(50, 9, generator=g) * 10
    x = c[torch.randint(0, 50, (5000,), generator=g)] + torch.randn(5000, 9, generator=g) * 0.1
    idx, dist = assign(x, c, chunk=999)
    assert torch.equal(idx, brute_force(x, c))
    assert torch.allclose(dist, (x - c[idx]).pow(2).sum(1), rtol=1e-3, atol=1e-3)  # float32 expansion


def test_fewer_points_than_entries_keeps_every_point():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 4, generator=g)
    c = kmeans(x, 32, generator=g)
    assert c.shape == (32, 4)
    assert torch.equal(c[:10], x)
    assert torch.isfinite(c).all()


def test_duplicate_points_reseed_empty_clusters():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, generator=g).repeat(200, 1)  # 1000 points, 5 distinct
    c = kmeans(x, 16, iters=4, generator=g)
    assert torch.isfinite(c).all()
    # every distinct point is a centre
    assert (torch.cdist(x[:5], c).min(1).values < 1e-6).all()


def test_scalar_assignment_is_exact():
    """D = 1 goes through a binary search over the sorted centres: equal to brute force, ties included."""
    g = torch.Generator().manual_seed(3)
    c = torch.randn(64, 1, generator=g)
    c[10] = c[3]  # a duplicate centre: the lower index wins
    x = torch.cat([torch.randn(20000, 1, generator=g), c, (c[:-1] + c[1:]) / 2])  # + centres and midpoints
    idx, dist = assign(x, c)
    assert torch.equal(idx, brute_force(x, c))
    assert torch.equal(dist, (x[:, 0] - c[idx, 0]).square())
    centres = kmeans(torch.randn(50000, 1, generator=g), 32, generator=g)
    assert centres.shape == (32, 1) and torch.isfinite(centres).all() and centres.unique().numel() == 32


def test_assign_takes_each_rows_first_nearest_centre_as_torch_min_does():
    """``assign`` finds each row's smallest distance with NumPy's ``argmin`` on a CPU: the same value and the
    same column as ``torch.min(dim=1)``, the first one on ties (duplicated centres make every row tie)."""
    from nwsconvert.core.kmeans import assign

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10_000, 9, generator=gen)
    centres = torch.randn(64, 9, generator=gen)
    centres = torch.cat([centres, centres])  # entry j + 64 equals entry j: the nearest is always tied
    idx, dist = assign(x, centres, chunk=1000)
    d = torch.addmm((centres * centres).sum(1), x, centres.t(), alpha=-2.0)
    v, want = d.min(dim=1)
    assert torch.equal(idx, want) and bool((idx < 64).all())
    assert torch.equal(dist, (v + (x * x).sum(1)).clamp_min(0))


def _seeding_in_torch(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding written step by step in torch: the arithmetic ``_kmeans_pp`` must reproduce."""
    n = x.shape[0]
    centers = torch.empty(k, x.shape[1])
    first = int(torch.randint(n, (1,), generator=gen))
    centers[0] = x[first]
    d2 = (x - x[first]).pow(2).sum(1)
    u = torch.rand(k, generator=gen, dtype=torch.float64)
    for j in range(1, k):
        cum = torch.cumsum(d2, 0, dtype=torch.float64)
        pick = int(torch.searchsorted(cum, u[j] * cum[-1]).clamp_max(n - 1))
        centers[j] = x[pick]
        torch.minimum(d2, (x - x[pick]).pow(2).sum(1), out=d2)
    return centers


def test_seeding_on_numpy_picks_the_same_centres_as_torch():
    """The seeding loop runs on NumPy views (one op over all components a step); its picks are exactly torch's:
    the same float32 squared distances summed in component order and the same float64 running sum. Widths
    cover scalars, 1x1 groups, 3x3 / 5x5 / 7x7 kernels; duplicated rows make many distances exactly 0."""
    from nwsconvert.core.kmeans import _kmeans_pp

    gen = torch.Generator().manual_seed(4)
    for width in (1, 2, 4, 9, 16, 25, 49):
        for n in (300, 4096):
            x = torch.randn(n, width, generator=gen) * torch.rand(1, generator=gen) * 3 + torch.randn(1, generator=gen)
            x[: n // 4] = x[n // 4 : n // 2]  # duplicates
            for k in (2, 16, 256):
                want = _seeding_in_torch(x, k, torch.Generator().manual_seed(k + width))
                got = _kmeans_pp(x, k, torch.Generator().manual_seed(k + width))
                assert torch.equal(got, want), (width, n, k)
