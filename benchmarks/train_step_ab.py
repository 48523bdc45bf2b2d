"""NWS training step of this checkout against an earlier commit, interleaved in one process.

    python benchmarks/train_step_ab.py --baseline 0b77e96 [--rounds 80] [--model resnet18 | torchvision:resnet18]
    python benchmarks/train_step_ab.py --baseline 0b77e96 --pools      # pool learning's step

Single runs of ``train_step.py`` drift by more than most optimisations gain,
so a change to the step is measured here: the dense model, the NWS model built
with the ``nwsconvert`` of ``--baseline`` (extracted with ``git archive`` into a
temporary folder and imported under another name) and the NWS model of this
checkout take turns, in alternating order, for ``--rounds`` rounds after
warm-up. Same step and data as ``train_step.py`` (fused commitment, SGD momentum 0.9; ``--data``:
real split-mnist digits, a new batch each round that every variant takes, or one random batch).
Prints each median and the median of the per-round current / baseline ratios.

``--pools``: pool learning's step instead (``set_mode(model, "pool")``: the pools are parameters, the loss
adds ``beta * distillation_loss`` with ``nws-train``'s default ``beta=0.5``), against the dense model's
plain step, which is what dense pretraining takes.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import batches, make_model, step  # noqa: E402  (the same step and data as the main benchmark)

ROOT = Path(__file__).resolve().parent.parent


def load_baseline(ref: str, into: Path):
    """Import ``nwsconvert`` as it was at git ``ref``, under the name ``nwsconvert_baseline``."""
    got = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "nwsconvert"], capture_output=True)
    if got.returncode:
        sys.exit(f"--baseline {ref}: git archive failed: {got.stderr.decode().strip()}")
    archive = got.stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "nwsconvert").rename(into / "nwsconvert_baseline")
    sys.path.insert(0, str(into))
    return importlib.import_module("nwsconvert_baseline")


def build(args, lib):
    model = make_model(args)  # as train_step.py builds it (torchvision:NAME: a user's own loop)
    if lib is not None:
        lib.convert(model, pool_size=args.pool_size, init="kmeans")
        lib.set_commitment(model, 1.0)
        if args.pools:
            lib.set_mode(model, "pool")  # before the optimiser: the pools become its parameters
    model.train()
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5), lib


def pool_step(model, opt, x, y, lib):
    """Pool learning's step (``nws-train``'s, in float32): cross-entropy + 0.5 x distillation; the dense
    model (``lib`` None) takes the plain step."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    if lib is not None:
        loss = loss + 0.5 * lib.distillation_loss(model)
    loss.backward()
    opt.step()


def take(args, model, opt, x, y, lib):
    if args.pools:
        pool_step(model, opt, x, y, lib)
    else:
        step(model, opt, x, y, lib is not None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="git commit (or any ref) to compare against")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--pool-size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--data", choices=["split-mnist", "random"], default="split-mnist", help="as train_step.py's")
    ap.add_argument("--warmup", type=int, default=3, help="steps of each variant before timing (as train_step.py's)")
    ap.add_argument("--pools", action="store_true", help="time pool learning's step (see above)")
    args = ap.parse_args()
    args.device = "cpu"
    torch.set_num_threads(args.threads)
    import nwsconvert

    with tempfile.TemporaryDirectory() as tmp:
        baseline = load_baseline(args.baseline, Path(tmp))
        variants = {"dense": build(args, None), "baseline": build(args, baseline), "current": build(args, nwsconvert)}
        data = batches(args)
        for _ in range(args.warmup):
            x, y = next(data)
            for model, opt, lib in variants.values():
                take(args, model, opt, x, y, lib)
        times = {name: [] for name in variants}
        for r in range(args.rounds):
            x, y = next(data)
            order = list(variants.items()) if r % 2 else list(variants.items())[::-1]
            for name, (model, opt, lib) in order:
                t0 = time.perf_counter()
                take(args, model, opt, x, y, lib)
                times[name].append(time.perf_counter() - t0)
    dense = statistics.median(times["dense"])
    print(
        f"{args.model}, input {args.size}x{args.size}, batch {args.batch}, {args.threads} threads, "
        f"data {args.data}, baseline {args.baseline}, median of {args.rounds} rounds"
        + (", pool learning's step" if args.pools else "")
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:9s} {med * 1e3:8.1f} ms   {med / dense:.3f}x dense")
    paired = statistics.median(c / b for c, b in zip(times["current"], times["baseline"]))
    print(f"current / baseline, median of per-round ratios: {paired:.3f}")


if __name__ == "__main__":
    main()
