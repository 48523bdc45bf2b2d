"""Kernel-selection analysis of a run (paper Sec. 5.7 and App. F), as plain numbers.

For every NWS layer l of every task, with d = the layer's kernel count (pool
vectors that build it), n = its pool size and h_u = how many of the d kernel
positions chose pool entry u:

* **KUR** (kernel utilisation ratio) = U / n, U = number of pool entries with
  h_u > 0.
* **LS** (layer sparsity) = Σ_u h_u / d over the chosen entries (h_u > 0) with
  h_u < √d, strictly (paper Eq. 5: the sum runs over the U unique selected
  kernels subject to h_u < √d). It is the fraction of the layer's kernel
  positions filled with a *rarely* chosen pool entry: 0 when every chosen entry
  is reused at least √d times, 1 when every chosen entry is used fewer than √d
  times.
* **selection rate** SR_i = h_i / d for every pool entry i in [0, n) (App. F
  plots SR against the kernel index i, one subplot per layer, one figure per
  task); this module keeps the integer counts h_i, SR follows by dividing by d.
* **entropy**: the order-0 empirical entropy -Σ p_u log2 p_u (p_u = h_u / d) in
  bits per kernel, the floor of a per-layer static code for the indices
  (plain packing spends ``bits`` = ceil(log2 n); a delta coding against a base
  task can go below it).
* **stored bits per kernel** = 8 × stored index bytes / d, and the coding the
  pack file uses for the layer (:meth:`TaskPack.layer_codings`; version 1
  packs read as ``"bits"``, plain fixed-width packing).

Bytes follow ``nws-info`` (:mod:`nwsconvert.analysis.summary`): per task, indices
(without the head's), state (BatchNorm statistics, biases, ...; without the
head's) and head (head indices + head state); per layer, the index bytes
stored in the pack (:meth:`TaskPack.layer_index_bytes`) and the layer's shared
pool bytes. When a task's indices are delta-coded against the run's base pack
(the pool-learning model, ``base.nwspack``), that base must be kept too: its
bytes are reported once, like the pool set.

Everything returned is JSON-able (ints, floats, strings, lists, dicts, None).
No plotting here: :mod:`nwsconvert.analysis.html` draws these numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from ..core.pools import PoolSet
from ..train.rundir import RunDir
from .summary import shared_base_bytes, task_bytes

__all__ = [
    "selection_counts",
    "kernel_utilisation",
    "layer_sparsity",
    "index_entropy",
    "layer_stats",
    "task_bytes",
    "analyse_run",
]


def selection_counts(indices: torch.Tensor | Sequence[int], pool_size: int) -> list[int]:
    """h: how many kernel positions chose each pool entry.

    Args:
        indices: ``(d,)`` chosen pool entries of one layer, each in ``[0, pool_size)``.
        pool_size: n.

    Returns:
        ``n`` ints, ``h[i]`` = occurrences of ``i`` in ``indices``; they sum to d.
    """
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= pool_size):
        raise ValueError(f"indices must lie in [0, {pool_size}), got [{int(idx.min())}, {int(idx.max())}]")
    return torch.bincount(idx, minlength=pool_size).tolist()


def kernel_utilisation(counts: Sequence[int]) -> float:
    """KUR = U / n: the share of the n pool entries chosen at least once (``counts``: ``n`` ints)."""
    return sum(1 for h in counts if h > 0) / len(counts) if len(counts) else 0.0


def layer_sparsity(counts: Sequence[int]) -> float:
    """LS = Σ h_u / d over chosen entries with 0 < h_u < √d (strict); d = Σ counts.

    ``counts``: ``n`` ints (:func:`selection_counts`). 0.0 for an empty layer.
    """
    d = sum(counts)
    if d == 0:
        return 0.0
    # h < sqrt(d)  <=>  h * h < d for non-negative integers: exact, no float rounding.
    return sum(h for h in counts if 0 < h and h * h < d) / d


def index_entropy(counts: Sequence[int]) -> float:
    """Order-0 empirical entropy of the chosen indices, bits per kernel (``counts``: ``n`` ints)."""
    d = sum(counts)
    if d == 0:
        return 0.0
    return max(0.0, -sum(h / d * math.log2(h / d) for h in counts if h > 0))


def layer_stats(indices: torch.Tensor | Sequence[int], pool_size: int) -> dict:
    """Every per-layer number for one layer of one task.

    Args:
        indices: ``(d,)`` chosen pool entries.
        pool_size: n.

    Returns:
        ``{'kernels': d, 'pool_size': n, 'unique': U, 'kur': U/n, 'ls': LS,
        'max_rate': max_i h_i/d, 'entropy_bits': bits per kernel, 'counts': [n ints]}``.
    """
    counts = selection_counts(indices, pool_size)
    d = sum(counts)
    return {
        "kernels": d,
        "pool_size": pool_size,
        "unique": sum(1 for h in counts if h > 0),
        "kur": kernel_utilisation(counts),
        "ls": layer_sparsity(counts),
        "max_rate": max(counts) / d if d else 0.0,
        "entropy_bits": index_entropy(counts),
        "counts": counts,
    }


def _pool_bytes(run: RunDir, layers: list[dict]) -> dict[str, int]:
    """Layer name -> bytes of its pool in the run's pool file (float32 n x D from the layer table if absent)."""
    if run.pool_path.is_file():
        pools = PoolSet.load(run.pool_path)
        out = {}
        for r in layers:
            key = r.get("pool", r["name"])
            out[r["name"]] = (
                pools[key].numel() * pools[key].element_size()
                if key in pools
                else 4 * r["pool_size"] * r["vector_size"]
            )
        return out
    return {r["name"]: 4 * r["pool_size"] * r["vector_size"] for r in layers}


