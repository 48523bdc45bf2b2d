"""What a run costs and scores, in the paper's memory accounting (``nws-info``).

NWS keeps one pool set plus, per task, its indices and the tensors no pool
owns (BatchNorm statistics and affine parameters, biases); the head's weights
are indices into the head's scalar pool, its bias is state. Dense finetune
keeps one full float32 model per task (every weight, BatchNorm tensor and
head). Sizes are counted from the files' tensors, not guessed.
"""

from __future__ import annotations

import math
import os

from ..conversion.report import format_bytes
from ..formats.packs import TaskPack
from ..train.manifest import Manifest
from ..train.rundir import RunDir

__all__ = ["run_summary", "format_summary", "shared_base_bytes", "task_bytes"]


def shared_base_bytes(manifest: Manifest, packs: list[TaskPack]) -> int:
    """Bytes (indices + state) of the bases ``packs`` are delta-coded against that are
    not tasks of the run themselves (``base.nwspack``): kept once, like the pool set.
    A base that is a task (task 0 under ``pack_base=task0``) is counted as that task."""
    task_shas = {e.sha256 for e in manifest.tasks}
    extra = {p.base.sha256: p.base for p in packs if p.base is not None and p.base.sha256 not in task_shas}
    return sum(b.index_bytes + b.state_bytes for b in extra.values())


def task_bytes(pack: TaskPack) -> dict:
    """Stored bytes of one task, split as ``nws-info`` splits them.

    Returns:
        ``{'indices', 'state', 'head', 'total'}`` (ints): ``indices`` and ``state``
        without the head's share, ``head`` = head index bytes + head state bytes
        (its bias), ``total`` = all indices + all state.
    """
    heads = {r["name"] for r in pack.layers if r["role"] == "head"}
    per_layer = pack.layer_index_bytes()
    index_head = sum(b for name, b in per_layer.items() if name in heads)
    index_all = sum(per_layer.values())
    state_head = sum(b for k, b in pack.layer_state_bytes().items() if k.rsplit(".", 1)[0] in heads)
    return {
        "indices": index_all - index_head,
        "state": pack.state_bytes - state_head,
        "head": index_head + state_head,
        "total": index_all + pack.state_bytes,
    }


def _task_costs(pack: TaskPack) -> dict:
    """:func:`task_bytes` plus ``dense``: the same task as one float32 model (every weight + the state,
    whose floating entries a dense checkpoint keeps in float32 whatever dtype the pack stores them in)."""
    dense_weights = sum(4 * math.prod(r["shape"]) for r in pack.layers)
    dense_state = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in pack.state.values())
    return {**task_bytes(pack), "dense": dense_weights + dense_state}


def run_summary(run_dir: str | os.PathLike) -> dict:
    """Per-task accuracy and bytes of a run, and totals beside dense finetune.

    Returns:
        ``{'run', 'model', 'suite', 'pools_bytes', 'base_bytes', 'tasks': [...], 'total': {...}}``;
        ``base_bytes`` is the shared pack the tasks' indices are stored against
        (``base.nwspack``; 0 when they are standalone or coded against task 0);
        every task row has ``id, name, classes, acc, indices, state, head, total, dense``
        (bytes; ``indices`` and ``state`` without the head's share, ``head`` = head
        indices + head bias).
    """
    from ..train.loading import load_run_pools, load_task_files

    run = RunDir(run_dir)
    manifest = run.read()
    rows = []
    packs = []
    pool_set = load_run_pools(run, manifest) if manifest.pools is not None else None
    for entry in sorted(manifest.tasks, key=lambda e: e.id):
        _, pack = load_task_files(run, manifest, entry.id, pool_set)
        packs.append(pack)
        rows.append(
            {
                "id": entry.id,
                "name": entry.name,
                "classes": entry.num_classes,
                "acc": entry.metrics.get("val_acc"),
                **_task_costs(pack),
            }
        )
    pools = pool_set.nbytes if pool_set is not None else 0  # counted from the file, like the packs
    base_bytes = shared_base_bytes(manifest, packs)
    nws_total = pools + base_bytes + sum(r["total"] for r in rows)
    dense_total = sum(r["dense"] for r in rows)
    accs = [r["acc"] for r in rows if r["acc"] is not None]
    return {
        "run": str(run.path),
        "model": manifest.model.spec,
        "suite": manifest.data.get("suite"),
        "pools_bytes": pools,
        "pools_dtype": str(pool_set.dtype).removeprefix("torch.") if pool_set is not None and len(pool_set) else None,
        "base_bytes": base_bytes,
        "pools_file_bytes": _file_size(run.pool_path),
        "base_file_bytes": _file_size(run.base_path) if base_bytes else 0,
        # Training state beside the packs (the weights every new task starts from, stage checkpoints):
        # not part of what a task costs, but what the run directory holds.
        "checkpoints_bytes": sum(_file_size(p) for p in (run.path / "checkpoints").glob("*")),
        "tasks": rows,
        "total": {
            "nws_bytes": nws_total,
            "dense_finetune_bytes": dense_total,
            "ratio": dense_total / nws_total if nws_total else None,
            "avg_acc": sum(accs) / len(accs) if accs else None,  # over tasks with a recorded val_acc
            "tasks": len(rows),
        },
    }


