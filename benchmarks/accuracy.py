"""NWS against the methods users would pick instead, on the same tasks with the same budget.

For each seed, in one process on the same machine:

* NWS: ``nws-train`` 's job (pool learning on the suite's pretraining split,
  then every task, packs written and re-evaluated from the files);
* every method of ``--methods`` (``benchmarks/baselines.py``: ``dense``
  finetune, ``bn_head``, ``packnet``): the same architecture unconverted,
  pretrained on the same pretraining split for the same epochs, then task after
  task with the same optimiser, schedule, batch size and data-order seeds; each
  stores its tasks and is evaluated from its files.

Prints and writes a JSON with per-seed and mean ± std average accuracy, memory
(files on disk and the paper's accounting) and training time.

    python benchmarks/accuracy.py --suite split-mnist --seeds 1993 1994 1995
    python benchmarks/accuracy.py suite.path=~/data/cifar-100-python.tar.gz --suite split-cifar100 --methods all
    (the paper's benchmark: recipe split-cifar100 unless recipe= says otherwise, the paper's table printed beside)
    python benchmarks/accuracy.py suite.train_per_class=200 --suite split-fashion-mnist --methods dense bn_head packnet
    (the nws-train keys come before --methods, which takes every name after it)
    python benchmarks/accuracy.py --suite mixed-domain --methods all --json r.json --resume
    (a killed run, or one with more seeds or methods than ``r.json``: only what ``r.json`` lacks is run)
    python benchmarks/accuracy.py --suite mixed-domain --methods bn_head --nws-variants weights=pretrained,learn_pools=false
    (``weights=pretrained`` in a variant: NWS starts from the dense model the baselines start from,
    passed as ``nws-train weights=FILE``: k-means pools of its weights, then the tasks; with
    ``learn_pools=false`` no pool learning, so NWS and the baselines get the same pretraining)

The JSON is written after every method of every seed: a killed run loses at most the method it was
running. ``--resume`` keeps what the JSON already holds for the same job and runs the rest; a JSON of
another job (suite, model, recipe, keys, variants, or NWS's training options as resolved, defaults
included: ``nws_config`` in the JSON) is refused, naming the keys that differ.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from baselines import METHODS, fit  # benchmarks/ is on sys.path when this script runs

from nwsconvert.analysis.summary import run_summary
from nwsconvert.formats.atomic import atomic_write_bytes
from nwsconvert.train.config import BEFORE_OPTION, TrainConfig
from nwsconvert.train.job import resolve_job, run_job, train_config
from nwsconvert.train.rundir import RunDir
from nwsconvert.train.specs import build_model
from nwsconvert.zoo import get_suite


def pretrained_model(job: dict, seed: int, suite=None) -> torch.nn.Module:
    """The dense model every baseline starts from: built as the NWS run's, pretrained on the suite's
    pretraining split with the pool-learning recipe (the NWS run learns its pools on the same data).
    ``suite``: the job's suite when the caller has loaded it already."""
    cfg = train_config({**job, "seed": seed})
    suite = suite if suite is not None else get_suite(job["suite"], **job["suite_options"])
    kwargs = dict(job["model_kwargs"])
    if job["model"].startswith("timm:") and suite.channels != 3:
        kwargs.setdefault("in_chans", suite.channels)
    torch.manual_seed(seed)
    model = build_model(job["model"], num_classes=suite.pretrain_classes or suite.tasks[0].num_classes, **kwargs)
    pool_cfg = cfg.for_pools()
    if suite.pretrain is not None and job["learn_pools"]:
        fit(model, suite.pretrain, pool_cfg, pool_cfg.epochs, pool_cfg.lr, pool_cfg.seed)
    return model


#: ``weights=`` value of a variant: the dense model every baseline starts from (:func:`pretrained_model`).
PEERS_START = "pretrained"


