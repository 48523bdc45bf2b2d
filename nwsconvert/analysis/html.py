"""``nws-report``: plots of a run's kernel-selection analysis and one self-contained HTML page.

Draws the numbers of :func:`nwsconvert.analysis.selection.analyse_run`:

* ``kur.png`` / ``ls.png``: kernel utilisation ratio and layer sparsity heatmaps,
  layers × tasks (paper Fig. 4), values written in the cells when they fit;
* ``selection_task_<id>.png``: selection rate SR_i = h_i / d against pool index
  i, one small subplot per layer, one figure per task (paper App. F);
* ``bytes_task.png``: bytes per task, stacked indices / BN+state / head;
* ``bytes_layer.png``: stored index bytes per task and shared pool bytes, per layer;
* ``accuracy.png``: validation accuracy per task;
* ``report.html``: all of the above inline (base64 ``data:`` URIs) with tables
  of the numbers; no external reference, opens offline;
* ``analysis.json``: the numbers themselves.

Figures are built with :class:`matplotlib.figure.Figure` and rendered by the
Agg canvas directly: no pyplot, no global backend switch, safe in a library.
Every file is written atomically.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..conversion.report import format_bytes
from ..formats.storage import atomic_write_bytes
from .selection import analyse_run

__all__ = [
    "new_figure",
    "figure_png",
    "byte_formatter",
    "heatmap_figure",
    "selection_figure",
    "bytes_task_figure",
    "bytes_layer_figure",
    "accuracy_figure",
    "render_figures",
    "render_html",
    "write_report",
]

_COLORS = {"indices": "#4C72B0", "state": "#DD8452", "head": "#55A868", "pool": "#8C8C8C"}


def new_figure(width: float, height: float, layout: str | None = "constrained"):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout=layout)


def figure_png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return buf.getvalue()


def _task_ticks(ax, tasks: list[dict], width: int = 14) -> None:
    """Task ids and (shortened) names on the x axis: two lines when few tasks, slanted when many."""
    many = len(tasks) > 8
    labels = []
    for t in tasks:
        name = str(t["name"])
        name = name if len(name) <= width else name[: width - 1] + "…"
        labels.append(f"{t['id']}: {name}" if many else f"{t['id']}\n{name}")
    ax.set_xticks(
        range(len(tasks)),
        labels,
        fontsize=8,
        rotation=40 if many else 0,
        ha="right" if many else "center",
        rotation_mode="anchor",
    )


def byte_formatter(compact: bool = False):
    """Tick labels in B / KB / MB; ``compact``: ``1 KB`` rather than ``1.00 KB`` (log axes)."""
    from matplotlib.ticker import FuncFormatter

    def short(v: float) -> str:
        for unit in ("B", "KB", "MB"):
            if abs(v) < 1000:
                return f"{v:g} {unit}"
            v /= 1000.0
        return f"{v:g} GB"

    return FuncFormatter(lambda v, _pos: "0" if v <= 0 else short(v) if compact else format_bytes(v))


def heatmap_figure(
    values: list[list], layers: Sequence[str], tasks: list[dict], title: str, label: str, vmax: float | None = None
):
    """A layers × tasks heatmap (paper Fig. 4 style).

    Args:
        values: ``L × T`` floats (None: no value, drawn blank).
        layers: ``L`` layer names (y axis, top to bottom).
        tasks: ``T`` task rows of :func:`analyse_run` (x axis).
        title: figure title; ``label``: colour-bar label.
        vmax: top of the colour scale; None: 1 (KUR and LS are shares in [0, 1]).

    Returns:
        a :class:`matplotlib.figure.Figure`.
    """
    import numpy as np

    data = np.array([[np.nan if v is None else float(v) for v in row] for row in values], dtype=float).reshape(
        len(layers), len(tasks)
    )
    n_l, n_t = data.shape
    annotate = n_t <= 24 and n_l <= 80
    fig = new_figure(
        max(5.0, 1.6 + 0.62 * n_t + 0.07 * max((len(s) for s in layers), default=0)), max(3.0, 1.3 + 0.3 * n_l)
    )
    ax = fig.add_subplot()
    hi = vmax if vmax is not None else 1.0
    im = ax.imshow(
        np.ma.masked_invalid(data), aspect="auto", cmap="viridis", vmin=0.0, vmax=hi, interpolation="nearest"
    )
    _task_ticks(ax, tasks)
    ax.set_yticks(range(n_l), list(layers), fontsize=8)
    ax.set_xlabel("task (id, name)")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=11)
    if annotate:
        for i in range(n_l):
            for j in range(n_t):
                v = data[i, j]
                if np.isfinite(v):
                    dark = v < 0.6 * hi
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
    cbar = fig.colorbar(im, ax=ax, shrink=0.8 if n_l > 6 else 1.0)
    cbar.set_label(label)
    return fig


def selection_figure(analysis: dict, task: int):
    """Selection rate per pool entry, one subplot per layer, for one task (paper App. F).

    Args:
        analysis: :func:`analyse_run` output.
        task: position of the task in ``analysis['tasks']`` (not its id).

    Returns:
        a Figure with ``L`` subplots: x = pool index i in ``[0, n)``, y = SR_i = h_i / d.
    """
    import numpy as np

    layers = analysis["layers"]
    t = analysis["tasks"][task]
    cols = min(4, max(1, len(layers)))
    rows = (len(layers) + cols - 1) // cols
    # Fixed margins in inches instead of constrained layout: half the drawing time for 20+ subplots.
    width, height = 3.4 * cols, 0.9 + 2.0 * rows
    fig = new_figure(width, height, layout=None)
    fig.subplots_adjust(
        left=0.65 / width, right=1 - 0.15 / width, bottom=0.5 / height, top=1 - 0.95 / height, wspace=0.28, hspace=0.75
    )
    axes = fig.subplots(rows, cols, squeeze=False)
    for k, layer in enumerate(layers):
        ax = axes[k // cols][k % cols]
        counts, d = analysis["counts"][k][task], analysis["kernels"][k][task]
        if counts is None or not d:
            ax.set_title(f"{layer['name']} (not in task)", fontsize=8)
            ax.set_axis_off()
            continue
        sr = np.asarray(counts, dtype=float) / d
        x = np.flatnonzero(sr)
        ax.vlines(x, 0, sr[x], color=_COLORS["indices"], linewidth=0.8)
        ax.set_xlim(-0.5, len(counts) - 0.5)
        ax.set_ylim(0, max(sr.max() * 1.15, 1e-3))
        ax.set_title(
            f"{layer['name']}  d={d:,}\nKUR {analysis['kur'][k][task]:.2f}  LS {analysis['ls'][k][task]:.2f}  max SR {sr.max():.3f}",
            fontsize=8,
        )
        ax.tick_params(labelsize=7)
        ax.locator_params(axis="y", nbins=4)
        if k % cols == 0:
            ax.set_ylabel("selection rate", fontsize=8)
        if k // cols == rows - 1 or k + cols >= len(layers):
            ax.set_xlabel("pool index", fontsize=8)
    for k in range(len(layers), rows * cols):
        axes[k // cols][k % cols].set_axis_off()
    fig.suptitle(f"Selection rate per pool entry, task {t['id']} ({t['name']})", fontsize=12)
    return fig


def bytes_task_figure(analysis: dict):
    """Stored bytes per task, stacked: indices (no head), BN/state (no head), head.

    Returns:
        a Figure with one stacked bar per task, the total written above it.
    """
    tasks = analysis["tasks"]
    fig = new_figure(min(14.0, max(6.0, 3.5 + 0.6 * len(tasks))), 4.2 + 0.8 * (len(tasks) > 8))
    ax = fig.add_subplot()
    x = range(len(tasks))
    bottom = [0] * len(tasks)
    for part, label in (("indices", "indices"), ("state", "BN / state"), ("head", "head (indices + bias)")):
        vals = [t["bytes"][part] for t in tasks]
        ax.bar(x, vals, bottom=bottom, color=_COLORS[part], label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        ax.text(i, total, format_bytes(total), ha="center", va="bottom", fontsize=7)
    _task_ticks(ax, tasks)
    ax.set_xlabel("task (id, name)")
    ax.set_ylabel("bytes stored per task")
    ax.yaxis.set_major_formatter(byte_formatter())
    ax.set_ylim(0, max(bottom, default=1) * 1.15 or 1)
    shared = f"pool set {format_bytes(analysis['pools_bytes'])}"
    if analysis.get("base_bytes") is not None:
        shared += f"\n+ base pack {format_bytes(analysis['base_bytes'])} (the tasks' delta codings refer to it)"
    ax.set_title(f"Bytes per task\nkept once for all tasks: {shared}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def bytes_layer_figure(analysis: dict):
    """Per layer: stored index bytes of one task (mean over tasks, min-max whiskers) and the shared pool bytes.

    Returns:
        a Figure with horizontal bars on a log axis, layers top to bottom.
    """
    import numpy as np

    layers = analysis["layers"]
    names = [r["name"] for r in layers]
    idx = [[v for v in row if v is not None] for row in analysis["index_bytes"]]
    mean = np.array([np.mean(r) if r else np.nan for r in idx])
    lo = np.array([min(r) if r else np.nan for r in idx])
    hi = np.array([max(r) if r else np.nan for r in idx])
    pool = np.array([r["pool_bytes"] for r in layers], dtype=float)
    fig = new_figure(max(6.5, 3.5 + 0.07 * max((len(s) for s in names), default=0)), max(3.0, 1.7 + 0.32 * len(layers)))
    ax = fig.add_subplot()
    y = np.arange(len(layers))
    ax.barh(
        y - 0.2,
        mean,
        height=0.4,
        color=_COLORS["indices"],
        label="indices, per task (mean; min-max whiskers)",
        xerr=np.vstack([mean - lo, hi - mean]) if (hi > lo).any() else None,
        error_kw={"elinewidth": 0.8, "capsize": 2},
    )
    ax.barh(y + 0.2, pool, height=0.4, color=_COLORS["pool"], label="pool, shared by all tasks")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(byte_formatter(compact=True))
    left = np.nanmin(np.concatenate([mean[mean > 0], pool[pool > 0], [1.0]])) / 3
    ax.set_xlim(left=left)
    for i in np.flatnonzero(mean == 0):  # nothing stored (e.g. unchanged from the base): no bar on a log axis
        ax.text(left * 1.15, i - 0.2, "0 B", va="center", ha="left", fontsize=7)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("bytes (log scale)")
    ax.set_ylabel("layer")
    ax.set_title("Bytes per layer: stored indices (per task) and pools (shared)", fontsize=11)
    fig.legend(fontsize=8, loc="outside lower center", ncols=2)
    return fig


def accuracy_figure(analysis: dict):
    """Validation accuracy per task (percent), the mean as a dashed line.

    Returns:
        a Figure with one bar per task; tasks without a recorded accuracy are left empty.
    """
    tasks = analysis["tasks"]
    fig = new_figure(min(12.0, max(5.0, 1.8 + 0.6 * len(tasks))), 4.0 + 0.8 * (len(tasks) > 8))
    ax = fig.add_subplot()
    acc = [None if t["acc"] is None else 100 * t["acc"] for t in tasks]
    ax.bar(range(len(tasks)), [a or 0 for a in acc], color=_COLORS["indices"], width=0.7)
    for i, a in enumerate(acc):
        if a is not None:  # inside the bar's top, clear of the mean line
            inside = a > 12
            ax.text(
                i,
                a - 1.5 if inside else a + 1,
                f"{a:.1f}",
                ha="center",
                va="top" if inside else "bottom",
                fontsize=8,
                color="white" if inside else "black",
            )
    title = "Accuracy per task"
    if analysis.get("avg_acc") is not None:
        mean = 100 * analysis["avg_acc"]
        ax.axhline(mean, color="black", linestyle="--", linewidth=1)
        title += f" (dashed: mean {mean:.2f}%)"
    _task_ticks(ax, tasks)
    ax.set_ylim(0, 105)
    ax.set_xlabel("task (id, name)")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(title, fontsize=11)
    return fig


def render_figures(analysis: dict) -> dict[str, bytes]:
    """Every plot of the report as PNG bytes.

    Returns:
        file name -> PNG bytes, in page order: ``accuracy.png``, ``kur.png``,
        ``ls.png``, ``bytes_task.png``, ``bytes_layer.png``, then
        ``selection_task_<id>.png`` per task.
    """
    names = [r["name"] for r in analysis["layers"]]
    tasks = analysis["tasks"]
    out = {
        "accuracy.png": figure_png(accuracy_figure(analysis)),
        "kur.png": figure_png(
            heatmap_figure(
                analysis["kur"],
                names,
                tasks,
                "Kernel utilisation ratio KUR\n(pool entries chosen at least once / pool size)",
                "KUR",
            )
        ),
        "ls.png": figure_png(
            heatmap_figure(
                analysis["ls"],
                names,
                tasks,
                "Layer sparsity LS\n(share of kernels whose pool entry is chosen < √d times)",
                "LS",
            )
        ),
        "bytes_task.png": figure_png(bytes_task_figure(analysis)),
        "bytes_layer.png": figure_png(bytes_layer_figure(analysis)),
    }
    for i, t in enumerate(tasks):
        out[f"selection_task_{t['id']}.png"] = figure_png(selection_figure(analysis, i))
    return out


# ------------------------------------------------------------------ HTML
_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 0.2em 0.5em; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
img { max-width: 100%; height: auto; display: block; margin: 0.5em 0; }
p.note { color: #555; font-size: 0.9em; max-width: 60em; }
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _table(head: Sequence[str], rows: Sequence[Sequence], left: int = 1) -> str:
    def cell(tag, i, v):
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{html.escape(str(v))}</{tag}>"

    out = ["<table>", "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(head)) + "</tr>"]
    out += ["<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows]
    out.append("</table>")
    return "\n".join(out)


def _f(v, fmt: str = "{:.3f}") -> str:
    return "–" if v is None else fmt.format(v)


def render_html(analysis: dict, figures: dict[str, bytes]) -> str:
    """One self-contained page: run facts, every figure inline, tables of the numbers.

    Args:
        analysis: :func:`analyse_run` output.
        figures: :func:`render_figures` output (embedded as base64 ``data:`` URIs).
    """
    a = analysis
    tasks = a["tasks"]
    names = [r["name"] for r in a["layers"]]
    tcols = [f"t{t['id']}" for t in tasks]
    fig = lambda name, alt: _img(figures[name], alt) if name in figures else ""  # noqa: E731
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>nws-report: {html.escape(a['run'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Neural Weight Search report: {html.escape(a['run'])}</h1>",
        _table(
            (
                "model",
                "suite",
                "tasks",
                "NWS layers",
                "pool set (shared)",
                "base pack (shared)",
                "all tasks + shared",
                "mean accuracy",
            ),
            [
                (
                    a["model"],
                    a["suite"],
                    len(tasks),
                    len(names),
                    format_bytes(a["pools_bytes"]),
                    "not needed" if a.get("base_bytes") is None else format_bytes(a["base_bytes"]),
                    format_bytes(
                        a["pools_bytes"] + (a.get("base_bytes") or 0) + sum(t["bytes"]["total"] for t in tasks)
                    ),
                    _f(None if a["avg_acc"] is None else 100 * a["avg_acc"], "{:.2f}%"),
                )
            ],
            left=2,
        ),
        "<h2>Accuracy and bytes per task</h2>",
        fig("accuracy.png", "accuracy per task"),
        fig("bytes_task.png", "bytes per task"),
        _table(
            ("task", "name", "classes", "accuracy", "indices", "BN / state", "head", "total"),
            [
                (
                    t["id"],
                    t["name"],
                    t["classes"],
                    _f(None if t["acc"] is None else 100 * t["acc"], "{:.2f}%"),
                    format_bytes(t["bytes"]["indices"]),
                    format_bytes(t["bytes"]["state"]),
                    format_bytes(t["bytes"]["head"]),
                    format_bytes(t["bytes"]["total"]),
                )
                for t in tasks
            ],
            left=2,
        ),
        "<h2>Kernel utilisation ratio (KUR)</h2>",
        '<p class="note">KUR = U / n: the share of the layer\'s n pool entries that the task chose at least once '
        "(paper Sec. 5.7, Fig. 4a). A layer with fewer kernels than pool entries (d &lt; n, often the stem) cannot "
        "exceed d / n.</p>",
        fig("kur.png", "KUR heatmap"),
        _table(("layer", *tcols), [(n, *(_f(v) for v in row)) for n, row in zip(names, a["kur"])]),
        "<h2>Layer sparsity (LS)</h2>",
        '<p class="note">LS = Σ h<sub>u</sub> / d over the chosen pool entries u with h<sub>u</sub> &lt; √d, where '
        "h<sub>u</sub> counts the layer's kernel positions that chose u and d is the layer's kernel count: the share "
        "of kernels built from a rarely chosen entry (paper Eq. 5, Fig. 4b).</p>",
        fig("ls.png", "LS heatmap"),
        _table(("layer", *tcols), [(n, *(_f(v) for v in row)) for n, row in zip(names, a["ls"])]),
        "<h2>Bytes per layer</h2>",
        f'<p class="note">Vector sizes D and pool sizes n planned for {html.escape(a["planned_for"])} '
        "(nwsconvert.conversion.budget).</p>"
        if a.get("planned_for")
        else "",
        fig("bytes_layer.png", "bytes per layer"),
        _table(
            (
                "layer",
                "role",
                "shape",
                "kernels d",
                "D",
                "pool n",
                "fixed bits",
                "coding",
                "stored bits/kernel",
                "stored bits/weight",
                "entropy bits/kernel",
                "index bytes",
                "pool bytes",
                "max SR",
            ),
            [
                (
                    r["name"],
                    r["role"],
                    "×".join(map(str, r["shape"])),
                    _f(_first(a["kernels"][k]), "{:,}"),
                    r["vector_size"],
                    r["pool_size"],
                    r["bits"],
                    " / ".join(sorted({c for c in a["coding"][k] if c is not None})) or "–",
                    _f(_mean(a["index_bits"][k]), "{:.2f}"),
                    _f(
                        None if _mean(a["index_bits"][k]) is None else _mean(a["index_bits"][k]) / r["vector_size"],
                        "{:.3f}",
                    ),
                    _f(_mean(a["entropy_bits"][k]), "{:.2f}"),
                    format_bytes(_mean(a["index_bytes"][k])),
                    format_bytes(r["pool_bytes"]),
                    _f(_max(a["max_rate"][k]), "{:.3f}"),
                )
                for k, r in enumerate(a["layers"])
            ],
            left=3,
        ),
        '<p class="note">Kernels d: first task shown; coding: every coding used; stored bits, entropy and index '
        "bytes: mean over the tasks shown; max SR: largest over them (only the head differs between tasks with other "
        "class counts). Fixed bits = ceil(log2 n), the paper's plain packing; entropy is the order-0 empirical "
        "entropy of the chosen indices, the floor of a per-layer static code (delta codings against the base task "
        "can go below it).</p>",
        "<h2>Selection rate per pool entry</h2>",
        '<p class="note">SR<sub>i</sub> = h<sub>i</sub> / d against the pool index i, one subplot per layer '
        "(paper App. F).</p>",
    ]
    for t in tasks:
        parts.append(fig(f"selection_task_{t['id']}.png", f"selection rates, task {t['id']}"))
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _known(row):
    return [v for v in row if v is not None]


def _first(row):
    k = _known(row)
    return k[0] if k else None


def _mean(row):
    k = _known(row)
    return sum(k) / len(k) if k else None


def _max(row):
    k = _known(row)
    return max(k) if k else None


def write_report(
    run_dir: str | os.PathLike, out: str | os.PathLike | None = None, tasks: Sequence[int] | None = None
) -> dict:
    """Analyse a run and write its PNGs, ``analysis.json`` and ``report.html`` into ``out``.

    Args:
        run_dir: the run directory.
        out: output folder (created); None: ``RUN/report``.
        tasks: task ids to include; None: every finished task.

    Returns:
        ``{'html': path, 'json': path, 'figures': [paths]}`` (strings).

    Raises:
        FileNotFoundError / FormatError / KeyError: as :func:`analyse_run`.
        ValueError: the run has no finished task to report.
    """
    analysis = analyse_run(run_dir, tasks)
    if not analysis["tasks"]:
        raise ValueError(f"run {str(run_dir)!r} has no finished tasks yet: nothing to report")
    folder = Path(out) if out is not None else Path(run_dir) / "report"
    figures = render_figures(analysis)
    paths = []
    for name, png in figures.items():
        atomic_write_bytes(folder / name, png)
        paths.append(str(folder / name))
    atomic_write_bytes(folder / "analysis.json", (json.dumps(analysis) + "\n").encode())
    atomic_write_bytes(folder / "report.html", render_html(analysis, figures).encode("utf-8"))
    return {"html": str(folder / "report.html"), "json": str(folder / "analysis.json"), "figures": paths}
