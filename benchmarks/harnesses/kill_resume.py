#!/usr/bin/env python
"""Kill -9 and resume: does a training run killed at any moment continue to the same result?

    python benchmarks/harnesses/kill_resume.py --kills 40 --seed 0 --work /tmp/nws-kill \\
        --out benchmarks/results/kill_resume.json

What it does
------------
1. Reference: the job (``--job``, default a small split-mnist run of ``timm:test_resnet``)
   runs uninterrupted ``--ref-runs`` times (default 2) through ``python -m nwsconvert.cli.train``;
   the runs must agree with each other (else the job is not deterministic and nothing
   below could be compared: the script stops). Recorded from ``manifest.json``: the pool
   set's, the base pack's and every task pack's content SHA-256 and every task's
   ``val_acc`` / ``val_correct`` / ``rebuilt_acc``; also the timeline of the run (when
   ``job.json``, ``manifest.json``, the pool file, each checkpoint and pack appeared),
   from which the kill moments below are drawn.
2. Trials, until ``--kills`` SIGKILLs have been sent: the same job starts in a fresh
   directory and is killed (SIGKILL, no warning) at a moment drawn by one of four
   strategies, then continued with ``--resume`` (the full command line plus
   ``--resume``, or just ``--resume out=DIR``, at random; the plain command where the kill
   came before ``job.json``, as ``--resume``'s refusal tells the user), possibly killed
   again, until a process exits 0. Odd trials run with ``checkpoint_interval=0`` (a
   checkpoint every epoch: kills resume from checkpoints), even ones with the default 60 s
   (no checkpoint in this job: a killed stage starts again, which is what exposes a pool
   file the manifest does not record yet). Strategies (a quota of each is shuffled over the kills):

   * ``startup``  -- before ``manifest.json`` exists (uniform over the reference's time to
     the manifest; a quarter of them within the first ~0.5 s, around ``job.json``);
   * ``pools``    -- at a uniform moment of what is left of pool learning;
   * ``tasks``    -- at a uniform moment of what is left of the task epochs;
   * ``write:*``  -- right around a file write: the harness polls the run directory every
     ``--poll-ms`` and kills as soon as a temporary file of an atomic write is seen
     (``write:tmp``, during the write), or 0-3 ms after the n-th new checkpoint, task pack,
     manifest version, pool/base file or metrics line (``write:checkpoint``...).

   The first resume of every trial is started as a *pair* of concurrent ``--resume``
   processes on the same directory (and every ``--pair-finished-every``-th finished run
   gets a pair too): exactly one may run, the other must exit non-zero at once with one
   line on stderr that names the lock / another process, and no traceback.
3. Checks. After every kill: ``manifest.json``, if present, reads
   (``nwsconvert.RunDir(d).read()``); its pool file, base pack and every finished task's
   pack load, match the recorded SHA-256 and (being the same deterministic job) the
   reference's. After the final exit 0: pool / base / pack hashes, accuracies and the set
   of tasks equal the reference; no ``.*.tmp`` file anywhere under the run; no stage has two
   ``done`` records in ``metrics.jsonl``; no process printed a traceback; no process other
   than a killed one or a pair's loser exited non-zero.

How to read the output
----------------------
Progress: one line per process life (how it was started, the kill strategy, when it was
killed and in which phase the run was then, what the post-kill check found) and one per
trial. At the end a summary table: kills by strategy and by the phase observed at the kill,
resumes needed, runs identical to the reference, and every failure class with its count.
Everything must read 0 under "failures" for the run to pass; ``other metric differences``
(e.g. ``train_acc`` recorded as null) are reported separately: they are not accuracies but
show where a resumed run records something other than the uninterrupted one.
The raw JSON (``--out``) has per-trial, per-life records with the exact command lines, the
run directories (kept under ``--work`` for inspection), the counts, the git commit,
library versions and the machine.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".venv" / "bin" / "python"  # the project's virtualenv runs nws-train
SRC = REPO  # where nwsconvert is imported from (main() may point it at a snapshot of a commit)
# checkpoint_interval=0: a checkpoint after every epoch (these take well under a second), so that
# kills land between checkpoints and on them, as on a long run.
DEFAULT_JOB = (
    "model=timm:test_resnet pool_size=32 pool_epochs=3 epochs=3 tasks=4 seed=5 progress=false checkpoint_interval=0"
)
STRATEGIES = ("startup", "pools", "tasks", "write")
WRITE_TRIGGERS = ("tmp", "checkpoint", "pack", "manifest", "poolfiles", "metrics")
CONVERSION_MARK = b" kernels\n"  # the line nws-train prints after converting the model, before the Trainer


def now() -> float:
    return time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- run directory state
def tmp_files(d: Path) -> list[str]:
    """Temporary files of atomic writes (``.NAME.*.tmp``) anywhere under the run directory."""
    if not d.is_dir():
        return []
    return sorted(str(p.relative_to(d)) for p in d.rglob(".*.tmp"))


def tmp_files_fast(d: Path) -> set[str]:
    out = set()
    for sub in ("", "checkpoints", "tasks"):
        try:
            with os.scandir(d / sub if sub else d) as it:
                for e in it:
                    if e.name.startswith(".") and e.name.endswith(".tmp"):
                        out.add(f"{sub}/{e.name}")
        except OSError:
            pass
    return out


def stat_key(p: Path):
    try:
        s = os.stat(p)
        return (s.st_ino, s.st_mtime_ns, s.st_size)
    except OSError:
        return None


def read_json(p: Path):
    try:
        return json.loads(p.read_bytes())
    except (OSError, ValueError):
        return None


def read_metrics(d: Path) -> list[dict]:
    p = d / "metrics.jsonl"
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def run_state(d: Path, n_tasks: int, pool_epochs: int, epochs: int) -> dict:
    """What the run directory holds now (from its files; used to plan the next kill)."""
    m = read_json(d / "manifest.json") if (d / "manifest.json").is_file() else None
    pools_done = bool(m and m.get("pools"))
    tasks_done = len(m.get("tasks", [])) if m else 0
    logged = {}
    for r in read_metrics(d):
        if "epoch" in r and "event" not in r:
            logged[r["stage"]] = max(logged.get(r["stage"], 0), int(r["epoch"]))
    pool_left = 0 if pools_done else pool_epochs - logged.get("pools", 0)
    task_left = 0
    for t in range(tasks_done, n_tasks):
        task_left += epochs - (logged.get(f"task:{t}", 0) if t == tasks_done else 0)
    return {
        "job": (d / "job.json").is_file(),
        "manifest": m is not None,
        "pools_done": pools_done,
        "tasks_done": tasks_done,
        "pool_epochs_left": max(pool_left, 0),
        "task_epochs_left": max(task_left, 0),
        "tasks_left": n_tasks - tasks_done,
    }


def phase_of(state: dict, printed_conversion: bool, manifest_at_start: bool, n_tasks: int) -> str:
    """The phase the run was in when its process was killed (files are frozen once it is dead)."""
    if not state["manifest"]:
        return "startup: before job.json" if not state["job"] else "startup: job.json, no manifest"
    if manifest_at_start and not printed_conversion:
        return "startup: resumed process, model not built yet"
    if not state["pools_done"]:
        return "pool learning"
    if state["tasks_done"] < n_tasks:
        return "task epochs"
    return "after the last task (summary)"


# ----------------------------------------------------------------------------- checks
def as_dict(manifest) -> dict:
    """The manifest as its JSON dict: ``RunDir.read()`` gives a ``Manifest`` since 250a190, a dict before."""
    return manifest.to_dict() if hasattr(manifest, "to_dict") else manifest


class Checker:
    """Manifest and file checks, with nwsconvert imported once in this process."""

    def __init__(self):
        sys.path.insert(0, str(SRC))
        import nwsconvert
        from nwsconvert.core.pools import PoolSet
        from nwsconvert.formats.packs import TaskPack

        self.nws, self.TaskPack, self.PoolSet = nwsconvert, TaskPack, PoolSet

    def record(self, d: Path) -> dict:
        """Hashes and accuracies of a finished run (raises if anything does not load)."""
        run = self.nws.RunDir(d)
        m = as_dict(run.read())
        pools = self.PoolSet.load(run.resolve(m["pools"]["file"]))
        rec = {
            "pool_sha256": m["pools"]["sha256"],
            "pool_sha256_loaded": pools.sha256,
            "pool_file_sha256": hashlib.sha256(run.pool_path.read_bytes()).hexdigest(),
            "base_sha256": m["base"]["sha256"],
            "pool_metrics": m["pools"].get("metrics"),
            "tasks": {},
        }
        for e in m["tasks"]:
            rec["tasks"][str(e["id"])] = {
                "sha256": e["sha256"],
                "val_acc": e["metrics"]["val_acc"],
                "val_correct": e["metrics"].get("val_correct"),
                "rebuilt_acc": e["metrics"].get("rebuilt_acc"),
                "metrics": e["metrics"],
            }
        return rec

    def check(self, d: Path, ref: dict | None) -> dict:
        """Post-kill / final check of ``d``: manifest valid, every listed file loads and matches its
        recorded hash and the reference's. Returns {'manifest': bool, 'errors': [...], 'ref_mismatch': [...], 'tasks': n}."""
        out = {"manifest": False, "errors": [], "ref_mismatch": [], "tasks": 0, "pools": False}
        run = self.nws.RunDir(d)
        if not run.exists():
            return out
        out["manifest"] = True
        try:
            manifest = run.read()
            m = as_dict(manifest)
        except Exception as e:  # noqa: BLE001 - any exception is a finding
            out["errors"].append(f"manifest: RunDir.read() raised {type(e).__name__}: {e}")
            return out
        pool_sha, run_id = None, m.get("run_id")
        if m.get("pools"):
            out["pools"] = True
            pool_sha = m["pools"]["sha256"]
            try:
                got = self.PoolSet.load(run.resolve(m["pools"].get("file") or "pools.safetensors")).sha256
                if got != pool_sha:
                    out["errors"].append(f"pools: file hash {got[:12]} != manifest {pool_sha[:12]}")
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"pools: load raised {type(e).__name__}: {e}")
            if ref and pool_sha != ref["pool_sha256"]:
                out["ref_mismatch"].append(f"pools: {pool_sha[:12]} != reference {ref['pool_sha256'][:12]}")
        if m.get("base"):
            try:
                self.TaskPack.load(
                    run.resolve(m["base"].get("file") or "base.nwspack"),
                    sha256=m["base"]["sha256"],
                    pool_sha256=pool_sha,
                    run_id=run_id,
                )
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"base: load raised {type(e).__name__}: {e}")
            if ref and m["base"]["sha256"] != ref["base_sha256"]:
                out["ref_mismatch"].append(f"base: {m['base']['sha256'][:12]} != reference {ref['base_sha256'][:12]}")
        for e in m["tasks"]:
            t = e["id"]
            out["tasks"] += 1
            try:
                self.TaskPack.load(
                    run.task_path(manifest, t), sha256=e["sha256"], pool_sha256=pool_sha, run_id=run_id, task=t
                )
            except Exception as ex:  # noqa: BLE001
                out["errors"].append(f"task {t}: load raised {type(ex).__name__}: {ex}")
            if ref:
                r = ref["tasks"].get(str(t))
                if r is None:
                    out["ref_mismatch"].append(f"task {t}: not in the reference")
                    continue
                if e["sha256"] != r["sha256"]:
                    out["ref_mismatch"].append(f"task {t}: pack {e['sha256'][:12]} != reference {r['sha256'][:12]}")
                for k in ("val_acc", "val_correct", "rebuilt_acc"):
                    if e["metrics"].get(k) != r[k]:
                        out["ref_mismatch"].append(f"task {t}: {k} {e['metrics'].get(k)} != reference {r[k]}")
        return out


