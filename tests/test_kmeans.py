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
