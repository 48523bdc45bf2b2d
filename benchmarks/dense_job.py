"""Dense finetune's whole job as its own process: what ``nws-train``'s job is timed against.

    python benchmarks/dense_job.py --suite long-mixed-20            # pretraining, then every task
    /usr/bin/time -v python benchmarks/dense_job.py --suite long-mixed-20

The same work :mod:`benchmarks.task_time` times as dense's side, in a fresh process, so that a
whole-process timing of ``nws-train suite=long-mixed-20`` beside this one counts the imports, the
suite's loading and the model's construction on both sides: the dense model built as the NWS run's
(``nws-train``'s keys, the same seed), pretrained on the suite's pretraining split with the pool-learning
recipe, then finetuned task after task with the task recipe, each task stored and evaluated from its
files (``benchmarks/baselines.py``'s ``dense``). Prints one line: the seconds and the average accuracy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from accuracy import METHODS, pretrained_model  # benchmarks/ is on sys.path

from nwsconvert.train.job import resolve_job, train_config
from nwsconvert.zoo import get_suite


def main(argv=None) -> int:
    tic = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("items", nargs="*", help="nws-train keys (the job dense's side copies)")
    p.add_argument("--suite", default="long-mixed-20")
    p.add_argument("--tasks", type=int, default=None, help="the first N tasks (default: every task, as nws-train)")
    p.add_argument("--seed", type=int, default=1993)
    args = p.parse_args(argv)
    tasks = [f"tasks={args.tasks}"] if args.tasks else []
    job = resolve_job([f"suite={args.suite}", "progress=false", f"seed={args.seed}", *tasks, *args.items])
    suite = get_suite(job["suite"], **job["suite_options"])  # loaded once, as nws-train loads it
    pretrained = pretrained_model(job, args.seed, suite)
    # What accuracy.method_run does for "dense", less its bookkeeping (the memory curve after every task,
    # the final re-evaluation of every task): train, store and evaluate each task from its file.
    with tempfile.TemporaryDirectory() as tmp:
        method = METHODS["dense"](pretrained, f"{tmp}/dense", train_config({**job, "seed": args.seed}), args.seed)
        accs = [
            method.learn(t, task) for t, task in enumerate(suite.tasks[: args.tasks] if args.tasks else suite.tasks)
        ]
    print(
        f"dense finetune, {args.suite}: {time.perf_counter() - tic:.1f} s in this process, "
        f"average {100 * sum(accs) / len(accs):.2f} % (each task's accuracy re-loaded from its file)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