def metric_diffs(rec: dict, ref: dict) -> list[str]:
    """Recorded metrics (other than timings and the accuracies compared above) that differ from the reference."""
    out = []

    def cmp(where, a, b, skip):
        a, b = a or {}, b or {}
        for k in sorted(set(a) | set(b)):
            if k in skip:
                continue
            if a.get(k) != b.get(k):
                out.append(f"{where}.{k}: {a.get(k)!r} (reference {b.get(k)!r})")

    cmp("pools.metrics", rec.get("pool_metrics"), ref.get("pool_metrics"), {"seconds"})
    for t, r in ref["tasks"].items():
        if t in rec["tasks"]:
            cmp(
                f"tasks[{t}].metrics",
                rec["tasks"][t]["metrics"],
                r["metrics"],
                {"seconds", "val_acc", "val_correct", "rebuilt_acc"},
            )
    return out


def log_checks(d: Path) -> dict:
    """metrics.jsonl: 'done' records per stage (must be one), epoch records logged twice / never."""
    done = collections.Counter()
    epochs = collections.Counter()
    for r in read_metrics(d):
        if r.get("event") == "done":
            done[r.get("stage")] += 1
        elif "epoch" in r and "event" not in r:
            epochs[(r.get("stage"), r.get("epoch"))] += 1
    return {
        "done_per_stage": dict(done),
        "duplicate_done": {s: n for s, n in done.items() if n > 1},
        "epoch_records_repeated": sorted(f"{s}#{e}" for (s, e), n in epochs.items() if n > 1),
    }


