"""Command lines: ``nws-train`` (pools, then tasks, into a run directory) and ``nws-info RUN``.

The CLI is an application on top of the library: it picks data and recipes
from ``nwsconvert.zoo`` (imported here, never by the core modules).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import TrainConfig

__all__ = ["train_main", "info_main", "run_job", "resolve_job", "DEFAULT_JOB"]

#: Job keys of ``nws-train`` besides the TrainConfig fields.
DEFAULT_JOB: dict = {
    "suite": "split-mnist",  # nwsconvert.zoo.list_suites()
    "suite_options": {},  # e.g. {"path": "~/data/cifar-100-python.tar.gz"}
    "model": "timm:resnet18",  # timm:<name>, torchvision:<name>, module:factory
    "model_kwargs": {},  # factory keyword arguments; in_chans follows the suite for timm
    "pool_size": 512,
    "group_size": 1,  # floats per pool vector for 1x1 convs and the FC layer
    "preset": None,  # conversion preset: nwsconvert.zoo.list_presets() or "auto"
    "init": "kmeans",  # kmeans | random | <pool file>
    "recipe": "demo",  # nwsconvert.zoo.list_recipes()
    "learn_pools": True,  # pool learning on the suite's pretraining data
    "tasks": None,  # how many tasks to train (None: all)
    "device": None,  # cuda / cpu (None: CUDA when present)
    "out": None,  # run directory (default runs/<suite>-<model>)
    "progress": True,
}

_HELP_KEYS = """\
keys (key=value; values are YAML: 3, 0.01, true, [50, 80], {{a: 1}}):
  suite=NAME              task suite: split-mnist (default, embedded), split-fashion-mnist,
                          split-cifar100, image-folders
  suite.OPTION=VALUE      suite option, e.g. suite.path=~/cifar-100-python.tar.gz,
                          suite.folders=[~/cub, ~/cars], suite.root=/usr/share/datasets/fashion-mnist
  model=SPEC              timm:resnet18 (default), torchvision:resnet18, package.module:factory
  model.KW=VALUE          factory keyword argument, e.g. model.drop_rate=0.1
  pool_size=N             pool entries per layer (512)
  group_size=G            floats per pool vector of 1x1 convs and the FC layer (1)
  preset=NAME|auto        conversion preset per architecture family (nwsconvert.zoo.list_presets();
                          auto: guessed from the model); pool_size and group_size set its fields
  init=kmeans|random|FILE pools before pool learning (kmeans of the initial weights)
  recipe=NAME             demo (default), split-cifar100, cub-to-sketches, paper-adam
  learn_pools=true|false  learn pools on the suite's pretraining data first
  tasks=N                 train only the first N tasks
  device=cuda|cpu         default: CUDA when present
  out=DIR                 run directory (default runs/<suite>-<model>)
  progress=true|false     progress bars