def nws_run(job: dict, seed: int, folder: str, peers_start=None) -> dict:
    """``nws-train`` 's job for one seed in ``folder``; accuracies and bytes as the run directory records them.

    ``peers_start()`` gives the baselines' pretrained model, for a job with ``weights=pretrained``
    (written to ``folder``'s side as a safetensors state dict and given to the job as its file)."""
    if job.get("weights") == PEERS_START:
        from safetensors.torch import save_file

        path = f"{folder}.pretrained.safetensors"
        save_file({k: v.detach().contiguous() for k, v in peers_start().state_dict().items()}, path)
        job = {**job, "weights": path}
    tic = time.perf_counter()
    run_job({**job, "seed": seed, "out": folder})
    seconds = time.perf_counter() - tic
    summary = run_summary(folder)
    accs = [r["acc"] for r in summary["tasks"]]
    run = RunDir(folder)
    entries = sorted(run.read().tasks, key=lambda e: e.id)
    shared = summary["pools_file_bytes"] + summary["base_file_bytes"]
    packs = [(run.path / e.file).stat().st_size for e in entries]
    on_disk = [shared + sum(packs[: t + 1]) for t in range(len(packs))]
    return {
        "accs": accs,
        "avg": sum(accs) / len(accs),
        "seconds": seconds,
        # files on disk, as every baseline's: pool file + base pack + packs, headers included (before
        # the curves, d585cdb, this was the tensors' bytes alone, nws-info's figure: 8 % less on long-mixed-20)
        "disk_bytes": on_disk[-1],
        "content_bytes": summary["total"]["nws_bytes"],
        "paper_bits": None,
        "curve": {
            # after task t: the files on disk (pools, base pack, packs 0..t), and each task's training seconds
            "disk_bytes": on_disk,
            "task_seconds": [e.metrics.get("seconds") for e in entries],
        },
    }


def method_run(name: str, pretrained: torch.nn.Module, job: dict, seed: int, folder: str) -> dict:
    """Every task of the suite with baseline ``name``; accuracies re-loaded from its files, after the last task."""
    cfg = train_config({**job, "seed": seed})
    suite = get_suite(job["suite"], **job["suite_options"])
    tasks = suite.tasks[: job["tasks"]] if job["tasks"] else suite.tasks
    method = METHODS[name](pretrained, folder, cfg, seed)
    curve: dict = {"learned_accs": [], "disk_bytes": [], "task_seconds": []}
    seconds = 0.0
    for t, task in enumerate(tasks):
        tic = time.perf_counter()
        curve["learned_accs"].append(method.learn(t, task))  # re-loaded from its files right after it
        curve["task_seconds"].append(time.perf_counter() - tic)
        seconds += curve["task_seconds"][-1]
        curve["disk_bytes"].append(method.memory()["disk_bytes"])
        if hasattr(method, "free_fraction"):
            curve.setdefault("free_fraction", []).append(method.free_fraction())
    accs = [method.evaluate(t, task.test) for t, task in enumerate(tasks)]
    return {"accs": accs, "avg": sum(accs) / len(accs), "seconds": seconds, **method.memory(), "curve": curve}


#: Suites the paper reports: the recipe it used, and its table (method -> (average accuracy %, total MB)),
#: under our method names where we have the method (``nws``, ``dense``, ``packnet``).
PAPER = {
    "split-cifar100": {
        "recipe": "split-cifar100",
        "source": "Jiang & Celiktutan, WACV, Table 1 (ResNet-18, ImageNet-pretrained, 20 tasks of 5 classes)",
        "table": {
            "nws": (73.4, 33.9),
            "dense": (71.3, 892.0),
            "KSM": (71.5, 192.5),
            "packnet": (67.1, 55.2),
            "AQD": (69.9, 52.7),
        },
    },
}


