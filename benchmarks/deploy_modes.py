"""The Runtime's modes side by side against the dense ONNX model, on bundles nws-export writes.

    python benchmarks/deploy_modes.py --run runs/demo --json benchmarks/results/deploy_demo.json
    python benchmarks/deploy_modes.py --models resnet18 mobilenetv2_100 efficientnet_b0 --tasks 6 --device cpu

A bundle comes from a run directory a user trained (``--run``: every task exported as ``nws-export
--task all --onnx`` does) or, for ``--models``, from a short run of each timm model trained here with the
user's defaults (``convert(model)``: k-means pools of 512 entries; one epoch per task on 16 random
images: packs close to the base, so ``keep="pack"`` decodes less than a real task's). The dense baseline
is task 0's model with plain layers exported by ``torch.onnx.export``, in a plain session.

Measured:

* latency at batch 1 and 32 on one task, interleaved with the dense model (median): switch mode (one
  session, weights in bound buffers laid out for this machine) and session mode (the task's own session);
* a switch's cost: the first run after it minus a steady run of the same task, over a round robin of every
  task (:func:`nwsconvert.export.timing.switch_costs`; median and quartiles): switch mode keeping every
  task's indices (the default) or only its pack, session mode with its default 4 cached sessions;
* memory, each in a fresh process (RSS growth from the libraries imported to every task run twice, the
  steady state: ``benchmarks/runtime_memory.py``): the dense model's session, and two of them sharing
  one arena (what onnxruntime itself costs per added session); switch mode with the
  bundle's first N tasks (N = 1, 5, 20 where the run has them), beside what each task keeps
  (``Runtime.info()``); every task held ready (``ready=N``: a buffer each); session mode with one and
  with every task cached (what each further cached task adds, against its dense weights);
* the switch mode's start-up (the layout found for this machine) and the files.
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
from nwsconvert.export.graphruns import GraphRuns
from nwsconvert.export.runtime import session_providers
from nwsconvert.export.switch import SWITCH_FILE


def make_bundle(name: str, tasks: int, size: int, out: Path, preset: str = "none") -> Path:
    """A trained run of ``tasks`` tasks in ``out/run``, exported to ``out/run/export``: converted with the
    defaults of ``convert(model)`` (k-means, 512 entries; ``preset="none"``), or with a preset of
    ``nwsconvert.zoo`` (``auto``: the model family's, as ``nws-train preset=auto``)."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5)
    if preset == "none":
        nwsconvert.convert(model)
    else:
        from nwsconvert.zoo import apply_preset

        apply_preset(model, None if preset == "auto" else preset)
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


def _initializer_bytes(path: Path) -> int:
    """The bytes of a graph's initializers (its weights, as the dense model stores them)."""
    import onnx
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(i).nbytes for i in onnx.load(str(path)).graph.initializer)


class _Dense:
    """A plain onnxruntime session over the dense model, called like a Runtime; ``graph``: through
    onnxruntime's CUDA graph, its runs at fixed addresses as the Runtime's (:class:`GraphRuns`)."""

    def __init__(self, path: Path, device: str, threads: int | None, graph: bool = False):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        # TF32 off, as the Runtime's default: like with like (onnxruntime's own default rounds to TF32).
        self.sess = ort.InferenceSession(str(path), opts, providers=session_providers(device == "cuda", graph=graph))
        self.graphs = GraphRuns(ort, self.sess, device, "input", self.sess.get_outputs()[0].name) if graph else None
        self.binding = self.sess.io_binding()

    def run(self, task: int, x: np.ndarray) -> np.ndarray:
        if self.graphs is None:
            return self.sess.run(None, {"input": x})[0]
        out = self.graphs.run(self.binding, x)
        if out is None:
            raise RuntimeError(f"the dense model's CUDA graph: none for input shape {x.shape}")
        return out


