"""Command line ``nws-report RUN``: kernel-selection plots and one self-contained HTML page."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UsageError
from ..train.rundir import RunDir
from .common import run_cli

__all__ = ["report_main"]

_EPILOG = """\
files written to --out (default RUN/report):
  report.html               every figure inline + tables of the numbers; opens offline
  kur.png                   kernel utilisation ratio (unique chosen / pool size), layers x tasks
  ls.png                    layer sparsity (share of kernels whose pool entry is chosen < sqrt(d) times)
  selection_task_<id>.png   selection rate h_i / d per pool entry i, one subplot per layer
  bytes_task.png            bytes per task: indices, BN/state, head
  bytes_layer.png           index bytes per task and shared pool bytes, per layer
  accuracy.png              validation accuracy per task
  analysis.json             the numbers behind the figures

examples:
  nws-report runs/split-mnist-resnet18
  nws-report runs/a --tasks 0 3 --out /tmp/a-report
"""


def report_main(argv: list[str] | None = None) -> int:
    """Entry point of ``nws-report``; returns the exit status (0 ok, 2 bad run / task, 1 damaged file)."""
    return run_cli("nws-report", _report, argv)


def _report(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="nws-report",
        description="Analyse which pool kernels a run's tasks chose (paper Sec. 5.7 and App. F) and write "
        "PNG plots plus one self-contained HTML page.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("run", metavar="RUN", help="run directory written by nws-train / nwsconvert.Trainer")
    parser.add_argument("--out", metavar="DIR", default=None, help="output folder (default: RUN/report)")
    parser.add_argument(
        "--tasks",
        metavar="ID",
        type=int,
        nargs="+",
        default=None,
        help="task ids to include, in this order (default: every finished task)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args = parser.parse_args(argv)
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a file, not a folder: give a folder for the report")
    try:
        manifest = RunDir(args.run).read()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    done = manifest.finished
    if not done:
        raise UsageError(
            f"run {args.run} has no finished tasks yet: nothing to report (nws-train --resume finishes it)"
        )
    missing = [t for t in args.tasks or () if t not in done]
    if missing:
        raise UsageError(
            f"--tasks {missing[0]}: run {args.run} has no finished task {missing[0]}; finished tasks: {done or 'none'}"
        )

    from ..analysis.html import write_report

    paths = write_report(args.run, args.out, args.tasks)
    print(f"wrote {paths['html']} ({len(paths['figures'])} figures, numbers in {paths['json']})")
    return 0


if __name__ == "__main__":
    sys.exit(report_main())
