"""``nws-export`` (deployment bundle of a run) and ``nws-infer`` (onnxruntime top-k, --bench)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["export_main", "infer_main"]


def _task_arg(text: str):
    if text == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--task must be a task id or 'all', got {text!r}") from None


def export_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="nws-export",
        description="Write a deployment bundle of a run: the shared pool file (once), the task's index pack and, "
        "with --onnx, task_<t>.onnx whose weights are rebuilt by Gather from the pool file at load time.",
    )
    p.add_argument("run_dir", nargs="?", default=None, metavar="RUN", help="run directory (as nws-info RUN; or --run)")
    p.add_argument("--task", type=_task_arg, required=True, help="task id, or 'all'")
    p.add_argument("--run", default=None, help="run directory (default: the current directory)")
    p.add_argument("--out", default=None, help="bundle folder (default: RUN/export)")
    p.add_argument("--onnx", action="store_true", help="also write the ONNX graph of each task (opset 17)")
    args = p.parse_args(argv)
    if args.run_dir is not None and args.run is not None and args.run_dir != args.run:
        p.error(f"two run directories given: {args.run_dir} and --run {args.run}")
    args.run = args.run_dir or args.run or "."
    from nwsconvert.report import format_bytes
    from nwsconvert.storage import FormatError

    from .bundle import StaleBundleError, export_bundle

    try:
        desc = export_bundle(args.run, args.out, args.task, onnx=args.onnx)
    except (FileNotFoundError, KeyError, FormatError, StaleBundleError) as e:
        print(f"nws-export: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.run) / "export"
    print(f"bundle {out}: pool file {format_bytes(desc['pool_bytes'])} (shared)")
    bases = {row["base"]: row["base_bytes"] for row in desc["tasks"].values() if "base" in row}
    for name, size in sorted(bases.items()):
        print(f"  {name} {format_bytes(size)} (shared: the packs store their indices as changes against it; the .onnx graphs do not need it)")
    for t, row in sorted(desc["tasks"].items(), key=lambda kv: int(kv[0])):
        extra = f", {row['onnx']} {format_bytes(row['onnx_bytes'])} ({row['gather_nodes']} Gather weights, {row['index_dtype']} indices)" if "onnx" in row else ""
        print(f"  task {t} ({row['name']}): {row['pack']} {format_bytes(row['pack_bytes'])}{extra}")
    return 0


def _load_images(paths: list[str], runtime, task: int):
    import numpy as np
    import onnx
    from PIL import Image

    meta = {p.key: p.value for p in onnx.load(str(runtime.path / runtime._row(task)["onnx"]), load_external_data=False).metadata_props}
    c, h, w = json.loads(meta["nwsconvert.input_size"])
    mean = np.array(json.loads(meta["nwsconvert.mean"]) or [0.0] * c, dtype=np.float32)[:, None, None]
    std = np.array(json.loads(meta["nwsconvert.std"]) or [1.0] * c, dtype=np.float32)[:, None, None]
    out = []
    for path in paths:
        img = Image.open(path).convert("L" if c == 1 else "RGB").resize((w, h))
        arr = np.asarray(img, dtype=np.float32) / 255.0
        arr = arr[None] if c == 1 else arr.transpose(2, 0, 1)
        out.append((arr - mean) / std)
    return np.stack(out)


def infer_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nws-infer", description="Classify images with a bundle's task on onnxruntime (CUDA when present).")
    p.add_argument("--bundle", required=True, help="bundle folder written by nws-export --onnx")
    p.add_argument("--task", type=int, required=True)
    p.add_argument("images", nargs="*", help="image files (resized and normalised as the bundle's metadata says)")
    p.add_argument("-k", type=int, default=3, help="top-k classes to print")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--bench", action="store_true", help="print latency and the task-switch time")
    args = p.parse_args(argv)
    import numpy as np

    from .runtime import Runtime

    try:
        rt = Runtime(args.bundle, device=args.device)
        rt.session(args.task)
    except (FileNotFoundError, KeyError) as e:
        print(f"nws-infer: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(f"providers: {rt.session(args.task).get_providers()}")
    if args.images:
        for path, top in zip(args.images, rt.predict(args.task, _load_images(args.images, rt, args.task), k=args.k)):
            print(f"{path}: " + ", ".join(f"{name} {prob:.3f}" for name, prob in top))
    if args.bench:
        shape = rt.session(args.task).get_inputs()[0].shape
        meta_shape = [d if isinstance(d, int) else 1 for d in shape]
        x = np.random.default_rng(0).standard_normal(meta_shape).astype(np.float32)
        rt.run(args.task, x)
        times = []
        for _ in range(50):
            tic = time.perf_counter()
            rt.run(args.task, x)
            times.append(time.perf_counter() - tic)
        switches = []
        for t in rt.tasks:
            rt._sessions.pop(t, None)
            rt.session(t)
            switches.append(rt.last_switch_seconds)
        print(f"latency (batch 1): median {1e3 * float(np.median(times)):.2f} ms over 50 runs")
        print(f"task switch (session creation, pools shared): median {1e3 * float(np.median(switches)):.1f} ms over {len(switches)} tasks")
    return 0
