"""Accuracy against bytes per added task: NWS's budget swept, every peer beside it.

Reads ``benchmarks/accuracy.py --json`` files of one suite and model: ``MAIN`` (NWS at its default and
every peer, any seeds) and ``SWEEP`` (``--nws-variants bits_per_weight=...``, on seeds ``MAIN`` has
too), and with ``--vectors`` a second sweep drawn beside the first (another layout, e.g. the vector
plan the preset used before its scalar pools). Left panel: the seeds the sweep ran, NWS's budgets
joined by a line per sweep, labelled in bits a weight (``off``: the preset's old scalar rule, 9 bits;
the sweep's own default in bold); right panel: ``MAIN``'s mean ± std over its seeds (NWS's default
from ``SWEEP`` where the sweep ran every one of them: a later run of it). The x axis is what a task
adds on disk (the last file total minus the first, over the tasks after the first), log scale.

    python benchmarks/plot_budget.py benchmarks/results/accuracy_long20_mobilenetv3_small.json \\
        benchmarks/results/accuracy_long20_mobilenetv3_small_budgets_scalar.json \\
        --vectors benchmarks/results/accuracy_long20_mobilenetv3_small_budgets_v5.json \\
        --out benchmarks/results/budget_curve.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from plot_accuracy import STYLE  # benchmarks/ is on sys.path when this script runs

from nwsconvert.analysis.html import byte_formatter, figure_png, new_figure
from nwsconvert.formats.atomic import atomic_write_bytes

#: the budget plain ``nws`` ran with where a file's job names none: ``preset=inverted-residual``'s before
#: its scalar pools (2 bits, vectors allowed); since then a job of the preset's default records none either,
#: so a sweep of today's default names its keys (``bits_per_weight=3.25 'group_sizes=[1]'``)
UNNAMED_DEFAULT_BITS = 2.0
OLD_RULE_BITS = 9.0


def per_added_task(run: dict) -> float:
    """Bytes a task adds on disk: (last total - first total) / (tasks - 1)."""
    disk = run["curve"]["disk_bytes"]
    return (disk[-1] - disk[0]) / max(1, len(disk) - 1)


def default_bits(result: dict) -> float:
    """The budget of a file's plain ``nws``: its job's ``bits_per_weight``, else :data:`UNNAMED_DEFAULT_BITS`."""
    bits = result["job"].get("bits_per_weight")
    return UNNAMED_DEFAULT_BITS if bits in (None, False) else float(bits)


def bits_of(method: str, default: float) -> float | None:
    """``nws`` -> ``default``, ``nws[bits_per_weight=B]`` -> B (``off``: the scalar rule; other keys beside
    it, such as ``group_sizes=null``, are the budget's own), else ``None``."""
    if method == "nws":
        return default
    if not method.startswith("nws[bits_per_weight="):
        return None
    keys = dict(item.split("=", 1) for item in method[len("nws[") : -1].split(","))
    if set(keys) - {"bits_per_weight", "group_sizes"}:
        return None  # a variant that changes more than the budget is no point of this curve
    value = keys["bits_per_weight"]
    return OLD_RULE_BITS if value in ("off", "False") else float(value)


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


def _panel(ax, curves: list[tuple[str, float, dict]], peers: dict[str, tuple[float, float, float]], title: str) -> None:
    """``curves``: ``(label, default bits, points)`` per sweep, each joined by a line; ``peers``: one point each."""
    styles = [(STYLE["nws"][1], "-o"), ("#17becf", "--s")]  # a colour no peer has
    for i, ((label, default, points), (colour, line)) in enumerate(zip(curves, styles)):
        curve = sorted((b, p) for m, p in points.items() if (b := bits_of(m, default)) is not None)
        if i:  # the old rule is one layout whatever the sweep: drawn once, on the first curve
            curve = [(bits, p) for bits, p in curve if bits != OLD_RULE_BITS]
        ax.plot([p[2] for _, p in curve], [p[0] for _, p in curve], line, color=colour, label=label)
        for bits, (acc, std, size) in curve:
            text = "9 (old rule)" if bits == OLD_RULE_BITS else f"{bits:g}"
            weight = "bold" if bits == default else "normal"
            ax.annotate(text, (size, acc), textcoords="offset points", xytext=(4, 5), fontsize=8, fontweight=weight)
            if std:
                ax.errorbar([size], [acc], yerr=[std], color=colour, capsize=3)
    for m, (acc, std, size) in sorted(peers.items()):
        label, colour = STYLE.get(m, (m, "#333333"))
        ax.errorbar([size], [acc], yerr=[std] if std else None, fmt="o", color=colour, capsize=3, label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(byte_formatter(compact=True))
    ax.set_xlabel("bytes a task adds on disk (log scale)")
    ax.set_ylabel("average accuracy, %")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def _merged(main_rows: list[dict], sweep: dict) -> tuple[set, list[dict]]:
    """The sweep's seeds, and ``MAIN``'s rows of those seeds with the sweep's runs over them."""
    by_seed = {r["seed"]: r for r in sweep["rows"]}
    return set(by_seed), [{**r, **by_seed[r["seed"]]} for r in main_rows if r["seed"] in by_seed]


def _is_nws(method: str) -> bool:
    return method == "nws" or method.startswith("nws[")


def _only_nws(points: dict, result: dict | None = None) -> dict:
    """NWS's points (of ``result``'s runs only, where given: a sweep's curve, not ``MAIN``'s other NWS runs)."""
    ran = None if result is None else {k for r in result["rows"] for k in r}
    return {m: p for m, p in points.items() if _is_nws(m) and (ran is None or m in ran)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("main", type=Path)
    p.add_argument("sweep", type=Path)
    p.add_argument("--vectors", type=Path, help="a second sweep, drawn beside the first (another layout)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    main_result, sweep = json.loads(args.main.read_text()), json.loads(args.sweep.read_text())
    seeds, merged = _merged(main_result["rows"], sweep)
    model = main_result["job"]["model"].split(":")[-1]
    layout = ", scalar pools" if sweep["job"].get("group_sizes") == [1] else ""
    points = _points(merged)
    curves = [(f"NWS{layout} (labels: bits a weight)", default_bits(sweep), _only_nws(points, sweep))]
    if args.vectors is not None:
        other = json.loads(args.vectors.read_text())
        _, rows = _merged(main_result["rows"], other)
        curves.append(("NWS, vector plan (the default before)", default_bits(other), _only_nws(_points(rows), other)))
    peers = {m: pt for m, pt in points.items() if not _is_nws(m)}
    fig = new_figure(13, 4.6)
    left, right = fig.subplots(1, 2)
    _panel(left, curves, peers, f"{main_result['suite']}, {model}: budget in bits a weight (seed {sorted(seeds)})")
    # The right panel: MAIN's methods over its seeds; where the sweep ran NWS's default on every one
    # of them (a later run, e.g. the default changed since), its NWS figures replace MAIN's.
    rows = merged if seeds >= {r["seed"] for r in main_result["rows"]} else main_result["rows"]
    methods = {k for r in main_result["rows"] for k, v in r.items() if isinstance(v, dict) and "curve" in v}
    n = len(main_result["rows"])
    right_points = {m: pt for m, pt in _points(rows).items() if m in methods}
    default = default_bits(sweep) if rows is merged else default_bits(main_result)
    nws = _only_nws(right_points)
    right_points = {m: pt for m, pt in right_points.items() if not _is_nws(m)}
    _panel(
        right,
        [("NWS, its default", default, nws)],
        right_points,
        f"{main_result['suite']}, {model}: defaults, {n} seeds",
    )
    atomic_write_bytes(args.out, figure_png(fig))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
