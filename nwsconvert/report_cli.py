"""Command line ``nws-report RUN``: kernel-selection plots and one self-contained HTML page."""

from __future__ import annotations

import argparse
import sys

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
    """Entry point of ``nws-report``; returns the exit status (0 ok, 2 bad run / task)."""
    parser = argparse.ArgumentParser(
        prog="nws-report",
        description="Analyse which pool kernels a run's tasks chose (paper Sec. 5.7 and App. F) and write "
        "PNG plots plus one self-contained HTML page.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    parser.add_argument("run", metavar="RUN", help="run directory written by nws-train / nwsconvert.Trainer")
    parser.add_argument("--out", metavar="DIR", default=None, help="output folder (default: RUN/report)")
    parser.add_argument("--tasks", metavar="ID", type=int, nargs="+", default=None,
                        help="task ids to include, in this order (default: every finished task)")
    args = parser.parse_args(argv)

    from .report_html import write_report
    from .storage import FormatError

    try:
        paths = write_report(args.run, args.out, args.tasks)
    except KeyError as e:
        print(f"nws-report: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FormatError, ValueError) as e:
        print(f"nws-report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {paths['html']} ({len(paths['figures'])} figures, numbers in {paths['json']})")
    return 0


if __name__ == "__main__":
    sys.exit(report_main())
