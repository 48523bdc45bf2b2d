"""Why a baseline fails on a model: PackNet's and Piggyback's first task, phase by phase.

Runs the first task of a suite with ``benchmarks/baselines.py``'s PackNet and Piggyback, from the
same pretrained model as ``benchmarks/accuracy.py`` builds (same job keys, same seed), and prints:

* PackNet: the task's test accuracy after training the free weights, right after pruning, after
  pruning with the BatchNorm statistics re-estimated on the task's training images (no weight
  changed), after retraining with ``retrain_epochs`` epochs (``--retrain``, default the
  method's own, ``epochs // 2``, and ``epochs``), and as stored (after ``recalibrate_bn``, on by
  default, re-estimates the statistics over every training image);
* Piggyback: the task's accuracy from its stored files and, per masked layer, the fraction of
  weights its mask switched off and the layer's mean ``|W|`` (the score update of the shared SGD
  recipe is ``lr * W * dL/dW_masked``: large weights flip their masks first).

    python benchmarks/probes/probe_baselines.py suite.pairs=hard suite.train_per_class=200 \\
        suite.pretrain_images=2000 suite.resize=64 model=nwsconvert.zoo.pretrained:efficientnet_lite0 \\
        model.in_chans=1 model.image_size=64 preset=inverted-residual --suite split-fashion-mnist
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: accuracy, baselines
import accuracy  # noqa: E402
import baselines  # noqa: E402
from torch.optim.swa_utils import update_bn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from nwsconvert.train.evaluation import evaluate  # noqa: E402
from nwsconvert.zoo import get_suite  # noqa: E402


def _reestimate_bn(model: torch.nn.Module, data) -> None:
    """Recompute ``model``'s BatchNorm statistics on ``data`` in place (cumulative average over its
    batches of 64, weights untouched, momentum restored: ``torch.optim.swa_utils.update_bn``)."""
    update_bn(DataLoader(data, batch_size=64), model)


def probe_packnet(pretrained, cfg, seed, task, retrain: int) -> dict:
    """Accuracy of PackNet's first task after each phase, with ``retrain`` epochs of retraining."""
    method = baselines.PackNet(pretrained, tempfile.mkdtemp(), cfg, seed, retrain_epochs=retrain)
    out: dict = {"retrain_epochs": retrain}
    real_fit = baselines.fit

    def fit(model, data, cfg_, epochs, lr, seed_, **kwargs):
        if "trained" in out:  # the retraining call: the weights are pruned, nothing retrained yet
            out["pruned"] = evaluate(model, task.test)["acc"]
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            _reestimate_bn(model, task.train)
            out["pruned_bn_reestimated"] = evaluate(model, task.test)["acc"]
            model.load_state_dict(saved)
        real_fit(model, data, cfg_, epochs, lr, seed_, **kwargs)
        out["retrained" if "trained" in out else "trained"] = evaluate(model, task.test)["acc"]

    baselines.fit = fit
    try:
        method.learn(0, task)
    finally:
        baselines.fit = real_fit
    out["stored"] = evaluate(method.model, task.test)["acc"]  # after recalibrate_bn, when the recipe sets it
    out["from_files"] = method.evaluate(0, task.test)
    return out


def probe_piggyback(pretrained, cfg, seed, task) -> dict:
    """Piggyback's first task: accuracy from its files, and per masked layer the weights switched off."""
    method = baselines.Piggyback(pretrained, tempfile.mkdtemp(), cfg, seed)
    method.learn(0, task)
    layers = {}
    for name in method.masked:
        owner, _, attr = name.rpartition(".")
        parametrization = method.model.get_submodule(owner).parametrizations[attr]
        off = parametrization[0].binary() == 0
        layers[name] = {"off": float(off.float().mean()), "mean_abs_w": float(parametrization.original.abs().mean())}
    return {"from_files": method.evaluate(0, task.test), "layers": layers}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", help="nws-train keys, as benchmarks/accuracy.py takes them")
    p.add_argument("--suite", default="split-fashion-mnist")
    p.add_argument("--seed", type=int, default=1993)
    p.add_argument(
        "--retrain", type=int, nargs="*", help="PackNet retraining epochs to try (default: epochs//2, epochs)"
    )
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    job = accuracy.resolve_job([f"suite={args.suite}", "progress=false", *args.items])
    cfg = accuracy.train_config({**job, "seed": args.seed})
    task = get_suite(job["suite"], **job["suite_options"]).tasks[0]
    pretrained = accuracy.pretrained_model(job, args.seed)
    result = {"job": job, "seed": args.seed, "task": task.name, "packnet": [], "piggyback": None}
    for retrain in args.retrain or sorted({max(1, cfg.epochs // 2), cfg.epochs}):
        row = probe_packnet(pretrained, cfg, args.seed, task, retrain)
        result["packnet"].append(row)
        print("packnet", json.dumps(row), flush=True)
    result["piggyback"] = probe_piggyback(pretrained, cfg, args.seed, task)
    worst = sorted(result["piggyback"]["layers"].items(), key=lambda kv: -kv[1]["off"])[:6]
    print("piggyback from files", result["piggyback"]["from_files"], flush=True)
    for name, row in worst:
        print(f"  {name}: {100 * row['off']:.1f} % off, mean |W| {row['mean_abs_w']:.3f}")
    if args.json:
        accuracy._write(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
