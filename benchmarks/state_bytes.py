"""What coding a task's float16 state against the base pack's saves, on a finished run.

For every task pack of a run (any pack version), in one process: the state's raw bytes, the
bytes of the entries as pack version 5 stores them (each float16 entry coded against the base
pack's, :mod:`nwsconvert.formats.statecode`, where that is smaller), split by kind of entry
(BatchNorm weight, bias, running mean, running variance, the rest), and the pack file's size
before and after re-saving it with this nwsconvert. Each re-saved pack is read back and must
hold the same indices and state, bit for bit.

    nws-train suite=long-mixed-20 model=timm:mobilenetv2_100 preset=auto out=/tmp/mbv2
    python benchmarks/state_bytes.py /tmp/mbv2 --json benchmarks/results/state_bytes_mbv2.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from nwsconvert import RunDir, TaskPack

KINDS = ("weight", "bias", "running_mean", "running_var")


def _kind(key: str) -> str:
    last = key.rsplit(".", 1)[-1]
    return last if last in KINDS else "other"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a finished run directory (nws-train's out=)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    run = RunDir(args.run)
    manifest = run.read()
    rows, kinds = [], {k: [0, 0] for k in (*KINDS, "other")}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(Path(args.run) / "base.nwspack", Path(tmp) / "base.nwspack")  # beside the re-saved packs
        base = TaskPack.load(Path(tmp) / "base.nwspack")
        for entry in manifest.tasks:
            src = Path(args.run) / entry.file
            pack = TaskPack.load(src)
            raw = {k: t.numel() * t.element_size() for k, t in pack.state.items()}
            pack._encoded_state = None  # as this nwsconvert codes it, whatever the file holds
            pack.base = base
            stored = pack.layer_state_bytes()
            for k in raw:
                kinds[_kind(k)][0] += raw[k]
                kinds[_kind(k)][1] += stored[k]
            out = Path(tmp) / src.name
            pack.save(out)
            back = TaskPack.load(out)
            same = all(torch.equal(back.indices[n], v) for n, v in pack.indices.items()) and all(
                back.state[k].dtype == v.dtype and torch.equal(back.state[k].view(-1), v.view(-1))
                for k, v in pack.state.items()
            )
            if not same:
                print(f"task {entry.id}: the re-saved pack does not hold the same indices and state", file=sys.stderr)
                return 1
            rows.append(
                {
                    "task": entry.id,
                    "state_raw": sum(raw.values()),
                    "state_stored": sum(stored.values()),
                    "file_before": src.stat().st_size,
                    "file_after": out.stat().st_size,
                }
            )
            r = rows[-1]
            print(
                f"task {entry.id}: state {r['state_raw'] / 1000:.1f} -> {r['state_stored'] / 1000:.1f} KB, "
                f"pack {r['file_before'] / 1000:.1f} -> {r['file_after'] / 1000:.1f} KB",
                flush=True,
            )
    n = len(rows)
    total = {k: sum(r[k] for r in rows) for k in ("state_raw", "state_stored", "file_before", "file_after")}
    print(f"\n{n} tasks of {manifest.model.spec}, KB (1,000 bytes) a task:")
    print("| entries | raw | stored | stored / raw |\n|---|---|---|---|")
    for k, (a, b) in kinds.items():
        if a:
            print(f"| {k} | {a / n / 1000:.1f} | {b / n / 1000:.1f} | {b / a:.3f} |")
    print(
        f"| state | {total['state_raw'] / n / 1000:.1f} | {total['state_stored'] / n / 1000:.1f} | "
        f"{total['state_stored'] / total['state_raw']:.3f} |"
    )
    print(
        f"pack files: {total['file_before'] / n / 1000:.1f} -> {total['file_after'] / n / 1000:.1f} KB a task "
        f"({total['file_after'] / total['file_before']:.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "run": str(args.run),
                    "model": manifest.model.spec,
                    "kinds": {k: {"raw": a, "stored": b} for k, (a, b) in kinds.items()},
                    "tasks": rows,
                    "total": total,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
