"""The two Runtime modes side by side, same bundle, same run: per-task sessions vs one session for every task.

    python benchmarks/deploy_modes.py --models resnet18 mobilenetv2_100 --tasks 6 --device cpu

For each model a bundle of ``--tasks`` tasks is built without training (random
512-entry pools, each task its own random indices, BatchNorm statistics and
head of ``5 + t`` classes), with the exporter the CLI uses: ``task_<t>.onnx``
per task, ``switch.onnx``, packs (the one-session mode reads each task's pack).

Measured, with ``Runtime`` defaults (``max_sessions=4``, fewer than the tasks):

* latency at batch 1 and 32 on one task (interleaved modes, median);
* the task-switch cost: each task called twice in a row, cycling over all tasks;
  the median over pairs of (call right after a switch) minus (the repeat right after it);
* the first use of a task (session mode: session creation; switch mode: the pack
  decoded without torch and its values uploaded);
* memory: resident-set growth per cached task (session mode: folded weights;
  switch mode: the bound inputs, also reported by ``Runtime.info()``);
* files: per-task ``.onnx`` (session mode), ``.nwspack`` (switch mode's per-task file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from deploy import converted_model  # benchmarks/ is on sys.path when this script runs

import nwsconvert
from nwsconvert.export import Runtime
from nwsconvert.export.bundlefile import BUNDLE_FORMAT, BUNDLE_VERSION, file_sha256
from nwsconvert.export.onnx_graph import export_onnx
from nwsconvert.export.switch import SWITCH_FILE, export_switch
from nwsconvert.train.heads import resize_head


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@torch.no_grad()
def make_bundle(name: str, tasks: int, size: int, out: Path) -> None:
    model = converted_model(name)
    pools = nwsconvert.pool_set(model)
    pool_sha = pools.save(out / "pools.safetensors")
    shape = (3, size, size)
    rows = {}
    g = torch.Generator().manual_seed(1)
    for t in range(tasks):
        classes = 5 + t
        resize_head(model, classes, g)
        for layer in nwsconvert.nws_layers(model):
            layer.nws.indices.copy_(torch.randint(0, layer.nws.pool_size, layer.nws.indices.shape, generator=g))
            layer.nws.invalidate_cache()
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
        pack = nwsconvert.extract_task(model, task=t)
        pack_sha = pack.save(out / f"task_{t}.nwspack")
        info = export_onnx(
            model,
            out / f"task_{t}.onnx",
            out / "pools.safetensors",
            input_shape=shape,
            metadata={"nwsconvert.task": t, "nwsconvert.pool_sha256": pool_sha},
        )
        rows[str(t)] = {
            "name": f"t{t}",
            "num_classes": classes,
            "pack": f"task_{t}.nwspack",
            "pack_sha256": pack_sha,
            "onnx": f"task_{t}.onnx",
            "onnx_sha256": file_sha256(out / f"task_{t}.onnx"),
            "onnx_bytes": info["bytes"],
        }
    # The last task has the widest head: the switch graph is exported from it.
    export_switch(
        model,
        out / SWITCH_FILE,
        out / "pools.safetensors",
        input_shape=shape,
        metadata={"nwsconvert.pool_sha256": pool_sha},
    )
    desc = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "pool_sha256": pool_sha,
        "model": {"spec": f"timm:{name}"},
        "data": {"channels": 3, "input_size": [size, size]},
        "tasks": rows,
        "switch": {"onnx": SWITCH_FILE, "onnx_sha256": file_sha256(out / SWITCH_FILE), "max_classes": 5 + tasks - 1},
    }
    (out / "bundle.json").write_text(json.dumps(desc))


def measure(bundle: Path, device: str, threads: int | None, rounds: int, cycles: int) -> dict:
    ntasks = len(json.loads((bundle / "bundle.json").read_text())["tasks"])
    x1 = (
        np.random.default_rng(0)
        .standard_normal((1, 3, *json.loads((bundle / "bundle.json").read_text())["data"]["input_size"]))
        .astype(np.float32)
    )
    x32 = np.repeat(x1, 32, 0)
    out = {}
    rts = {}
    for mode in ("session", "switch"):
        before = rss()
        rt = Runtime(
            bundle, device=device, mode=mode, threads=threads, max_sessions=ntasks
        )  # all cached: memory per task
        first = []
        for t in rt.tasks:
            rt.run(t, x1)
            first.append(rt.last_switch_seconds)
        out[mode] = {
            "rss_per_task": (rss() - before) / ntasks,
            "info": rt.info(),
            "first_use_ms": 1e3 * float(np.median(first[1:] or first)),
        }
        del rt
        rts[mode] = Runtime(bundle, device=device, mode=mode, threads=threads)  # defaults: max_sessions=4
        rts[mode].run(0, x1)
        rts[mode].run(0, x32)
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
        out[m]["last_switch_seconds"] = rt.last_switch_seconds
        out[m]["providers"] = rt.info()["providers"]
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
    p.add_argument("--json", default=None)
    args = p.parse_args()
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
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            make_bundle(name, args.tasks, args.size, d)
            sizes = {
                "onnx_per_task": os.path.getsize(d / "task_0.onnx"),
                "pack_per_task": os.path.getsize(d / "task_0.nwspack"),
                "switch_onnx": os.path.getsize(d / SWITCH_FILE),
                "pools": os.path.getsize(d / "pools.safetensors"),
            }
            r = measure(d, args.device, args.threads, args.rounds, args.cycles)
        r["files"] = sizes
        results["models"][name] = r
        s, w = r["session"], r["switch"]
        print(f"{name} {args.size}x{args.size}, {args.tasks} tasks, {args.device} ({s['providers']})")
        print(
            f"  latency b1: session {s['latency_b1_ms']:.2f} ms, switch {w['latency_b1_ms']:.2f} ms (x{w['latency_b1_ms'] / s['latency_b1_ms']:.2f})"
        )
        print(
            f"  latency b32: session {s['latency_b32_ms']:.1f} ms, switch {w['latency_b32_ms']:.1f} ms (x{w['latency_b32_ms'] / s['latency_b32_ms']:.2f})"
        )
        print(
            f"  call after a switch / same task again, {args.tasks} tasks (max_sessions=4): session {s['switch_call_ms']:.2f} / {s['same_call_ms']:.2f} ms, "
            f"switch {w['switch_call_ms']:.2f} / {w['same_call_ms']:.2f} ms"
        )
        print(
            f"  switch cost (median paired difference [IQR]): session {s['switch_ms']:.2f} ms, switch {w['switch_ms']:.3f} ms "
            f"[{w['switch_ms_iqr'][0]:.2f}, {w['switch_ms_iqr'][1]:.2f}]; "
            f"Runtime.last_switch_seconds (switch mode, re-bind): {1e6 * w['last_switch_seconds']:.1f} us"
        )
        print(
            f"  first use of a task: session {s['first_use_ms']:.1f} ms (session creation), switch {w['first_use_ms']:.1f} ms (pack decoded, values uploaded)"
        )
        print(
            f"  memory per cached task (RSS growth): session {s['rss_per_task'] / 1e6:.1f} MB, switch {w['rss_per_task'] / 1e6:.2f} MB "
            f"(bound inputs {np.mean(list(w['info']['bytes_per_task'].values())) / 1e6:.2f} MB)"
        )
        print(
            f"  files per task: .onnx {sizes['onnx_per_task'] / 1e6:.2f} MB (session mode), .nwspack {sizes['pack_per_task'] / 1e6:.2f} MB (switch mode); shared: switch.onnx {sizes['switch_onnx'] / 1e6:.2f} MB, pools {sizes['pools'] / 1e6:.2f} MB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
