"""A torch.profiler trace of NWS training steps on CUDA, to see where the engine's time goes.

    python benchmarks/gpu_profile.py --model resnet50 --size 224 --batch 32 --out /tmp/prof

Builds the model as ``benchmarks/train_step.py`` does (``convert`` with k-means pools of 512 entries,
fused commitment, ``--search engine``), takes 5 warm-up steps on real digits, then profiles ``--steps``
steps (CPU and CUDA activities). Writes ``<out>/profile_<model>_<size>.txt``: the operators sorted by
their CUDA time, per step, and the Triton kernels' share; ``<out>/trace_<model>_<size>.json.gz``: the
Chrome trace (open it in chrome://tracing or Perfetto); ``<out>/host_<model>_<size>.txt``: a cProfile of
20 more steps (the host's Python time, which paces an eager step when it exceeds the GPU's work). With
``--dense`` it profiles the dense model's step instead, for the side-by-side table.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step  # noqa: E402  (the same model, data and step as the step benchmark)


def _device_work(trace: Path) -> dict[str, tuple[float, int]]:
    """The GPU's own work in a Chrome trace: microseconds and count per kernel (name cut at 80 characters),
    copy and memset."""
    events = json.loads(trace.read_text())["traceEvents"]
    work: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            us, n = work.get(e["name"][:80], (0.0, 0))
            work[e["name"][:80]] = (us + e["dur"], n + 1)
    return work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dense", action="store_true", help="profile the dense model's step instead")
    ap.add_argument("--out", default="/tmp/gpu_profile")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile.py: no CUDA device")
    args = argparse.Namespace(
        model=a.model,
        model_kwargs="{}",
        size=a.size,
        batch=a.batch,
        device="cuda",
        pool_size=512,
        search="engine",
        unfused=False,
        data="split-mnist",
    )
    nws = not a.dense
    model, opt = train_step.build(args, nws)
    data = train_step.batches(args)
    for _ in range(5):
        train_step.step(model, opt, *next(data), nws)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            train_step.step(model, opt, *next(data), nws)
        torch.cuda.synchronize()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.model}_{a.size}{'_dense' if a.dense else ''}"
    events = prof.key_averages()
    raw = out / f"trace_{tag}.json"
    prof.export_chrome_trace(str(raw))
    kernels = _device_work(raw)
    total_us = sum(us for us, _ in kernels.values())
    lines = [
        f"{a.model} {a.size}x{a.size} batch {a.batch}, {'dense' if a.dense else 'NWS (engine)'}, {a.steps} steps, "
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        # kernels, copies and memsets from the trace: the operators' own CUDA totals would count each kernel twice
        f"GPU time per step: {total_us / a.steps / 1000:.2f} ms ({sum(n for _, n in kernels.values()) / a.steps:.0f} "
        "kernels, copies and memsets)",
        "",
        "per step: us, launches, kernel",
        *(
            f"{us / a.steps:9.1f} {n / a.steps:6.1f}  {name}"
            for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
        ),
        "",
        events.table(sort_by="self_device_time_total", row_limit=40),
    ]
    (out / f"profile_{tag}.txt").write_text("\n".join(lines))
    # The host's side: where a step's Python time goes (an eager step on a GPU is paced by it when it exceeds
    # the GPU's work), cProfile over 20 more steps, by own time and by cumulative time.
    host = cProfile.Profile()
    host.enable()
    for _ in range(20):
        train_step.step(model, opt, *next(data), nws)
    torch.cuda.synchronize()
    host.disable()
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumtime").print_stats(30)
    (out / f"host_{tag}.txt").write_text(f"cProfile of 20 steps ({lines[0]})\n" + text.getvalue())
    with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    print("\n".join(lines[:2]))


if __name__ == "__main__":
    main()
