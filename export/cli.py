"""``nws-export`` (deployment bundle of a run) and ``nws-infer`` (onnxruntime top-k, --bench)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nwsconvert.cli.common import run_cli
from nwsconvert.errors import UsageError

__all__ = ["export_main", "infer_main"]


def _task_arg(text: str):
    if text == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--task must be a task id or 'all', got {text!r}") from None


def export_main(argv: list[str] | None = None) -> int:
    """``nws-export``: returns the exit code (0 done, 2 usage error, 1 failure)."""
    return run_cli("nws-export", _export, argv, resume_hint="export again")


def _export(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="nws-export",
        description="Write a deployment bundle of a run: the shared pool file (once), the task's index pack and, "
        "with --onnx, task_<t>.onnx whose weights are rebuilt by Gather from the pool file at load time.",
    )
    p.add_argument("run_dir", nargs="?", default=None, metavar="RUN", help="run directory (as nws-info RUN; or --run)")
    p.add_argument("--task", type=_task_arg, required=True, help="task id, or 'all'")
    p.add_argument("--run", default=None, help="run directory (default: the current directory)")
    p.add_argument("--out", default=None, help="bundle folder (default: RUN/export)")
    p.add_argument(
        "--onnx",
        action="store_true",
        help="also write the ONNX graph of each task and switch.onnx (one graph for every task)",
    )
    p.add_argument(
        "--exporter",
        choices=["auto", "torchscript", "dynamo"],
        default="auto",
        help="torch's ONNX exporter: auto (default) = TorchScript (opset 17), and the torch.export-based one (opset 18, "
        "needs onnxscript) for architectures TorchScript cannot lower",
    )
    p.add_argument(
        "--trust-code",
        action="store_true",
        help="let the run's package.module:factory model spec import and run its code (only --onnx builds the model; "
        "timm: and torchvision: specs need no trust)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args = p.parse_args(argv)
    if args.run_dir is not None and args.run is not None and args.run_dir != args.run:
        p.error(f"two run directories given: {args.run_dir} and --run {args.run}")
    args.run = args.run_dir or args.run or "."
    from nwsconvert.train.rundir import RunDir

    try:
        manifest = RunDir(args.run).read()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    done = manifest.finished
    if args.task != "all" and args.task not in done:
        raise UsageError(
            f"--task {args.task}: run {args.run} has no finished task {args.task}; finished tasks: {done or 'none'}"
        )
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a file, not a folder")
    from nwsconvert.conversion.report import format_bytes

    from .bundle import export_bundle

    desc = export_bundle(
        args.run, args.out, args.task, onnx=args.onnx, trust_code=args.trust_code, exporter=args.exporter
    )
    out = Path(args.out) if args.out else Path(args.run) / "export"
    print(f"bundle {out}: pool file {format_bytes(desc['pool_bytes'])} (shared)")
    bases = {row["base"]: row["base_bytes"] for row in desc["tasks"].values() if "base" in row}
    for name, size in sorted(bases.items()):
        print(
            f"  {name} {format_bytes(size)} (shared: the packs store their indices as changes against it; the switch mode reads it, the task graphs do not)"
        )
    for t, row in sorted(desc["tasks"].items(), key=lambda kv: int(kv[0])):
        extra = (
            f", {row['onnx']} {format_bytes(row['onnx_bytes'])} ({row['gather_nodes']} Gather weights, {row['index_dtype']} indices)"
            if "onnx" in row
            else ""
        )
        print(f"  task {t} ({row['name']}): {row['pack']} {format_bytes(row['pack_bytes'])}{extra}")
    return 0


def _load_images(paths: list[str], runtime, task: int):
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    meta = runtime.metadata(task)
    try:
        c, h, w = json.loads(meta["nwsconvert.input_size"])
        mean = np.array(json.loads(meta["nwsconvert.mean"]) or [0.0] * c, dtype=np.float32)[:, None, None]
        std = np.array(json.loads(meta["nwsconvert.std"]) or [1.0] * c, dtype=np.float32)[:, None, None]
    except (KeyError, ValueError, TypeError) as e:
        from nwsconvert.errors import FormatError

        graph = runtime.desc["switch"]["onnx"] if runtime.mode == "switch" else runtime._row(task)["onnx"]
        raise FormatError(
            f"{runtime.path / graph}: metadata without a valid input size and normalisation ({e})"
        ) from None
    out = []
    for path in paths:
        try:
            img = Image.open(path)
            img.load()
        except (UnidentifiedImageError, OSError) as e:
            raise UsageError(f"{path}: cannot read it as an image ({type(e).__name__}: {str(e)[:120]})") from None
        img = img.convert("L" if c == 1 else "RGB").resize((w, h))
        arr = np.asarray(img, dtype=np.float32) / 255.0
        arr = arr[None] if c == 1 else arr.transpose(2, 0, 1)
        out.append((arr - mean) / std)
    return np.stack(out)


def infer_main(argv: list[str] | None = None) -> int:
    """``nws-infer``: returns the exit code (0 done, 2 usage error, 1 failure)."""
    return run_cli("nws-infer", _infer, argv)


def _infer(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="nws-infer",
        description="Classify images with a bundle's task on onnxruntime (CUDA when present).",
        epilog="Image files are resized to the bundle's input size, scaled to [0, 1] and normalised with the mean "
        "and std of its metadata here. From Python, Runtime.run(task, images) takes (B, C, H, W) float32 images "
        "normalised so; integer pixels (uint8) and frames of another shape are refused in one line naming the "
        "shape and normalisation the bundle takes. One Runtime may be called from many threads.",
    )
    p.add_argument("--bundle", required=True, help="bundle folder written by nws-export --onnx")
    p.add_argument("--task", type=int, required=True, help="the task to run (a number nws-export wrote a graph for)")
    p.add_argument(
        "images", nargs="*", help="image files (resized, scaled to [0, 1] and normalised as the bundle's metadata says)"
    )
    p.add_argument("-k", type=int, default=3, help="top-k classes to print (default: 3)")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto (default): CUDA when present"
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="CUDA: let cuDNN/cuBLAS round float32 products to TF32 (faster on Ampere and later; logits move ~1e-3)",
    )
    p.add_argument(
        "--mode",
        default="auto",
        choices=["auto", "switch", "session"],
        help="switch (auto's choice when the bundle has switch.onnx): one session for every task, its weights "
        "buffers that a switch rewrites from the pools and the task's indices (dense speed, the memory of one "
        "model); session: one session per task graph (dense speed; each cached task holds its own weights, "
        "another costs a session creation)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="CUDA, switch mode (experimental): replay each batch size's run from onnxruntime's CUDA graph, one "
        "launch a run; a switch rewrites the weights the graph reads",
    )
    p.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "float16"],
        help="switch mode: float16 runs the graph and its weight buffers in half precision (half their memory; "
        "images in and logits out stay float32), meant for GPUs; with --bench measured against float32",
    )
    p.add_argument(
        "--bench",
        action="store_true",
        help="print latency, which mode (switch or session) runs faster on this machine for this bundle and by "
        "how much, and the task-switch cost",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args = p.parse_args(argv)
    if args.cuda_graph and (args.device == "cpu" or args.mode == "session"):
        flag = "--device cpu" if args.device == "cpu" else "--mode session"
        raise UsageError(f"--cuda-graph replays the switch mode's session on CUDA; {flag} has none")
    if args.precision != "float32" and args.mode == "session":
        raise UsageError(f"--precision {args.precision} runs the switch mode's session; --mode session runs float32")
    if args.k < 1:
        raise UsageError(f"-k {args.k}: give how many classes to print, at least 1")
    missing = [path for path in args.images if not Path(path).is_file()]
    if missing:
        what = "a folder, not an image file" if Path(missing[0]).is_dir() else "no such image file"
        raise UsageError(f"{missing[0]}: {what}")

    from nwsconvert.devices import check_device

    from .bundlefile import read_bundle
    from .runtime import Runtime

    why = check_device("cuda", flag="--device ") if args.device == "cuda" else None
    if why is not None:
        raise UsageError(why)
    try:
        desc = read_bundle(args.bundle)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    row = desc["tasks"].get(str(args.task))
    if row is None or "onnx" not in row:
        have = sorted(int(t) for t, r in desc["tasks"].items() if "onnx" in r)
        again = "export it again with nws-export RUN --task all --onnx"
        raise UsageError(
            f"--task {args.task}: bundle {args.bundle} has no ONNX graph for task {args.task}; tasks with graphs: {have}"
            if have
            else f"--task {args.task}: bundle {args.bundle} holds no ONNX graphs (exported without --onnx): {again}"
        )
    if args.precision != "float32" and "switch" not in desc:
        raise UsageError(
            f"--precision {args.precision} runs the switch mode: bundle {args.bundle} has no switch.onnx "
            "(export it again with nws-export RUN --task all --onnx)"
        )
    rt = Runtime(
        args.bundle,
        device=args.device,
        mode=args.mode,
        tf32=args.tf32,
        cuda_graph=args.cuda_graph,
        precision=args.precision,
    )
    rt.session(args.task)
    layout = f", layout {rt.info()['layout']}, {rt.precision}" if rt.mode == "switch" else ""
    layout += ", CUDA graph" if rt.cuda_graph else ""
    print(f"mode: {rt.mode}; providers: {rt.session(args.task).get_providers()}{layout}")
    if args.images:
        for path, top in zip(args.images, rt.predict(args.task, _load_images(args.images, rt, args.task), k=args.k)):
            print(f"{path}: " + ", ".join(f"{name} {prob:.3f}" for name, prob in top))
    if args.bench:
        other = None  # the bundle's other mode (or float16's float32), measured beside this one
        if rt.precision != "float32":
            other = Runtime(args.bundle, device=args.device, mode="switch", tf32=args.tf32)
        elif "switch" in desc:
            theirs = "session" if rt.mode == "switch" else "switch"
            other = Runtime(args.bundle, device=args.device, mode=theirs, tf32=args.tf32)
        _bench(rt, args.task, other)
    return 0


def _bench(rt, task: int, other=None) -> None:
    """Latency of ``task`` at batch 1; against ``other`` (the bundle's other mode, where it has both), runs
    interleaved, which mode is faster here and by how much; and what a switch costs: the first run after it
    minus a steady run, over a round robin of every task (median and quartiles)."""
    import numpy as np

    from .timing import interleaved_times, run_times, summary, switch_costs

    shape = rt.session(task).get_inputs()[0].shape
    x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in shape]).astype(np.float32)
    lat = summary(run_times(rt, task, x, rounds=50))
    print(
        f"latency (batch 1): median {1e3 * lat['median']:.2f} ms "
        f"(IQR {1e3 * lat['q25']:.2f}-{1e3 * lat['q75']:.2f}) over 50 runs"
    )
    if other is not None:
        mine, theirs = (summary(t)["median"] for t in interleaved_times(rt, other, task, x, rounds=50))
        ratio = mine / theirs
        differ = other.precision != rt.precision

        def name(r) -> str:
            return f"{r.mode} mode" + (f" in {r.precision}" if differ else "")

        flag = f"--precision {other.precision}" if differ else f"--mode {other.mode}"
        verdict = (
            f"the {name(rt)} runs at the {name(other)}'s speed"
            if ratio <= 1.05
            else f"the {name(other)} is faster here ({flag})"
        )
        why, info = "", rt.info()
        if ratio > 1.05 and rt.mode == "switch" and info.get("layout_note"):
            why = f"; the switch mode's layout: {info['layout']} ({info['layout_note']})"
        print(
            f"{name(rt)} against {name(other)} (batch 1, 50 runs each, interleaved): median "
            f"{1e3 * mine:.2f} ms against {1e3 * theirs:.2f} ms ({ratio:.2f}x): {verdict}{why}"
        )
    if len(rt.tasks) < 2:
        print("task switch: the bundle holds one task, nothing to switch to")
        return
    costs = summary(switch_costs(rt, x, cycles=5))
    what = (
        f"buffers rewritten, {rt.ready} task(s) held ready"
        if rt.mode == "switch"
        else f"{rt.max_sessions} session(s) cached"
    )
    print(
        f"task switch (first run after it minus a steady run, {len(rt.tasks)} tasks in turn; {what}): "
        f"median {1e3 * costs['median']:.2f} ms (IQR {1e3 * costs['q25']:.2f}-{1e3 * costs['q75']:.2f}) "
        f"over {costs['n']} switches"
    )
