"""Exactness fuzzing of the searches: every fast path against ``brute_force``, every weight dtype and magnitude.

    python benchmarks/harnesses/search_fuzz.py --seconds 300 --seed 0 --out benchmarks/results/search_fuzz.json
    python benchmarks/harnesses/search_fuzz.py --cases 200 --seed 3 --max-exponent 300   # float64 extremes
    TRITON_INTERPRET=1 python benchmarks/harnesses/search_fuzz.py --seconds 600 --kinds engine   # the engine

What it checks
--------------
``nwsconvert.core.search.brute_force`` is the definition of the nearest pool entry (float64 distances of
each row and entry alone, the lowest index on ties). Four kinds of case, taken in turn (``--kinds``; by default
the first two):

* **one-shot** (``search``): random vectors against a random pool, ``nearest_two`` (with and without
  ``pair``, chunks of 2048 and 97 rows), and for D = 1 ``nearest_scalar`` and ``nearest_scalar_from`` (from
  the right entry or a random one), each compared with ``brute_force``; with ``pair``, ``third`` must be at
  most every other entry's distance.
* **lazy** (``lazy``): an ``NWSWeight`` through 4-12 training-mode updates, each after one to three random
  edits of the weights or the pool (noise, rows moved onto bisectors and 0-3 ulps off them, jumps, pool moves
  down to 1e-12 of its scale, duplicated entries); after every update its indices must equal brute force.
* **engine** (``--kinds engine``, slower; on CUDA a third copy with ``SearchEngine(graph=True)``, its update
  replayed from a CUDA graph): a small model under ``SearchEngine``: a 7x7, 3x3 or 1x1 stem of
  1-72 rows, then 3x3, depthwise 3x3, 1x1 and linear layers, with pools of 2, 5, 64 or 200 entries (over
  the GPU kernels' pool tile of 64) of any kind below. Its torch kernel runs, and its Triton kernels on a
  copy: under ``TRITON_INTERPRET=1``, or on CUDA where there is a GPU. In task or pool mode, 3-8
  training-mode updates follow the same edits of every layer's weights and pool (as the lazy cases; float16,
  bfloat16 or float32, the dtypes the engine takes). After every update every layer's indices must equal
  brute force.
* **fused** (``--kinds fused``): a one-shot case's rows (at most 4096) through ``fused_nearest_two``, the
  Triton search the layers take on CUDA, where it runs (as for engine cases): the index must be brute
  force's and the radius at most half the gap between the two nearest entries.

Weights and pools are float16, bfloat16, float32 or float64 (any pair); D in {1, 2, 9}; pools random, with
duplicates, symmetric pairs (+-c), tiny entries beside large ones, on a grid or clustered; scales 10^[-E, E]
(float16 10^[-3, 3]). Cases with a non-finite value are skipped. Case ``i`` depends only on
``(--seed, i)``: ``--replay i`` repeats it and prints it. Exit status 1 on any wrong index or exception.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
import traceback
import warnings
from collections import Counter

import torch
from torch import nn

from nwsconvert.core.layers import NWSWeight
from nwsconvert.core.search import _exact_sq_dist, brute_force, nearest_scalar, nearest_scalar_from, nearest_two

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _pool(rng: random.Random, g: torch.Generator, n: int, dim: int, scale: float) -> tuple[torch.Tensor, str]:
    kind = rng.choice(["randn", "dup", "sym", "tiny_big", "grid", "clustered"])
    p = torch.randn(n, dim, generator=g, dtype=torch.float64) * scale
    if kind == "dup" and n > 1:
        k = rng.randint(1, n - 1)
        p[torch.randperm(n, generator=g)[:k]] = p[torch.randint(0, n, (k,), generator=g)]
    elif kind == "sym" and n > 1:
        p[n // 2 : 2 * (n // 2)] = -p[: n // 2]
    elif kind == "tiny_big":
        p[torch.rand(n, generator=g) < 0.3] *= 10.0 ** rng.uniform(-12, -4)
    elif kind == "grid":
        p = torch.randint(-8, 9, (n, dim), generator=g).double() / 8 * scale
    elif kind == "clustered":
        p = p[:1] + torch.randn(n, dim, generator=g, dtype=torch.float64) * scale * 10.0 ** rng.uniform(-9, -2)
    return p, kind


def _near_bisectors(g: torch.Generator, pool: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows on the bisector of two random entries, rounded to ``dtype``, then 0-3 ulps off it per element."""
    i, j = (torch.randint(0, pool.shape[0], (rows,), generator=g) for _ in range(2))
    x = ((pool[i] + pool[j]) / 2).to(dtype)
    for _ in range(int(torch.randint(0, 4, (1,), generator=g))):
        toward = torch.where(torch.rand(x.shape, generator=g) < 0.5, float("inf"), float("-inf")).to(dtype)
        x = torch.where(torch.rand(x.shape, generator=g) < 0.5, torch.nextafter(x, toward), x)
    return x


