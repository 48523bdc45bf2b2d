"""Command line ``nws-info RUN``: per-task accuracy and memory of a run in the paper's accounting."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import UsageError
from ..train.rundir import RunDir
from .common import run_cli

__all__ = ["info_main"]


def _info(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="nws-info",
        description="Per-task accuracy and memory of a run in the paper's accounting: pool set + per-task "
        "indices + BN statistics + heads, beside dense finetune (one float32 model per task).",
    )
    parser.add_argument("run", metavar="RUN", help="run directory written by nws-train / nwsconvert.Trainer")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (bytes, accuracy in 0..1)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args = parser.parse_args(argv)
    try:
        RunDir(args.run).read()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    from ..analysis.summary import format_summary, run_summary

    summary = run_summary(args.run)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def info_main(argv: list[str] | None = None) -> int:
    """``nws-info RUN``: returns the exit code."""
    return run_cli("nws-info", _info, argv)


if __name__ == "__main__":
    sys.exit(info_main())
