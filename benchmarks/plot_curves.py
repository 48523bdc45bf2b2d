"""Many tasks, task by task: memory, accuracy so far and PackNet's capacity after each task learned.

Reads ``benchmarks/accuracy.py --json`` files (written since the per-task curves were recorded) and
draws one row of three panels per file:

* memory on disk (files: shared parts + every task's) against the number of tasks learned, log scale;
* the average accuracy over the tasks learned so far, after each task (each task's accuracy as
  re-loaded from its files right after it was learned: no method here changes a stored task, so
  that is also its accuracy after any later task; ``accuracy.py`` re-evaluates every task at the
  end, and this script checks the two agree);
* PackNet's free capacity: the share of its prunable weights no task owns yet.

Lines are means over the seeds a method ran (shaded: ± std where it ran more than one).

    python benchmarks/plot_curves.py benchmarks/results/accuracy_long_mixed_20.json \\
        benchmarks/results/accuracy_long_mixed_50.json --out benchmarks/results/long_sequences.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from plot_accuracy import STYLE  # benchmarks/ is on sys.path when this script runs

from nwsconvert.analysis.html import byte_formatter, figure_png, new_figure
from nwsconvert.formats.atomic import atomic_write_bytes


def learned_accs(figures: dict) -> list[float]:
    """Each task's accuracy (%) right after it was learned: NWS records it in its run (``accs`` are the
    manifest's figures, taken from the pack's rebuild check); a baseline in ``curve.learned_accs``.

    Raises ValueError when a baseline's final re-evaluation differs from its learned figure: the
    curve would then not be the accuracy after later tasks."""
    curve = figures["curve"]
    if "learned_accs" not in curve:
        return [100 * a for a in figures["accs"]]
    changed = [t for t, (a, b) in enumerate(zip(curve["learned_accs"], figures["accs"])) if a != b]
    if changed:
        raise ValueError(f"tasks {changed[:5]} score otherwise at the end than right after they were learned")
    return [100 * a for a in curve["learned_accs"]]


def running_mean(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        out.append(total / (i + 1))
    return out


def method_curves(result: dict) -> dict:
    """method -> ``{'acc': (mean, std) per task count, 'bytes': mean per task count, 'free': ... | None,
    'seeds': n}`` over the rows (seeds) that ran the method."""
    out = {}
    for m in result["methods"]:
        rows = [row[m] for row in result["rows"] if m in row and "curve" in row[m]]
        if not rows:
            continue
        accs = [running_mean(learned_accs(r)) for r in rows]
        n = min(len(a) for a in accs)

        def stats(series, n=n):
            return (
                [statistics.mean(s[t] for s in series) for t in range(n)],
                [statistics.stdev(s[t] for s in series) if len(series) > 1 else 0.0 for t in range(n)],
            )

        free = [r["curve"]["free_fraction"] for r in rows if "free_fraction" in r["curve"]]
        out[m] = {
            "acc": stats(accs),
            "bytes": stats([r["curve"]["disk_bytes"] for r in rows])[0],
            "free": stats([[100 * f for f in s] for s in free])[0] if free else None,
            "seeds": len(rows),
        }
    return out


def figure(results: list[tuple[Path, dict]]):
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = new_figure(17.0, 4.3 * len(results))
    axes = fig.subplots(len(results), 3, squeeze=False)
    for (mem, acc, cap), (_path, result) in zip(axes, results):
        curves = method_curves(result)
        for m, c in curves.items():
            label, colour = STYLE.get(m, (m, "#333333"))
            label += f" ({c['seeds']} seed{'s' if c['seeds'] > 1 else ''})"
            tasks = list(range(1, len(c["acc"][0]) + 1))
            width = 2.4 if m == "nws" else 1.3
            mem.plot(range(1, len(c["bytes"]) + 1), c["bytes"], color=colour, lw=width, label=label)
            mean, std = c["acc"]
            acc.plot(tasks, mean, color=colour, lw=width, label=label)
            if c["seeds"] > 1:
                acc.fill_between(
                    tasks,
                    [a - s for a, s in zip(mean, std)],
                    [a + s for a, s in zip(mean, std)],
                    color=colour,
                    alpha=0.12,
                )
            if c["free"] is not None:
                cap.plot(range(1, len(c["free"]) + 1), c["free"], color=colour, lw=width, marker="o", ms=3, label=label)
        name = f"{result['suite']} ({result['job']['model']}, recipe {result['job']['recipe']})"
        mem.set_yscale("log")
        mem.yaxis.set_major_formatter(byte_formatter(compact=True))
        mem.set_title(f"{name}\nmemory on disk after each task", fontsize=9)
        mem.set_ylabel("files on disk (log scale)")
        acc.set_title(f"{name}\naverage accuracy over the tasks learned so far", fontsize=9)
        acc.set_ylabel("%, mean over seeds (± std shaded)")
        cap.set_title(f"{name}\nPackNet: weights still free for later tasks", fontsize=9)
        cap.set_ylabel("% of prunable weights (log scale)")
        cap.set_yscale("log")
        if not any(c["free"] for c in curves.values()):
            cap.text(0.5, 0.5, "no PackNet run in this file", ha="center", va="center", transform=cap.transAxes)
        cap.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g} %"))
        for ax in (mem, acc, cap):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("tasks learned")
            ax.grid(alpha=0.3)
        acc.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="JSON files of benchmarks/accuracy.py --json")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    results = []
    for path in args.results:
        try:
            result = json.loads(path.read_text())
        except FileNotFoundError:
            p.error(f"{path}: no such file")
        except json.JSONDecodeError as e:
            p.error(f"{path}: not an accuracy.py JSON ({e.msg} at line {e.lineno})")
        rows = result.get("rows") or ([result["partial"]] if result.get("partial") else [])
        if not any("curve" in f for row in rows for f in row.values() if isinstance(f, dict)):
            p.error(f"{path}: no per-task curves (written by an accuracy.py older than them); run it again")
        results.append((path, {**result, "rows": rows}))
    atomic_write_bytes(args.out, figure_png(figure(results)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
