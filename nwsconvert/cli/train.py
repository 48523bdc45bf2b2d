"""Command line ``nws-train``: pool learning, then tasks, into a run directory.

Argument parsing and printing only: the job itself (its keys, their checks, the run) is
:mod:`nwsconvert.train.job`. ``nws-train`` checks the whole job (types, ranges, paths, the device,
file kinds) before it imports torch, so a bad value is refused in a fraction of a second with one
line and exit code 2; failures while training are one line and exit code 1 (``--debug`` shows the
traceback; :mod:`nwsconvert.cli.common`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UntrustedCodeError, UsageError
from ..train.config import TrainConfig
from ..train.job import JOB_FILE, is_main_process, launch, recorded_job, resolve_job, resume_changes, validate_job
from ..train.rundir import RunDir
from ..train.specs import is_registry_spec
from .common import run_cli

__all__ = ["train_main"]

_HELP_KEYS = """\
keys (key=value; values are YAML: 3, 0.01, true, [50, 80], {{a: 1}}):
  suite=NAME              task suite: split-mnist (default, embedded), split-fashion-mnist,
                          mixed-domain, long-mixed-20, long-mixed-50, split-cifar100, image-folders
  suite.OPTION=VALUE      suite option, e.g. suite.path=~/cifar-100-python.tar.gz,
                          suite.folders=[~/cub, ~/cars], suite.root=/usr/share/datasets/fashion-mnist,
                          suite.pairs=hard, suite.classes_per_task=5, suite.train_per_class=50
  model=SPEC              timm:resnet18 (default), torchvision:resnet18, package.module:factory
  model.KW=VALUE          factory keyword argument, e.g. model.drop_rate=0.1
  pool_size=N             pool entries per layer (512)
  group_size=G            floats per pool vector of 1x1 convs and the FC layer (1)
  preset=NAME|auto        conversion preset per architecture family (nwsconvert.zoo.list_presets();
                          auto: guessed from the model); pool_size and group_size set its fields
  bits_per_weight=B       a budget: the planner picks each layer's vector and pool size so a task's
                          indices take at most B bits a weight (inverted-residual's own: 3.25; off: none)
  budget=BYTES            the same as bytes per task, state included (200000, 200KB, 0.2MB)
  group_sizes=[G, ...]    vector sizes the planner may give 1x1 / linear layers ([1]: scalar pools,
                          inverted-residual's own; [1, 2, 4, 8, 16]: all, the default elsewhere)
  init=kmeans|random|FILE pools before pool learning (kmeans of the initial weights)
  weights=FILE            start from these dense weights (a safetensors state dict, e.g.
                          safetensors.torch.save_file(model.state_dict(), FILE)): loaded before
                          conversion, so pools and every task start from them; a classifier of
                          another size is left fresh; with learn_pools=false the tasks start from
                          them as the pools quantise them, without pool learning; the run
                          records the file's SHA-256 and --resume refuses a changed file
  recipe=NAME             training options by name (any of them can be overridden):
                          demo (default): sgd lr 0.02, 3 epochs a task, 6 pool epochs, batch 64, cosine;
                          split-cifar100: sgd lr 0.01, 100 epochs, lr/10 at [50, 80], batch 32 (paper);
                          cub-to-sketches: sgd lr 0.001, 100 epochs, lr/10 at [50, 80], beta 0.1 (paper);
                          paper-adam: adam lr 0.01, 100 epochs, lr/10 at [50], batch 32 (paper)
  learn_pools=true|false  learn pools on the suite's pretraining data first
  tasks=N                 train only the first N tasks
  device=cuda|cpu         default: CUDA when present
  out=DIR                 run directory (default runs/<suite>-<model>)
  progress=true|false     progress bars
training options (override the recipe): {fields}
"""


def _user_keys(items: list[str]) -> set[str]:
    """The job keys the command line itself sets (key=value items and the keys of its YAML files)."""
    import yaml

    keys = set()
    for item in items:
        if "=" in item:
            keys.add(item.partition("=")[0].strip())
        elif Path(item).is_file():
            try:
                data = yaml.safe_load(Path(item).read_text()) or {}
            except (yaml.YAMLError, UnicodeDecodeError):
                continue
            keys.update(data if isinstance(data, dict) else ())
    return keys


def _train(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="nws-train",
        description="Learn pools, then one task after another, into a run directory "
        "(manifest.json, pools.safetensors, tasks/task_<t>.nwspack). Multi-process: torchrun --nproc_per_node N -m nwsconvert.cli.train ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_HELP_KEYS.format(fields=", ".join(TrainConfig.__dataclass_fields__))
        + "\nexit codes: 0 done, 2 usage error (nothing started), 1 failure while training (one line; --debug: traceback)\n"
        "\nexamples:\n  nws-train                                   split-mnist, timm ResNet-18, demo recipe\n"
        "  nws-train job.yaml epochs=10 out=runs/a     YAML config with overrides\n"
        "  nws-train --resume out=runs/a               continue a killed run\n",
    )
    parser.add_argument(
        "items",
        nargs="*",
        metavar="CONFIG.yaml|key=value",
        help="YAML config files and key=value overrides, applied in order",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in out=DIR (its recorded job, then your overrides)"
    )
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="on --resume, let the run's recorded package.module:factory model spec import and run its code",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors (also NWS_DEBUG=1)"
    )
    args = parser.parse_args(argv)
    user = resolve_job(args.items)
    base = held = None
    try:
        resume = args.resume
        if resume:
            if user["out"] is None:
                raise UsageError("--resume needs out=DIR (the run directory to continue)")
            out = Path(user["out"]).expanduser()
            if out.exists() and not out.is_dir():
                raise UsageError(f"cannot resume: out={str(out)!r} is a file, not a run directory")
            started = out.is_dir() and (RunDir(out).exists() or (out / JOB_FILE).is_file())
            if started and is_main_process():
                from ..train.runlock import RunLock

                held = RunLock.acquire(out)  # refuse a second writer before saying anything; launch() re-enters it
            base, source = recorded_job(out) if started else (None, "none")
            if base is None:
                what = "does not exist" if not out.exists() else f"holds no run (no manifest.json, no {JOB_FILE})"
                raise UsageError(
                    f"--resume: {str(out)!r} {what}, so there is nothing to resume: "
                    f"start a run there with nws-train [CONFIG.yaml] [key=value ...] out={out} (without --resume)"
                )
            if source == JOB_FILE:
                print(
                    f"nws-train: {out} was stopped before its manifest was written: starting it again from {JOB_FILE}",
                    file=sys.stderr,
                )
                resume = False
        job = resolve_job(args.items, base)
        validate_job(job)
        changes = None
        if resume and base is not None and source == "manifest":
            changes = resume_changes(base, job, str(RunDir(out).manifest_path))  # refused before torch loads
        trusted = True
        if base is not None and "model" not in _user_keys(args.items) and not is_registry_spec(job["model"]):
            trusted = args.trust_code  # the spec comes from the run directory, not from this command line
            if not trusted:
                raise UntrustedCodeError(
                    f"the run's model spec {job['model']!r} would import and call code named by {out}: "
                    "add --trust-code if you trust who wrote it, or restate model=... yourself"
                )
        out = launch(job, resume=resume, trust_code=trusted, changes=changes)
        print_summary(out)
    finally:
        if held is not None:
            held.release()
    return 0


def print_summary(out: str) -> None:
    """The finished run's memory and accuracy table (``nws-info``'s), from the main process only."""
    if is_main_process():
        from ..analysis.summary import format_summary, run_summary

        print(format_summary(run_summary(out)))


def train_main(argv: list[str] | None = None) -> int:
    """``nws-train``: returns the exit code (0 done, 2 usage error, 1 failure; see :mod:`nwsconvert.cli.common`)."""
    return run_cli("nws-train", _train, argv, resume_hint="run the same command with --resume")


if __name__ == "__main__":  # torchrun -m nwsconvert.cli.train ... runs nws-train
    sys.exit(train_main())
