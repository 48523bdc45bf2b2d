"""Where an NWS task's wall time goes, beside dense finetune's, in one process on one machine.

Runs ``nws-train``'s job (the defaults: k-means pools of 512, the demo recipe) for the first
``--tasks`` tasks of a suite, then ``benchmarks/baselines.py``'s dense finetune on the same tasks
from the same pretraining, and splits each one's wall time into phases by timing the functions
that do them:

* NWS: conversion (k-means), pool learning, and per task the training steps, the per-epoch
  validation, BatchNorm recalibration, checkpoint writes, the pack's write and the check that the
  model rebuilt from the pack scores what the trained one does (rebuild + both evaluations);
* dense: pretraining, and per task training (recalibration included), storing and evaluating.

Both run in this process, NWS first: the model's library (timm) is imported before either is timed, so
that neither pays its import (before 2026-11-27 the NWS job paid it, about 2 s, and dense, run after
it, did not). The whole jobs as separate processes, imports and all, are timed side by side by
``nws-train suite=...`` against ``benchmarks/dense_job.py --suite ...`` (``benchmarks/RESULTS.md``).

    python benchmarks/task_time.py --suite long-mixed-20 --tasks 6 --json benchmarks/results/task_time.json
    python benchmarks/task_time.py checkpoint_interval=0 --tasks 6   (a checkpoint after every epoch, as before)

Items before the flags are ``nws-train`` keys, as in ``benchmarks/accuracy.py``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
import time

from accuracy import _commit, _machine, method_run, pretrained_model  # benchmarks/ is on sys.path

from nwsconvert.formats.atomic import atomic_write_bytes
from nwsconvert.train import job as job_module
from nwsconvert.train import stage, store, trainer
from nwsconvert.train.job import resolve_job, run_job


class Phases:
    """Seconds spent inside named functions; a function called inside another timed one counts
    only in the inner phase (the outer one gets its own time minus the inner)."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self._stack: list[list] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        frame = [name, 0.0]  # name, seconds of inner phases
        self._stack.append(frame)
        tic = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - tic
            self._stack.pop()
            self.seconds[name] += spent - frame[1]
            if self._stack:
                self._stack[-1][1] += spent

    def wrap(self, owner, attr: str, name: str, patches: list) -> None:
        """Time every call of ``owner.attr`` as phase ``name`` (put back from ``patches`` by the caller).
        A name starting with ``*`` is shared by both stages: ``pool learning: ...`` inside pool
        learning, ``task: ...`` otherwise."""
        real = getattr(owner, attr)

        def timed(*args, **kwargs):
            label = name
            if name.startswith("*"):
                pools = any(frame[0] == "pool learning" for frame in self._stack)
                label = ("pool learning: " if pools else "task: ") + name[1:]
            with self.phase(label):
                return real(*args, **kwargs)

        patches.append((owner, attr, real))
        setattr(owner, attr, timed)


def nws_phases(job: dict, folder: str) -> dict:
    phases, patches = Phases(), []
    for owner, attr, name in [
        (job_module, "convert_job", "conversion (k-means)"),
        (trainer.Trainer, "fit_pools", "pool learning"),
        (trainer.Trainer, "fit_task", "task: other (start, search)"),
        (stage, "train_one_epoch", "*training steps"),
        (stage, "evaluate", "*validation per epoch"),
        (stage, "update_bn", "task: BatchNorm recalibration"),
        (stage, "save_checkpoint", "*checkpoints"),
        (trainer.Trainer, "_finish_task", "task: rebuild check (evaluations)"),
        (store.RunStore, "write_pack", "task: pack write"),
        (store.RunStore, "rebuild", "task: rebuild from the pack"),
    ]:
        phases.wrap(owner, attr, name, patches)
    try:
        tic = time.perf_counter()
        with phases.phase("other (suite, model, manifest)"):
            run_job({**job, "out": folder})
        total = time.perf_counter() - tic
    finally:
        for owner, attr, real in reversed(patches):
            setattr(owner, attr, real)
    return {"total": total, "phases": dict(phases.seconds)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", help="nws-train keys")
    p.add_argument("--suite", default="long-mixed-20")
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--seed", type=int, default=1993)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    commit = _commit()
    job = resolve_job(
        [f"suite={args.suite}", "progress=false", f"tasks={args.tasks}", f"seed={args.seed}", *args.items]
    )
    if job["model"].startswith("timm:"):
        import timm  # noqa: F401  (imported for both sides: see the module docstring)
    with tempfile.TemporaryDirectory() as tmp:
        nws = nws_phases(job, f"{tmp}/run")
        tic = time.perf_counter()
        pre = pretrained_model(job, args.seed)
        pretrain = time.perf_counter() - tic
        dense = method_run("dense", pre, job, args.seed, f"{tmp}/dense")
    dense_total = pretrain + dense["seconds"]
    result = {
        "suite": args.suite,
        "tasks": args.tasks,
        "job": job,
        "commit": commit,
        "machine": _machine(),
        "nws": nws,
        "dense": {"total": dense_total, "pretraining": pretrain, "tasks": dense["seconds"]},
        "ratio": nws["total"] / dense_total,
    }
    print(f"{args.suite}, first {args.tasks} tasks, {job['model']}, recipe {job['recipe']}, seed {args.seed}")
    print(f"  NWS job: {nws['total']:.1f} s")
    for name, sec in sorted(nws["phases"].items(), key=lambda kv: -kv[1]):
        per_task = f"  ({sec / args.tasks:.2f} s per task)" if name.startswith("task") else ""
        print(f"    {name:<40} {sec:7.2f} s{per_task}")
    print(f"  dense finetune: {dense_total:.1f} s (pretraining {pretrain:.1f} s, tasks {dense['seconds']:.1f} s)")
    print(f"  ratio NWS / dense: {result['ratio']:.2f}x")
    if args.json:
        atomic_write_bytes(args.json, json.dumps(result, indent=2).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