def _scale(rng: random.Random, dtypes: tuple, exponent: float) -> float:
    limit = 3.0 if torch.float16 in dtypes else exponent
    return 10.0 ** rng.uniform(-limit, limit)


def _one_shot(rng: random.Random, g: torch.Generator, exponent: float):
    """A one-shot case's rows and pool: ``(x, pool, n, rows, dim)``."""
    vd, pd = rng.choice(DTYPES), rng.choice(DTYPES)
    scale = _scale(rng, (vd, pd), exponent)
    dim, n = rng.choice([1, 2, 9]), rng.choice([1, 2, 3, 5, 17, 64, 200, 600])
    rows = rng.choice([1, 7, 100, 1024, 1025, 1500] if dim > 1 else [1, 7, 100, 2000, 20000])
    rows = max(1, min(rows, int(6e6 / (n * dim))))
    pool64, _ = _pool(rng, g, n, dim, scale)
    pool = pool64.to(pd)
    kind = rng.choice(["randn", "bisect", "copies", "far"])
    if kind == "bisect" and n > 1:
        x = _near_bisectors(g, pool.double(), rows, vd)
    elif kind == "copies":
        x = pool[torch.randint(0, n, (rows,), generator=g)].to(vd)
    else:
        x = (torch.randn(rows, dim, generator=g, dtype=torch.float64) * scale * (1e3 if kind == "far" else 1)).to(vd)
    return x, pool, n, rows, dim


def search_case(rng: random.Random, g: torch.Generator, exponent: float, counts: Counter) -> list[str]:
    """One one-shot case; returns what failed."""
    x, pool, n, rows, dim = _one_shot(rng, g, exponent)
    if not (torch.isfinite(x).all() and torch.isfinite(pool).all()):
        counts["skipped (not finite)"] += 1
        return []
    expect = brute_force(x, pool)
    pair, chunk = rng.random() < 0.5, rng.choice([2048, 97])
    res = nearest_two(x, pool, chunk=chunk, pair=pair)
    counts["nearest_two"] += 1
    failed = []
    if not torch.equal(res.index, expect):
        failed.append(f"nearest_two (pair={pair}, chunk={chunk}): {int((res.index != expect).sum())} rows")
    elif pair and res.third is not None and n >= 3:
        dist = torch.from_numpy(_exact_sq_dist(x, pool)).sqrt()
        dist.scatter_(1, res.index[:, None], float("inf")).scatter_(1, res.second[:, None], float("inf"))
        floor = dist.min(dim=1).values
        if not bool((res.third <= floor * (1 + 1e-12)).all()):
            failed.append("third above another entry's distance")
        counts["pair"] += 1
    if dim == 1:
        got = nearest_scalar(x.reshape(-1), pool.reshape(-1))
        counts["nearest_scalar"] += 1
        if not torch.equal(got, expect):
            failed.append(f"nearest_scalar: {int((got != expect).sum())} rows")
        start = torch.where(torch.rand(rows, generator=g) < 0.7, expect, torch.randint(0, n, (rows,), generator=g))
        got = nearest_scalar_from(x.reshape(-1), start, pool.reshape(-1))
        counts["nearest_scalar_from"] += 1
        if not torch.equal(got, expect):
            failed.append(f"nearest_scalar_from: {int((got != expect).sum())} rows")
    return failed


