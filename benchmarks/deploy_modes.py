"""The two Runtime modes side by side against the dense ONNX model, on a bundle nws-export writes from a trained run.

    python benchmarks/deploy_modes.py --models resnet18 mobilenetv2_100 efficientnet_b0 --tasks 6 --device cpu

For each timm model a short real run is trained with the user's defaults (``convert(model)``:
k-means pools of 512 entries; ``Trainer`` with pool learning off, one epoch per task on 16
random ``size x size`` images of ``5 + t`` classes; packs delta-coded against the run's base
pack) and exported as ``nws-export --task all --onnx`` does (:func:`export_bundle`): per-task
``task_<t>.onnx``, ``switch.onnx`` (the dense template), packs. The dense baseline is task 0's
model with plain layers (``nwsconvert.materialize``) exported by ``torch.onnx.export`` with
constant folding, run in a plain session.

Measured, with ``Runtime`` defaults (``max_sessions=4``, fewer than the tasks):

* latency at batch 1 and 32 on one task, interleaved with the dense model (median);
* the task-switch cost: each task called twice in a row, cycling over all tasks;
  the median over pairs of (call right after a switch) minus (the repeat right after it),
  and ``Runtime.last_switch_seconds`` for a switch between two cached tasks;
* the first use of a task (session mode: session creation; switch mode: the pack decoded,
  the task's dense tensors gathered and folded with NumPy, a session of the template built);
* memory: resident-set growth per cached task, the tensors a materialised task holds
  (``Runtime.info()``), and what a task costs before it is materialised (its pack, on disk);
* files: per-task ``.onnx`` (session mode), ``.nwspack`` (switch mode's per-task file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import timm
import torch
from torch.utils.data import TensorDataset

import nwsconvert
from nwsconvert import TrainConfig, Trainer
from nwsconvert.export import Runtime, export_bundle
from nwsconvert.export.switch import SWITCH_FILE


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def make_bundle(name: str, tasks: int, size: int, out: Path) -> Path:
    """A trained run of ``tasks`` tasks (the user's defaults) in ``out/run``, exported to ``out/run/export``."""
    torch.manual_seed(0)
    model = nwsconvert.convert(timm.create_model(name, num_classes=5))  # k-means, 512 entries
    config = TrainConfig(epochs=1, lr=0.01, batch_size=8, milestones=[], seed=0)
    info = {"channels": 3, "input_size": [size, size], "mean": [0.5] * 3, "std": [0.25] * 3}
    g = torch.Generator().manual_seed(1)
    with Trainer(model, out / "run", config, model_spec=f"timm:{name}", data_info=info, progress=False) as trainer:
        for t in range(tasks):
            classes = 5 + t
            data = [
                TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.arange(n) % classes) for n in (16, 8)
            ]
            trainer.fit_task(t, data[0], data[1], classes, name=f"t{t}")
    export_bundle(out / "run", tasks="all", onnx=True)
    return out / "run" / "export"


def dense_onnx(run: Path, size: int, path: Path, channels: int = 3) -> None:
    """Task 0's model with plain layers, exported by torch.onnx with constant folding (what a user deploys without NWS)."""
    model = nwsconvert.load(run, task=0, dense=True).eval()
    torch.onnx.export(
        model,
        (torch.zeros(1, channels, size, size),),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    )