def _child(bundle: Path, config: dict, device: str, threads: int | None, cuda_arena: str = "own") -> dict:
    """``benchmarks/runtime_memory.py`` in a fresh process: what ``config`` holds, from a runtime's imports on
    (a Runtime built with ``cuda_arena`` unless ``config`` names its own)."""
    if config.get("kind") == "runtime":
        config = {"cuda_arena": cuda_arena, **config}
    cmd = [sys.executable, str(Path(__file__).with_name("runtime_memory.py")), str(bundle), json.dumps(config)]
    cmd += ["--device", device] + (["--threads", str(threads)] if threads else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"memory child {config}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _input(bundle: Path, batch: int) -> np.ndarray:
    """A random batch in the bundle's input geometry."""
    data = json.loads((bundle / "bundle.json").read_text())["data"]
    shape = (batch, data["channels"], *data["input_size"])
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def _first_tasks(run: Path, bundle: Path, n: int, out: Path) -> Path:
    """A bundle of the run's first ``n`` tasks (nws-export --task 0 ... n-1 --onnx)."""
    if n == len(json.loads((bundle / "bundle.json").read_text())["tasks"]):
        return bundle
    export_bundle(run, out, tasks=list(range(n)), onnx=True)
    return out


def _against(rt, ref, batches) -> tuple[float, int, int]:
    """``rt``'s logits against ``ref``'s, every task, each of ``batches``: the largest difference over the
    largest logit, the images whose top-1 class agrees, and the images."""
    worst, agree, n = 0.0, 0, 0
    for t in rt.tasks:
        for x in batches:
            want, got = ref.run(t, x), rt.run(t, x)
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
            agree, n = agree + int((got.argmax(1) == want.argmax(1)).sum()), n + len(x)
    return worst, agree, n


def measure(
    run: Path,
    bundle: Path,
    dense: Path,
    device: str,
    threads: int | None,
    rounds: int,
    cycles: int,
    memory: str = "all",
    cuda_arena: str = "own",
    cuda_graph: bool = False,
    precision: str = "float32",
) -> dict:
    from nwsconvert.export.timing import summary, switch_costs

    x1 = _input(bundle, 1)
    x32 = np.repeat(x1, 32, 0)
    ntasks = len(json.loads((bundle / "bundle.json").read_text())["tasks"])
    out: dict = {"tasks": ntasks}

    def child(b: Path, config: dict) -> dict:
        return _child(b, config, device, threads, cuda_arena)

    # Memory, each configuration in a fresh process.
    out["memory"] = {"dense": child(bundle, {"kind": "dense", "path": str(dense)})}
    if memory == "all":
        out["memory"]["dense_two_sessions"] = child(bundle, {"kind": "dense", "path": str(dense), "sessions": 2})
    counts = sorted({n for n in (1, 5, 20) if n <= ntasks} | {ntasks})
    for n in counts:
        sub = _first_tasks(run, bundle, n, bundle.parent / f"first_{n}")
        out["memory"][f"switch_{n}"] = child(sub, {"kind": "runtime", "mode": "switch"})
    out["memory"]["switch_keep_pack"] = child(bundle, {"kind": "runtime", "mode": "switch", "keep": "pack"})
    graph_error = None  # the graphed runs' failure: recorded, and the rest of the bundle measured without them
    if cuda_graph:  # every task, each run through the graph (captured at its first runs)
        graphed = {"kind": "runtime", "mode": "switch", "cuda_graph": True, "cuda_arena": "own"}
        try:
            out["memory"]["switch_graph"] = child(bundle, graphed)
        except RuntimeError as e:
            graph_error = f"memory child: {str(e)[-300:]}"
    if precision != "float32":  # the switch mode in that precision, every task kept
        out["memory"][f"switch_{precision}"] = child(
            bundle, {"kind": "runtime", "mode": "switch", "precision": precision}
        )
    out["memory"]["session_all_cached"] = child(bundle, {"kind": "runtime", "mode": "session", "max_sessions": ntasks})
    if ntasks > 1 and memory == "all":  # every task held ready (a buffer each) against one: what each further one adds
        out["memory"]["switch_all_ready"] = child(bundle, {"kind": "runtime", "mode": "switch", "ready": ntasks})
    if ntasks > 1 and memory == "all":  # one cached session: what each further one adds is the difference
        one = _first_tasks(run, bundle, 1, bundle.parent / "first_1")
        out["memory"]["session_one_cached"] = child(one, {"kind": "runtime", "mode": "session", "max_sessions": 1})
    # Latency, interleaved, on task 0 (no switch in between).
    rts = {
        "switch": Runtime(bundle, device=device, mode="switch", threads=threads, cuda_arena=cuda_arena),
        "session": Runtime(bundle, device=device, mode="session", threads=threads, cuda_arena=cuda_arena),
        "dense": _Dense(dense, device, threads),
    }
    if precision != "float32":
        rts[f"switch_{precision}"] = Runtime(
            bundle, device=device, mode="switch", threads=threads, cuda_arena=cuda_arena, precision=precision
        )
    if cuda_graph:  # both through onnxruntime's CUDA graph (own arenas, whatever --cuda-arena says)
        try:
            rts["switch_graph"] = Runtime(bundle, device=device, mode="switch", cuda_graph=True)
            rts["dense_graph"] = _Dense(dense, device, threads, graph=True)
            for _ in range(3):  # each shape's graph captured here (its third run), not inside the timed rounds
                for m in ("switch_graph", "dense_graph"):
                    rts[m].run(0, x1)
                    rts[m].run(0, x32)
        except Exception as e:  # noqa: BLE001 (onnxruntime's own types)
            graph_error = f"{type(e).__name__}: {str(e)[:300]}"
            rts.pop("switch_graph", None)
            rts.pop("dense_graph", None)
        cuda_graph = "switch_graph" in rts
    out["layout"] = rts["switch"].info()["layout"]
    for rt in rts.values():
        rt.run(0, x1)
        rt.run(0, x32)
    for batch, x, n in ((1, x1, rounds), (32, x32, max(5, rounds // 4))):
        lat: dict[str, list[float]] = {m: [] for m in rts}
        order = list(rts)
        shuffle = np.random.default_rng(batch)
        for _ in range(n):
            shuffle.shuffle(order)  # each round in another order: no mode always runs right after another
            for m in order:
                rt = rts[m]
                tic = time.perf_counter()
                rt.run(0, x)
                lat[m].append(time.perf_counter() - tic)
        ratios = {m: np.array(lat[m]) / np.array(lat["dense"]) for m in rts}  # round by round: drift cancels
        out[f"latency_b{batch}"] = {
            m: {"median_ms": 1e3 * float(np.median(lat[m])), "ratio": summary(list(ratios[m]))} for m in rts
        }
        if cuda_graph:
            graphed = np.array(lat["switch_graph"]) / np.array(lat["dense_graph"])
            out[f"latency_b{batch}"]["switch_graph"]["ratio_vs_dense_graph"] = summary(list(graphed))
    # Switch cost: first run after a switch minus a steady run, every task in turn.
    out["switch_cost"] = {
        "switch": summary(switch_costs(rts["switch"], x1, cycles)),
        "switch_keep_pack": summary(
            switch_costs(
                Runtime(bundle, device=device, keep="pack", threads=threads, cuda_arena=cuda_arena), x1, cycles
            )
        ),
        "session": summary(switch_costs(rts["session"], x1, cycles)),
    }
    if cuda_graph:
        rt = rts["switch_graph"]
        out["switch_cost"]["switch_graph"] = summary(switch_costs(rt, x1, cycles))
        worst, _, _ = _against(rt, rts["switch"], (x1, x32))  # graphed against the plain switch mode
        out["graph"] = {"on": rt.cuda_graph, "graphs": rt.info()["graphs"], "parity": worst}
    if graph_error is not None:
        out.setdefault("graph", {})["error"] = graph_error
    if precision != "float32":
        rt = rts[f"switch_{precision}"]
        out["switch_cost"][f"switch_{precision}"] = summary(switch_costs(rt, x1, cycles))
        worst, agree, n = _against(rt, rts["switch"], (x1, x32))  # against the float32 switch mode
        for b in (1, 32):
            lat = out[f"latency_b{b}"]
            lat[f"switch_{precision}"]["vs_float32"] = (
                lat[f"switch_{precision}"]["median_ms"] / lat["switch"]["median_ms"]
            )
        out[precision] = {"max_rel": worst, "top1_agree": agree / n, "images": n}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["resnet18", "mobilenetv2_100"])
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--size", type=int, default=224)
    p.add_argument(
        "--preset",
        default="none",
        help="--models' conversion: none (convert(model)'s defaults), auto (the family's preset, as nws-train "
        "preset=auto: scalar pools planned for 3.25 bits on MobileNets and EfficientNets) or a preset name",
    )
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
    p.add_argument(
        "--memory",
        choices=["all", "core"],
        default="all",
        help="core: the dense session, the switch mode with N tasks and with packs only, the session mode with "
        "every task cached (three fresh processes fewer a bundle: a GPU lease's budget); all: also every task "
        "held ready, one cached session and a second dense session (what each further one costs)",
    )
    p.add_argument(
        "--cuda-arena",
        choices=["own", "shared"],
        default="own",
        help="CUDA: the Runtime's sessions each with their own memory arena (default) or one shared",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="CUDA: also the switch mode and the dense model through onnxruntime's CUDA graph, each session with "
        "its own arena (latency, switch cost, memory, parity with the plain switch mode)",
    )
    p.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "float16"],
        help="float16: also the switch mode in half precision (latency beside float32's, switch cost, memory, "
        "top-1 agreement and the largest logit difference with float32)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph: onnxruntime's CUDA graph needs --device cuda")
    import onnxruntime as ort

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {
        "command": "python benchmarks/deploy_modes.py " + " ".join(os.sys.argv[1:]),
        "commit": commit,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda_arena": args.cuda_arena,
        "cuda_graph": args.cuda_graph,
        "preset": None if args.run else args.preset,
        "models": {},
    }
    for name in [args.run.name] if args.run else args.models:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            tic = time.perf_counter()
            if args.run:  # the user's run, exported into the temporary folder
                run = args.run
                export_bundle(run, d / "export", tasks="all", onnx=True)
                bundle = d / "export"
                written = json.loads((bundle / "bundle.json").read_text())
                args.size, args.tasks = written["data"]["input_size"][0], len(written["tasks"])
                dense_onnx(run, args.size, d / "dense.onnx", channels=written["data"]["channels"])
            else:
                bundle = make_bundle(name, args.tasks, args.size, d, args.preset)
                run = d / "run"
                dense_onnx(run, args.size, d / "dense.onnx")
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
                "dense_weights": _initializer_bytes(d / "dense.onnx"),
                "bundle": sum(f.stat().st_size for f in bundle.iterdir() if f.is_file()),
                "switch_bundle": sum(
                    f.stat().st_size
                    for f in bundle.iterdir()
                    if f.is_file() and (f.suffix != ".onnx" or f.name == SWITCH_FILE)
                ),
            }
            built = time.perf_counter() - tic
            r = measure(
                run, bundle, d / "dense.onnx", args.device, args.threads, args.rounds, args.cycles, args.memory,
                args.cuda_arena, args.cuda_graph, args.precision,
            )  # fmt: skip
        r["files"] = sizes
        r["build_seconds"] = built
        results["models"][name] = r
        report(name, args, r)
        if args.json:  # after each bundle: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))


