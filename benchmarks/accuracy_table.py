"""The RESULTS.md table of one ``benchmarks/accuracy.py --json`` file, in Markdown.

One row per method: average accuracy (mean ± std over seeds), mean accuracy per task,
memory for every task in the paper's accounting (floats at 32 bits, PackNet's owner
map; NWS: what ``nws-info`` counts) and as files on disk, training time per seed,
and the gap to dense finetune (method − dense, points) when dense ran. ``--beside OTHER.json``
adds a column with each method's mean in another run of the same sequence and seeds (another
setting) and the change from it to this one.

    python benchmarks/accuracy_table.py benchmarks/results/accuracy_mixed_domain.json
    python benchmarks/accuracy_table.py new.json --beside old.json --beside-label "recalibrate_bn=false"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from plot_accuracy import points  # benchmarks/ is on sys.path when this script runs

LABELS = {
    "nws": "**NWS**",
    "dense": "dense finetune",
    "bn_head": "BN + head",
    "packnet": "PackNet (prune 60 %)",
    "piggyback": "Piggyback",
    "lora4": "LoRA r=4",
    "lora16": "LoRA r=16",
}


def table(result: dict, beside: dict | None = None, beside_label: str = "other run") -> str:
    """Markdown table of an ``accuracy.py`` result (accuracies in %, bytes in MB of 10^6).

    Args:
        beside: another result of the same seeds: a last column ``its mean (this − it)`` per method
            it holds ("–" for the others).

    Raises:
        ValueError: ``beside`` ran other seeds.
    """
    rows = result["rows"]
    other = {}
    if beside is not None:
        if [r["seed"] for r in beside["rows"]] != [r["seed"] for r in rows]:
            raise ValueError("--beside: the two files ran different seeds")
        other = {p["method"]: p["acc"] for p in points(beside)}
    tasks = len(rows[0]["nws"]["accs"])
    dense = [100 * r["dense"]["avg"] for r in rows] if "dense" in result["methods"] else None
    head = (
        f"| method | avg acc ({'mean ± std, ' if len(rows) > 1 else ''}{len(rows)} seed{'s' if len(rows) > 1 else ''}) | per task, mean (tasks 0–{tasks - 1}) "
        "| memory, paper accounting | files on disk | training time / seed | method − dense, points |"
    )
    columns = 7 if beside is None else 8
    lines = [head if beside is None else f"{head} {beside_label} |", "|---" * columns + "|"]
    stats = {p["method"]: p for p in points(result)}  # mean ± std over seeds, as the figure draws them
    for m in result["methods"]:
        label = LABELS.get(m, f"**NWS** `{m[4:-1]}`" if m.startswith("nws[") else m)
        avg, std = stats[m]["acc"], stats[m]["std"]
        per_task = " / ".join(f"{100 * statistics.mean(r[m]['accs'][t] for r in rows):.1f}" for t in range(tasks))
        disk = stats[m]["bytes"] / 1e6
        bits = [r[m].get("paper_bits") for r in rows]
        paper = (
            f"{statistics.mean(bits) / 8e6:.2f} MB" if all(b is not None for b in bits) else f"{disk:.2f} MB (nws-info)"
        )
        seconds = statistics.mean(r[m]["seconds"] for r in rows)
        gap = (
            f"{statistics.mean(100 * r[m]['avg'] - d for r, d in zip(rows, dense)):+.2f}" if dense is not None else "–"
        )
        spread = f" ± {std:.2f}" if len(rows) > 1 else ""  # one seed: no spread to show
        line = f"| {label} | {avg:.2f}{spread} % | {per_task} | {paper} | {disk:.2f} MB | {seconds:.0f} s | {gap} |"
        if beside is not None:
            line += f" {other[m]:.2f} ({avg - other[m]:+.2f}) |" if m in other else " – |"
        lines.append(line)
    per_seed = "; ".join(
        f"{LABELS.get(m, m).strip('*')} " + " / ".join(f"{100 * r[m]['avg']:.2f}" for r in rows)
        for m in result["methods"]
    )
    return "\n".join(lines) + f"\n\nPer seed ({', '.join(str(r['seed']) for r in rows)}), avg %: {per_seed}."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a JSON written by benchmarks/accuracy.py --json")
    p.add_argument("--beside", type=Path, help="another run of the same seeds: a column with its means")
    p.add_argument("--beside-label", default="other run", help="that column's heading")
    args = p.parse_args(argv)
    files = [args.result, *([args.beside] if args.beside else [])]
    loaded = []
    for path in files:
        try:
            loaded.append(json.loads(path.read_text()))
        except FileNotFoundError:
            p.error(f"{path}: no such file")
    try:
        print(table(loaded[0], loaded[1] if args.beside else None, args.beside_label))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
