"""Accuracy against bytes per added task: NWS's budget swept, every peer beside it.

Reads two ``benchmarks/accuracy.py --json`` files of one job: ``MAIN`` (NWS at its default and
every peer, any seeds) and ``SWEEP`` (``--nws-variants bits_per_weight=...``, on seeds ``MAIN``
has too). Left panel: the seeds the sweep ran, NWS's budgets joined by a line, labelled in bits a
weight (``off``: the preset's old scalar rule, 9 bits); right panel: ``MAIN``'s mean ± std over
its seeds (NWS's default from ``SWEEP`` where the sweep ran every one of them: a later run of it). The x axis is what a task adds on disk (the last file total minus the first, over the
tasks after the first), log scale.

    python benchmarks/plot_budget.py benchmarks/results/accuracy_long20_mobilenetv3_small.json \\
        benchmarks/results/accuracy_long20_mobilenetv3_small_budgets.json --out benchmarks/results/budget_curve.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from plot_accuracy import STYLE  # benchmarks/ is on sys.path when this script runs

from nwsconvert.analysis.html import byte_formatter, figure_png, new_figure
from nwsconvert.formats.atomic import atomic_write_bytes

#: the default budget of ``preset=inverted-residual`` (what plain ``nws`` ran with)
DEFAULT_BITS = 2.0
OLD_RULE_BITS = 9.0


def per_added_task(run: dict) -> float:
    """Bytes a task adds on disk: (last total - first total) / (tasks - 1)."""
    disk = run["curve"]["disk_bytes"]
    return (disk[-1] - disk[0]) / max(1, len(disk) - 1)


def bits_of(method: str) -> float | None:
    """``nws`` -> the default budget, ``nws[bits_per_weight=B]`` -> B (``off``: the scalar rule), else ``None``."""
    if method == "nws":
        return DEFAULT_BITS
    if method.startswith("nws[bits_per_weight="):
        value = method[len("nws[bits_per_weight=") : -1]
        return OLD_RULE_BITS if value in ("off", "False") else float(value)
    return None


def _points(rows: list[dict]) -> dict[str, tuple[float, float, float]]:
    """method -> (mean accuracy %, std, mean bytes per added task) over ``rows``."""
    out = {}
    methods = {k for r in rows for k, v in r.items() if isinstance(v, dict) and "curve" in v}
    for m in methods:
        runs = [r[m] for r in rows if m in r]
        accs = [100 * run["avg"] for run in runs]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        out[m] = (statistics.mean(accs), std, statistics.mean(per_added_task(run) for run in runs))
    return out


def _panel(ax, points: dict[str, tuple[float, float, float]], title: str) -> None:
    curve = sorted((bits_of(m), p) for m, p in points.items() if bits_of(m) is not None)
    ax.plot(
        [p[2] for _, p in curve],
        [p[0] for _, p in curve],
        "-o",
        color=STYLE["nws"][1],
        label="NWS (labels: bits a weight)",
    )
    for bits, (acc, std, size) in curve:
        label = "9 (old rule)" if bits == OLD_RULE_BITS else f"{bits:g}"
        weight = "bold" if bits == DEFAULT_BITS else "normal"
        ax.annotate(label, (size, acc), textcoords="offset points", xytext=(4, 5), fontsize=8, fontweight=weight)
        if std:
            ax.errorbar([size], [acc], yerr=[std], color=STYLE["nws"][1], capsize=3)
    for m, (acc, std, size) in sorted(points.items()):
        if bits_of(m) is not None or m.startswith("nws["):
            continue
        label, colour = STYLE.get(m, (m, "#333333"))
        ax.errorbar([size], [acc], yerr=[std] if std else None, fmt="o", color=colour, capsize=3, label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(byte_formatter(compact=True))
    ax.set_xlabel("bytes a task adds on disk (log scale)")
    ax.set_ylabel("average accuracy, %")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("main", type=Path)
    p.add_argument("sweep", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    main_result, sweep = json.loads(args.main.read_text()), json.loads(args.sweep.read_text())
    seeds = {r["seed"] for r in sweep["rows"]}
    by_seed = {r["seed"]: r for r in sweep["rows"]}
    merged = [{**r, **by_seed[r["seed"]]} for r in main_result["rows"] if r["seed"] in seeds]
    model = main_result["job"]["model"].split(":")[-1]
    fig = new_figure(13, 4.6)
    left, right = fig.subplots(1, 2)
    _panel(left, _points(merged), f"{main_result['suite']}, {model}: budget in bits a weight (seed {sorted(seeds)})")
    # The right panel: MAIN's methods over its seeds; where the sweep ran NWS's default on every one
    # of them (a later run, e.g. after a pack format change), its NWS figures replace MAIN's.
    rows = merged if seeds >= {r["seed"] for r in main_result["rows"]} else main_result["rows"]
    methods = {k for r in main_result["rows"] for k, v in r.items() if isinstance(v, dict) and "curve" in v}
    n = len(main_result["rows"])
    right_points = {m: pt for m, pt in _points(rows).items() if m in methods}
    _panel(right, right_points, f"{main_result['suite']}, {model}: defaults, {n} seeds")
    atomic_write_bytes(args.out, figure_png(fig))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
