"""The switch mode against the session mode on CPU, across CNN families (issue 65 item 4).

    python benchmarks/family_modes.py --json benchmarks/results/family_modes.json
    python benchmarks/family_modes.py --models convnext_atto densenet121 --size 48 --tasks 2 --rounds 30

For each timm model: a short run of ``--tasks`` tasks trained with the user's defaults (``convert(model)``;
:func:`deploy_modes.make_bundle`) and exported as ``nws-export --task all --onnx`` does, then
``Runtime(bundle, device="cpu", mode="switch")`` and ``mode="session"`` timed on task 0 at batch 1 and 8,
interleaved and compared round by round (median of the ratios: drift cancels). Each round runs the modes in a
shuffled order, each one untimed run and then ``BLOCK`` timed runs in a row (their median): onnxruntime's
intra-op threads spin for a while after a run, and a run of one session right after the other's would
compete with the other's spinning threads for the cores. Both modes' logits are compared too (largest difference over the largest logit). Public API
only: ``Runtime(...)``, ``.run(task, x)``, ``.info()``.

``--keep DIR`` keeps each bundle in ``DIR/<model>`` and reuses it on the next call: the layout is worked
out again by each call (in this process), so two versions of ``export/layout.py`` can be compared on the
same bundles.

Printed: one row per model (layout, the tensors left plain graph inputs, switch / session at batch 1
and 8); ``--json`` also holds the medians in ms, the quartiles of the ratios and ``info()``'s layout note.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deploy_modes, beside this file

FAMILIES = [
    "convnext_atto",
    "densenet121",
    "fastvit_t8",
    "mixnet_s",
    "repvgg_a0",
    "ghostnet_050",
    "hgnet_tiny",
    "resnet18",
    "mobilenetv2_100",
    "efficientnet_b0",
]
BATCHES = (1, 8)
BLOCK = 3  # timed runs of one mode in a row, after an untimed one (their median is the round's time)


def _input(bundle: Path, batch: int) -> np.ndarray:
    data = json.loads((bundle / "bundle.json").read_text())["data"]
    return np.random.default_rng(0).standard_normal((batch, data["channels"], *data["input_size"])).astype(np.float32)


def _plain_count(layout: str, note: str | None) -> str:
    """The tensors the switch graph left plain graph inputs, as its layout string says (``all``: the plain graph)."""
    if layout == "plain":
        return "all"
    m = re.search(r"\((\d+) tensors? plain\)", layout)
    return m.group(1) if m else "0"


def measure(bundle: Path, rounds: int, threads: int | None) -> dict:
    from nwsconvert.export import Runtime
    from nwsconvert.export.timing import summary

    tic = time.perf_counter()
    rts = {"switch": Runtime(bundle, device="cpu", mode="switch", threads=threads)}
    start = time.perf_counter() - tic
    rts["session"] = Runtime(bundle, device="cpu", mode="session", threads=threads)
    info = rts["switch"].info()
    out: dict = {
        "layout": info.get("layout"),
        "layout_note": info.get("layout_note"),
        "switch_start_seconds": start,
    }
    out["plain"] = _plain_count(out["layout"] or "", out["layout_note"])
    for batch in BATCHES:
        x = _input(bundle, batch)
        ref = rts["session"].run(0, x)
        got = rts["switch"].run(0, x)
        out[f"parity_b{batch}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
        for _ in range(3):  # warm both
            for rt in rts.values():
                rt.run(0, x)
        lat: dict[str, list[float]] = {m: [] for m in rts}
        order = list(rts)
        shuffle = np.random.default_rng(batch)
        for _ in range(rounds):
            shuffle.shuffle(order)
            for m in order:
                rts[m].run(0, x)  # untimed: the other session's threads may still be spinning
                block = []
                for _ in range(BLOCK):
                    tic = time.perf_counter()
                    rts[m].run(0, x)
                    block.append(time.perf_counter() - tic)
                lat[m].append(float(np.median(block)))
        ratio = np.array(lat["switch"]) / np.array(lat["session"])
        out[f"b{batch}"] = {
            "switch_ms": 1e3 * float(np.median(lat["switch"])),
            "session_ms": 1e3 * float(np.median(lat["session"])),
            "ratio": summary(list(ratio)),
        }
    return out


def _row(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:<18} ERROR {r['error'][:100]}"
    ratios = "  ".join(f"{r[f'b{b}']['ratio']['median']:>6.2f}" for b in BATCHES)
    return f"{name:<18} {r['layout']:<34} {r['plain']:>6}  {ratios}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=FAMILIES)
    p.add_argument("--size", type=int, default=64, help="input height and width (default 64)")
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20, help="rounds per batch size (default 20)")
    p.add_argument("--threads", type=int, default=None, help="CPU provider threads (default: onnxruntime's)")
    p.add_argument("--keep", type=Path, default=None, help="keep the bundles here and reuse them (DIR/<model>)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import onnxruntime as ort
    from deploy_modes import make_bundle  # benchmarks/ is on sys.path

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "export/layout.py"], capture_output=True, text=True)
    results = {
        "command": "python benchmarks/family_modes.py " + " ".join(sys.argv[1:]),
        "commit": commit + ("+layout.py edited" if dirty.stdout.strip() else ""),
        "onnxruntime": ort.__version__,
        "cpus": os.cpu_count(),
        "size": args.size,
        "tasks": args.tasks,
        "models": {},
    }
    print(f"{'model':<18} {'layout':<34} {'plain':>6}  {'b1':>6}  {'b8':>6}   (switch / session latency)")
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            out = (args.keep / name) if args.keep else Path(tmp)
            bundle = out / "run" / "export"
            tic = time.perf_counter()
            try:
                if not (bundle / "bundle.json").exists():
                    out.mkdir(parents=True, exist_ok=True)
                    make_bundle(name, args.tasks, args.size, out)
                built = time.perf_counter() - tic
                r = measure(bundle, args.rounds, args.threads)
                r["build_seconds"] = built
            except Exception as e:  # noqa: BLE001 (one model's failure: recorded, the others measured)
                r = {"error": f"{type(e).__name__}: {e}"}
        results["models"][name] = r
        print(_row(name, r), flush=True)
        if args.json:  # after each model: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
    for name, r in results["models"].items():
        if r.get("layout_note"):
            print(f"  {name}: {r['layout_note']}")


if __name__ == "__main__":
    main()
