"""Where does NWS's gap to a frozen-backbone peer come from: the backbone it starts from, or task learning?

A NWS run's tasks start from its base pack: the kernels pool learning ended with, drawn from the
pools. The peers of ``benchmarks/accuracy.py`` start from a dense model pretrained on the same
data for the same epochs. This probe reads a finished run and trains the peers (``--methods``,
BN + head by default) on the run's tasks twice, with the recipe, seed and data order of the run:

* from the run's base pack, made dense (every kernel the pool entry the base pack names);
* from the dense pretrained model ``benchmarks/accuracy.py`` gives them.

The first minus the second is what the starting backbone costs; the run's NWS accuracy minus the
first is what NWS's task learning adds on top of it. Measured on the hard Fashion-MNIST pairs in
``benchmarks/RESULTS.md`` ("Why NWS misses, and what helped")::

    nws-train suite=split-fashion-mnist suite.pairs=hard suite.train_per_class=200 \\
        suite.pretrain_images=2000 seed=1993 out=/tmp/q/run
    python benchmarks/probes/probe_base.py /tmp/q/run --json /tmp/q/base.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: accuracy, baselines

from accuracy import method_run, pretrained_model  # noqa: E402
from baselines import METHODS  # noqa: E402

from nwsconvert.analysis.summary import run_summary  # noqa: E402
from nwsconvert.core.nwsmodel import materialize  # noqa: E402
from nwsconvert.formats.atomic import atomic_write_bytes  # noqa: E402
from nwsconvert.train.distributed import DistInfo  # noqa: E402
from nwsconvert.train.job import recorded_job  # noqa: E402
from nwsconvert.train.loading import build_run_model, load_run_pools  # noqa: E402
from nwsconvert.train.rundir import RunDir  # noqa: E402
from nwsconvert.train.specs import build_model  # noqa: E402
from nwsconvert.train.store import RunStore  # noqa: E402
from nwsconvert.zoo import get_suite  # noqa: E402


def base_model(run_dir: str | Path, job: dict) -> nn.Module:
    """The run's base pack as an ordinary dense model (train mode): every NWS weight is the pool
    kernel the base pack names, BatchNorm and head as pool learning left them."""
    run = RunDir(run_dir)
    manifest = run.read()
    pack = RunStore(run, manifest, DistInfo()).load_pack(None)  # checked against the manifest
    suite = get_suite(job["suite"], **job["suite_options"])
    kwargs = dict(manifest.model.kwargs or {})
    model = build_model(manifest.model.spec, num_classes=suite.pretrain_classes or suite.tasks[0].num_classes, **kwargs)
    net = build_run_model(run, manifest, load_run_pools(run, manifest), pack, model=model)
    return materialize(net).train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished nws-train run directory")
    parser.add_argument(
        "--methods", nargs="+", default=["bn_head"], choices=sorted(METHODS), help="peers to train (bn_head)"
    )
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if not RunDir(args.run).exists():
        parser.error(f"{args.run}: no nws-train run there (no manifest.json)")
    job, _ = recorded_job(Path(args.run))
    if job is None or not job.get("learn_pools", True):
        parser.error(f"{args.run}: the run learned no pools, so it has no base pack to start from")
    summary = run_summary(args.run)
    done = len(summary["tasks"])
    if not done:
        parser.error(f"{args.run}: the run has finished no task yet (nws-train --resume finishes it)")
    job = {**job, "tasks": done}
    seed = int(job["seed"])
    nws = [r["acc"] for r in summary["tasks"]]
    out: dict = {"run": str(args.run), "seed": seed, "tasks": done, "nws": {"accs": nws, "avg": sum(nws) / done}}
    # Built once: every method copies the model it is given (as accuracy.py shares one per seed).
    starts = {"nws_base": base_model(args.run, job), "dense_pretrained": pretrained_model(job, seed)}
    with tempfile.TemporaryDirectory() as scratch:  # the peers' stored tasks; the run is only read
        for method in args.methods:
            out[method] = {}
            for start, model in starts.items():
                torch.manual_seed(seed)
                r = method_run(method, model, job, seed, str(Path(scratch) / f"{method}_{start}"))
                out[method][start] = {"accs": r["accs"], "avg": r["avg"]}
    print(f"{args.run}: seed {seed}, {done} tasks; average accuracy over the tasks")
    print(f"  NWS (the run)                     {100 * out['nws']['avg']:6.2f} %")
    for method in args.methods:
        a, b = out[method]["nws_base"]["avg"], out[method]["dense_pretrained"]["avg"]
        print(f"  {method:<10} from the NWS base pack  {100 * a:6.2f} %")
        print(
            f"  {method:<10} from dense pretraining  {100 * b:6.2f} %   (NWS base - dense: {100 * (a - b):+.2f} points)"
        )
    if args.json:
        atomic_write_bytes(Path(args.json), (json.dumps(out, indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