def _file_size(path) -> int:
    return path.stat().st_size if path.is_file() else 0


def format_summary(s: dict) -> str:
    """The summary as a table (what ``nws-info RUN`` prints)."""
    head = ("task", "name", "classes", "acc", "indices", "BN/state", "head", "NWS task", "dense model")
    rows = [
        (
            str(r["id"]),
            r["name"],
            str(r["classes"]),
            f"{100 * r['acc']:.2f}%" if r["acc"] is not None else "n/a",
            format_bytes(r["indices"]),
            format_bytes(r["state"]),
            format_bytes(r["head"]),
            format_bytes(r["total"]),
            format_bytes(r["dense"]),
        )
        for r in s["tasks"]
    ]
    t = s["total"]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [
        f"run {s['run']}  model {s['model']}  suite {s['suite']}",
        "sizes: tensor bytes, the paper's accounting (files add their JSON headers: nws-info --json has both)",
        line(head),
        "  ".join("-" * w for w in widths),
    ]
    out += [line(r) for r in rows]
    out.append("")
    if not s["pools_bytes"]:  # killed before its pool file was recorded
        out.append(f"pool set: not written yet (pool learning has not finished: nws-train --resume out={s['run']})")
    else:
        out.append(
            f"pool set (shared)        {format_bytes(s['pools_bytes'])}   (file {format_bytes(s.get('pools_file_bytes', 0))} with its header"
            + (f"; {s['pools_dtype']})" if s.get("pools_dtype") else ")")
        )
    if s.get("base_bytes"):
        out.append(
            f"base pack (shared)       {format_bytes(s['base_bytes'])}   (file {format_bytes(s.get('base_file_bytes', 0))}; "
            "indices after pool learning; task indices are stored as changes against it)"
        )
    if t["tasks"]:
        shared = "pool set + base pack" if s.get("base_bytes") else "pool set"
        out.append(
            f"NWS total ({t['tasks']} tasks)     {format_bytes(t['nws_bytes'])}   ({shared} + every task's indices, BN/state, head)"
        )
        out.append(f"dense finetune total     {format_bytes(t['dense_finetune_bytes'])}   (one float32 model per task)")
        avg = f"{100 * t['avg_acc']:.2f}%" if t["avg_acc"] is not None else "n/a"
        out.append(f"NWS is {t['ratio']:.1f}x smaller; average accuracy {avg}")
    else:
        out.append("no finished tasks yet")
    if s.get("checkpoints_bytes"):
        out.append(
            f"also in the run: checkpoints/ {format_bytes(s['checkpoints_bytes'])} (training state: the weights "
            "a new task starts from; not deployed, and needed only to add tasks or resume)"
        )
    return "\n".join(out)
