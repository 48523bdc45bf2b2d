"""Accuracy against memory, one point per method, one panel per task sequence.

Reads the JSON files ``benchmarks/accuracy.py --json`` writes and draws, for each,
the mean average accuracy over the seeds (error bar: std) against the total bytes
the method stored for the sequence (files on disk, shared parts included; log
scale). The figure is an ``nws-report``-style PNG:

    python benchmarks/plot_accuracy.py benchmarks/results/accuracy_hard_pairs.json \\
        benchmarks/results/accuracy_mixed_domain.json --out benchmarks/results/accuracy_vs_memory.png

``A.json+B.json`` draws B's NWS rows in A's panel: its plain NWS named by the job keys B changed
(e.g. ``nws[task_init=original]``), for an NWS variant run on its own, and its ``--nws-variants``
rows (e.g. ``nws[weights=pretrained,learn_pools=false]``) beside A's baselines.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from nwsconvert.analysis.html import byte_formatter, figure_png, new_figure
from nwsconvert.formats.atomic import atomic_write_bytes
from nwsconvert.train.config import TrainConfig

#: method key -> (label, colour); NWS stands out, the rest in muted colours.
STYLE = {
    "nws": ("NWS", "#C44E52"),
    "dense": ("dense finetune", "#8C8C8C"),
    "bn_head": ("BN + head", "#4C72B0"),
    "packnet": ("PackNet", "#55A868"),
    "piggyback": ("Piggyback", "#8172B3"),
    "lora4": ("LoRA r=4", "#DD8452"),
    "lora16": ("LoRA r=16", "#937860"),
}


#: NWS variants of one panel (``nws[...]``), in order: marker and colour, each told apart from the others.
VARIANTS = [("^", "#7A1F22"), ("s", "#E377C2"), ("D", "#17BECF"), ("v", "#BCBD22")]


def _minor_labels(formatter):
    """Label only the minor ticks at 2× and 5× a power of ten, in ``formatter``'s units: a panel that
    spans less than a decade still gets readable labels, never matplotlib's crowded ``3×10⁶`` ones."""
    from matplotlib.ticker import FuncFormatter

    def label(v: float, pos) -> str:
        mantissa = v / 10 ** math.floor(math.log10(v)) if v > 0 else 0
        return formatter(v, pos) if round(mantissa, 6) in (2.0, 5.0) else ""

    return FuncFormatter(label)


def merge(first: dict, other: dict) -> dict:
    """``first`` with ``other``'s NWS rows added, for the seeds both hold. ``other``'s plain NWS row is
    named ``nws[key=value,...]`` by the job keys ``other`` changed (left out when it changed none: it
    is the same job as ``first``'s NWS); its variants ``nws[v]`` come as ``nws[key=value,...,v]``
    (``nws[v]`` for the same job). ``other``'s baselines are not drawn: ``first`` holds the panel's."""
    changed = ",".join(f"{k}={v}" for k, v in sorted(other["job"].items()) if first["job"].get(k) != v)
    names = {"nws": f"nws[{changed}]"} if changed else {}
    for m in other["methods"]:
        if m.startswith("nws["):
            names[m] = f"nws[{changed},{m[4:]}" if changed else m
    names = {m: name for m, name in names.items() if name not in first["methods"]}
    by_seed = {r["seed"]: r for r in other["rows"]}
    rows = [
        {**r, **{name: by_seed[r["seed"]][m] for m, name in names.items()}}
        for r in first["rows"]
        if r["seed"] in by_seed
    ]
    return {**first, "methods": [*first["methods"][:1], *names.values(), *first["methods"][1:]], "rows": rows}


def nws_label(result: dict) -> str:
    """The plain NWS row's label: ``NWS``, with its task initialisation when that is not today's
    default (``accuracy.recorded_nws_config``: a JSON written before ``nws_config`` was recorded ran
    ``previous`` unless its job or recipe said otherwise), so that panels of older and newer files
    do not give two settings one name."""
    from accuracy import recorded_nws_config  # torch and the baselines: only when a figure is drawn

    init = recorded_nws_config(result)["task_init"]
    return "NWS" if init == TrainConfig.__dataclass_fields__["task_init"].default else f"NWS task_init={init}"


