"""What storing a task's non-pool state (BatchNorm, head bias) in float16 costs and saves.

Takes a finished run trained with ``state_dtype=float32`` and, for every task, in one
process: the accuracy of the model rebuilt from its pack (float32 state) and of the
same model with the state rounded to float16 (``nwsconvert.round_state_``, what a
``state_dtype=float16`` pack stores), the predictions that changed, and the state's
bytes in each dtype.

    nws-train suite=split-fashion-mnist suite.pairs=hard suite.train_per_class=200 \\
        suite.pretrain_images=2000 state_dtype=float32 out=/tmp/fp32run
    python benchmarks/state_dtype.py /tmp/fp32run --json benchmarks/results/state_dtype.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import nwsconvert
from nwsconvert import RunDir, extract_task, round_state_
from nwsconvert.zoo import get_suite


@torch.no_grad()
def predictions(model: torch.nn.Module, data, batch_size: int = 256) -> torch.Tensor:
    """Top-1 class of every sample of ``data`` (a TensorDataset), in order."""
    x, _ = data.tensors
    model.eval()
    return torch.cat([model(x[i : i + batch_size]).argmax(1) for i in range(0, len(x), batch_size)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run directory trained with state_dtype=float32")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    manifest = RunDir(args.run).read()
    if manifest.config.get("state_dtype", "float32") != "float32":
        p.error(
            f"{args.run}: trained with state_dtype={manifest.config['state_dtype']}; this compares against a float32 run"
        )
    info = manifest.data  # the suite the run was trained on (nws-train records it)
    suite = get_suite(info["suite"], **info.get("options", {}))
    rows = []
    for entry in manifest.tasks:
        t = entry.id
        model = nwsconvert.load(args.run, task=t)
        test = suite.tasks[t].test
        y = test.tensors[1]
        full = predictions(model, test)
        bytes32 = extract_task(model, state_dtype="float32").state_bytes
        round_state_(model, "float16")
        half = predictions(model, test)
        bytes16 = extract_task(model, state_dtype="float16").state_bytes
        rows.append(
            {
                "task": t,
                "acc_float32": (full == y).float().mean().item(),
                "acc_float16": (half == y).float().mean().item(),
                "changed_predictions": int((full != half).sum()),
                "samples": len(y),
                "state_bytes_float32": bytes32,
                "state_bytes_float16": bytes16,
            }
        )
        r = rows[-1]
        print(
            f"task {t}: acc {100 * r['acc_float32']:.2f}% (float32 state) -> {100 * r['acc_float16']:.2f}% (float16), "
            f"{r['changed_predictions']}/{r['samples']} predictions changed; state {bytes32 / 1e3:.1f} KB -> {bytes16 / 1e3:.1f} KB",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "run": str(args.run),
                    "model": manifest.model.spec,
                    "suite": info["suite"],
                    "suite_options": info.get("options", {}),
                    "tasks": rows,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
