"""What a switch-mode run costs beyond its graph, beside the dense model, in one process.

    python benchmarks/probes/probe_run_overhead.py BUNDLE DENSE.onnx [--rounds 2000] [--batch 1]

Times, interleaved round by round in a shuffled order (so no mode always runs after another, and drift
cancels in the per-round ratios): the dense model through ``InferenceSession.run``; ``Runtime.run`` in the
switch and the session mode; and the switch mode's own session run bare (``run_with_iobinding`` on its
bound buffers, no input bound, no logits read). The bare run is the graph alone, so ``Runtime.run`` minus it
is the per-run work of the switch mode: the frame check, the slot lock, binding the images and reading
the logits. ``DENSE.onnx``: task 0's model with plain layers (``benchmarks/deploy_modes.py`` writes one,
``dense_onnx``). One intra-op thread, CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from nwsconvert.export import Runtime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("dense", type=Path)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    switch = Runtime(args.bundle, mode="switch", threads=1)
    session = Runtime(args.bundle, mode="session", threads=1)
    data = json.loads((args.bundle / "bundle.json").read_text())["data"]
    shape = (args.batch, data["channels"], *data["input_size"])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    dense = ort.InferenceSession(str(args.dense), opts, providers=["CPUExecutionProvider"])
    feed = {dense.get_inputs()[0].name: x}
    switch.run(0, x)  # task 0 written, its binding holds this batch's images and logits
    impl = switch._impl
    sess, binding = impl._session, impl._held[0].binding
    modes = {
        "dense": lambda: dense.run(None, feed),
        "switch": lambda: switch.run(0, x),
        "session": lambda: session.run(0, x),
        "switch graph alone": lambda: sess.run_with_iobinding(binding),
    }
    for f in modes.values():
        for _ in range(20):
            f()
    times: dict[str, list[float]] = {m: [] for m in modes}
    order, rng = list(modes), np.random.default_rng(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for m in order:
            tic = time.perf_counter()
            modes[m]()
            times[m].append(time.perf_counter() - tic)
    t = {m: np.array(v) for m, v in times.items()}
    print(f"{args.bundle}, batch {args.batch}, {args.rounds} rounds, onnxruntime {ort.__version__}")
    for m, v in t.items():
        r = v / t["dense"]
        print(
            f"  {m:18s} {1e6 * np.median(v):8.1f} us   x{np.median(r):.3f} dense "
            f"[{np.quantile(r, 0.25):.3f}, {np.quantile(r, 0.75):.3f}]"
        )
    extra = np.median(t["switch"] - t["switch graph alone"])
    print(f"  switch mode's work beyond its graph: {1e6 * extra:.1f} us a run (median of the per-round differences)")


if __name__ == "__main__":
    main()
