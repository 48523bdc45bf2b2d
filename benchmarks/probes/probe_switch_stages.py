"""Where a packs-only switch spends its time: read and decode, task values, blocks, fill.

Runs the switch mode's own steps (``Runtime(bundle, keep="pack")``) one at a time over every task of a
bundle and prints each step's minimum over the rounds (the minimum: two lanes of other work may run
beside it). Reaches into the runtime's private parts: a probe, not a benchmark.

    python benchmarks/probes/probe_switch_stages.py BUNDLE [--rounds 5]

``blocks`` is the copy into contiguous blocks that kept values get (``keep="indices"``); a packs-only
switch skips it since 96f9281, so the figure says what it would cost.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from nwsconvert.export import switchmode
from nwsconvert.export.densify import iter_dense_tensors, task_values
from nwsconvert.export.runtime import Runtime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    mode = Runtime(args.bundle, device="cpu", keep="pack", threads=1)._impl
    slot = mode._slots[0]
    times: dict[str, list[float]] = {k: [] for k in ("read", "values", "blocks", "fill")}
    for r in range(args.rounds + 1):  # the first round warms caches and is not counted
        for task in mode.setup.tasks:
            row = mode.setup.row(task)
            path = args.bundle / row["pack"]
            t0 = time.perf_counter()
            raw = switchmode._switch_inputs(
                path, mode._base(row), row.get("pack_sha256"), mode.setup.desc["pool_sha256"], task, mode._index_dtype
            )
            t1 = time.perf_counter()
            values = task_values(mode._recipe, raw, mode._pool_shapes, mode._index_dtype)
            t2 = time.perf_counter()
            switchmode._compact(values)
            t3 = time.perf_counter()
            mode._graph.fill(slot.buffer, iter_dense_tensors(mode._recipe, mode._pool_arrays, values))
            t4 = time.perf_counter()
            if r:
                for k, a, b in (("read", t0, t1), ("values", t1, t2), ("blocks", t2, t3), ("fill", t3, t4)):
                    times[k].append(1e3 * (b - a))
    mins = {k: float(np.min(v)) for k, v in times.items()}
    print(f"{args.bundle}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in mins.items()), end="")
    print(f"; a packs-only switch's sum {mins['read'] + mins['values'] + mins['fill']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
