"""NWS vs dense finetune accuracy on the same tasks with the same budget.

For each seed, in one process on the same machine:

* NWS: ``nws-train`` 's job (pool learning on the suite's pretraining split,
  then every task, packs written and re-evaluated from the files);
* dense finetune: the same architecture unconverted, pretrained on the same
  pretraining split for the same epochs, then finetuned task after task (head
  resized the same way, the weights of task t start from task t-1's), one full
  model kept per task. Same optimiser, schedule, batch size, data order seeds.

Prints and writes a JSON with per-seed and mean ± std average accuracy.

    python benchmarks/accuracy.py --suite split-mnist --seeds 1993 1994 1995
    python benchmarks/accuracy.py --suite split-fashion-mnist suite.train_per_class=1000 suite.pretrain_images=3000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from nwsconvert import evaluate, resize_head
from nwsconvert.cli import resolve_job, run_job, _train_config
from nwsconvert.config import lr_factor
from nwsconvert.specs import build_model
from nwsconvert.summary import run_summary
from nwsconvert.zoo import get_suite


def _fit_dense(model, data, cfg, epochs, lr, seed):
    opt = (
        torch.optim.Adam(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    )
    sched_cfg = cfg.replace(epochs=epochs)
    for epoch in range(epochs):
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(sched_cfg, epoch)
        loader = DataLoader(
            data,
            batch_size=cfg.batch_size,
            sampler=RandomSampler(data, generator=torch.Generator().manual_seed(seed * 1000 + epoch)),
            drop_last=len(data) > cfg.batch_size,
        )
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def dense_run(job: dict, seed: int) -> list[float]:
    cfg = _train_config({**job, "seed": seed})
    suite = get_suite(job["suite"], **job["suite_options"])
    kwargs = dict(job["model_kwargs"])
    if job["model"].startswith("timm:") and suite.channels != 3:
        kwargs.setdefault("in_chans", suite.channels)
    torch.manual_seed(seed)
    model = build_model(job["model"], num_classes=suite.pretrain_classes or suite.tasks[0].num_classes, **kwargs)
    pool_cfg = cfg.for_pools()
    if suite.pretrain is not None and job["learn_pools"]:
        _fit_dense(model, suite.pretrain, pool_cfg, pool_cfg.epochs, pool_cfg.lr, pool_cfg.seed)
    accs = []
    tasks = suite.tasks[: job["tasks"]] if job["tasks"] else suite.tasks
    for t, task in enumerate(tasks):
        resize_head(model, task.num_classes, torch.Generator().manual_seed(seed + t))
        _fit_dense(model, task.train, cfg, cfg.epochs, cfg.lr, seed + 1 + t)
        accs.append(evaluate(model, task.test)["acc"])
    return accs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", help="nws-train keys (suite=..., suite.X=..., model=..., epochs=...)")
    p.add_argument("--suite", default="split-mnist")
    p.add_argument("--seeds", type=int, nargs="+", default=[1993, 1994, 1995])
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    job = resolve_job([f"suite={args.suite}", "progress=false", *args.items])
    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            tic = time.perf_counter()
            run_job({**job, "seed": seed, "out": f"{tmp}/run"})
            nws_s = time.perf_counter() - tic
            summary = run_summary(f"{tmp}/run")
        nws = [r["acc"] for r in summary["tasks"]]
        tic = time.perf_counter()
        dense = dense_run(job, seed)
        dense_s = time.perf_counter() - tic
        row = {
            "seed": seed,
            "nws": nws,
            "dense": dense,
            "nws_avg": sum(nws) / len(nws),
            "dense_avg": sum(dense) / len(dense),
            "nws_seconds": nws_s,
            "dense_seconds": dense_s,
            "nws_bytes": summary["total"]["nws_bytes"],
            "dense_bytes": summary["total"]["dense_finetune_bytes"],
        }
        rows.append(row)
        print(
            f"seed {seed}: NWS {100 * row['nws_avg']:.2f}% ({nws_s:.0f}s)  dense finetune {100 * row['dense_avg']:.2f}% ({dense_s:.0f}s)",
            flush=True,
        )

    def ms(key):
        vals = [100 * r[key] for r in rows]
        return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0

    (nm, ns), (dm, ds) = ms("nws_avg"), ms("dense_avg")
    gaps = [100 * (r["dense_avg"] - r["nws_avg"]) for r in rows]
    result = {"suite": args.suite, "job": job, "rows": rows, "nws_mean": nm, "nws_std": ns, "dense_mean": dm, "dense_std": ds}
    print(f"\n{args.suite}, {job['model']}, recipe {job['recipe']}, seeds {args.seeds}")
    print(f"  NWS            {nm:.2f} ± {ns:.2f} %   ({rows[0]['nws_bytes'] / 1e6:.2f} MB for {len(rows[0]['nws'])} tasks)")
    print(f"  dense finetune {dm:.2f} ± {ds:.2f} %   ({rows[0]['dense_bytes'] / 1e6:.2f} MB)")
    print(f"  gap (dense - NWS) per seed: {', '.join(f'{g:+.2f}' for g in gaps)} points; mean {statistics.mean(gaps):+.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