def points(result: dict) -> list[dict]:
    """One point per method of an ``accuracy.py`` result: ``method``, ``acc`` and ``std`` (%), ``bytes`` (mean over seeds)."""
    out = []
    for m in result["methods"]:
        rows = [row for row in result["rows"] if m in row]  # accuracy.py --one-seed: not every seed
        accs = [100 * row[m]["avg"] for row in rows]
        out.append(
            {
                "method": m,
                "acc": statistics.mean(accs),
                "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "bytes": statistics.mean(row[m]["disk_bytes"] for row in rows),
            }
        )
    return out


#: Training options every method of ``accuracy.py`` honours whose default changed since results were
#: first written: a panel whose file ran another value names it.
SHARED_DEFAULTS = ("recalibrate_bn",)


def title_of(result: dict, path: Path) -> str:
    """A panel title: the suite and the options that tell its sequences apart, and the training
    options every method of the panel ran with beyond its recipe (``pool_epochs=12``), or beside
    today's default (``recalibrate_bn=False`` for a file that predates it)."""
    from accuracy import recorded_nws_config  # torch and the baselines: only when a figure is drawn

    job = result["job"]
    opts = job.get("suite_options") or {}
    extra = ", ".join(f"{k}={v}" for k, v in sorted(opts.items()) if k != "path")
    shared = {k: job[k] for k in job if k in TrainConfig.__dataclass_fields__}
    recorded = recorded_nws_config(result)
    for key in SHARED_DEFAULTS:
        if key not in shared and recorded[key] != TrainConfig.__dataclass_fields__[key].default:
            shared[key] = recorded[key]
    recipe = ", ".join(f"{k}={shared[k]}" for k in sorted(shared))
    seeds = f"{len(result['rows'])} seed(s)" + (f", {recipe}" if recipe else "")
    return f"{result['suite']}: {path.stem}" + (f"\n{extra}" if extra else "") + f"\n{seeds}"


def figure(results: list[tuple[Path, dict]]):
    """The matplotlib figure: one panel per result."""
    n = len(results)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig = new_figure(7.6 * cols, 4.5 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (path, result) in zip(axes, results):
        variants_seen = 0
        panel = points(result)
        for p in panel:
            variant = p["method"].startswith("nws[")
            marker, variant_colour = VARIANTS[variants_seen % len(VARIANTS)] if variant else ("o", "#333333")
            variants_seen += variant
            label, colour = STYLE.get(
                p["method"], (f"NWS {p['method'][4:-1]}" if variant else p["method"], variant_colour)
            )
            label = nws_label(result) if p["method"] == "nws" else label
            ax.errorbar(
                p["bytes"],
                p["acc"],
                yerr=p["std"],
                fmt=marker,
                color=colour,
                capsize=3,
                markersize=9 if p["method"].startswith("nws") else 6,
                label=label,
            )
        ax.set_xscale("log")
        sizes = [p["bytes"] for p in panel]
        ax.set_xlim(min(sizes) / 1.6, max(sizes) * 1.6)  # room for a labelled tick beside the smallest point
        ax.xaxis.set_major_formatter(byte_formatter(compact=True))
        ax.xaxis.set_minor_formatter(_minor_labels(byte_formatter(compact=True)))
        ax.set_xlabel("memory for every task (files on disk, log scale)")
        ax.set_ylabel("average accuracy, % (mean ± std over seeds)")
        ax.set_title(title_of(result, path), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the panel: never over a point
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "results", nargs="+", help="JSON files written by benchmarks/accuracy.py --json (A.json+B.json: one panel)"
    )
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    results = []
    for arg in args.results:
        panel = []
        for path in map(Path, arg.split("+")):
            try:
                panel.append(json.loads(path.read_text()))
            except FileNotFoundError:
                p.error(f"{path}: no such file")
            except json.JSONDecodeError as e:
                p.error(f"{path}: not an accuracy.py JSON ({e.msg} at line {e.lineno})")
            missing = [k for k in ("suite", "job", "methods", "rows") if k not in panel[-1]]
            missing += [] if missing or "recipe" in panel[-1]["job"] else ["job.recipe"]
            if missing:
                p.error(f"{path}: not an accuracy.py JSON (field {missing[0]} missing)")
        result = panel[0]
        for other in panel[1:]:
            result = merge(result, other)
        results.append((Path(arg.split("+")[0]), result))
    atomic_write_bytes(args.out, figure_png(figure(results)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
