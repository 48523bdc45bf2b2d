"""Many threads on one Runtime, and many switches on one: wrong outputs, exceptions, crashes, memory growth.

    python benchmarks/harnesses/runtime_load.py threads --json /tmp/runtime_load_threads.json
    python benchmarks/harnesses/runtime_load.py threads --mixed --runs 2000 --repeat 3
    python benchmarks/harnesses/runtime_load.py soak --json /tmp/runtime_load_soak.json
    python benchmarks/harnesses/runtime_load.py threads --model resnet18 --size 32 --tasks 4
    python benchmarks/harnesses/runtime_load.py soak --bundle runs/demo/export

It uses the public API only: ``Runtime(bundle, device=, mode=, ready=, keep=, threads=, max_sessions=)``,
``.run(task, x)``, ``.tasks``, ``.info()`` and ``.session(task).get_inputs()`` (the input's shape).

The bundle
----------
``--bundle DIR``: an existing bundle (``nws-export --onnx``). Without it one is trained and exported into
``--work`` (reused on later calls unless ``--rebuild``): by default a tiny run as ``tests/trainer_utils.py``'s
``train_run`` trains it (timm ``test_resnet``, one channel, 16x16, pools of 32 entries) with ``--tasks`` tasks
of 3, 2, 4, 3... classes; ``--model NAME --size S``: that timm model with the user's defaults (k-means pools of
512 entries), one short epoch per task on random images, as ``benchmarks/deploy_modes.py``'s ``make_bundle``.

``threads``
-----------
Each configuration (``--configs``; by default the switch mode with ``ready`` = 1, 2, 4, and the session mode)
runs in a child process (this interpreter, ``faulthandler`` on), so that a crash (SIGSEGV, SIGABRT: return
code < 0) is counted, not fatal to the harness; a child past ``--timeout`` is killed and counted as a hang.
In the child:

1. images: per task, ``--images`` fixed random batches of 1 and as many of 2 (seeded), shaped as
   ``rt.session(task).get_inputs()[0].shape`` with its symbolic dimensions set to the batch;
2. the reference: a Runtime with the configuration's settings, called from one thread, computes every
   (task, image) output once;
3. the call list: ``--runs`` calls; call ``k`` belongs to thread ``k % T``; its task is thread ``j``'s own
   (``tasks[j % len(tasks)]``, over the bundle's first ``--tasks`` tasks) or, with ``--mixed``, one drawn at
   random (seeded); its image is drawn at random among the task's;
4. single thread: the reference Runtime makes the whole call list in order (its runs per second);
5. ``T`` threads (``--workers``) on one fresh Runtime with the same settings, thread ``j`` making calls
   ``j, j + T, ...``, started together.

Every output is compared with the reference (``np.array_equal``: bit for bit; a wrong shape, a value off or a
NaN is wrong; the largest absolute difference is kept), every exception is counted by type and message. Each
thread keeps its counts in a file mapping at every call and prints its first wrong outputs and each new
exception at once, so a crash leaves what was counted up to it (and faulthandler's stacks: ``crash_site``). The
throughput ratio is the T-thread run's runs per second over the single thread's on the same calls, in list
order: where a switch costs more than a run (``ready=1``), threads that happen to batch a task's calls do fewer
switches than the list, so the ratio is not a measure of parallelism alone; on a loaded machine it is noise.

``soak``
--------
Each in a child: one Runtime, a switch at every call (``run(task, x)`` round robin over every task of the
bundle, one image each): the switch mode with ``ready=1``, ``keep="indices"`` and ``keep="pack"``, for
``--switches`` calls, RSS (``/proc/self/status`` VmRSS, else psutil) read every ``--every``; the session
mode with ``max_sessions=2`` over the first 4 tasks (every call builds a session) for ``--session-switches``,
read every ``--session-every``. The slope is MB per 1,000 switches, least squares over the readings after
the first 1,000 switches. Outputs are compared with each task's first (a switch that corrupts is counted).

``--json FILE`` writes everything (settings, the runtime module that ran and its SHA-256, per configuration
the counts, the first wrong outputs, the exceptions, the child's stderr tail). Exit status 1 when anything
was wrong, raised, crashed or hung (``threads``), or raised or crashed (``soak``; growth is reported only).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CHILD_FLAG = "--child"
DEFAULT_CONFIGS = "switch:1,switch:2,switch:4,session"
SOAK_CONFIGS = "indices,pack,session"


# ---------------------------------------------------------------- the bundle (parent only: torch, timm)
def tiny_bundle(out: Path, tasks: int) -> Path:
    """A tiny run of ``tasks`` tasks (``tests/trainer_utils.py``'s ``train_run``) in ``out/run``, exported to
    ``out/export``."""
    sys.path.insert(0, str(REPO / "tests"))
    from trainer_utils import train_run

    from nwsconvert.export import export_bundle

    classes = tuple((3, 2, 4)[t % 3] for t in range(tasks))
    train_run(out / "run", tasks=classes)
    export_bundle(out / "run", out / "export", "all", onnx=True)
    return out / "export"


def model_bundle(name: str, tasks: int, size: int, out: Path) -> Path:
    """``benchmarks/deploy_modes.py``'s ``make_bundle``: timm ``name`` converted with the user's defaults,
    one epoch per task (5, 6, ... classes) on 16 random images, exported to ``out/run/export``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, beside this folder
    from deploy_modes import make_bundle

    return make_bundle(name, tasks, size, out)


def get_bundle(args) -> Path:
    if args.bundle:
        bundle = Path(args.bundle)
        if not (bundle / "bundle.json").is_file():
            sys.exit(f"runtime_load: {bundle} holds no bundle.json (export it with nws-export --onnx)")
        return bundle
    name = f"{args.model}-{args.size or 32}px-t{args.tasks}" if args.model else f"tiny-t{args.tasks}"
    out = Path(args.work) / name
    for kept in (out / "export", out / "run" / "export"):  # tiny_bundle's, model_bundle's
        if (kept / "bundle.json").is_file() and not args.rebuild:
            print(f"reusing the bundle {kept} (--rebuild to train it again)", flush=True)
            return kept
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tic = time.perf_counter()
    print(f"training and exporting {name} into {out} ...", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.model:
            bundle = model_bundle(args.model, args.tasks, args.size or 32, out)
        else:
            bundle = tiny_bundle(out, args.tasks)
    print(f"  {time.perf_counter() - tic:.0f} s", flush=True)
    return bundle


# ---------------------------------------------------------------- child side (no torch)
def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _emit(kind: str, payload: dict) -> None:
    sys.stdout.write(f"{kind} {json.dumps(payload, default=str)}\n")  # one write: threads' lines stay whole
    sys.stdout.flush()


def _runtime(spec: dict):
    from nwsconvert.export import Runtime

    return Runtime(spec["bundle"], **spec["runtime"])


def _input_shape(rt, task: int, batch: int) -> tuple[int, ...] | None:
    """The input shape of ``task``'s session with its symbolic dimensions set to ``batch``; None where the graph
    fixes another batch."""
    dims = rt.session(task).get_inputs()[0].shape
    if isinstance(dims[0], int) and dims[0] != batch:
        return None
    return tuple(d if isinstance(d, int) else batch for d in dims)


def _images(rt, tasks: list[int], per_size: int, seed: int) -> dict[int, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    images = {}
    for t in tasks:
        shapes = [s for s in (_input_shape(rt, t, b) for b in (1, 2)) if s is not None]
        images[t] = [rng.standard_normal(s).astype(np.float32) for s in shapes for _ in range(per_size)]
        if not images[t]:
            raise RuntimeError(f"task {t}: its graph takes neither batch 1 nor 2")
    return images


class _Counts:
    """One thread's counts (only that thread writes them); ``live``: a row of a file mapping (runs, wrong,
    exceptions, largest difference) kept up to date at every call, which the parent reads after a crash."""

    def __init__(self, live: np.ndarray | None = None):
        self.runs = self.wrong = self.shape = self.nonfinite = self.exceptions = 0
        self.max_abs_diff = 0.0
        self.errors: Counter = Counter()
        self.examples: list[dict] = []
        self.live = live

    def _publish(self) -> None:
        if self.live is not None:
            self.live[:] = (self.runs, self.wrong, self.exceptions, self.max_abs_diff)

    def check(self, out, want: np.ndarray, task: int, image: int) -> None:
        self.runs += 1
        out = np.asarray(out)
        if out.shape == want.shape and np.array_equal(out, want):
            if self.live is not None:
                self.live[0] = self.runs
            return
        self.wrong += 1
        if out.shape != want.shape:
            self.shape += 1
            diff = float("inf")
        elif not np.all(np.isfinite(out)):
            self.nonfinite += 1
            diff = float("inf")
        else:
            diff = float(np.max(np.abs(out.astype(np.float64) - want)))
        self.max_abs_diff = max(self.max_abs_diff, diff)
        if len(self.examples) < 5:
            self.examples.append({"task": task, "image": image, "shape": list(out.shape), "max_abs_diff": diff})
            if self.live is not None:  # on the record at once: a crash may follow
                _emit("WRONG", self.examples[-1])
        self._publish()

    def raised(self, e: BaseException) -> None:
        self.runs += 1
        self.exceptions += 1
        message = f"{type(e).__name__}: {str(e)[:200]}"
        if self.live is not None and message not in self.errors:
            _emit("RAISED", {"error": message})
        self.errors[message] += 1
        self._publish()


def _total(counts: list[_Counts]) -> dict:
    errors: Counter = Counter()
    for c in counts:
        errors.update(c.errors)
    return {
        "runs": sum(c.runs for c in counts),
        "wrong": sum(c.wrong for c in counts),
        "wrong_shape": sum(c.shape for c in counts),
        "nonfinite": sum(c.nonfinite for c in counts),
        "max_abs_diff": max((c.max_abs_diff for c in counts), default=0.0),
        "exceptions": sum(c.exceptions for c in counts),
        "errors": dict(errors.most_common(10)),
        "examples": [e for c in counts for e in c.examples][:10],
    }


def _call(rt, counts: _Counts, task: int, image: int, images: dict, ref: dict) -> None:
    try:
        out = rt.run(task, images[task][image])
        if not isinstance(out, np.ndarray):  # an OrtValue in: the switch mode's OrtValue of (B, max classes)
            out = out.numpy()[:, : rt.num_classes(task)]
    except Exception as e:  # noqa: BLE001 (counted: what the harness is for)
        counts.raised(e)
    else:
        counts.check(out, ref[(task, image)], task, image)


def _as_ortvalues(rt, images: dict) -> dict:
    """The same images as onnxruntime OrtValues on the Runtime's device (``--input ortvalue``)."""
    import onnxruntime as ort

    device = "cuda" if rt.cuda else "cpu"
    return {t: [ort.OrtValue.ortvalue_from_numpy(x, device, 0) for x in xs] for t, xs in images.items()}


def _threads_child(spec: dict) -> dict:
    workers, runs, seed = spec["workers"], spec["runs"], spec["seed"]
    tic = time.perf_counter()
    ref_rt = _runtime(spec)
    tasks = ref_rt.tasks[: spec["tasks"]]
    images = _images(ref_rt, tasks, spec["images"], seed)
    ref = {(t, i): np.array(ref_rt.run(t, x)) for t in tasks for i, x in enumerate(images[t])}
    if spec.get("input") == "ortvalue":  # the single thread and the threads alike; the reference from NumPy
        images = _as_ortvalues(ref_rt, images)
    rng = np.random.default_rng(seed + 1)
    calls = []
    for k in range(runs):
        task = tasks[int(rng.integers(len(tasks)))] if spec["mixed"] else tasks[(k % workers) % len(tasks)]
        calls.append((task, int(rng.integers(len(images[task])))))
    result: dict = {"tasks": tasks, "images_per_task": len(images[tasks[0]]), "setup_s": time.perf_counter() - tic}
    _emit("PROGRESS", {"phase": "reference", **result})

    single = _Counts()
    tic = time.perf_counter()
    for task, image in calls:
        _call(ref_rt, single, task, image, images, ref)
    seconds = time.perf_counter() - tic
    result["single"] = {**_total([single]), "seconds": seconds, "runs_per_s": runs / seconds}
    _emit("PROGRESS", {"phase": "single", **result})
    del ref_rt

    rt = _runtime(spec)
    live = np.memmap(spec["live_file"], dtype=np.float64, mode="w+", shape=(workers, 4))
    counts = [_Counts(live[j]) for j in range(workers)]
    barrier = threading.Barrier(workers + 1)

    def work(j: int) -> None:
        barrier.wait()
        for task, image in calls[j::workers]:
            _call(rt, counts[j], task, image, images, ref)

    threads = [threading.Thread(target=work, args=(j,), daemon=True) for j in range(workers)]
    for t in threads:
        t.start()
    _emit("PROGRESS", {"phase": "threaded"})
    barrier.wait()
    tic = time.perf_counter()
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(0.5)
        seconds = time.perf_counter() - tic
        _emit("PROGRESS", {"phase": "threaded", **result, "threaded": {**_total(counts), "seconds": seconds}})
    seconds = time.perf_counter() - tic
    done = _total(counts)
    result["threaded"] = {**done, "seconds": seconds, "runs_per_s": done["runs"] / seconds}
    result["ratio"] = result["threaded"]["runs_per_s"] / result["single"]["runs_per_s"]
    result["info"] = rt.info()
    return result


def _soak_child(spec: dict) -> dict:
    tic = time.perf_counter()
    rt = _runtime(spec)
    tasks = rt.tasks[: spec["tasks"]] if spec["tasks"] else rt.tasks
    if len(tasks) < 2:
        raise RuntimeError(f"the bundle has {len(tasks)} task(s): a switch needs two")
    images = _images(rt, tasks, 1, spec["seed"])
    x = {t: images[t][0] for t in tasks}
    first = {t: np.array(rt.run(t, x[t])) for t in tasks}
    counts = _Counts()
    every, switches = spec["every"], spec["switches"]
    samples = [(0, _rss_mb())]
    result: dict = {"tasks": tasks, "setup_s": time.perf_counter() - tic, "samples": samples}
    tic = time.perf_counter()
    for k in range(1, switches + 1):
        t = tasks[k % len(tasks)]
        try:
            out = rt.run(t, x[t])
        except Exception as e:  # noqa: BLE001
            counts.raised(e)
        else:
            counts.check(out, first[t], t, 0)
        if k % every == 0:
            samples.append((k, _rss_mb()))
            _emit("PROGRESS", {**result, **_total([counts])})
    result["seconds"] = time.perf_counter() - tic
    result.update(_total([counts]))
    result["info"] = rt.info()
    return result


def child_main(spec: dict) -> None:
    faulthandler.enable()
    if spec.get("timeout"):
        faulthandler.dump_traceback_later(max(1, spec["timeout"] - 5), exit=False)
    warnings.simplefilter("ignore")  # the session mode's rebuild advice, once per Runtime
    import nwsconvert.export.runtime as module

    source = Path(module.__file__)
    head = {"runtime_module": str(source), "runtime_sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    _emit("PROGRESS", head)
    try:
        result = (_threads_child if spec["kind"] == "threads" else _soak_child)(spec)
    except Exception as e:  # noqa: BLE001 (the parent records it)
        _emit("RESULT", {**head, "failed": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
        return
    _emit("RESULT", {**head, **result})


# ---------------------------------------------------------------- parent side
def run_child(spec: dict, work: Path, timeout: float) -> dict:
    """``spec`` in a child process: its RESULT, or its last PROGRESS with how it ended (crash: the signal)."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        out, err, live_file = Path(tmp) / "stdout", Path(tmp) / "stderr", Path(tmp) / "live"
        spec = {**spec, "timeout": timeout, "live_file": str(live_file)}
        cmd = [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, json.dumps(spec)]
        tic = time.perf_counter()
        with open(out, "w") as o, open(err, "w") as e:
            proc = subprocess.Popen(cmd, stdout=o, stderr=e, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
            try:
                rc = proc.wait(timeout=timeout)
                hung = False
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                hung = True
        wall = time.perf_counter() - tic
        lines = out.read_text(errors="replace").splitlines()
        stderr = err.read_text(errors="replace")
        live = np.fromfile(live_file, dtype=np.float64).reshape(-1, 4) if live_file.is_file() else None
    final = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    progress = [json.loads(line[9:]) for line in lines if line.startswith("PROGRESS ")]
    record_now = {
        "wrong_as_seen": [json.loads(line[6:]) for line in lines if line.startswith("WRONG ")][:20],
        "raised_as_seen": sorted({json.loads(line[7:])["error"] for line in lines if line.startswith("RAISED ")}),
    }
    merged: dict = {}
    for p in progress:
        merged.update(p)
    record = {**merged, **(final[-1] if final else {}), **record_now}
    record.update(returncode=rc, wall_s=wall, hung=hung, completed=bool(final) and "failed" not in record)
    record["crash"] = rc < 0 and not hung
    if rc < 0:
        try:
            record["signal"] = signal.Signals(-rc).name
        except ValueError:
            record["signal"] = str(-rc)
    if not record["completed"]:
        record["stderr_tail"] = stderr[-4000:]
        site = stderr.partition("Current thread")[2].partition("\n\n")[0]
        if site:
            record["crash_site"] = [line.strip() for line in site.splitlines()[1:6]]
        seen = record.get("threaded", {})
        if live is not None and live.size and live[:, 0].sum() >= seen.get("runs", 0):
            # counts the child's threads wrote into the file mapping up to the end, beyond its last report
            record["threaded"] = {
                **seen,
                "runs": int(live[:, 0].sum()),
                "wrong": int(live[:, 1].sum()),
                "exceptions": int(live[:, 2].sum()),
                "max_abs_diff": float(live[:, 3].max()),
                "counted_until_the_end": True,
            }
    return record


def _fmt_ratio(r: dict) -> str:
    return f"{r['ratio']:.2f}" if "ratio" in r else "-"


def _how_ended(r: dict) -> str:
    if r["hung"]:
        return "hang (killed)"
    if r["crash"]:
        return f"CRASH {r['signal']}"
    if r.get("failed"):
        return "child error"
    if r["returncode"]:
        return f"exit {r['returncode']}"
    return "no"


def threads_main(args) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bundle = get_bundle(args)
    configs = []
    for c in args.configs.split(","):
        mode, _, ready = c.strip().partition(":")
        if mode not in ("switch", "session"):
            sys.exit(f"runtime_load: --configs: {c!r} is not switch:READY or session")
        kwargs = {"device": args.device, "mode": mode, "threads": args.intra_op}
        if mode == "switch":
            kwargs["ready"] = int(ready or 1)
        else:
            kwargs["max_sessions"] = args.max_sessions
        configs.append((c.strip(), kwargs))
    pattern = "mixed" if args.mixed else "own"
    results = []
    for name, kwargs in configs:
        for rep in range(args.repeat):
            spec = {
                "kind": "threads",
                "bundle": str(bundle),
                "runtime": kwargs,
                "workers": args.workers,
                "runs": args.runs,
                "tasks": args.tasks,
                "images": args.images,
                "mixed": args.mixed,
                "input": args.input,
                "seed": args.seed + rep,
            }
            print(f"{name} ({pattern} tasks, {args.workers} threads, {args.runs} runs, try {rep + 1}) ...", flush=True)
            r = run_child(spec, work, args.timeout)
            r.update(config=name, pattern=pattern, repeat=rep, runtime_kwargs=kwargs, planned_runs=args.runs)
            results.append(r)
            th = r.get("threaded", {})
            print(
                f"  threaded: {th.get('runs', 0)} runs, {th.get('wrong', 0)} wrong, {th.get('exceptions', 0)} raised, "
                f"crash: {_how_ended(r)}, ratio {_fmt_ratio(r)} ({r['wall_s']:.0f} s)",
                flush=True,
            )
    rows = [
        (
            "config",
            "tasks",
            "runs",
            "wrong",
            "max|diff|",
            "raised",
            "crash",
            "1-thread runs/s",
            f"{args.workers}-thread runs/s",
            "ratio",
        )
    ]
    for r in results:
        th, single = r.get("threaded", {}), r.get("single", {})
        rows.append(
            (
                r["config"] + (f" #{r['repeat'] + 1}" if args.repeat > 1 else ""),
                r["pattern"],
                f"{th.get('runs', 0)}/{r['planned_runs']}",
                str(th.get("wrong", "-")),
                f"{th['max_abs_diff']:.3g}" if th.get("wrong") else "0",
                str(th.get("exceptions", "-")),
                _how_ended(r),
                f"{single['runs_per_s']:.0f}"
                + (
                    f" ({single['wrong']}w {single['exceptions']}x)"
                    if single.get("wrong") or single.get("exceptions")
                    else ""
                )
                if single
                else "-",
                f"{th['runs_per_s']:.0f}" if "runs_per_s" in th else "-",
                _fmt_ratio(r),
            )
        )
    _table(rows)
    for r in results:
        for msg, n in r.get("threaded", {}).get("errors", {}).items():
            print(f"  {r['config']}: {n} x {msg}")
    bad = any(
        not r["completed"] or r.get("threaded", {}).get("wrong") or r.get("threaded", {}).get("exceptions")
        for r in results
    )
    _write(args, bundle, {"kind": "threads", "pattern": pattern, "results": results})
    return 1 if bad else 0


def slope_per_1000(samples: list, after: int = 1000) -> float | None:
    """MB per 1,000 switches: least squares over the readings taken at ``after`` switches and later."""
    pts = [(k, mb) for k, mb in samples if k >= after]
    if len(pts) < 2:
        return None
    k, mb = np.array(pts, dtype=np.float64).T
    return float(np.polyfit(k, mb, 1)[0] * 1000)


def soak_main(args) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bundle = get_bundle(args)
    plans = {
        "indices": ({"mode": "switch", "ready": 1, "keep": "indices"}, args.switches, args.every, 0),
        "pack": ({"mode": "switch", "ready": 1, "keep": "pack"}, args.switches, args.every, 0),
        "session": (
            {"mode": "session", "max_sessions": args.max_sessions},
            args.session_switches,
            args.session_every,
            args.session_tasks,
        ),
    }
    results = []
    for name in args.configs.split(","):
        name = name.strip()
        if name not in plans:
            sys.exit(f"runtime_load: soak --configs: {name!r} is not one of {', '.join(plans)}")
        kwargs, switches, every, tasks = plans[name]
        kwargs = {"device": args.device, "threads": args.intra_op, **kwargs}
        spec = {
            "kind": "soak",
            "bundle": str(bundle),
            "runtime": kwargs,
            "switches": switches,
            "every": every,
            "tasks": tasks,
            "seed": args.seed,
        }
        print(f"soak {name}: {switches} switches ...", flush=True)
        r = run_child(spec, work, args.timeout)
        r.update(config=name, runtime_kwargs=kwargs, planned_switches=switches)
        r["slope_mb_per_1000"] = slope_per_1000(r.get("samples", []))
        results.append(r)
        samples = r.get("samples", [])
        print(f"  RSS MB at switches {', '.join(f'{k}: {mb:.1f}' for k, mb in samples)}", flush=True)
    rows = [
        (
            "config",
            "tasks",
            "switches",
            "RSS start MB",
            "RSS end MB",
            "MB / 1,000 switches",
            "ms / switch",
            "wrong",
            "raised",
            "crash",
        )
    ]
    for r in results:
        s = r.get("samples", [])
        done = s[-1][0] if s else 0
        slope = r["slope_mb_per_1000"]
        rows.append(
            (
                r["config"],
                str(len(r.get("tasks", []))),
                f"{done}/{r['planned_switches']}",
                f"{s[0][1]:.1f}" if s else "-",
                f"{s[-1][1]:.1f}" if s else "-",
                f"{slope:+.3f}" if slope is not None else "-",
                f"{1e3 * r['seconds'] / done:.2f}" if "seconds" in r and done else "-",
                str(r.get("wrong", "-")),
                str(r.get("exceptions", "-")),
                _how_ended(r),
            )
        )
    _table(rows)
    for r in results:
        for msg, n in r.get("errors", {}).items():
            print(f"  {r['config']}: {n} x {msg}")
    _write(args, bundle, {"kind": "soak", "results": results})
    bad = any(not r["completed"] or r.get("exceptions") or r.get("wrong") for r in results)
    return 1 if bad else 0


def _table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    print()
    for n, row in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _write(args, bundle: Path, payload: dict) -> None:
    if not args.json:
        return
    import onnxruntime

    settings = {k: v for k, v in vars(args).items() if k != "func"}
    doc = {
        "command": [Path(sys.executable).name, *sys.argv],
        "settings": settings,
        "bundle": str(bundle),
        "git_head": _git_head(),
        "onnxruntime": onnxruntime.__version__,
        "cpus": os.cpu_count(),
        **payload,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {args.json}")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("bundle and runtime")
    g.add_argument("--bundle", help="an existing bundle (nws-export --onnx); default: train one into --work")
    g.add_argument("--model", help="timm model to train the bundle from (e.g. resnet18); default: the tiny test_resnet")
    g.add_argument("--size", type=int, help="--model's input side in pixels (default 32)")
    g.add_argument("--tasks", type=int, default=4, help="tasks trained, and (threads, session soak) used (default 4)")
    g.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "nws-runtime-load"), help="bundles built here")
    g.add_argument("--rebuild", action="store_true", help="train the bundle again even when --work holds it")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="Runtime(device=)")
    g.add_argument("--intra-op", type=int, help="Runtime(threads=): onnxruntime intra-op threads (default its own)")
    g.add_argument("--timeout", type=float, default=900, help="seconds per child before it is killed (a hang)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", help="write the results here")

    parser = argparse.ArgumentParser(
        description="Reliability and throughput of nwsconvert.export.Runtime under threads and long switch runs.",
        epilog="Each configuration runs in a child process: a crash is counted with its signal. See the module docstring.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("threads", parents=[common], help="T threads on one Runtime against a single-thread reference")
    t.add_argument("--workers", "-T", type=int, default=4, help="threads sharing the Runtime (default 4)")
    t.add_argument("--runs", "-N", type=int, default=10_000, help="calls in all, over every thread (default 10,000)")
    t.add_argument("--mixed", action="store_true", help="each call a random task (seeded), not its thread's own")
    t.add_argument(
        "--input",
        choices=["numpy", "ortvalue"],
        default="numpy",
        help="images as NumPy arrays, or as onnxruntime OrtValues on the Runtime's device (CUDA: device memory)",
    )
    t.add_argument("--images", type=int, default=3, help="random batches of 1 and as many of 2 per task (default 3)")
    t.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help=f"switch:READY or session, comma-separated ({DEFAULT_CONFIGS})"
    )
    t.add_argument("--max-sessions", type=int, default=4, help="session mode's max_sessions (default 4)")
    t.add_argument("--repeat", type=int, default=1, help="children per configuration (crashes are chance events)")
    t.set_defaults(func=threads_main)
    s = sub.add_parser("soak", parents=[common], help="switch after switch on one Runtime, RSS read as it goes")
    s.add_argument("--configs", default=SOAK_CONFIGS, help=f"of indices, pack, session ({SOAK_CONFIGS})")
    s.add_argument("--switches", type=int, default=10_000, help="switch mode: switches (default 10,000)")
    s.add_argument("--every", type=int, default=1000, help="switch mode: RSS read every this many (default 1,000)")
    s.add_argument("--session-switches", type=int, default=2000, help="session mode: switches (default 2,000)")
    s.add_argument("--session-every", type=int, default=200, help="session mode: RSS read every (default 200)")
    s.add_argument("--session-tasks", type=int, default=4, help="session mode: the first this many tasks (default 4)")
    s.add_argument("--max-sessions", type=int, default=2, help="session mode's max_sessions (default 2)")
    s.set_defaults(func=soak_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD_FLAG]:
        child_main(json.loads(argv[1]))
        return 0
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
