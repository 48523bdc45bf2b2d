"""onnxruntime vs PyTorch: output parity over the core model set, top-1 agreement on a run's test sets.

Two measurements, one JSON report:

* ``--models``: every model of the conversion test set (``tests/model_zoo.py``)
  is converted (random pools of 64 entries), exported with
  :func:`nwsconvert.export.export_onnx` and run on CPU by onnxruntime; the
  largest absolute logit difference against the PyTorch NWS model, relative to
  the largest logit, and whether the top-1 classes agree. Models that do not
  export are listed with the exporter's error.
* ``--run RUN``: the run's tasks are exported as a bundle and every task's test
  set (rebuilt from the suite recorded in the manifest) is classified by
  :class:`nwsconvert.export.Runtime` and by ``nwsconvert.load``; top-1 agreement
  and both accuracies per task. With ``--precision float16`` the float16 switch mode
  (``Runtime(..., precision="float16")``) beside the float32 one: top-1 agreement, its
  accuracy, and the largest logit difference (absolute, and over the largest logit).

    python benchmarks/parity.py --models --run runs/demo --json parity.json
    python benchmarks/parity.py --run runs/demo --precision float16 --device cuda --json parity_fp16.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nwsconvert as nc  # noqa: E402
from nwsconvert.export import Runtime, export_bundle  # noqa: E402


def model_parity(only: list[str] | None = None) -> dict:
    from export_coverage import onnx_parity  # benchmarks/ is on sys.path when this script runs
    from model_zoo import TIMM_MODELS, build, export_input_size, torchvision_models

    specs = torchvision_models() + [f"timm:{m}" for m in TIMM_MODELS]
    if only:
        specs = [s for s in specs if any(o in s for o in only)]
    rows = {}
    for spec in specs:
        tic = time.perf_counter()
        try:
            torch.manual_seed(0)
            model = build(spec)
            nc.convert(model, pool_size=64, init="random")
            model.eval()
            rows[spec] = {
                "exports": True,
                **onnx_parity(model, export_input_size(spec), batch=4),
                "seconds": time.perf_counter() - tic,
            }
        except Exception as e:  # report, never stop the sweep
            rows[spec] = {"exports": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(spec, rows[spec], flush=True)
    return rows


def run_parity(run: str, precision: str = "float32", device: str = "cpu") -> dict:
    from nwsconvert.zoo import get_suite

    manifest = nc.RunDir(run).read()
    job = manifest.data["job"]
    suite = get_suite(job["suite"], **job.get("suite_options", {}))
    out = {}
    with tempfile.TemporaryDirectory() as d:
        export_bundle(run, d, "all", onnx=True)
        rt = Runtime(d, device=device)
        half = Runtime(d, device=device, precision=precision) if precision != "float32" else None
        for entry in manifest.tasks:
            t = entry.id
            test = suite.tasks[t].test
            x = torch.stack([test[i][0] for i in range(len(test))])
            labels = np.array([int(test[i][1]) for i in range(len(test))])
            model = nc.load(run, task=t)
            with torch.no_grad():
                ref = torch.cat([model(x[i : i + 256]) for i in range(0, len(x), 256)]).numpy()
            y = np.concatenate([rt.run(t, x[i : i + 256].numpy()) for i in range(0, len(x), 256)])
            out[str(t)] = {
                "images": len(x),
                "top1_agree": float((y.argmax(1) == ref.argmax(1)).mean()),
                "acc_onnxruntime": float((y.argmax(1) == labels).mean()),
                "acc_pytorch": float((ref.argmax(1) == labels).mean()),
                "acc_manifest": entry.metrics.get("val_acc"),
                "max_abs": float(np.abs(y - ref).max()),
            }
            if half is not None:
                h = np.concatenate([half.run(t, x[i : i + 256].numpy()) for i in range(0, len(x), 256)])
                out[str(t)].update(
                    {
                        f"top1_agree_{precision}": float((h.argmax(1) == y.argmax(1)).mean()),
                        f"acc_{precision}": float((h.argmax(1) == labels).mean()),
                        f"max_abs_{precision}": float(np.abs(h - y).max()),
                        f"max_rel_{precision}": float(np.abs(h - y).max() / np.abs(y).max()),
                    }
                )
            print(f"task {t}: {out[str(t)]}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", action="store_true", help="parity over the conversion test set")
    p.add_argument("--only", nargs="*", help="with --models: only specs containing one of these strings")
    p.add_argument("--run", help="run directory: top-1 agreement on its tasks' test sets")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "float16"],
        help="with --run: also the switch mode in this precision against float32's",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="with --run: the Runtime's device")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args(argv)
    if not a.models and not a.run:
        p.error("give --models and/or --run RUN")
    torch.set_num_threads(a.threads)
    report = {"torch": torch.__version__}
    if a.models:
        report["models"] = model_parity(a.only)
        rows = report["models"].values()
        ok = [r for r in rows if r["exports"]]
        print(
            f"{len(ok)}/{len(rows)} export; worst |diff| {max(r['max_abs'] for r in ok):.3g}, worst relative {max(r['rel'] for r in ok):.3g}; top-1 agrees on {sum(r['top1_agree'] for r in ok)}/{len(ok)}"
        )
    if a.run:
        tasks = run_parity(a.run, a.precision, a.device)
        report["run"] = {"dir": a.run, "device": a.device, "precision": a.precision, "tasks": tasks}
        if a.precision != "float32":
            images = sum(r["images"] for r in tasks.values())
            agree = sum(r[f"top1_agree_{a.precision}"] * r["images"] for r in tasks.values()) / images
            rel = max(r[f"max_rel_{a.precision}"] for r in tasks.values())
            report["run"][a.precision] = {"top1_agree": agree, "max_rel": rel, "images": images}
            print(
                f"{a.precision} against float32: top-1 agrees on {100 * agree:.2f} % of {images} images; largest logit difference {rel:.3g} of the largest logit"
            )
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
