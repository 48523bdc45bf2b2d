"""What a switch-mode run costs beyond its graph, beside the dense model, in one process.

    python benchmarks/probes/probe_run_overhead.py BUNDLE DENSE.onnx [--rounds 2000] [--batch 1]

Times, interleaved round by round in a shuffled order (so no mode always runs after another, and drift
cancels in the per-round ratios): the dense model through ``InferenceSession.run`` and ``Runtime.run`` in the
switch and the session mode. Then, in a second phase, the switch mode beside its own session run bare
(``run_with_iobinding`` on its bound buffers: no images bound, no logits read, the graph alone); the
difference is the switch mode's per-run work: the frame check, the slot lock, binding the images, reading
the logits. (Beside the dense model the bare run would leave the switch mode a warm session: hence two
phases.) ``DENSE.onnx``: task 0's model with plain layers (``benchmarks/deploy_modes.py`` writes one,
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
    print(f"{args.bundle}, batch {args.batch}, {args.rounds} rounds a phase, onnxruntime {ort.__version__}")
    # Two phases: a mode run right after another on the same session finds it warm, so the bare graph is timed
    # beside the switch mode only, not beside the dense model.
    t = _interleaved(modes, ["dense", "switch", "session"], args.rounds)
    for m, v in t.items():
        r = v / t["dense"]
        print(
            f"  {m:18s} {1e6 * np.median(v):8.1f} us   x{np.median(r):.3f} dense "
            f"[{np.quantile(r, 0.25):.3f}, {np.quantile(r, 0.75):.3f}]"
        )
    t = _interleaved(modes, ["switch", "switch graph alone"], args.rounds)
    extra = np.median(t["switch"] - t["switch graph alone"])
    print(
        f"  switch graph alone {1e6 * np.median(t['switch graph alone']):8.1f} us; the switch mode's work beyond "
        f"its graph: {1e6 * extra:.1f} us a run (median of the per-round differences)"
    )


def _interleaved(modes: dict, names: list[str], rounds: int) -> dict[str, np.ndarray]:
    """Seconds of each of ``names`` per round, the order shuffled every round (20 warm-up runs each)."""
    for m in names:
        for _ in range(20):
            modes[m]()
    times: dict[str, list[float]] = {m: [] for m in names}
    order, rng = list(names), np.random.default_rng(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for m in order:
            tic = time.perf_counter()
            modes[m]()
            times[m].append(time.perf_counter() - tic)
    return {m: np.array(v) for m, v in times.items()}


if __name__ == "__main__":
    main()