# ----------------------------------------------------------------------------- processes
class Life:
    """One nws-train process on a run directory."""

    def __init__(self, args: list[str], d: Path, logs: Path, tag: str):
        self.args, self.d, self.tag = args, d, tag
        self.cmd = [str(PY), "-m", "nwsconvert.cli.train", *args]
        self.out_path, self.err_path = logs / f"{tag}.out", logs / f"{tag}.err"
        env = {k: v for k, v in os.environ.items() if k not in ("NWS_DEBUG",)}
        self.manifest_at_start = (d / "manifest.json").is_file()
        self.t0 = now()
        with open(self.out_path, "wb") as o, open(self.err_path, "wb") as e:
            self.p = subprocess.Popen(self.cmd, cwd=SRC, stdout=o, stderr=e, env=env)
        self._out_size = 0
        self.printed_conversion = False
        self._log_offset = stat_key(d / "metrics.jsonl")[2] if (d / "metrics.jsonl").is_file() else 0
        self._log_size = self._log_offset
        self._records: list[dict] = []

    def new_records(self) -> list[dict]:
        """The metrics.jsonl records this process appended (complete lines)."""
        p = self.d / "metrics.jsonl"
        s = stat_key(p)
        if s is not None and s[2] != self._log_size:
            self._log_size = s[2]
            with open(p, "rb") as f:
                f.seek(self._log_offset)
                data = f.read()
            recs = []
            for line in data.split(b"\n")[:-1]:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if isinstance(r, dict):
                    recs.append(r)
            self._records = recs
        return self._records

    def conversion_printed(self) -> bool:
        if not self.printed_conversion:
            try:
                size = os.path.getsize(self.out_path)
            except OSError:
                return False
            if size != self._out_size:
                self._out_size = size
                self.printed_conversion = CONVERSION_MARK in self.out_path.read_bytes()
        return self.printed_conversion

    def kill(self) -> float:
        t = now() - self.t0
        try:
            os.kill(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()
        self.conversion_printed()
        return t

    def stderr(self) -> str:
        try:
            return self.err_path.read_text(errors="replace")
        except OSError:
            return ""

    def stdout(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except OSError:
            return ""


# ----------------------------------------------------------------------------- reference
def watch_timeline(life: Life, poll: float, timeout: float) -> tuple[int, dict]:
    """Run ``life`` to its end, noting when files appear or change (seconds since start)."""
    d = life.d
    events: list[tuple[float, str]] = []
    watched = {
        "job": d / "job.json",
        "manifest": d / "manifest.json",
        "pools": d / "pools.safetensors",
        "base": d / "base.nwspack",
        "checkpoint": d / "checkpoints" / "last.safetensors",
        "metrics": d / "metrics.jsonl",
    }
    last = {k: None for k in watched}
    packs: dict[str, object] = {}
    pack_first: dict[str, float] = {}
    tmps_seen: set[str] = set()
    while life.p.poll() is None:
        t = now() - life.t0
        if t > timeout:
            life.kill()
            raise RuntimeError(f"reference run did not finish in {timeout} s")
        for k, p in watched.items():
            s = stat_key(p)
            if s is not None and s != last[k]:
                events.append((t, k))
            last[k] = s
        if (d / "tasks").is_dir():
            for p in (d / "tasks").glob("task_*.nwspack"):
                s = stat_key(p)
                if s != packs.get(p.name):
                    events.append((t, f"pack:{p.name}"))
                    packs[p.name] = s
                    pack_first.setdefault(p.name, t)
        for n in tmp_files_fast(d) - tmps_seen:
            tmps_seen.add(n)
            events.append((t, f"tmp:{n}"))
        if life.conversion_printed() and not any(k == "conversion" for _, k in events):
            events.append((t, "conversion"))
        time.sleep(poll)
    t_end = now() - life.t0
    first = {}
    for t, k in events:
        first.setdefault(k, t)
    packs_first = sorted(pack_first.values())
    timeline = {
        "end": t_end,
        "job": first.get("job"),
        "conversion": first.get("conversion"),
        "manifest": first.get("manifest"),
        "pools_file": first.get("pools"),
        "packs": packs_first,
        "events": [(round(t, 4), k) for t, k in events],
        "tmp_seen": len(tmps_seen),
    }
    return life.p.returncode, timeline


# ----------------------------------------------------------------------------- kill plans
class Plan:
    def __init__(self, strategy: str, **kw):
        self.strategy = strategy
        self.__dict__.update(kw)

    def describe(self) -> str:
        if self.strategy == "write":
            return f"write:{self.trigger} #{self.n} +{self.post_ms:.1f}ms"
        if self.strategy == "startup":
            return f"startup @{self.delay:.2f}s"
        return f"{self.strategy} +{self.delay:.2f}s after {self.marker}"

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def make_plan(strategy: str, state: dict, tl: dict, rng: random.Random, cfg: dict) -> Plan | None:
    """A concrete kill moment for ``strategy`` in a process started on a run in ``state``; None if it cannot happen."""
    P, E, N = cfg["pool_epochs"], cfg["epochs"], cfg["tasks"]
    pool_span = max(tl["pools_file"] - tl["conversion"], 0.5)  # conversion line -> pool file (fresh run)
    task_span = max(tl["packs"][-1] - tl["pools_file"], 0.5)  # pool file -> last pack
    if strategy == "startup":
        if state["manifest"]:
            return None
        early = rng.random() < 0.25
        hi = (tl["job"] or 0.3) * 1.6 if early else tl["manifest"] * 0.9
        return Plan("startup", delay=rng.uniform(0.02, hi), early=early)
    if strategy == "pools":
        if state["pools_done"]:
            return None
        # anchored on an event, not on the clock (the machine's speed varies): the j-th pool epoch
        # record this process logs (j = 0: its conversion line), then a uniform part of one epoch
        j = rng.randint(0, max(state["pool_epochs_left"], 1) - 1)
        return Plan(
            "pools",
            anchor=j,
            marker=f"pool epoch record #{j}" if j else "conversion line",
            delay=rng.uniform(0, 0.95 * pool_span / P),
        )
    if strategy == "tasks":
        if state["tasks_left"] == 0:
            return None
        j = rng.randint(0, max(state["task_epochs_left"], 1) - 1)
        return Plan(
            "tasks",
            anchor=j,
            marker=f"task epoch record #{j}" if j else "pool file + conversion line",
            delay=rng.uniform(0, 0.95 * task_span / (N * E)),
        )
    if strategy == "write":
        counts = {
            "checkpoint": state["pool_epochs_left"] + state["task_epochs_left"],
            "pack": state["tasks_left"],
            "manifest": (0 if state["manifest"] else 1) + (0 if state["pools_done"] else 1) + state["tasks_left"],
            "poolfiles": 0 if state["pools_done"] else 3,
            "metrics": state["pool_epochs_left"]
            + state["task_epochs_left"]
            + state["tasks_left"]
            + (0 if state["pools_done"] else 1),
        }
        counts["tmp"] = max(
            1, tl["tmp_seen"] * (counts["checkpoint"] + counts["pack"] + 1) // max(cfg["ref_writes"], 1)
        )
        options = [k for k in WRITE_TRIGGERS if counts[k] > 0]
        if not options:
            return None
        trig = rng.choice(options)
        n = rng.randint(1, counts[trig])
        post = 0.0 if trig == "tmp" else rng.uniform(0, 3.0)
        return Plan("write", trigger=trig, n=n, post_ms=post)
    raise ValueError(strategy)


def drive(life: Life, plan: Plan | None, poll: float, timeout: float) -> dict:
    """Run ``life`` until it exits or ``plan`` says to kill it. Returns what happened."""
    d = life.d
    armed_at = None
    fire_at = None
    seen = 0
    trig_paths = {
        "checkpoint": [d / "checkpoints" / "last.safetensors"],
        "manifest": [d / "manifest.json"],
        "poolfiles": [d / "pools.safetensors", d / "base.nwspack", d / "checkpoints" / "base_weights.safetensors"],
        "metrics": [d / "metrics.jsonl"],
    }
    last: dict = {}
    if plan is not None and plan.strategy == "write":
        if plan.trigger in trig_paths:
            last = {p: stat_key(p) for p in trig_paths[plan.trigger]}
        elif plan.trigger == "pack":
            last = {p: stat_key(p) for p in (d / "tasks").glob("task_*.nwspack")} if (d / "tasks").is_dir() else {}
        elif plan.trigger == "tmp":
            last = {"tmp": tmp_files_fast(d)}
    trigger_info = None
    while True:
        rc = life.p.poll()
        if rc is not None:
            life.conversion_printed()
            return {"killed": False, "rc": rc, "t": now() - life.t0}
        t = now() - life.t0
        if t > timeout:
            k = life.kill()
            return {"killed": True, "rc": life.p.returncode, "t": k, "hang": True}
        if plan is not None:
            if fire_at is not None:
                if now() >= fire_at:
                    k = life.kill()
                    return {"killed": True, "rc": life.p.returncode, "t": k, "trigger": trigger_info}
            elif plan.strategy == "startup":
                if t >= plan.delay:
                    return {"killed": True, "rc": None, "t": life.kill()}
            elif plan.strategy in ("pools", "tasks"):
                if armed_at is None and life.conversion_printed():
                    if plan.anchor == 0:
                        if plan.strategy == "pools" or (d / "pools.safetensors").is_file():
                            armed_at = now()
                    else:
                        recs = [r for r in life.new_records() if "event" not in r and "epoch" in r]
                        mine = [r for r in recs if (r.get("stage") == "pools") == (plan.strategy == "pools")]
                        if len(mine) >= plan.anchor:
                            armed_at = now()
                if armed_at is not None and now() - armed_at >= plan.delay:
                    return {"killed": True, "rc": None, "t": life.kill()}
            else:  # write triggers
                hit = None
                if plan.trigger == "tmp":
                    cur = tmp_files_fast(d)
                    new = cur - last["tmp"]
                    last["tmp"] = cur
                    if new:
                        hit = sorted(new)[0]
                elif plan.trigger == "pack":
                    if (d / "tasks").is_dir():
                        for p in (d / "tasks").glob("task_*.nwspack"):
                            s = stat_key(p)
                            if s is not None and s != last.get(p):
                                last[p] = s
                                hit = f"tasks/{p.name}"
                else:
                    for p in trig_paths[plan.trigger]:
                        s = stat_key(p)
                        if s is not None and s != last.get(p):
                            hit = str(p.relative_to(d))
                        last[p] = s
                if hit is not None:
                    seen += 1
                    if seen >= plan.n:
                        trigger_info = {"file": hit, "seen_at": round(t, 4)}
                        fire_at = now() + plan.post_ms / 1000.0
                        if plan.post_ms == 0:
                            k = life.kill()
                            return {"killed": True, "rc": life.p.returncode, "t": k, "trigger": trigger_info}
                        continue  # no sleep: fire within a few ms
        time.sleep(poll)


def stderr_findings(text: str) -> dict:
    lines = [l for l in text.splitlines() if l.strip()]
    return {"traceback": "Traceback" in text, "lines": lines[-5:], "n_lines": len(lines)}


def resume_args(d: Path, job_args: list[str], rng: random.Random) -> tuple[list[str], str]:
    """What a user runs next: ``--resume`` with the full command line, or bare ``--resume out=DIR`` when
    the directory records its job; the plain command when it records none (killed before ``job.json``:
    ``--resume`` refuses such a folder, with exit code 2, and says to run the command without it)."""
    started = (d / "job.json").is_file() or (d / "manifest.json").is_file()
    if not started:
        return [*job_args, f"out={d}"], "plain"
    if rng.random() < 0.5:
        return ["--resume", f"out={d}"], "bare"
    return [*job_args, f"out={d}", "--resume"], "full"


def with_checkpoint_interval(job_args: list[str], seconds: int) -> list[str]:
    """``job_args`` with ``checkpoint_interval=seconds``: 0 checkpoints every epoch, 60 (the default) none
    in this small job, so a killed stage starts again from its start (the results must not differ)."""
    return [a for a in job_args if not a.startswith("checkpoint_interval=")] + [f"checkpoint_interval={seconds}"]


def lock_refusal_ok(rc: int | None, err: str) -> tuple[bool, str]:
    lines = [l for l in err.splitlines() if l.strip()]
    if rc in (0, None):
        return False, f"exit code {rc}"
    if "Traceback" in err:
        return False, "traceback on stderr"
    low = err.lower()
    if len(lines) != 1 and not (len(lines) == 2 and "starting it" in lines[0]):
        return False, f"{len(lines)} lines on stderr"
    if not ("lock" in low or "another process" in low):
        return False, "message names neither the lock nor another process"
    return True, ""


def start_pair(
    d: Path, job_args: list[str], logs: Path, tag: str, rng: random.Random, wait: float = 60.0
) -> tuple[Life | None, dict]:
    """Two ``--resume`` processes at once; the one that runs is returned (it goes on as this life)."""
    a_args, a_style = resume_args(d, job_args, rng)
    b_args, b_style = resume_args(d, job_args, rng)
    a = Life(a_args, d, logs, f"{tag}a")
    b = Life(b_args, d, logs, f"{tag}b")
    t0 = now()
    rec = {"styles": [a_style, b_style], "commands": [shlex.join(a.cmd), shlex.join(b.cmd)], "ok": False}
    while now() - t0 < wait:
        ra, rb = a.p.poll(), b.p.poll()
        if ra is not None or rb is not None:
            break
        time.sleep(0.01)
    time.sleep(0.3)  # if both are about to exit, see both
    ra, rb = a.p.poll(), b.p.poll()
    if ra is None and rb is None:
        rec["problem"] = f"both processes still running after {wait:.0f} s: both hold the run"
        rec["loser"] = None
        b.kill()
        return a, rec
    if ra is not None and rb is not None:
        for x in (a, b):
            rec.setdefault("exits", []).append({"rc": x.p.returncode, "stderr": stderr_findings(x.stderr())})
        rec["problem"] = f"both exited (rc {ra}, {rb}): none ran, or both ran"
        if ra == 0 and rb == 0:
            rec["problem"] = "both exited 0: both ran"
        rec["loser"] = None
        return None, rec
    loser, winner = (a, b) if ra is not None else (b, a)
    err = loser.stderr()
    ok, why = lock_refusal_ok(loser.p.returncode, err)
    rec.update(
        loser={
            "rc": loser.p.returncode,
            "after_s": round(now() - t0, 3),
            "stderr": err.strip().splitlines()[-3:],
            "traceback": "Traceback" in err,
        },
        ok=ok,
        problem=why or None,
    )
    return winner, rec


# ----------------------------------------------------------------------------- main
def versions() -> dict:
    out = {"python": platform.python_version()}
    code = "import json,torch,timm,numpy,nwsconvert;print(json.dumps({'torch':torch.__version__,'timm':timm.__version__,'numpy':numpy.__version__,'nwsconvert':nwsconvert.__version__}))"
    try:
        out.update(
            json.loads(
                subprocess.run([str(PY), "-c", code], cwd=SRC, capture_output=True, text=True, check=True).stdout
            )
        )
    except Exception as e:  # noqa: BLE001
        out["error"] = str(e)
    return out


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory": mem,
        "hostname": platform.node(),
    }


def git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "nwsconvert", "zoo", "export"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return rev + ("+dirty(nwsconvert/zoo/export)" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def snapshot(rev: str, work: Path) -> Path:
    """``git archive`` of ``rev``'s nwsconvert/, zoo/ and export/ laid out as the installed package
    (nwsconvert.zoo, nwsconvert.export), under ``work``; returns the folder to import from."""
    full = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    dest = work / f"src_{full}"
    if (dest / "nwsconvert" / "__init__.py").is_file():
        return dest
    tmp = work / f".src_{full}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", full, "nwsconvert", "zoo", "export"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    (tmp / "zoo").rename(tmp / "nwsconvert" / "zoo")
    (tmp / "export").rename(tmp / "nwsconvert" / "export")
    tmp.rename(dest)
    return dest


def job_numbers(job_args: list[str]) -> dict:
    kv = dict(a.split("=", 1) for a in job_args if "=" in a)
    epochs = int(kv.get("epochs", 3))
    return {"pool_epochs": int(kv.get("pool_epochs", epochs)), "epochs": epochs, "tasks": int(kv.get("tasks", 5))}


def main(argv=None) -> int:
    if argv is None and Path(sys.prefix).resolve() != (REPO / ".venv").resolve() and PY.is_file():
        os.execv(str(PY), [str(PY), str(Path(__file__).resolve()), *sys.argv[1:]])  # the checks import nwsconvert
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    ap.add_argument(
        "--kills",
        type=int,
        default=40,
        help="SIGKILLs to send in all (trials run until this many were sent; default 40)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default 0)")
    ap.add_argument(
        "--work",
        default="/tmp/nws-kill",
        help="folder for the run directories and process logs (its ref_*/trial_*/logs are replaced)",
    )
    ap.add_argument("--out", default="benchmarks/results/kill_resume.json", help="raw JSON results")
    ap.add_argument(
        "--job", default=DEFAULT_JOB, help=f"nws-train key=value items of the job (default: {DEFAULT_JOB!r})"
    )
    ap.add_argument(
        "--ref-runs", type=int, default=2, help="uninterrupted reference runs, which must agree (default 2)"
    )
    ap.add_argument(
        "--max-kills-per-trial", type=int, default=4, help="kills per trial are drawn from 1..this (default 4)"
    )
    ap.add_argument(
        "--pair-finished-every",
        type=int,
        default=3,
        help="concurrent --resume pair on every N-th finished run (0: never; default 3)",
    )
    ap.add_argument("--poll-ms", type=float, default=1.0, help="how often the run directory is polled, ms (default 1)")
    ap.add_argument(
        "--source",
        default="HEAD",
        help="code under test: a git revision of the repository, unpacked (nwsconvert, zoo, export) under --work and imported "
        "from there, so that edits made to the working tree while the benchmark runs do not mix versions (default HEAD); "
        "'worktree': the working tree as it is",
    )
    ap.add_argument(
        "--life-timeout", type=float, default=600.0, help="a process running longer is killed and counted as hung (s)"
    )
    args = ap.parse_args(argv)

    wall0 = now()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rng = random.Random(args.seed)
    poll = args.poll_ms / 1000.0
    base_args = shlex.split(args.job)
    cfg = job_numbers(base_args)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for p in list(work.glob("ref_*")) + list(work.glob("trial_*")) + [work / "logs"]:
        if p.is_dir():
            shutil.rmtree(p)
    logs = work / "logs"
    logs.mkdir()
    out_path = Path(args.out)
    if not out_path.is_absolute():
        out_path = REPO / out_path
    global SRC
    head = git_rev()
    if args.source != "worktree":
        SRC = snapshot(args.source, work)
    source = {
        "requested": args.source,
        "path": str(SRC),
        "rev": None if args.source == "worktree" else SRC.name.split("_", 1)[1],
        "head_at_start": head,
    }
    probe = subprocess.run(
        [
            str(PY),
            "-c",
            "import nwsconvert, nwsconvert.zoo, nwsconvert.cli.train; print(nwsconvert.__file__, nwsconvert.zoo.__file__)",
        ],
        cwd=SRC,
        capture_output=True,
        text=True,
    )
    source["imports"] = probe.stdout.strip()
    if (
        args.source != "worktree"
        and str(REPO / "nwsconvert") in probe.stdout
        or probe.returncode != 0
        or str(SRC) not in probe.stdout
    ):
        log(f"the code under test is not imported from {SRC}: {probe.stdout.strip()} {probe.stderr.strip()[-300:]}")
        return 1
    checker = Checker()
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["kill_resume.py", *argv])
    log(
        f"kill/resume benchmark: code {source['rev'] or 'worktree'} from {SRC} (repository HEAD {head}); job {args.job!r}; {args.kills} kills, seed {args.seed}, work {work}"
    )

    # ---- reference runs
    refs, timelines = [], []
    for i in range(args.ref_runs):
        d = work / f"ref_{i}"
        life = Life([*base_args, f"out={d}"], d, logs, f"ref_{i}")
        rc, tl = watch_timeline(life, poll, args.life_timeout)
        if rc != 0:
            log(f"reference run {i} failed with exit code {rc}: {life.stderr().strip()[-500:]}")
            return 1
        rec = checker.record(d)
        refs.append(rec)
        timelines.append(tl)
        log(
            f"reference {i}: {tl['end']:.1f} s (job.json {tl['job']:.2f} s, manifest {tl['manifest']:.2f} s, pools file {tl['pools_file']:.2f} s, "
            f"last pack {tl['packs'][-1]:.2f} s); pools {rec['pool_sha256'][:12]} base {rec['base_sha256'][:12]} "
            + " ".join(f"t{t}:{r['sha256'][:8]}/{r['val_acc']:.4f}" for t, r in rec["tasks"].items())
        )
    ref = refs[0]
    ref_ok = True
    for i, r in enumerate(refs[1:], 1):
        same = (
            r["pool_sha256"] == ref["pool_sha256"]
            and r["base_sha256"] == ref["base_sha256"]
            and all(
                r["tasks"][t]["sha256"] == ref["tasks"][t]["sha256"]
                and r["tasks"][t]["val_acc"] == ref["tasks"][t]["val_acc"]
                for t in ref["tasks"]
            )
            and set(r["tasks"]) == set(ref["tasks"])
        )
        if not same:
            ref_ok = False
            log(
                f"reference run {i} differs from reference run 0: the job is not deterministic; kill/resume results could not be compared"
            )
    if not ref_ok:
        return 1
    tl = timelines[0]
    cfg["ref_writes"] = cfg["pool_epochs"] + cfg["tasks"] * cfg["epochs"] + cfg["tasks"] + 1

    # ---- kill schedule
    n_startup = max(8, round(0.22 * args.kills))
    n_pools = max(1, round(0.15 * args.kills))
    n_write = max(1, round(0.35 * args.kills))
    n_tasks = max(1, args.kills - n_startup - n_pools - n_write)
    todo = ["startup"] * n_startup + ["pools"] * n_pools + ["write"] * n_write + ["tasks"] * n_tasks
    rng.shuffle(todo)
    order = {"startup": 0, "pools": 1, "write": 2, "tasks": 2}

    trials = []
    kills = 0
    pairs = []
    failures: list[dict] = []
    trial_no = 0
    while kills < args.kills:
        trial_no += 1
        if not todo:
            todo = [rng.choice(STRATEGIES) for _ in range(8)]
        k = min(rng.randint(1, args.max_kills_per_trial), len(todo), args.kills - kills)
        mine = sorted(todo[:k], key=lambda s: (order[s], rng.random()))
        del todo[:k]
        d = work / f"trial_{trial_no:03d}"
        interval = 0 if trial_no % 2 else 60  # odd trials resume from checkpoints, even ones restart stages
        job_args = with_checkpoint_interval(base_args, interval)
        trial = {
            "trial": trial_no,
            "dir": str(d),
            "checkpoint_interval": interval,
            "planned": list(mine),
            "lives": [],
            "failures": [],
        }
        log(f"trial {trial_no}: {d.name}, planned kills {mine}")
        life_no = 0
        consecutive_fail = 0
        ended = False
        while not ended:
            life_no += 1
            tag = f"trial_{trial_no:03d}_life{life_no}"
            state = run_state(d, cfg["tasks"], cfg["pool_epochs"], cfg["epochs"])
            plan = None
            while mine and plan is None:
                plan = make_plan(mine[0], state, tl, rng, cfg)
                if plan is None:
                    fallback = "tasks" if state["tasks_left"] else None
                    trial.setdefault("replanned", []).append(f"{mine[0]} -> {fallback}")
                    if fallback is None:
                        mine.pop(0)
                    else:
                        mine[0] = fallback
            if mine and plan is not None:
                mine.pop(0)
            pair = None
            if life_no == 1:
                life = Life([*job_args, f"out={d}"], d, logs, tag)
                style = "new"
            elif life_no == 2:
                life, pair = start_pair(d, job_args, logs, tag, rng)
                style = "pair"
                pair["trial"], pair["on"] = trial_no, "unfinished run"
                pairs.append(pair)
                if not pair["ok"]:
                    f = {
                        "kind": "concurrent writers",
                        "trial": trial_no,
                        "dir": str(d),
                        "detail": pair.get("problem"),
                        "commands": pair["commands"],
                    }
                    failures.append(f)
                    trial["failures"].append(f)
                if life is None:
                    life = Life(resume_args(d, job_args, rng)[0], d, logs, tag + "r")
            else:
                ra, style = resume_args(d, job_args, rng)
                life = Life(ra, d, logs, tag)
            res = drive(life, plan, poll, args.life_timeout)
            err = life.stderr()
            sf = stderr_findings(err)
            entry = {
                "life": life_no,
                "start": style if style != "pair" else "pair:" + "/".join(pair["styles"]),
                "command": shlex.join(life.cmd),
                "state_before": state,
                "plan": plan.to_json() if plan else None,
                "killed": res["killed"],
                "t": round(res["t"], 4),
                "rc": life.p.returncode,
                "stderr": sf,
                "stderr_mode": (
                    "restarted from job.json"
                    if "starting it again from job.json" in err
                    else "no run yet: started plainly"
                    if style == "plain"
                    else None
                ),
            }
            if sf["traceback"]:
                f = {
                    "kind": "traceback on stderr",
                    "trial": trial_no,
                    "life": life_no,
                    "command": entry["command"],
                    "stderr": sf["lines"],
                }
                failures.append(f)
                trial["failures"].append(f)
            if res.get("hang"):
                f = {"kind": "hang", "trial": trial_no, "life": life_no, "command": entry["command"]}
                failures.append(f)
                trial["failures"].append(f)
            if res["killed"]:
                kills += 1
                after = run_state(d, cfg["tasks"], cfg["pool_epochs"], cfg["epochs"])
                phase = phase_of(after, life.printed_conversion, life.manifest_at_start, cfg["tasks"])
                chk = checker.check(d, ref)
                tmps = tmp_files(d)
                label = (
                    f"write:{plan.trigger}"
                    if plan and plan.strategy == "write"
                    else (plan.strategy if plan else "timeout")
                )
                recs = life.new_records()
                last_rec = {k: recs[-1].get(k) for k in ("stage", "epoch", "event")} if recs else None
                entry.update(
                    strategy=label,
                    phase=phase,
                    state_after=after,
                    check=chk,
                    tmp_after_kill=tmps,
                    trigger=res.get("trigger"),
                    last_record=last_rec,
                )
                for kind, items in (
                    ("invalid after kill", chk["errors"]),
                    ("reference mismatch after kill", chk["ref_mismatch"]),
                ):
                    if items:
                        f = {
                            "kind": kind,
                            "trial": trial_no,
                            "life": life_no,
                            "dir": str(d),
                            "detail": items,
                            "plan": entry["plan"],
                            "phase": phase,
                        }
                        failures.append(f)
                        trial["failures"].append(f)
                log(
                    f"  life {life_no} [{entry['start']}] killed {plan.describe() if plan else 'timeout'} at {res['t']:.2f}s"
                    + (f" (saw {res['trigger']['file']})" if res.get("trigger") else "")
                    + f"; phase: {phase}"
                    + (
                        f" (last record {last_rec['stage']} {last_rec['event'] or 'epoch ' + str(last_rec['epoch'])})"
                        if last_rec
                        else ""
                    )
                    + f"; manifest {'ok' if chk['manifest'] and not chk['errors'] else ('-' if not chk['manifest'] else 'BAD')}, "
                    f"{chk['tasks']} task(s) ok{', ' + str(len(tmps)) + ' tmp left' if tmps else ''}"
                    + (
                        f"; ERRORS {chk['errors'] + chk['ref_mismatch']}"
                        if chk["errors"] or chk["ref_mismatch"]
                        else ""
                    )
                )
                consecutive_fail = 0
            elif res["rc"] == 0:
                fin = checker.check(d, ref)
                entry["final"] = final = {"check": fin}
                try:
                    rec = checker.record(d)
                except Exception as e:  # noqa: BLE001
                    rec = None
                    fin["errors"].append(f"record: {type(e).__name__}: {e}")
                missing = sorted(set(ref["tasks"]) - set(rec["tasks"])) if rec else list(ref["tasks"])
                if missing:
                    fin["ref_mismatch"].append(f"tasks missing: {missing}")
                if rec and rec["pool_file_sha256"] != ref["pool_file_sha256"]:
                    final["pool_file_bytes_differ"] = True
                final["metric_diffs"] = metric_diffs(rec, ref) if rec else []
                final["tmp_files"] = tmp_files(d)
                final["log"] = log_checks(d)
                final["leftover_checkpoint"] = (d / "checkpoints" / "last.safetensors").is_file()
                final["identical"] = not fin["errors"] and not fin["ref_mismatch"]
                for kind, bad in (
                    ("final run invalid", fin["errors"]),
                    ("final run differs from reference", fin["ref_mismatch"]),
                    ("tmp file left after success", final["tmp_files"]),
                    ("duplicate done records", final["log"]["duplicate_done"]),
                ):
                    if bad:
                        f = {"kind": kind, "trial": trial_no, "dir": str(d), "detail": bad}
                        failures.append(f)
                        trial["failures"].append(f)
                trial["metric_diffs"] = final["metric_diffs"]
                log(
                    f"  life {life_no} [{entry['start']}] exit 0 at {res['t']:.1f}s; "
                    f"{'IDENTICAL to reference' if final['identical'] else 'DIFFERS: ' + str(fin['errors'] + fin['ref_mismatch'])}"
                    f"{'; tmp left ' + str(final['tmp_files']) if final['tmp_files'] else ''}"
                    f"{'; duplicate done ' + str(final['log']['duplicate_done']) if final['log']['duplicate_done'] else ''}"
                    f"{'; other metrics differ: ' + str(len(final['metric_diffs'])) if final['metric_diffs'] else ''}"
                )
                ended = True
                trial["identical"] = final["identical"]
                if plan is not None:  # the process finished before the planned kill: give it to a later trial
                    todo.insert(0, plan.strategy)
                    entry["missed_kill"] = True
                todo[:0] = mine
            else:
                consecutive_fail += 1
                f = {
                    "kind": f"process exited {res['rc']} (not killed)",
                    "trial": trial_no,
                    "life": life_no,
                    "command": entry["command"],
                    "stderr": sf["lines"],
                    "dir": str(d),
                }
                failures.append(f)
                trial["failures"].append(f)
                log(f"  life {life_no} [{entry['start']}] EXIT {res['rc']} at {res['t']:.1f}s: {sf['lines']}")
                if plan is not None:
                    todo.insert(0, plan.strategy)
                if consecutive_fail >= 3:
                    log("  three failed resumes in a row: trial abandoned")
                    trial["abandoned"] = True
                    trial["identical"] = False
                    ended = True
            trial["lives"].append(entry)
        trial["kills"] = sum(1 for e in trial["lives"] if e["killed"])
        trial["resumes"] = len(trial["lives"]) - 1
        # concurrent pair on a finished run
        if args.pair_finished_every and trial_no % args.pair_finished_every == 0 and not trial.get("abandoned"):
            before = checker.record(d)
            winner, pair = start_pair(d, job_args, logs, f"trial_{trial_no:03d}_finished_pair", rng)
            pair["trial"], pair["on"] = trial_no, "finished run"
            if winner is not None:
                rc = winner.p.wait(timeout=args.life_timeout)
                pair["winner_rc"] = rc
                werr = winner.stderr()
                if rc != 0 or "Traceback" in werr:
                    pair["ok"] = False
                    pair["problem"] = (pair.get("problem") or "") + f" winner exit {rc}: {werr.strip()[-300:]}"
                after = checker.record(d)
                if (
                    after["pool_sha256"],
                    after["base_sha256"],
                    {t: r["sha256"] for t, r in after["tasks"].items()},
                ) != (
                    before["pool_sha256"],
                    before["base_sha256"],
                    {t: r["sha256"] for t, r in before["tasks"].items()},
                ):
                    pair["ok"] = False
                    pair["problem"] = (pair.get("problem") or "") + " the finished run changed"
                if tmp_files(d):
                    pair["ok"] = False
                    pair["problem"] = (pair.get("problem") or "") + f" tmp left {tmp_files(d)}"
            pairs.append(pair)
            if not pair["ok"]:
                f = {
                    "kind": "concurrent writers",
                    "trial": trial_no,
                    "dir": str(d),
                    "detail": pair.get("problem"),
                    "commands": pair["commands"],
                }
                failures.append(f)
                trial["failures"].append(f)
            log(
                f"  concurrent --resume pair on the finished run: {'ok' if pair['ok'] else 'FAILED: ' + str(pair.get('problem'))} (loser: {pair.get('loser')})"
            )
        trials.append(trial)
        log(
            f"trial {trial_no} done: {trial['kills']} kill(s), {trial['resumes']} resume(s), identical={trial.get('identical')}; kills so far {kills}/{args.kills}"
        )

    # ---- counts
    lives = [e for t in trials for e in t["lives"]]
    killed = [e for e in lives if e["killed"]]
    by_strategy = collections.Counter(e["strategy"] for e in killed)
    by_phase = collections.Counter(e["phase"] for e in killed)
    by_strategy_phase = collections.Counter(f"{e['strategy']} | {e['phase']}" for e in killed)
    fkinds = collections.Counter(f["kind"] for f in failures)
    metric_diff_trials = [t["trial"] for t in trials if t.get("metric_diffs")]
    metric_diff_fields = collections.Counter(
        d.split(":")[0].split(".", 2)[-1] if d.startswith("tasks[") else d.split(":")[0]
        for t in trials
        for d in t.get("metric_diffs", [])
    )
    counts = {
        "kills": len(killed),
        "kills_by_strategy": dict(sorted(by_strategy.items())),
        "kills_by_phase": dict(sorted(by_phase.items())),
        "kills_by_strategy_and_phase": dict(sorted(by_strategy_phase.items())),
        "kills_before_manifest": sum(
            1 for e in killed if e["phase"].startswith("startup: before") or e["phase"].startswith("startup: job.json")
        ),
        "kills_leaving_tmp_file": sum(1 for e in killed if e["tmp_after_kill"]),
        "kills_with_manifest_checked": sum(1 for e in killed if e["check"]["manifest"]),
        "post_kill_invalid": fkinds.get("invalid after kill", 0),
        "post_kill_reference_mismatch": fkinds.get("reference mismatch after kill", 0),
        "trials": len(trials),
        "resumes": sum(t["resumes"] for t in trials),
        "resumes_per_trial": dict(sorted(collections.Counter(t["resumes"] for t in trials).items())),
        "resume_modes": dict(collections.Counter(e["stderr_mode"] or "normal" for e in lives if e["life"] > 1)),
        "resume_styles": dict(collections.Counter(e["start"] for e in lives if e["life"] > 1)),
        "missed_kills": sum(1 for e in lives if e.get("missed_kill")),
        "final_identical": sum(1 for t in trials if t.get("identical")),
        "final_differs": sum(1 for t in trials if not t.get("identical")),
        "tmp_left_after_success": fkinds.get("tmp file left after success", 0),
        "duplicate_done_runs": fkinds.get("duplicate done records", 0),
        "tracebacks": fkinds.get("traceback on stderr", 0),
        "unexpected_exits": sum(n for k, n in fkinds.items() if k.startswith("process exited")),
        "hangs": fkinds.get("hang", 0),
        "concurrent_pairs": len(pairs),
        "concurrent_pairs_ok": sum(1 for p in pairs if p["ok"]),
        "concurrent_pairs_on_unfinished": sum(1 for p in pairs if p["on"] == "unfinished run"),
        "concurrent_pairs_on_finished": sum(1 for p in pairs if p["on"] == "finished run"),
        "runs_with_other_metric_differences": len(metric_diff_trials),
        "other_metric_difference_fields": dict(metric_diff_fields),
        "epoch_records_repeated_runs": sum(
            1 for e in lives if e.get("final", {}).get("log", {}).get("epoch_records_repeated")
        ),
        "leftover_checkpoint_after_success": sum(1 for e in lives if e.get("final", {}).get("leftover_checkpoint")),
        "failures": len(failures),
        "failures_by_kind": dict(fkinds),
    }
    wall = now() - wall0
    result = {
        "benchmark": "kill_resume",
        "command": command,
        "started": started,
        "wall_s": round(wall, 1),
        "git": head,
        "git_at_end": git_rev(),
        "source": source,
        "versions": versions(),
        "machine": machine(),
        "job": args.job,
        "args": vars(args),
        "reference": {"runs": refs, "timeline": timelines},
        "counts": counts,
        "failures": failures,
        "pairs": pairs,
        "trials": trials,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")

    # ---- summary table
    rows = [("kills (SIGKILL) total", counts["kills"])]
    rows += [(f"  strategy {k}", v) for k, v in counts["kills_by_strategy"].items()]
    rows += [(f"  phase {k}", v) for k, v in counts["kills_by_phase"].items()]
    rows += [
        ("  kills before manifest.json existed", counts["kills_before_manifest"]),
        ("  kills that left a .*.tmp file (cleaned by the next writer)", counts["kills_leaving_tmp_file"]),
        ("  missed (process finished before the planned kill)", counts["missed_kills"]),
        ("trials (fresh run directories)", counts["trials"]),
        ("resumes needed", counts["resumes"]),
        ("final runs identical to the reference", f"{counts['final_identical']}/{counts['trials']}"),
        (
            "concurrent --resume pairs with exactly one writer",
            f"{counts['concurrent_pairs_ok']}/{counts['concurrent_pairs']}",
        ),
        ("failures:", ""),
        ("  manifest/pack invalid after a kill", counts["post_kill_invalid"]),
        ("  hash/accuracy mismatch vs reference after a kill", counts["post_kill_reference_mismatch"]),
        ("  final run differs from the reference", counts["final_differs"]),
        ("  .*.tmp file left after success", counts["tmp_left_after_success"]),
        ("  duplicate 'done' records", counts["duplicate_done_runs"]),
        ("  tracebacks printed", counts["tracebacks"]),
        ("  unexpected non-zero exits", counts["unexpected_exits"]),
        ("  hangs", counts["hangs"]),
        ("  concurrent pairs failed", counts["concurrent_pairs"] - counts["concurrent_pairs_ok"]),
        ("not failures (reported):", ""),
        ("  runs with other recorded metrics differing", counts["runs_with_other_metric_differences"]),
        ("  runs with an epoch logged twice", counts["epoch_records_repeated_runs"]),
        ("  runs with checkpoints/last.safetensors left", counts["leftover_checkpoint_after_success"]),
        ("wall time", f"{wall / 60:.1f} min"),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    print(f"kill/resume at {source['rev'] or 'worktree ' + head}  job: {args.job}")
    print(f"{'':-<{width}}  ------")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if counts["other_metric_difference_fields"]:
        print(f"other metric fields differing: {counts['other_metric_difference_fields']}")
    for f in failures:
        print(f"FAILURE {f['kind']}: trial {f.get('trial')} {f.get('dir', '')} {f.get('detail', f.get('stderr', ''))}")
    print(f"raw results: {out_path}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