def _edit(
    rng: random.Random, g: torch.Generator, w: torch.Tensor, pool: torch.Tensor, edits: list[str], scale: float,
    bisect: list[int], jump: list[int],
) -> None:  # fmt: skip
    """The edits of ``w`` ``(rows, D)`` and ``pool`` ``(n, D)``, in place: noise, rows set onto bisectors (``k``
    of them, drawn from ``bisect``) or jumped (from ``jump``), the pool moved tiny or small amounts, an entry
    duplicated; drawn on the CPU, written on their device."""
    rows, n = w.shape[0], pool.shape[0]
    put = {"device": w.device, "dtype": w.dtype}
    for edit in edits:
        if edit == "noise":
            w.add_(
                (torch.randn(w.shape, generator=g, dtype=torch.float64) * scale * 10 ** rng.uniform(-6, -1)).to(**put)
            )
        elif edit == "bisect" and n > 1:
            k = min(rows, rng.choice(bisect))
            w[torch.randperm(rows, generator=g)[:k].to(w.device)] = _near_bisectors(
                g, pool.detach().double().cpu(), k, w.dtype
            ).to(w.device)
        elif edit == "jump":
            k = min(rows, rng.choice(jump))
            w[torch.randperm(rows, generator=g)[:k].to(w.device)] = (
                torch.randn(k, w.shape[1], generator=g, dtype=torch.float64) * scale
            ).to(**put)
        elif edit in ("pool_tiny", "pool_small"):
            rel = rng.choice([1e-12, 1e-9, 2.0**-30]) if edit == "pool_tiny" else 10 ** rng.uniform(-5, -1)
            step = torch.randn(pool.shape, generator=g, dtype=torch.float64) * scale * rel
            pool.add_(step.to(device=pool.device, dtype=pool.dtype))
        elif edit == "pool_dup" and n > 1:
            pool[rng.randrange(n)] = pool[rng.randrange(n)]


