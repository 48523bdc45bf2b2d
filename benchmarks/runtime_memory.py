"""The resident set (and device memory) a Runtime or a dense onnxruntime session holds, in a fresh process.

    python benchmarks/runtime_memory.py BUNDLE '{"kind": "runtime", "mode": "switch"}' [--device cpu] [--threads N]
    python benchmarks/runtime_memory.py BUNDLE '{"kind": "dense", "path": "dense.onnx"}'

Imports only what a robot's runtime imports (NumPy, onnxruntime, nwsconvert.export), then measures the
growth from there to every task run twice (the steady state); prints one JSON line. ``benchmarks/deploy_modes.py`` runs it
for each configuration it compares. Every figure is taken after the freed memory went back to the
system (gc and glibc's malloc_trim), the same for every configuration.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

#: Runs of each task (of the dense model) before the figure: onnxruntime's arena reaches its steady size at the
#: second run of a graph (the first runs without the memory pattern it plans; MobileNetV2 224^2: +2 MB at run 2,
#: nothing after), so every configuration is measured in that steady state.
RUNS = 2


def rss() -> int:
    """Resident set size in bytes, after gc and malloc_trim."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def gpu_memory() -> int | None:
    """This process's device memory in bytes (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(mib.strip()) * 2**20
    return None


def measure(bundle: Path, config: dict, device: str, threads: int | None) -> dict:
    import onnxruntime as ort

    from nwsconvert.export import Runtime

    data = json.loads((bundle / "bundle.json").read_text())["data"]
    x = np.zeros((1, data["channels"], *data["input_size"]), np.float32)
    start = rss()
    tic = time.perf_counter()
    if config["kind"] == "dense":
        # "sessions": N > 1 sessions of the dense model sharing one CPU arena, as the Runtime's session
        # mode shares one among its cached task sessions: what a dense session costs beside another.
        from nwsconvert.export.runtime import _shared_arena, session_providers

        shared = config.get("sessions", 1) > 1 and device == "cpu" and _shared_arena(ort)
        providers = session_providers(device == "cuda")  # TF32 off, as the Runtime's default
        sessions = []
        for _ in range(config.get("sessions", 1)):
            opts = ort.SessionOptions()
            if threads:
                opts.intra_op_num_threads = threads
            if shared:
                opts.add_session_config_entry("session.use_env_allocators", "1")
            sessions.append(ort.InferenceSession(config["path"], opts, providers=providers))
            for _ in range(RUNS):
                sessions[-1].run(None, {"input": x})
        return {"rss": rss() - start, "gpu": gpu_memory() if device == "cuda" else None}
    rt = Runtime(
        bundle,
        device=device,
        mode=config["mode"],
        threads=threads,
        keep=config.get("keep", "indices"),
        max_sessions=config.get("max_sessions", 4),
        ready=config.get("ready", 1),
        cuda_arena=config.get("cuda_arena", "own"),
        cuda_graph=config.get("cuda_graph", False),
        precision=config.get("precision", "float32"),
    )
    started = time.perf_counter() - tic
    # With cuda_graph a graph is captured at its id's third run: one more round, so that a one-task bundle's is.
    for _ in range(RUNS + (1 if rt.cuda_graph else 0)):
        for t in rt.tasks:
            rt.run(t, x)
    return {
        "rss": rss() - start,
        "gpu": gpu_memory() if device == "cuda" else None,
        "start_seconds": started,
        "info": rt.info(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("config", help="JSON: the configuration to measure")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    print(json.dumps(measure(args.bundle, json.loads(args.config), args.device, args.threads)))


if __name__ == "__main__":
    main()