def paper_table(suite: str, mean: dict, megabytes: dict) -> str:
    """The paper's figures for ``suite`` beside this run's (``mean``: method -> %, ``megabytes``: method -> MB)."""
    paper = PAPER[suite]
    lines = [
        f"paper ({paper['source']}) beside this run:",
        f"  {'method':<10} {'paper acc':>9} {'paper MB':>9} {'ours acc':>9} {'ours MB':>9}",
    ]
    for m in dict.fromkeys([*paper["table"], *mean]):
        acc, mb = paper["table"].get(m, (None, None))
        cells = [
            f"{acc:.1f}" if acc is not None else "-",
            f"{mb:.1f}" if mb is not None else "-",
            f"{mean[m]:.2f}" if m in mean else "-",
            f"{megabytes[m]:.2f}" if m in megabytes else "-",
        ]
        lines.append(f"  {m:<10} " + " ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def _machine() -> dict:
    """Versions and machine the figures come from."""
    import platform

    import timm

    try:
        import peft

        peft_version = peft.__version__
    except ImportError:
        peft_version = None
    return {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "peft": peft_version,
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        # The kernels torch dispatches to on this CPU (AVX2, AVX512...): the same command gives other
        # digits on another instruction set (benchmarks/RESULTS.md, "Pools stored in float16").
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str | None:
    """The CPU's model name from ``/proc/cpuinfo`` (``None`` where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _commit() -> str | None:
    """The checkout's commit, recorded beside the figures, with ``-dirty`` when tracked files differ
    from it (None outside a git checkout)."""
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7", "--match=NO-TAGS"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _result(args, commit, job, names, variants, rows, partial=None) -> dict:
    """The JSON of a run so far: complete per-seed rows, mean and std (%) per method over them, and
    ``partial``, the seed in progress (the methods it has finished), for ``--resume``."""

    def ms(method):
        vals = [100 * r[method]["avg"] for r in rows if method in r]
        if not vals:
            return None, None
        return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0

    return {
        "suite": args.suite,
        "commit": commit,
        "machine": _machine(),
        "job": job,
        "nws_config": train_config(job).to_dict(),
        "methods": names,
        "rows": rows,
        "variants": {name: v for name, v in zip(variants, args.nws_variants)},
        "seeds": args.seeds,
        "one_seed": args.one_seed,
        "mean": {m: ms(m)[0] for m in names},
        "std": {m: ms(m)[1] for m in names},
        **({"partial": partial} if partial else {}),
    }


def _write(path: str, result: dict) -> None:
    atomic_write_bytes(path, json.dumps(result, indent=2).encode())


def recorded_nws_config(result: dict) -> dict:
    """NWS's training options as the run of a results JSON resolved them: its ``nws_config``, with
    :data:`BEFORE_OPTION` for options it predates; for a file written before ``nws_config`` was
    recorded, its job resolved with ``task_init=previous`` (the default until it became
    ``original``) and :data:`BEFORE_OPTION`, unless the job said otherwise."""
    if result.get("nws_config"):
        return {**BEFORE_OPTION, **result["nws_config"]}
    job = {"task_init": "previous", **BEFORE_OPTION, **result.get("job", {})}
    return json.loads(json.dumps(train_config(job).to_dict()))


def _resumed(path: str, suite: str, job: dict) -> dict:
    """seed -> the methods ``path`` already measured for this job (complete rows and the partial one; a
    variant's figures are kept under its name, ``nws[key=value]``, whose job follows from the base job).

    Raises SystemExit naming the file and the keys that differ when ``path`` holds another job's figures."""
    try:
        with open(path) as f:
            old = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--resume: {path} is not a readable accuracy JSON ({exc})") from None
    here = json.loads(json.dumps(job))  # tuples as lists, as the file holds them
    there = old.get("job", {})
    # The training options are compared as NWS resolved them, defaults included (a default that
    # changed since must not mix two settings under one name); the job's other keys as written.
    options = set(TrainConfig.__dataclass_fields__)
    differ = sorted(k for k in {*here, *there} - options if here.get(k) != there.get(k))
    config = json.loads(json.dumps(train_config(job).to_dict()))
    recorded = recorded_nws_config(old)
    differ += [k for k in sorted(recorded) if recorded[k] != config.get(k)]
    if old.get("suite") != suite:
        differ.insert(0, "--suite")
    if differ:
        raise SystemExit(
            f"--resume: {path} holds another job's figures ({', '.join(differ)} differ); "
            "give another --json or the same keys"
        )
    done = {}
    for row in [*old.get("rows", []), *([old["partial"]] if old.get("partial") else [])]:
        done.setdefault(row["seed"], {}).update({k: v for k, v in row.items() if k != "seed"})
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", help="nws-train keys (suite=..., suite.X=..., model=..., epochs=...)")
    p.add_argument("--suite", default="split-mnist")
    p.add_argument("--seeds", type=int, nargs="+", default=[1993, 1994, 1995])
    p.add_argument(
        "--methods",
        nargs="*",
        default=["dense"],
        choices=["all", *sorted(METHODS)],
        help="baselines beside NWS (default: dense; all: every one; none after the flag: NWS alone)",
    )
    p.add_argument(
        "--nws-variants",
        nargs="*",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="more NWS runs beside the first, each with these nws-train keys changed (e.g. task_init=previous)",
    )
    p.add_argument(
        "--one-seed",
        nargs="*",
        default=[],
        choices=sorted(METHODS),
        metavar="METHOD",
        help="methods of --methods run on the first seed only (the long suites' slower peers)",
    )
    p.add_argument("--json", default=None, help="write the results here (after every method of every seed)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep what --json already holds for this job (its seeds join --seeds); run only what it lacks",
    )
    args = p.parse_args(argv)
    if args.resume and not args.json:
        p.error("--resume needs --json, the file to resume")
    commit = _commit()  # at the start: the code this run imported
    if "all" in args.methods:
        args.methods = list(METHODS)
    if set(args.one_seed) - set(args.methods):
        p.error(f"--one-seed {' '.join(sorted(set(args.one_seed) - set(args.methods)))}: not in --methods")
    recipe = [f"recipe={PAPER[args.suite]['recipe']}"] if args.suite in PAPER else []  # an item recipe=... overrides it
    job = resolve_job([f"suite={args.suite}", "progress=false", *recipe, *args.items])
    variants = {f"nws[{v}]": resolve_job(v.split(","), job) for v in args.nws_variants}
    names = ["nws", *variants, *args.methods]
    done = _resumed(args.json, args.suite, job) if args.resume else {}
    args.seeds = list(dict.fromkeys([*done, *args.seeds]))  # resuming never drops a seed the file holds
    dropped = sorted({m for row in done.values() for m in row} - set(names))
    if dropped:  # nor a method: the file is rewritten with this command's methods
        p.error(
            f"--resume: {args.json} holds {', '.join(dropped)}, which this command does not run; "
            "add them to --methods / --nws-variants or give another --json"
        )
    rows = []
    for seed in args.seeds:
        row = {"seed": seed, **{m: r for m, r in done.get(seed, {}).items() if m in names}}
        if len(row) > 1:
            print(f"seed {seed}: kept from {args.json}: {', '.join(m for m in names if m in row)}", flush=True)

        def finished(name, figures, row=row):
            row[name] = {**figures, "commit": commit}
            if args.json:  # after every method: a killed run loses at most the one it was running
                _write(args.json, _result(args, commit, job, names, variants, rows, partial=row))

        # the baselines' pretrained model, built once per seed when first needed, and its seconds
        pretraining: dict = {}

        def pretrain(seed=seed, pretraining=pretraining):
            tic = time.perf_counter()
            model = pretrained_model(job, seed)
            pretraining["seconds"] = time.perf_counter() - tic
            return model

        peers_start = functools.cache(pretrain)
        with tempfile.TemporaryDirectory() as tmp:
            if "nws" not in row:
                finished("nws", nws_run(job, seed, f"{tmp}/run", peers_start))
            for i, (name, vjob) in enumerate(variants.items()):
                if name not in row:
                    finished(name, nws_run(vjob, seed, f"{tmp}/variant{i}", peers_start))
            first = seed == args.seeds[0]
            for name in [n for n in args.methods if n not in row and (first or n not in args.one_seed)]:
                figures = method_run(name, peers_start(), job, seed, f"{tmp}/{name}")
                finished(name, {**figures, "pretrain_seconds": pretraining["seconds"]})
        rows.append(row)
        if args.json:
            _write(args.json, _result(args, commit, job, names, variants, rows))
        print(
            f"seed {seed}: "
            + "  ".join(f"{m} {100 * row[m]['avg']:.2f}% ({row[m]['seconds']:.0f}s)" for m in names if m in row),
            flush=True,
        )

    result = _result(args, commit, job, names, variants, rows)
    print(f"\n{args.suite}, {job['model']}, recipe {job['recipe']}, seeds {args.seeds}")
    for m in names:
        mean, std = result["mean"][m], result["std"][m]
        print(
            f"  {m:<8} {mean:.2f} ± {std:.2f} %   ({rows[0][m]['disk_bytes'] / 1e6:.2f} MB on disk for {len(rows[0][m]['accs'])} tasks)"
        )
    if "dense" in args.methods:
        gaps = [100 * (r["dense"]["avg"] - r["nws"]["avg"]) for r in rows if "dense" in r]
        print(
            f"  gap (dense - NWS) per seed: {', '.join(f'{g:+.2f}' for g in gaps)} points; mean {statistics.mean(gaps):+.2f}"
        )
    if args.suite in PAPER:
        megabytes = {m: rows[0][m]["disk_bytes"] / 1e6 for m in names}
        print(paper_table(args.suite, result["mean"], megabytes))
    if args.json:
        _write(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