def lazy_case(rng: random.Random, g: torch.Generator, exponent: float, counts: Counter) -> list[str]:
    """One NWSWeight through several updates; returns what failed."""
    wd, pd = rng.choice(DTYPES), rng.choice(DTYPES)
    scale = _scale(rng, (wd, pd), exponent)
    dim, n, rows = rng.choice([1, 2, 9]), rng.choice([1, 2, 5, 64, 300]), rng.choice([50, 700, 1500, 3000])
    pool64, _ = _pool(rng, g, n, dim, scale)
    w = nn.Parameter((torch.randn(rows, dim, generator=g, dtype=torch.float64) * scale).to(wd))
    if not (torch.isfinite(w).all() and torch.isfinite(pool64.to(pd)).all()):
        counts["skipped (not finite)"] += 1
        return []
    nws = NWSWeight(w, dim, pool64.to(pd))
    for step in range(rng.randint(4, 12)):
        edits = rng.sample(
            ["noise", "bisect", "jump", "pool_tiny", "pool_small", "pool_dup", "none"], rng.randint(1, 3)
        )
        with torch.no_grad():
            _edit(rng, g, w, nws.pool, edits, scale, bisect=[5, 100, 400, rows // 2], jump=[10, 300, rows // 3])
        if not (torch.isfinite(w).all() and torch.isfinite(nws.pool).all()):
            counts["skipped (not finite)"] += 1
            return []
        nws(w)
        counts["lazy steps"] += 1
        counts["rows searched again"] += int(nws.stats["searched"])
        counts["rows settled by pairs"] += int(nws.stats.get("paired", 0))
        expect = brute_force(w.detach().reshape(-1, dim), nws.pool)
        if not torch.equal(nws.indices.long(), expect):
            return [f"lazy step {step} after {edits}: {int((nws.indices.long() != expect).sum())} rows"]
    return []


def _triton_device() -> str | None:
    """Where the Triton kernels run: the CPU under ``TRITON_INTERPRET=1``, else CUDA where there is a GPU."""
    from nwsconvert.core import fused_search

    if fused_search.available("cpu"):
        return "cpu"
    return "cuda" if torch.cuda.is_available() and fused_search.available("cuda") else None


def fused_case(rng: random.Random, g: torch.Generator, exponent: float, counts: Counter) -> list[str]:
    """A one-shot case through the Triton search (``fused_nearest_two``: the layers' search on CUDA): its index
    must be brute force's and its radius at most half the gap between the nearest and second-nearest entries
    (float64 distances of the float32 rows); float64 rows or pools, which it does not take, are skipped."""
    from nwsconvert.core import fused_search

    x, pool, n, rows, dim = _one_shot(rng, g, exponent)
    device = _triton_device()
    if device is None:
        raise SystemExit("--kinds fused: the Triton kernels need TRITON_INTERPRET=1 or a CUDA GPU")
    if torch.float64 in (x.dtype, pool.dtype):
        counts["skipped (float64)"] += 1
        return []
    if not (torch.isfinite(x).all() and torch.isfinite(pool).all()):
        counts["skipped (not finite)"] += 1
        return []
    x32, pool32 = x[:4096].float(), pool.float()  # (the interpreter is slow: at most 4096 rows)
    index, radius, exact = (t.cpu() for t in fused_search.fused_nearest_two(x32.to(device), pool32.to(device)))
    counts["fused_nearest_two"] += 1
    counts["rows resolved in float64"] += int(exact.sum())
    expect = brute_force(x32, pool32)
    if not torch.equal(index, expect):
        return [f"fused_nearest_two (D={dim}, n={n}): {int((index != expect).sum())} rows"]
    if n >= 2:
        dist = torch.from_numpy(_exact_sq_dist(x32, pool32)).sqrt()
        two = dist.topk(2, dim=1, largest=False).values
        if not bool((radius <= (two[:, 1] - two[:, 0]) * 0.5).all()):
            return [f"fused_nearest_two (D={dim}, n={n}): a radius beyond half the gap"]
    return []


#: The engine's vector sizes in the fuzzed model: a stem of k x k kernels (D = 49, 9 or 1), then 3x3, depthwise
#: 3x3 and 1x1 convolutions and a linear head.
_STEMS = (7, 3, 1)


def _engine_net(rng: random.Random, n: int, dtype: torch.dtype) -> nn.Module:
    import nwsconvert

    c1, c2 = rng.choice([1, 4, 72]), rng.choice([1, 3, 8])
    net = nn.Sequential(
        nn.Conv2d(1, c1, rng.choice(_STEMS), padding="same"),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.Conv2d(c2, c2, 3, padding=1, groups=c2),
        nn.Conv2d(c2, c2, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c2, 3),
    )
    return nwsconvert.convert(net, pool_size=n, init="random", seed=rng.randrange(1 << 30)).to(dtype)


def engine_case(rng: random.Random, g: torch.Generator, exponent: float, counts: Counter) -> list[str]:
    """A small model's layers under ``SearchEngine`` (the torch kernel; under ``TRITON_INTERPRET=1`` the Triton
    kernels too, on a copy) through several training-mode updates; returns what failed."""
    from nwsconvert.core.engine import SearchEngine
    from nwsconvert.core.nwsmodel import nws_layers, set_mode

    dtype = rng.choice(DTYPES[:3])  # the engine leaves float64 models to the layers' own search
    scale = _scale(rng, (dtype,), exponent)
    n = rng.choice([2, 5, 64, 200])  # (convert takes 2 entries or more; 200: over one GPU pool tile of 64)
    model = _engine_net(rng, n, dtype)
    set_mode(model, rng.choice(["task", "pool"]))  # frozen pools, or pools as parameters that move
    with torch.no_grad():
        for layer in nws_layers(model):
            nws, w = layer.nws, layer.module.parametrizations.weight.original
            nws.pool.copy_(_pool(rng, g, n, nws.vector_size, scale)[0].to(dtype))
            w.copy_((torch.randn(w.shape, generator=g, dtype=torch.float64) * scale).to(dtype))
    models = {"torch": model}
    if _triton_device() is not None:  # the CPU under the interpreter, or CUDA: the kernels as a GPU compiles them
        models["triton"] = copy.deepcopy(model).to(_triton_device())
        if _triton_device() == "cuda":  # and the update replayed from a CUDA graph where no pool moved
            models["triton-graph"] = copy.deepcopy(model).to(_triton_device())
    engines = {
        k: SearchEngine(m, kernel=k.removesuffix("-graph"), graph=k.endswith("-graph")) for k, m in models.items()
    }
    edits_of = [
        rng.sample(["noise", "bisect", "jump", "pool_tiny", "pool_small", "none"], rng.randint(1, 3))
        for _ in range(rng.randint(3, 8))
    ]
    try:
        for step, edits in enumerate(edits_of):
            state = rng.getstate(), g.get_state()
            for m in models.values():  # the same edits on every copy
                rng.setstate(state[0])
                g.set_state(state[1])
                with torch.no_grad():
                    for lay in nws_layers(m):
                        w = lay.module.parametrizations.weight.original.view(-1, lay.nws.vector_size)
                        rows = w.shape[0]
                        _edit(rng, g, w, lay.nws.pool, edits, scale, [1, 5, 100, rows // 2 + 1], [1, 10, rows // 3 + 1])
            after = rng.getstate(), g.get_state()
            for kernel, m in models.items():
                layers = nws_layers(m)
                if not all(
                    torch.isfinite(x).all()
                    for lay in layers
                    for x in (lay.module.parametrizations.weight.original, lay.nws.pool)
                ):
                    counts["skipped (not finite)"] += 1
                    return []
                with torch.no_grad():
                    m.train()(torch.zeros(1, 1, 8, 8, dtype=dtype, device=layers[0].nws.pool.device))
                counts[f"engine steps ({kernel})"] += 1
                for lay in layers:
                    w = lay.module.parametrizations.weight.original.detach().reshape(-1, lay.nws.vector_size)
                    expect = brute_force(w.cpu(), lay.nws.pool.detach().cpu())
                    got = lay.nws.indices.long().cpu()
                    if not torch.equal(got, expect):
                        return [f"engine ({kernel}) step {step} after {edits}, {lay.name} (D={lay.nws.vector_size}, "
                                f"{dtype}): {int((got != expect).sum())} rows"]  # fmt: skip
            rng.setstate(after[0])
            g.set_state(after[1])
    finally:
        for engine in engines.values():
            engine.close()
    return []


CASES = {"search": search_case, "lazy": lazy_case, "engine": engine_case, "fused": fused_case}


def run_case(
    seed: int, i: int, exponent: float, counts: Counter, kinds: tuple = ("search", "lazy")
) -> tuple[str, list[str]]:
    """Case ``i`` of ``seed``: of kind ``kinds[i % len(kinds)]``."""
    rng = random.Random(seed * 1_000_003 + i)
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    kind = kinds[i % len(kinds)]
    try:
        return kind, CASES[kind](rng, g, exponent, counts)
    except Exception:  # noqa: BLE001 (a crash is a finding)
        return kind, ["exception: " + traceback.format_exc(limit=3).strip().splitlines()[-1]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="run cases for this long (default 60)")
    ap.add_argument("--cases", type=int, default=0, help="run exactly this many cases instead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-exponent", type=float, default=30.0, help="scales 10^[-E, E] (default 30)")
    ap.add_argument("--replay", type=int, default=None, help="run case i only, and say what it did")
    ap.add_argument("--out", default=None, help="write the counts and failures here as JSON")
    ap.add_argument(
        "--kinds",
        default="search,lazy",
        help="case kinds in turn, from search, lazy, engine and fused (default search,lazy; the last two run the "
        "Triton kernels too: under TRITON_INTERPRET=1 or on a GPU)",
    )
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the cases are small: one thread is faster, and the figures do not depend on it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (float16 and float64 extremes overflow in the test data itself)
            return _run(args)
    finally:
        torch.set_num_threads(threads)


def _kinds(args: argparse.Namespace) -> tuple:
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in CASES]
    if unknown or not kinds:
        raise SystemExit(f"--kinds {args.kinds!r}: choose from {', '.join(CASES)}")
    return kinds


def _run(args: argparse.Namespace) -> int:
    counts: Counter = Counter()
    if args.replay is not None:
        kind, failed = run_case(args.seed, args.replay, args.max_exponent, counts, _kinds(args))
        print(kind, dict(counts), failed or "ok")
        return 1 if failed else 0
    failures, start, i = [], time.perf_counter(), 0
    while (i < args.cases) if args.cases else (time.perf_counter() - start < args.seconds):
        kind, failed = run_case(args.seed, i, args.max_exponent, counts, _kinds(args))
        counts[f"{kind} cases"] += 1
        failures += [{"case": i, "kind": kind, "what": f} for f in failed]
        i += 1
    report = {
        "seed": args.seed,
        "max_exponent": args.max_exponent,
        "kinds": list(_kinds(args)),
        "cases": i,
        "seconds": round(time.perf_counter() - start, 1),
        "counts": dict(counts),
        "failures": failures,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}))
    for f in failures[:20]:
        print(f"case {f['case']} ({f['kind']}): {f['what']}   (--replay {f['case']} --seed {args.seed})")
    print(f"{len(failures)} failures")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