class _Dense:
    """A plain onnxruntime session over the dense model, called like a Runtime."""

    def __init__(self, path: Path, device: str, threads: int | None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        self.sess = ort.InferenceSession(str(path), opts, providers=providers)

    def run(self, task: int, x: np.ndarray) -> np.ndarray:
        return self.sess.run(None, {"input": x})[0]


def memory(bundle: Path, mode: str, device: str, threads: int | None) -> dict:
    """In a fresh process: RSS growth per task with every task of the bundle cached (``max_sessions`` = tasks),
    ``Runtime.info()``, and each task's first use."""
    ntasks = len(json.loads((bundle / "bundle.json").read_text())["tasks"])
    x1 = _input(bundle, 1)
    start = rss()
    rt = Runtime(bundle, device=device, mode=mode, threads=threads, max_sessions=ntasks)
    rt.run(rt.tasks[0], x1)  # the pools mapped, the first session's one-off costs paid
    before = rss()
    first = []
    for t in rt.tasks[1:]:
        rt.run(t, x1)
        first.append(rt.last_switch_seconds)
    return {
        "rss_all_cached": rss() - start,  # the Runtime with every task of the bundle cached
        "rss_per_task": (rss() - before) / max(ntasks - 1, 1),
        "info": rt.info(),
        "first_use_ms": 1e3 * float(np.median(first)),
    }


def _memory_child(bundle: Path, mode: str, device: str, threads: int | None) -> dict:
    cmd = [sys.executable, __file__, "--memory-child", str(bundle), mode, "--device", device]
    cmd += ["--threads", str(threads)] if threads else []
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    out["info"]["bytes_per_task"] = {int(k): v for k, v in (out["info"]["bytes_per_task"] or {}).items()} or None
    return out


def _input(bundle: Path, batch: int) -> np.ndarray:
    """A random batch in the bundle's input geometry."""
    data = json.loads((bundle / "bundle.json").read_text())["data"]
    shape = (batch, data["channels"], *data["input_size"])
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def measure(bundle: Path, dense: Path, device: str, threads: int | None, rounds: int, cycles: int) -> dict:
    x1 = _input(bundle, 1)
    x32 = np.repeat(x1, 32, 0)
    out = {}
    rts = {}
    for mode in ("session", "switch"):
        out[mode] = _memory_child(bundle, mode, device, threads)  # a fresh process: RSS growth is the Runtime's
        rts[mode] = Runtime(bundle, device=device, mode=mode, threads=threads)  # defaults: max_sessions=4
        rts[mode].run(0, x1)
        rts[mode].run(0, x32)
    out["dense"] = {}
    rts["dense"] = _Dense(dense, device, threads)
    rts["dense"].run(0, x1)
    rts["dense"].run(0, x32)
    for batch, x, n in ((1, x1, rounds), (32, x32, max(3, rounds // 8))):
        lat = {m: [] for m in rts}
        for _ in range(n):  # interleaved
            for m, rt in rts.items():
                tic = time.perf_counter()
                rt.run(0, x)
                lat[m].append(time.perf_counter() - tic)
        for m in rts:
            out[m][f"latency_b{batch}_ms"] = 1e3 * float(np.median(lat[m]))
    for m, rt in rts.items():
        if m == "dense":
            continue
        # Each task twice in a row, cycling: a call whose task differs from the previous one is a
        # switch; the next call (same task) is the reference. Both sit in the same loop, so drift cancels.
        for t in rt.tasks:
            rt.run(t, x1)
        switch, same, calls = [], [], []
        for _ in range(cycles):
            for t in rt.tasks:
                for rep in (0, 1):
                    tic = time.perf_counter()
                    rt.run(t, x1)
                    took = time.perf_counter() - tic
                    (switch if rep == 0 else same).append(took)
                    calls.append(took)
        out[m]["switch_call_ms"] = 1e3 * float(np.median(switch))
        out[m]["same_call_ms"] = 1e3 * float(np.median(same))
        paired = 1e3 * (np.array(switch) - np.array(same))  # each switch call minus the repeat right after it
        out[m]["switch_ms"] = float(np.median(paired))
        out[m]["switch_ms_iqr"] = [float(q) for q in np.percentile(paired, [25, 75])]
        out[m]["providers"] = rt.info()["providers"]
    # A switch between two tasks both cached (switch mode: a dictionary look-up; session mode: the same).
    both = Runtime(bundle, device=device, mode="switch", threads=threads)
    pairs = []
    for _ in range(50):
        for t in (0, 1):
            both.run(t, x1)
            pairs.append(both.last_switch_seconds)
    out["switch"]["cached_switch_us"] = 1e6 * float(np.median(pairs[2:]))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["resnet18", "mobilenetv2_100"])
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="CPU provider threads (default: onnxruntime's)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument(
        "--run",
        type=Path,
        default=None,
        help="measure this trained run directory (every task exported as nws-export --task all --onnx does) "
        "instead of training short runs of --models",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--memory-child", nargs=2, metavar=("BUNDLE", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        print(json.dumps(memory(Path(args.memory_child[0]), args.memory_child[1], args.device, args.threads)))
        return
    import onnxruntime as ort

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {
        "command": "python benchmarks/deploy_modes.py " + " ".join(os.sys.argv[1:]),
        "commit": commit,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "models": {},
    }
    for name in [args.run.name] if args.run else args.models:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            tic = time.perf_counter()
            if args.run:  # the user's run, exported into the temporary folder
                export_bundle(args.run, d / "export", tasks="all", onnx=True)
                bundle = d / "export"
                written = json.loads((bundle / "bundle.json").read_text())
                args.size, args.tasks = written["data"]["input_size"][0], len(written["tasks"])
                dense_onnx(args.run, args.size, d / "dense.onnx", channels=written["data"]["channels"])
            else:
                bundle = make_bundle(name, args.tasks, args.size, d)
                dense_onnx(d / "run", args.size, d / "dense.onnx")
            desc = json.loads((bundle / "bundle.json").read_text())
            packs = [row["pack_bytes"] for row in desc["tasks"].values()]
            sizes = {
                "onnx_per_task": os.path.getsize(bundle / "task_0.onnx"),
                "pack_per_task": float(np.median(packs)),
                "base_pack": os.path.getsize(bundle / desc["tasks"]["0"]["base"])
                if "base" in desc["tasks"]["0"]
                else 0,
                "switch_onnx": os.path.getsize(bundle / SWITCH_FILE),
                "pools": os.path.getsize(bundle / "pools.safetensors"),
                "dense_onnx": os.path.getsize(d / "dense.onnx"),
                "bundle": sum(f.stat().st_size for f in bundle.iterdir() if f.is_file()),
                # what switch mode reads: no per-task graph
                "switch_bundle": sum(
                    f.stat().st_size
                    for f in bundle.iterdir()
                    if f.is_file() and (f.suffix != ".onnx" or f.name == SWITCH_FILE)
                ),
            }
            built = time.perf_counter() - tic
            r = measure(bundle, d / "dense.onnx", args.device, args.threads, args.rounds, args.cycles)
        r["files"] = sizes
        r["build_seconds"] = built
        results["models"][name] = r
        s, w, dn = r["session"], r["switch"], r["dense"]
        print(
            f"{name} {args.size}x{args.size}, {args.tasks} tasks, {args.device} ({s['providers']}; run + export {built:.0f} s)"
        )
        for b in (1, 32):
            key = f"latency_b{b}_ms"
            print(
                f"  latency b{b}: dense {dn[key]:.2f} ms, session {s[key]:.2f} ms (x{s[key] / dn[key]:.2f}), "
                f"switch {w[key]:.2f} ms (x{w[key] / dn[key]:.2f})"
            )
        print(
            f"  call after a switch / same task again, {args.tasks} tasks (max_sessions=4): session {s['switch_call_ms']:.2f} / {s['same_call_ms']:.2f} ms, "
            f"switch {w['switch_call_ms']:.2f} / {w['same_call_ms']:.2f} ms"
        )
        print(
            f"  switch cost, {args.tasks} tasks round robin, 4 cached (median paired difference [IQR]): session {s['switch_ms']:.2f} ms "
            f"[{s['switch_ms_iqr'][0]:.2f}, {s['switch_ms_iqr'][1]:.2f}], switch {w['switch_ms']:.2f} ms "
            f"[{w['switch_ms_iqr'][0]:.2f}, {w['switch_ms_iqr'][1]:.2f}]; between two cached tasks (switch mode): "
            f"{w['cached_switch_us']:.1f} us"
        )
        print(
            f"  first use of a task: session {s['first_use_ms']:.1f} ms (session creation), switch {w['first_use_ms']:.1f} ms "
            "(pack decoded, tensors gathered and folded, session of the template)"
        )
        print(
            f"  memory per cached task (RSS growth): session {s['rss_per_task'] / 1e6:.1f} MB, switch {w['rss_per_task'] / 1e6:.1f} MB "
            f"(materialised tensors {np.mean(list(w['info']['bytes_per_task'].values())) / 1e6:.2f} MB); "
            f"a task not materialised: its pack, {sizes['pack_per_task'] / 1e6:.3f} MB on disk"
        )
        print(
            f"  files: per task .onnx {sizes['onnx_per_task'] / 1e6:.2f} MB (session mode), .nwspack {sizes['pack_per_task'] / 1e6:.3f} MB "
            f"(switch mode); shared: switch.onnx {sizes['switch_onnx'] / 1e6:.3f} MB, base pack {sizes['base_pack'] / 1e6:.3f} MB, "
            f"pools {sizes['pools'] / 1e6:.2f} MB; dense model {sizes['dense_onnx'] / 1e6:.1f} MB"
        )
        print(
            f"  bundle: {sizes['bundle'] / 1e6:.2f} MB in all, {sizes['switch_bundle'] / 1e6:.2f} MB without the per-task graphs "
            f"(what switch mode reads); RSS with all {args.tasks} tasks cached: session {s['rss_all_cached'] / 1e6:.0f} MB, "
            f"switch {w['rss_all_cached'] / 1e6:.0f} MB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