training options (override the recipe): {fields}
"""


def _parse_value(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _apply(job: dict, key: str, value, source: str) -> None:
    train_fields = set(TrainConfig.__dataclass_fields__)
    if key.startswith("suite."):
        job["suite_options"] = {**job["suite_options"], key[6:]: value}
    elif key.startswith("model."):
        job["model_kwargs"] = {**job["model_kwargs"], key[6:]: value}
    elif key in DEFAULT_JOB or key in train_fields:
        job[key] = value
    else:
        known = sorted(set(DEFAULT_JOB) | train_fields)
        raise SystemExit(f"nws-train: unknown key {key!r} in {source}; known keys: {', '.join(known)} (and suite.X, model.X)")


def resolve_job(items: list[str], base: dict | None = None) -> dict:
    """Defaults <- ``base`` <- YAML files <- ``key=value`` items, in the order given."""
    import yaml

    job = {**DEFAULT_JOB, **(base or {})}
    for item in items:
        if "=" in item:
            key, _, value = item.partition("=")
            _apply(job, key.strip(), _parse_value(value), f"argument {item!r}")
            continue
        path = Path(item)
        if not path.is_file():
            raise SystemExit(f"nws-train: {item!r} is neither key=value nor an existing YAML config file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise SystemExit(f"nws-train: {path}: invalid YAML ({e})") from None
        if not isinstance(data, dict):
            raise SystemExit(f"nws-train: {path}: the YAML config must be a mapping of keys to values")
        for key, value in data.items():
            if key in ("suite_options", "model_kwargs") and isinstance(value, dict):
                for k, v in value.items():
                    _apply(job, f"{key.split('_')[0]}.{k}", v, str(path))
            else:
                _apply(job, key, value, str(path))
    return job


def _convert_options(job: dict, model, init, seed: int) -> dict:
    """``convert`` keyword arguments of a job: its pool and group size, through its preset if it names one."""
    options = {"pool_size": int(job["pool_size"]), "group_size": int(job["group_size"]), "init": init, "seed": seed}
    if job["preset"] in (None, "none"):
        return options
    from nwsconvert.zoo import get_preset, preset_for

    name = preset_for(model) if job["preset"] == "auto" else str(job["preset"])
    try:
        preset = get_preset(name)
    except KeyError as e:
        raise SystemExit(f"nws-train: {e.args[0]} (or preset=auto)") from None
    print(f"conversion preset {name!r}", flush=True)
    return preset.convert_kwargs(model, **options)


def _train_config(job: dict) -> TrainConfig:
    from nwsconvert.zoo import get_recipe

    fields = {k: v for k, v in job.items() if k in TrainConfig.__dataclass_fields__}
    try:
        return get_recipe(job["recipe"], **fields)
    except (KeyError, ValueError, TypeError) as e:
        raise SystemExit(f"nws-train: {e}") from None


def run_job(job: dict, resume: bool = False) -> str:
    """Run a resolved job (see :data:`DEFAULT_JOB`); returns the run directory."""
    import torch

    from nwsconvert.zoo import get_suite

    from .convert import convert
    from .rundir import RunDir
    from .specs import build_model
    from .summary import format_summary, run_summary
    from .trainer import Trainer

    config = _train_config(job)
    try:
        suite = get_suite(job["suite"], **job["suite_options"])
    except (KeyError, FileNotFoundError, TypeError, ValueError) as e:
        raise SystemExit(f"nws-train: {e}") from None
    out = job["out"] or f"runs/{job['suite']}-{job['model'].split(':')[-1]}"
    run = RunDir(out)
    if run.exists() and not resume:
        raise SystemExit(f"nws-train: {out!r} already holds a run: add --resume to continue it, or out=OTHER_DIR")
    kwargs = dict(job["model_kwargs"])
    source = job["model"].split(":")[0]
    if source == "timm" and suite.channels != 3:
        kwargs.setdefault("in_chans", suite.channels)
    elif source == "torchvision" and suite.channels != 3:
        raise SystemExit(
            f"nws-train: {job['suite']} has {suite.channels}-channel images and torchvision classifiers take 3; "
            "use a timm model (model=timm:resnet18) or a factory that accepts them"
        )
    first = suite.pretrain_classes or suite.tasks[0].num_classes
    torch.manual_seed(config.seed)  # the model's random init too: a seed reproduces the whole run
    try:
        model = build_model(job["model"], num_classes=first, **kwargs)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"nws-train: {e}") from None
    init = job["init"]
    if run.exists() and run.pool_path.is_file():
        init = str(run.pool_path)  # resuming: the run's own pools, no k-means again
    convert(model, **_convert_options(job, model, init, config.seed))
    print(model.nws_report.table().splitlines()[0] + f"; {model.nws_report.kernels:,} kernels", flush=True)
    trainer = Trainer(
        model,
        out,
        config,
        model_spec=job["model"],
        model_kwargs=kwargs,
        data_info={**suite.info(), "job": job},
        device=job["device"],
        resume=resume,
        progress=bool(job["progress"]),
    )
    main = trainer.dist.is_main
    if job["learn_pools"] and suite.pretrain is not None:
        m = trainer.fit_pools(suite.pretrain, suite.pretrain_test, num_classes=suite.pretrain_classes)
        if main and m:
            print(f"pools: val acc {100 * m.get('val_acc', 0):.2f}%  pool usage {100 * m.get('pool_usage', 0):.1f}%", flush=True)
    tasks = suite.tasks[: job["tasks"]] if job["tasks"] else suite.tasks
    for t, task in enumerate(tasks):
        m = trainer.fit_task(t, task.train, task.test, task.num_classes, name=task.name, class_names=task.class_names)
        if main:
            print(f"task {t} ({task.name}): acc {100 * m['val_acc']:.2f}%  rebuilt from pack {100 * m['rebuilt_acc']:.2f}%", flush=True)
    if main:
        print(format_summary(run_summary(out)))
    return out


def train_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nws-train",
        description="Learn pools, then one task after another, into a run directory "
        "(manifest.json, pools.safetensors, tasks/task_<t>.nwspack). Multi-process: torchrun --nproc_per_node N -m nwsconvert.cli ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_HELP_KEYS.format(fields=", ".join(TrainConfig.__dataclass_fields__))
        + "\nexamples:\n  nws-train                                   split-mnist, timm ResNet-18, demo recipe\n"
        "  nws-train job.yaml epochs=10 out=runs/a     YAML config with overrides\n"
        "  nws-train --resume out=runs/a               continue a killed run\n",
    )
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value", help="YAML config files and key=value overrides, applied in order")
    parser.add_argument("--resume", action="store_true", help="continue the run in out=DIR (its recorded job, then your overrides)")
    args = parser.parse_args(argv)
    base = None
    if args.resume:
        out = resolve_job(args.items)["out"]
        if out is None:
            raise SystemExit("nws-train: --resume needs out=DIR (the run directory to continue)")
        from .rundir import RunDir

        try:
            base = RunDir(out).read().get("data", {}).get("job")
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"nws-train: cannot resume: {e}") from None
    job = resolve_job(args.items, base)
    run_job(job, resume=args.resume)
    return 0


def info_main(argv: list[str] | None = None) -> int:
    from .storage import FormatError
    from .summary import format_summary, run_summary

    parser = argparse.ArgumentParser(
        prog="nws-info",
        description="Per-task accuracy and memory of a run in the paper's accounting: pool set + per-task "
        "indices + BN statistics + heads, beside dense finetune (one float32 model per task).",
    )
    parser.add_argument("run", metavar="RUN", help="run directory written by nws-train / nwsconvert.Trainer")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (bytes, accuracy in 0..1)")
    args = parser.parse_args(argv)
    try:
        summary = run_summary(args.run)
    except (FileNotFoundError, FormatError, KeyError) as e:
        print(f"nws-info: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":  # torchrun -m nwsconvert.cli ... runs nws-train
    sys.exit(train_main())
