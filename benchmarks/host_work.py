"""Host work of a training step: what an NWS step adds on the host to the dense step.

    python benchmarks/host_work.py [--models resnet18 resnet50 ...] [--batch 32] [--size 224]

On a GPU a step's kernels run asynchronously; what the host spends issuing them (Python, the
dispatcher, the launches) sets the pace when it exceeds the GPU's time. Measured here without a GPU,
with the models and the engine's state on PyTorch's ``meta`` device (every op runs its Python and
dispatcher path, nothing is computed):

* launches: the aten ops of one step that launch a kernel (views and bare allocations left out),
  dense and NWS, plus the engine's Triton launches;
* of those, what ``engine_graph=true`` (``SearchEngine(graph=True)``) replays from a CUDA graph: the ops
  and Triton launches of the update's no-grad part (every group's ``refresh``), with its Python time;
* memory: the engine's state, and what one update and one backward allocate (every non-view op's
  output, however briefly it lives; the backward's beside dense's);
* Python time of the NWS path: the self time (cProfile) of every ``nwsconvert`` function and of the
  autograd Function the engine's straight-through gradient runs, over one NWS step; the dense step
  runs no such code. cProfile adds its own overhead per call, so this is an upper bound.

The step's wall time on meta is not reported: many meta kernels are Python reference
implementations, so meta dispatch costs far more than CUDA's.

Dense: the timm model, SGD with momentum, forward + cross-entropy + backward + step. NWS: the same
model converted (random pools of ``--pool-size``: pool values do not change the host path; a user's
default is k-means), commitment fused, the model-level :class:`~nwsconvert.core.engine.SearchEngine`
with its Triton kernels, whose launches are counted and skipped (they cannot run on meta tensors).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics

os.environ.setdefault("TRITON_INTERPRET", "1")  # the engine's Triton path without a GPU (kernels stubbed below)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: aten ops that launch no kernel
NO_LAUNCH = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "set_", "detach", "lift_fresh"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in NO_LAUNCH:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Alloc(TorchDispatchMode):
    """Bytes of every tensor the ops allocate (outputs of non-view ops): what an update asks the allocator
    for, an upper bound of its transient peak."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def _state_bytes(engine) -> int:
    """Bytes of the engine's own tensors (each counted once)."""
    seen: dict[int, int] = {}
    for g in engine.groups:
        for value in vars(g).values():
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor) and not t._is_view():
                    seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


class _Stub:
    """A Triton kernel that counts its launches and runs nothing."""

    def __init__(self, counter: list):
        self.counter = counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter[0] += 1

        return launch


