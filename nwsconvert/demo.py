"""``python -m nwsconvert.demo``: convert a timm ResNet-18 and show what NWS stores.

Converts the model, prints the conversion report and a size table (one
dense model per task vs. shared pools + one index pack per task), runs a
forward pass, checks the materialised dense model gives the same outputs,
and round-trips a task pack through files. Needs no data and no network.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from . import apply_task, convert, extract_task, materialize, pool_set
from .packs import TaskPack
from .report import format_bytes


def _size_table(dense_bytes: int, pool_bytes: int, task_bytes: int, tasks: list[int]) -> str:
    rows = [("tasks", "dense finetune (1 model/task)", "NWS (pools + packs)", "ratio")]
    for t in tasks:
        dense, nws = dense_bytes * t, pool_bytes + task_bytes * t
        rows.append((str(t), format_bytes(dense), format_bytes(nws), f"{dense / nws:.1f}x smaller"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nwsconvert.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", help="timm model name (default: resnet18)")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--pool-size", type=int, default=512)
    ap.add_argument("--init", default="kmeans", help="pool initialisation: kmeans or random")
    args = ap.parse_args(argv)

    import timm

    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=args.num_classes)
    dense_params = sum(p.numel() * p.element_size() for p in model.parameters())
    dense_buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    t0 = time.perf_counter()
    convert(model, pool_size=args.pool_size, init=args.init)
    print(model.nws_report)
    print(f"converted in {time.perf_counter() - t0:.1f} s\n")

    x = torch.randn(8, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        y = model(x)
        same = torch.equal(y, materialize(model)(x))
    print(f"forward: input {tuple(x.shape)} -> logits {tuple(y.shape)}; materialised dense model identical: {same}")

    with tempfile.TemporaryDirectory() as tmp:
        pools_path, pack_path = Path(tmp, "pools.safetensors"), Path(tmp, "task0.nwspack")
        pool_set(model).save(pools_path)
        pack = extract_task(model)
        pack.save(pack_path)
        fresh = timm.create_model(args.model, num_classes=args.num_classes)
        convert(fresh, pool_size=args.pool_size, init=pools_path)
        apply_task(fresh, TaskPack.load(pack_path)).eval()
        with torch.no_grad():
            again = torch.equal(fresh(x), y)
        pool_file, pack_file = pools_path.stat().st_size, pack_path.stat().st_size
    print(f"task pack round trip through files, fresh model bitwise identical: {again}\n")

    print(f"files: pool set {format_bytes(pool_file)} (shared), one task pack {format_bytes(pack_file)} "
          f"(indices {format_bytes(pack.index_bytes)} + BN/biases {format_bytes(pack.state_bytes)}); "
          f"dense model {format_bytes(dense_params + dense_buffers)}")
    print(_size_table(dense_params + dense_buffers, pool_file, pack_file, [1, 5, 20]))
    return 0 if (same and again) else 1


if __name__ == "__main__":
    raise SystemExit(main())