def report(name: str, args, r: dict) -> None:
    """The figures of one bundle, as RESULTS quotes them."""
    mem, sizes = r["memory"], r["files"]
    dense_rss = mem["dense"]["rss"]
    arena = f", {args.cuda_arena} CUDA arena" if args.device == "cuda" else ""
    print(f"{name} {args.size}x{args.size}, {r['tasks']} tasks, {args.device}, layout {r['layout']}{arena}")
    for b in (1, 32):
        lat = r[f"latency_b{b}"]
        print(
            f"  latency b{b}: dense {lat['dense']['median_ms']:.2f} ms; switch x{lat['switch']['ratio']['median']:.2f} "
            f"[{lat['switch']['ratio']['q25']:.2f}, {lat['switch']['ratio']['q75']:.2f}], "
            f"session x{lat['session']['ratio']['median']:.2f}"
        )
    for b in (1, 32) if "switch_graph" in r["latency_b1"] else ():
        g = r[f"latency_b{b}"]
        print(
            f"  latency b{b}, CUDA graphs: dense {g['dense_graph']['median_ms']:.2f} ms, switch "
            f"{g['switch_graph']['median_ms']:.2f} ms = x{g['switch_graph']['ratio_vs_dense_graph']['median']:.2f} the "
            f"graphed dense model, x{g['switch_graph']['ratio']['median']:.2f} the plain one"
        )
    g = r.get("graph", {})
    if "on" in g:
        print(
            f"  CUDA graph: {'on' if g['on'] else 'REFUSED'}, {g['graphs']} graphs; largest difference from the plain "
            f"switch mode {g['parity']:.1e} of the largest logit"
        )
    if "error" in g:
        print(f"  CUDA graph FAILED: {g['error']}")
    half = r.get("float16")
    if half:
        lat = [r[f"latency_b{b}"]["switch_float16"] for b in (1, 32)]
        m = r["memory"].get("switch_float16", {})
        dev = f"; device memory {m['gpu'] / 1e6:.0f} MB" if m.get("gpu") else ""
        print(
            f"  float16 switch mode: latency b1 {lat[0]['median_ms']:.2f} ms (x{lat[0]['vs_float32']:.2f} float32's), "
            f"b32 {lat[1]['median_ms']:.2f} ms (x{lat[1]['vs_float32']:.2f}); top-1 agrees with float32 on "
            f"{100 * half['top1_agree']:.2f} % of {half['images']} random images, largest logit difference "
            f"{half['max_rel']:.1e} of the largest; RSS {m.get('rss', 0) / 1e6:.1f} MB{dev}"
        )
    for key, what in (
        ("switch", "switch mode (indices kept)"),
        ("switch_float16", "switch mode in float16"),
        ("switch_graph", "switch mode, CUDA graph"),
        ("switch_keep_pack", "switch mode (pack only)"),
        ("session", "session mode (4 cached)"),
    ):
        if key not in r["switch_cost"]:
            continue
        c = r["switch_cost"][key]
        print(
            f"  switch cost, {what}: {1e3 * c['median']:.1f} ms [{1e3 * c['q25']:.1f}, {1e3 * c['q75']:.1f}] over {c['n']}"
        )
    for key, m in mem.items():
        if not key.startswith("switch_") or key in (
            "switch_keep_pack",
            "switch_all_ready",
            "switch_graph",
            "switch_float16",
        ):
            continue
        kept = sum(m["info"]["bytes_per_task"].values())
        n = len(m["info"]["bytes_per_task"])
        print(
            f"  memory, switch mode with {n} tasks: {m['rss'] / 1e6:.1f} MB RSS = dense session {dense_rss / 1e6:.1f} MB "
            f"x {(m['rss'] - kept) / dense_rss:.2f} + {kept / 1e6:.2f} MB kept ({kept / n / 1e6:.2f} MB a task); "
            f"start-up {m['start_seconds']:.2f} s"
        )
    pk = mem["switch_keep_pack"]
    print(
        f"  memory, switch mode keeping packs only: {pk['rss'] / 1e6:.1f} MB RSS ({pk['rss'] / dense_rss:.2f}x the dense session)"
    )
    if "switch_all_ready" in mem:
        added = (mem["switch_all_ready"]["rss"] - mem[f"switch_{r['tasks']}"]["rss"]) / (r["tasks"] - 1)
        print(
            f"  memory, switch mode with all {r['tasks']} tasks ready: {mem['switch_all_ready']['rss'] / 1e6:.1f} MB; each "
            f"further ready task adds {added / 1e6:.1f} MB ({added / sizes['dense_weights']:.2f}x its dense weights)"
        )
    if "switch_graph" in mem:
        m = mem["switch_graph"]
        gpu = (
            f", device {m['gpu'] / 1e6:.0f} MB against the dense session's {mem['dense']['gpu'] / 1e6:.0f} MB"
            if m.get("gpu")
            else ""
        )
        print(f"  memory, switch mode with the CUDA graph, every task: {m['rss'] / 1e6:.1f} MB RSS{gpu}")
    sc = mem["session_all_cached"]
    print(
        f"  memory, session mode with all {r['tasks']} cached: {sc['rss'] / 1e6:.1f} MB, "
        f"{sc['rss'] / r['tasks'] / 1e6:.1f} MB a task ({sc['rss'] / r['tasks'] / dense_rss:.2f}x the dense session)"
    )
    if "session_one_cached" in mem:
        added = (sc["rss"] - mem["session_one_cached"]["rss"]) / (r["tasks"] - 1)
        print(
            f"  memory, session mode: one cached {mem['session_one_cached']['rss'] / 1e6:.1f} MB; each further cached "
            f"task adds {added / 1e6:.1f} MB ({added / sizes['dense_weights']:.2f}x its {sizes['dense_weights'] / 1e6:.1f} MB "
            "of dense weights)"
        )
    if "dense_two_sessions" in mem:
        added = mem["dense_two_sessions"]["rss"] - dense_rss
        print(
            f"  memory, a second session of the dense model (on a CPU one arena shared, as the session mode's) adds "
            f"{added / 1e6:.1f} MB ({added / sizes['dense_weights']:.2f}x its weights)"
        )
    print(
        f"  files: per task .onnx {sizes['onnx_per_task'] / 1e6:.2f} MB, .nwspack {sizes['pack_per_task'] / 1e6:.3f} MB; "
        f"bundle {sizes['bundle'] / 1e6:.2f} MB, {sizes['switch_bundle'] / 1e6:.2f} MB without per-task graphs; "
        f"dense model {sizes['dense_onnx'] / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