def _to_meta(engine) -> None:
    """Move the engine's state (built on CPU, where the scalar pools' intervals are computed) to meta."""
    for g in engine.groups:
        for name, value in list(vars(g).items()):
            if isinstance(value, torch.Tensor):
                setattr(g, name, value.to("meta"))
            elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
                setattr(g, name, tuple(v.to("meta") for v in value))
        g.index_pieces = list(g.index.split([count for _, count in g.rows]))
        g.native = g.seen


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def measure(name: str, args) -> dict:
    import timm

    import nwsconvert
    from nwsconvert.core import triton_kernels
    from nwsconvert.core.engine import SearchEngine

    launches = [0]
    kernels = [name for name in triton_kernels.__all__ if name.startswith("engine_")]
    for kernel in (*kernels, "nearest_two_kernel"):
        setattr(triton_kernels, kernel, _Stub(launches))
    torch.manual_seed(0)
    dense = timm.create_model(name, num_classes=10)
    nws = nwsconvert.convert(timm.create_model(name, num_classes=10), pool_size=args.pool_size, init="random")
    nwsconvert.set_commitment(nws, 1.0)
    engine = SearchEngine(nws, kernel="triton")
    weight_bytes = sum(layer.weight.numel() * 4 for layer in nwsconvert.nws_layers(nws))
    _to_meta(engine)
    models = {"dense": dense.to("meta").train(), "nws": nws.to("meta").train()}
    for g in engine.groups:  # the pools' storage moved to meta: not a pool edit
        g._cut_stamp = g._stamp_pools()
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
    x = torch.empty(args.batch, 3, args.size, args.size, device="meta")
    y = torch.zeros(args.batch, dtype=torch.int64, device="meta")
    for _ in range(3):
        for k in models:
            _step(models[k], opts[k], x, y)
    ops = {}
    for k in models:
        with _Ops() as count:
            launches[0] = 0
            _step(models[k], opts[k], x, y)
        ops[k] = count.count
    triton = launches[0]
    with _Ops() as count:
        launches[0] = 0
        for g in engine.groups:
            g.refresh(False)
    graphed = {"ops": count.count, "triton": launches[0], "python_ms": []}
    for _ in range(args.rounds):
        prof = cProfile.Profile()
        prof.enable()
        for g in engine.groups:
            g.refresh(False)
        prof.disable()
        graphed["python_ms"].append(sum(v[2] for (f, _, _), v in pstats.Stats(prof).stats.items() if "nwsconvert" in f))
    graphed["python_ms"] = min(graphed["python_ms"]) * 1e3
    with torch.no_grad(), _Alloc() as alloc:
        engine.update()
    state = _state_bytes(engine)
    backward = {}  # bytes the backward allocates (the forward's activations are not counted)
    for k in models:
        opts[k].zero_grad(set_to_none=True)
        loss = F.cross_entropy(models[k](x), y)
        with _Alloc() as grads:
            loss.backward()
        backward[k] = grads.bytes / 2**20
    runs = []
    for _ in range(args.rounds):
        prof = cProfile.Profile()
        prof.enable()
        _step(models["nws"], opts["nws"], x, y)
        prof.disable()
        runs.append(pstats.Stats(prof).stats)
    engine._hook = None  # nothing to hand back from meta tensors

    def ours(path: str, fn: str) -> bool:
        return "nwsconvert" in path or fn in ("apply", "_GroupSTE")  # our code and the engine's autograd Function

    per_run = [sum(v[2] for (f, _, fn), v in st.items() if ours(f, fn)) for st in runs]
    best = runs[per_run.index(min(per_run))]
    top = sorted(((v[2], f"{os.path.basename(f)}:{fn}") for (f, _, fn), v in best.items() if ours(f, fn)), reverse=True)
    return {
        "model": name,
        "layers": sum(len(g.layers) for g in engine.groups),
        "groups": len(engine.groups),
        "dense_ops": ops["dense"],
        "nws_ops": ops["nws"],
        "triton_launches": triton,
        "extra_launches": ops["nws"] + triton - ops["dense"],
        "graphed_update": graphed,
        "weight_mb": weight_bytes / 2**20,
        "engine_state_mb": state / 2**20,
        "update_alloc_mb": alloc.bytes / 2**20,
        "backward_alloc_mb": backward,
        "python_ms": min(per_run) * 1e3,
        "python_ms_median": statistics.median(per_run) * 1e3,
        "top_python_ms": [(fn, t * 1e3) for t, fn in top[:6]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "mobilenetv2_100", "efficientnet_b0"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=5, help="profiled NWS steps (the least Python time is kept)")
    ap.add_argument("--pool-size", type=int, default=512)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    rows = [measure(name, args) for name in args.models]
    print(f"host work per training step (meta device), torch {torch.__version__}, batch {args.batch}, {args.size}^2")
    print(f"{'model':18} {'layers':>6} {'launches dense -> NWS':>30} {'extra':>6} {'NWS Python ms (min / median)':>30}")
    for r in rows:
        launches = f"{r['dense_ops']} -> {r['nws_ops'] + r['triton_launches']} ({r['triton_launches']} Triton)"
        print(
            f"{r['model']:18} {r['layers']:6d} {launches:>30} {r['extra_launches']:6d} "
            f"{r['python_ms']:19.2f} / {r['python_ms_median']:.2f}"
        )
        print("    most Python time: " + ", ".join(f"{fn} {t:.2f} ms" for fn, t in r["top_python_ms"]))
        gu = r["graphed_update"]
        print(
            f"    the update's no-grad part (one replay with engine_graph=true): {gu['ops']} ops + {gu['triton']} "
            f"Triton launches, {gu['python_ms']:.2f} ms of nwsconvert Python"
        )
        print(
            f"    NWS weights {r['weight_mb']:.1f} MB; engine state {r['engine_state_mb']:.1f} MB "
            f"({r['engine_state_mb'] / r['weight_mb']:.2f}x); one update allocates {r['update_alloc_mb']:.1f} MB "
            f"({r['update_alloc_mb'] / r['weight_mb']:.2f}x); the backward {r['backward_alloc_mb']['nws']:.1f} MB "
            f"against dense's {r['backward_alloc_mb']['dense']:.1f} MB"
        )
    if args.json:
        from nwsconvert.formats.atomic import atomic_write_bytes

        atomic_write_bytes(
            args.json, json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows}, indent=2).encode()
        )


if __name__ == "__main__":
    main()