def analyse_run(run_dir: str | os.PathLike, tasks: Sequence[int] | None = None) -> dict:
    """Kernel-selection statistics, bytes and accuracy of a run's finished tasks.

    Args:
        run_dir: a run directory (``nws-train`` / :class:`nwsconvert.Trainer`).
        tasks: task ids to include, in this order; None: every finished task by id.

    Returns:
        With T = tasks included, L = NWS layers (the first task's layer order),
        n_l = layer l's pool size::

            {'run': str, 'model': spec, 'suite': str | None, 'pools_bytes': int,
             'base_bytes': int | None (indices + state of a base pack the tasks are
                           delta-coded against, when it is not one of the run's
                           tasks; None otherwise),
             'tasks':  [T × {'id', 'name', 'classes', 'acc' (0..1 or None), 'file',
                             'bytes': {'indices', 'state', 'head', 'total'}}],
             'avg_acc': mean of the known accuracies (0..1) or None,
             'layers': [L × {'name', 'role', 'shape', 'vector_size', 'pool_size',
                             'bits', 'pool_bytes'}],
             'kernels':      L × T ints   (d),
             'unique':       L × T ints   (U),
             'kur':          L × T floats (U / n),
             'ls':           L × T floats (layer sparsity, threshold √d),
             'max_rate':     L × T floats (largest selection rate),
             'entropy_bits': L × T floats (order-0 entropy, bits per kernel),
             'index_bytes':  L × T ints   (stored index bytes),
             'index_bits':   L × T floats (stored bits per kernel, 8 * index_bytes / d),
             'coding':       L × T strs   (index coding in the pack file),
             'counts':       L × T × n_l ints (selection counts h; SR = h / d)}

        A layer missing from a task's pack has None in that task's cells.

    Raises:
        FileNotFoundError: no run directory / manifest, or a pack file is missing.
        FormatError: a corrupted manifest or pack.
        KeyError: a requested task is not finished (the message lists those that are).
    """
    from ..train.loading import load_run_pools, load_task_files

    run = RunDir(run_dir)
    manifest = run.read()
    if tasks is None:
        entries = sorted(manifest.tasks, key=lambda e: e.id)
    else:
        entries = [run.task_entry(manifest, int(t)) for t in tasks]
    pool_set = load_run_pools(run, manifest) if entries else None
    packs = [load_task_files(run, manifest, e.id, pool_set)[1] for e in entries]

    layers: list[dict] = []
    if packs:
        layers = [
            {k: r[k] for k in ("name", "role", "shape", "vector_size", "pool_size", "bits")} for r in packs[0].layers
        ]
        pool_bytes = _pool_bytes(run, packs[0].layers)
        for row in layers:
            row["pool_bytes"] = pool_bytes[row["name"]]
    keys = ("kernels", "unique", "kur", "ls", "max_rate", "entropy_bits", "counts")
    grid: dict[str, list[list]] = {
        k: [[None] * len(packs) for _ in layers] for k in (*keys, "index_bytes", "index_bits", "coding")
    }
    for t, pack in enumerate(packs):
        rows = {r["name"]: r for r in pack.layers}
        index_bytes = pack.layer_index_bytes()
        codings = pack.layer_codings()
        for l, layer in enumerate(layers):
            r = rows.get(layer["name"])
            if r is None:
                continue
            stats = layer_stats(pack.indices[r["name"]], r["pool_size"])
            for k in keys:
                grid[k][l][t] = stats[k]
            grid["index_bytes"][l][t] = index_bytes[r["name"]]
            grid["index_bits"][l][t] = 8 * index_bytes[r["name"]] / stats["kernels"] if stats["kernels"] else 0.0
            grid["coding"][l][t] = codings[r["name"]]

    task_rows = [
        {
            "id": e.id,
            "name": e.name,
            "classes": e.num_classes,
            "acc": e.metrics.get("val_acc"),
            "file": e.file,
            "bytes": task_bytes(pack),
        }
        for e, pack in zip(entries, packs)
    ]
    accs = [t["acc"] for t in task_rows if t["acc"] is not None]
    return {
        "run": str(run.path),
        "model": manifest.model.spec,
        "suite": manifest.data.get("suite"),
        "pools_bytes": (manifest.pools and manifest.pools.bytes) or sum(r["pool_bytes"] for r in layers),
        "base_bytes": shared_base_bytes(manifest, packs) or None,
        "tasks": task_rows,
        "avg_acc": sum(accs) / len(accs) if accs else None,
        "planned_for": manifest.model.config().planned_for,
        "layers": layers,
        **grid,
    }
