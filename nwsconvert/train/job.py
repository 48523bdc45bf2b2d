"""The job layer of ``nws-train``: job keys in, a trained run directory out.

A *job* is a dict of keys (:data:`DEFAULT_JOB` plus the :class:`~nwsconvert.train.config.TrainConfig`
fields): which suite, model, conversion, recipe and run directory. This module resolves a job from
YAML files and ``key=value`` items (:func:`resolve_job`), checks every key before anything heavy is
imported (:func:`validate_job`), records it in the run directory and runs it (:func:`launch`,
:func:`run_job`). The command line (:mod:`nwsconvert.cli.train`) parses argv and prints; scripts
(``benchmarks/accuracy.py``) call these functions directly.

Data and recipes come from ``nwsconvert.zoo``, imported inside the functions that need them (the
zoo builds on ``TrainConfig``; nothing else under ``nwsconvert/`` imports it).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

from ..devices import check_device
from ..errors import FormatError, RunExistsError, UntrustedCodeError, UsageError
from ..formats.atomic import atomic_write_bytes
from ..formats.limits import MAX_POOL_SIZE
from .config import BEFORE_OPTION, TrainConfig
from .rundir import RunDir
from .specs import LOADING_KWARGS, is_registry_spec

__all__ = [
    "DEFAULT_JOB",
    "JOB_FILE",
    "resolve_job",
    "validate_job",
    "train_config",
    "default_out",
    "recorded_job",
    "resume_changes",
    "launch",
    "run_job",
    "convert_job",
    "load_job_weights",
    "check_model_spec",
    "check_pool_file",
    "is_main_process",
]

JOB_FILE = "job.json"  # the job, written before anything else: --resume finds it even before the manifest exists

#: Job keys of ``nws-train`` besides the TrainConfig fields.
DEFAULT_JOB: dict = {
    "suite": "split-mnist",  # nwsconvert.zoo.list_suites()
    "suite_options": {},  # e.g. {"path": "~/data/cifar-100-python.tar.gz"}
    "model": "timm:resnet18",  # timm:<name>, torchvision:<name>, module:factory
    "model_kwargs": {},  # factory keyword arguments; in_chans follows the suite for timm
    "pool_size": 512,
    "group_size": 1,  # floats per pool vector for 1x1 convs and the FC layer
    "preset": None,  # conversion preset: nwsconvert.zoo.list_presets() or "auto"
    "bits_per_weight": None,  # a budget for the planner: index bits per weight (None: the preset's; off: none)
    "budget": None,  # the same as bytes per task (200000, "200KB", "0.2MB")
    "group_sizes": None,  # vector sizes the planner may give 1x1 / linear layers (None: the preset's, else all)
    "init": "kmeans",  # kmeans | random | <pool file>
    "weights": None,  # safetensors state dict loaded into the model before conversion
    "recipe": "demo",  # nwsconvert.zoo.list_recipes()
    "learn_pools": True,  # pool learning on the suite's pretraining data
    "tasks": None,  # how many tasks to train (None: all)
    "device": None,  # cuda / cpu (None: CUDA when present)
    "out": None,  # run directory (default runs/<suite>-<model>)
    "progress": True,
}


def is_main_process() -> bool:
    """Whether this process is the job's main one: always, unless torchrun started it as a rank other
    than 0 (read from ``RANK``, so it holds before the process group exists, and imports no torch)."""
    return os.environ.get("RANK", "0") == "0"


def _say(line: str) -> None:
    """Print ``line`` once per job, from the main process (every rank converts the model)."""
    if is_main_process():
        print(line, flush=True)


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
    elif key == "out" and (value is None or str(value).strip() == ""):
        raise UsageError(f"out= in {source} is empty: give the run directory, e.g. out=runs/a (or leave the key out)")
    elif key in DEFAULT_JOB or key in train_fields:
        job[key] = value
    else:
        known = sorted(set(DEFAULT_JOB) | train_fields)
        raise UsageError(f"unknown key {key!r} in {source}; known keys: {', '.join(known)} (and suite.X, model.X)")


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
            raise UsageError(f"{item!r} is neither key=value nor an existing YAML config file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: the YAML config must be a mapping of keys to values")
        for key, value in data.items():
            if key in ("suite_options", "model_kwargs") and isinstance(value, dict):
                for k, v in value.items():
                    _apply(job, f"{key.split('_')[0]}.{k}", v, str(path))
            else:
                _apply(job, key, value, str(path))
    return job


_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def budget_bytes(value) -> int | None:
    """``budget=`` as bytes: a whole number, or a number with a unit (``200KB``, ``0.2MB``, ``64KiB``).

    Raises:
        UsageError: anything else (the message shows the forms).
    """
    if value is None or (type(value) is int and value >= 1):
        return value
    text = str(value).strip().lower().replace(" ", "")
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits) :] or "b"
    try:
        number = float(digits)
    except ValueError:
        number = -1.0
    if unit not in _UNITS or not number > 0 or isinstance(value, bool):
        raise UsageError(f"budget={value!r}: expected bytes per task, e.g. budget=200000, budget=200KB, budget=0.2MB")
    return max(1, round(number * _UNITS[unit]))


def _off(value) -> bool:
    """``off`` as the command line gives it (YAML reads a bare ``off`` as false)."""
    return value is False or value == "off"


def _budget_options(job: dict) -> dict:
    """The budget keys as convert options: ``{}`` (none given), ``{bits_per_weight: b}``, ``{budget: n}``,
    or both ``None`` for ``off`` (a preset's own budget off)."""
    if _off(job["bits_per_weight"]) or _off(job["budget"]):
        return {"bits_per_weight": None, "budget": None}
    out: dict = {} if job["group_sizes"] is None else {"group_sizes": tuple(job["group_sizes"])}
    if job["budget"] is not None:
        return {**out, "budget": budget_bytes(job["budget"])}
    if job["bits_per_weight"] is not None:
        return {**out, "bits_per_weight": float(job["bits_per_weight"])}
    return out


def convert_job(job: dict, model, init, seed: int) -> None:
    """Convert ``model`` as the job says: its pool and group size and budget, through its preset if it names one.

    With a preset, ``pool_size`` and ``group_size`` reach it only where the job changes them from the
    defaults: a preset's own budget (``inverted-residual``'s) plans them unless the job names them."""
    from ..conversion.converter import convert

    options = {"init": init, "seed": seed, **_budget_options(job)}
    sizes = {"pool_size": int(job["pool_size"]), "group_size": int(job["group_size"])}
    if job["preset"] in (None, "none"):
        plain = job["preset"] is None and options.keys() == {"init", "seed"}  # no preset, budget or vector sizes
        mobile = plain and all(v == DEFAULT_JOB[k] for k, v in sizes.items()) and _inverted_residual(model)
        convert(model, **sizes, **{k: v for k, v in options.items() if v is not None})
        if mobile:  # the plain rule gives every 1x1 weight a 9-bit index: say what the family's preset gives
            _say(
                "note: this model has inverted-residual blocks; preset=auto stores a task about 8x smaller "
                "(scalar pools planned for 3.25 bits a weight: MobileNetV3-small 95 KB against 0.77 MB a task)"
            )
        return
    options.update({k: v for k, v in sizes.items() if v != DEFAULT_JOB[k]})
    from nwsconvert.zoo import get_preset, preset_for

    name = preset_for(model) if job["preset"] == "auto" else str(job["preset"])
    try:
        preset = get_preset(name)
    except KeyError as e:
        raise UsageError(f"{e.args[0]} (or preset=auto)") from None
    _say(f"conversion preset {name!r}")
    preset.apply(model, **options)


def _inverted_residual(model) -> bool:
    """Whether ``preset=auto`` would convert ``model`` with ``inverted-residual`` (MobileNets, EfficientNets)."""
    from nwsconvert.zoo import preset_for

    return preset_for(model) == "inverted-residual"


def load_job_weights(model, path: Path, recorded: str | None) -> str:
    """Load ``weights=`` into ``model``; returns the file's SHA-256. ``recorded``: the digest the run
    being resumed started from (``None`` for a new run, or a run recorded before digests were kept)."""
    from ..formats.stfile import file_sha256
    from .weights import load_weights

    try:
        digest = file_sha256(path)
    except OSError as e:
        raise UsageError(f"weights: {path}: {e.strerror or e}") from None
    if recorded is not None and digest != recorded:
        raise UsageError(
            f"weights={str(path)!r}: not the file the run started from (SHA-256 {digest[:12]}..., the run "
            f"recorded {recorded[:12]}...): restore that file, or start a new run in another out=DIR"
        )
    try:
        kept = load_weights(model, path)
    except (FileNotFoundError, FormatError, ValueError) as e:
        raise UsageError(f"weights: {e}") from None
    note = f" (classifier {', '.join(kept)} left fresh: the file's has another shape)" if kept else ""
    _say(f"weights: {path}{note}")
    return digest


def train_config(job: dict) -> TrainConfig:
    from nwsconvert.zoo import get_recipe

    fields = {k: v for k, v in job.items() if k in TrainConfig.__dataclass_fields__}
    try:
        return get_recipe(job["recipe"], **fields)
    except (KeyError, ValueError, TypeError) as e:
        raise UsageError(e.args[0] if e.args else str(e)) from None


def default_out(job: dict) -> str:
    return job["out"] or f"runs/{job['suite']}-{str(job['model']).split(':')[-1]}"


def validate_job(job: dict) -> None:
    """Check every key of a resolved job before anything heavy is imported or built.

    Raises:
        UsageError: the first key of the wrong type, out of range, naming a missing
            or wrong kind of file, or a device this machine lacks (the message names the key).
    """

    def expect(key, ok, what):
        if not ok:
            raise UsageError(f"{key}={job[key]!r}: expected {what}")

    def whole(v, low):
        return type(v) is int and v >= low

    for key in ("suite", "recipe", "model"):
        expect(key, isinstance(job[key], str) and job[key], "a name")
    source, sep, name = job["model"].partition(":")
    expect("model", sep and source and name, "timm:<name>, torchvision:<name> or package.module:factory")
    for key in ("suite_options", "model_kwargs"):
        if not isinstance(job[key], dict):
            raise UsageError(f"{key}: expected a mapping, got {job[key]!r}")
    loading = sorted(k for k in job["model_kwargs"] if k in LOADING_KWARGS)
    if loading:
        raise UsageError(
            f"model.{loading[0]}: runs never load weights or files through the model factory (pools and packs "
            "carry them); start from a dense checkpoint with weights=FILE (a safetensors state dict)"
        )
    expect(
        "pool_size",
        whole(job["pool_size"], 2) and job["pool_size"] <= MAX_POOL_SIZE,
        f"a whole number in [2, {MAX_POOL_SIZE}]",
    )
    expect("group_size", whole(job["group_size"], 1), "a whole number >= 1")
    expect("tasks", job["tasks"] is None or whole(job["tasks"], 1), "a whole number >= 1 (or leave it out: every task)")
    expect("preset", job["preset"] is None or isinstance(job["preset"], str), "a preset name or auto")
    b, n = job["bits_per_weight"], job["budget"]
    expect(
        "bits_per_weight",
        b is None or _off(b) or (type(b) in (int, float) and 0 < b <= 32),
        "a number of bits in (0, 32], or off (no budget, not even a preset's)",
    )
    if n is not None and not _off(n):
        budget_bytes(n)
    if b is not None and not _off(b) and n is not None and not _off(n):
        raise UsageError("bits_per_weight= and budget= are two forms of one budget: give one")
    sizes = job["group_sizes"]
    expect(
        "group_sizes",
        sizes is None or (isinstance(sizes, list) and sizes and all(whole(g, 1) for g in sizes)),
        "a list of vector sizes, e.g. [1] or [1, 2, 4]",
    )
    if sizes is not None and (_off(b) or _off(n)):
        off = "bits_per_weight" if _off(b) else "budget"
        raise UsageError(f"group_sizes={sizes} bounds the budget planner, which {off}=off turns off: give one")
    for key in ("learn_pools", "progress"):
        expect(key, type(job[key]) is bool, "true or false")
    expect("out", job["out"] is None or (isinstance(job["out"], str) and job["out"]), "a directory")
    why = check_device(job["device"])
    if why is not None:
        raise UsageError(why)
    init = job["init"]
    expect("init", isinstance(init, str) and init, "kmeans, random or a pool file")
    if init not in ("kmeans", "random"):
        check_pool_file(Path(init).expanduser())
    expect("weights", job["weights"] is None or (isinstance(job["weights"], str) and job["weights"]), "a file")
    if job["weights"] is not None:
        from .weights import weights_file_problem

        why = weights_file_problem(Path(job["weights"]).expanduser())
        if why is not None:
            raise UsageError(f"weights={str(Path(job['weights']).expanduser())!r}{why}")
    out = Path(default_out(job)).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"out={str(out)!r} is a file, not a directory: choose another out=DIR")
    fields = {k: v for k, v in job.items() if k in TrainConfig.__dataclass_fields__}
    cfg = TrainConfig(**fields)  # types and ranges of the training options (the recipe's own values are known good)
    if cfg.cuda_graph or cfg.engine_graph:
        import torch

        from .graphs import check_graphable

        device = torch.device(job["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
        check_graphable(cfg, device, int(os.environ.get("WORLD_SIZE", "1")) > 1)


def check_model_spec(spec: str, kwargs: dict) -> None:
    """Refuse an unknown timm / torchvision name or factory keyword in a fraction of a second: the model
    is built on the meta device (no memory, no init), before the suite's data load. Any other failure
    there is left to the real build, which some models need (their init reads tensor values)."""
    import torch

    from .specs import build_model, registry_problem

    why = registry_problem(spec, kwargs)
    if why is not None:
        raise UsageError(why)
    try:
        # A factory that loads its weights warns once per tensor that copying into a meta parameter is a
        # no-op (hundreds of lines for a pretrained zoo model): expected here, so silenced here only.
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_model(spec, num_classes=2, **kwargs)
    except TypeError as e:  # an unknown or ill-typed keyword: the factory's own words
        raise UsageError(f"model={spec} with model.{', model.'.join(kwargs) or '()'}: {e}") from None
    except Exception:  # noqa: BLE001 (the real build below reports what it finds)
        pass


def check_pool_file(path: Path) -> None:
    from ..formats.stfile import file_kind

    if not path.is_file():
        raise UsageError(f"init={str(path)!r}: no such file (init takes kmeans, random or a pool file)")
    try:
        kind = file_kind(path)
    except FormatError:
        kind = None
    if kind != "nwsconvert.poolset":
        what = {"nwsconvert.taskpack": "a task pack", "nwsconvert.train.checkpoint": "a checkpoint"}.get(
            kind, "not an nwsconvert pool file"
        )
        raise UsageError(f"init={str(path)!r} is {what}; init takes a pool file (pools.safetensors of a run)")


def run_job(job: dict, resume: bool = False, trust_code: bool = False, changes: list[str] | None = None) -> str:
    """Run a resolved, validated job (see :data:`DEFAULT_JOB`, :func:`validate_job`); returns the run directory.

    Args:
        trust_code: let a ``package.module:factory`` model spec import its code (the
            command line trusts specs the user typed; ``--trust-code`` one read from a run).
        changes: the options ``--resume`` changes (:func:`resume_changes`), said once the run is open.
    """
    import torch

    from nwsconvert.zoo import get_suite

    from .specs import build_model
    from .trainer import Trainer

    config = train_config(job)
    if is_registry_spec(job["model"]):
        check_model_spec(job["model"], job["model_kwargs"])  # before the data loads
    try:
        suite = get_suite(job["suite"], **job["suite_options"])
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(e.args[0] if e.args else str(e)) from None
    if job["tasks"] and int(job["tasks"]) > len(suite.tasks):
        raise UsageError(f"tasks={job['tasks']}: suite {job['suite']} has {len(suite.tasks)} tasks; give at most that")
    out = default_out(job)
    run = RunDir(out)
    if run.exists() and not resume:
        raise RunExistsError(f"{out!r} already holds a run: add --resume to continue it, or out=OTHER_DIR")
    kwargs = dict(job["model_kwargs"])
    source = job["model"].split(":")[0]
    if source == "timm" and suite.channels != 3:
        kwargs.setdefault("in_chans", suite.channels)
    elif source == "torchvision" and suite.channels != 3:
        raise UsageError(
            f"{job['suite']} has {suite.channels}-channel images and torchvision classifiers take 3; "
            "use a timm model (model=timm:resnet18) or a factory that accepts them"
        )
    first = suite.pretrain_classes or suite.tasks[0].num_classes
    torch.manual_seed(config.seed)  # the model's random init too: a seed reproduces the whole run
    try:
        model = build_model(job["model"], num_classes=first, trust_code=trust_code, **kwargs)
    except UntrustedCodeError:
        raise
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    data_info = {**suite.info(), "job": job}
    if job.get("weights") is not None:  # a job recorded before the key existed has none
        recorded = run.read().data.get("weights_sha256") if run.exists() else None
        data_info["weights_sha256"] = load_job_weights(model, Path(job["weights"]).expanduser(), recorded)
    init = job["init"]
    if run.exists() and run.read().pools is not None:
        # Resuming after pool learning: the run's own pools (checked against the manifest's hash when the
        # trainer loads them), no k-means again. A pool file the manifest does not record yet (a kill
        # between its write and the manifest's) is ignored: pool learning starts again from the pools
        # the job converts with, as the uninterrupted run did, not from the learned ones.
        init = str(run.pool_path)
    elif init not in ("kmeans", "random"):
        init = str(Path(init).expanduser())
    convert_job(job, model, init, config.seed)
    _say(model.nws_report.table().splitlines()[0] + f"; {model.nws_report.kernels:,} kernels")
    trainer = Trainer(
        model,
        out,
        config,
        model_spec=job["model"],
        model_kwargs=kwargs,
        data_info=data_info,
        device=job["device"],
        resume=resume,
        progress=bool(job["progress"]),
    )
    with trainer:
        main = trainer.dist.is_main
        if changes and main:
            print(
                f"nws-train: resuming {out} with {', '.join(changes)}: for what the run has left to train "
                "(finished stages keep theirs; metrics.jsonl records the change)",
                file=sys.stderr,
                flush=True,
            )
            trainer.stages.log({"event": "resumed with changed options", "changed": changes})
        earlier = " (finished before this --resume)"  # a stage the run had already finished: its recorded figures
        if job["learn_pools"] and suite.pretrain is not None:
            done = trainer.manifest.pools is not None
            m = trainer.fit_pools(suite.pretrain, suite.pretrain_test, num_classes=suite.pretrain_classes)
            if main and m:
                print(
                    f"pools: val acc {100 * m.get('val_acc', 0):.2f}%  pool usage {100 * m.get('pool_usage', 0):.1f}%"
                    + (earlier if done else ""),
                    flush=True,
                )
        tasks = suite.tasks[: job["tasks"]] if job["tasks"] else suite.tasks
        for t, task in enumerate(tasks):
            done = t in trainer.manifest.finished
            m = trainer.fit_task(
                t, task.train, task.test, task.num_classes, name=task.name, class_names=task.class_names
            )
            if main:
                print(
                    f"task {t} ({task.name}): acc {100 * m['val_acc']:.2f}%  rebuilt from pack {100 * m['rebuilt_acc']:.2f}%"
                    + (earlier if done else ""),
                    flush=True,
                )
    return out


def recorded_job(out: Path) -> tuple[dict | None, str]:
    """The job a run directory recorded: from its manifest, else from ``job.json`` (a run stopped
    before its manifest was written); ``(None, why)`` when it has neither."""
    run = RunDir(out)
    if run.exists():
        manifest = run.read()
        job = manifest.data.get("job")
        if not isinstance(job, dict):
            raise FormatError(
                f"{run.manifest_path}: field data.job: the run's job is missing; restate it with key=value items"
            )
        # Every training option as the run started with it: a default that changed since (task_init
        # did, recalibrate_bn did) must not change a run half-way; options the run predates as they
        # ran then. The job's own keys are the same values.
        return {**BEFORE_OPTION, **manifest.config, **job}, "manifest"
    path = out / JOB_FILE
    if path.is_file():
        try:
            job = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise FormatError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(job, dict):
            raise FormatError(f"{path}: expected a JSON object of job keys")
        return job, JOB_FILE
    return None, "none"


#: Job keys that say what a run trains (its tasks, model, pools and recipe): the finished stages were
#: trained with them, so ``--resume`` refuses another value.
FIXED_ON_RESUME = (
    "suite",
    "suite_options",
    "model",
    "model_kwargs",
    "pool_size",
    "group_size",
    "preset",
    "bits_per_weight",
    "budget",
    "group_sizes",
    "init",
    "learn_pools",
    "recipe",  # its options are the run's recorded ones on --resume: another name would change nothing
)
#: Suite options that say where the data is, not what it is: free on ``--resume`` (the data may have moved).
_SUITE_LOCATIONS = ("path", "root", "fashion_root", "folders")
#: Job keys that say how and where the run goes on, not what it trains: free on ``--resume``, unannounced
#: (``weights``: the file may have moved; the run checks its SHA-256).
_HOW_IT_RUNS = (
    "out",
    "progress",
    "device",
    "tasks",
    "num_workers",
    "checkpoint_every",
    "checkpoint_interval",
    "weights",
)


def _spelled(key: str, value, other=None) -> str:
    """``value`` as the command line gives ``key``: ``lr=0.5``; of the dict keys (``suite.X=V`` items) only
    the entries that differ from ``other``'s, ``suite.X unset`` where ``value`` has none."""
    if key in ("suite_options", "model_kwargs") and isinstance(value, dict):
        prefix, other = key.split("_")[0], other if isinstance(other, dict) else {}
        names = sorted(k for k in {*value, *other} if k not in value or k not in other or value[k] != other[k])
        return " ".join(f"{prefix}.{k}={json.dumps(value[k])}" if k in value else f"{prefix}.{k} unset" for k in names)
    return f"{key}={json.dumps(value)}"


def _comparable(key: str, value):
    """``value`` as ``--resume`` compares it with the run's: where data lies and how a path is spelled
    do not count (``suite.root=~/d`` is ``suite.root=/home/u/d``), nor ``preset=none`` against none."""
    if key == "suite_options" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in _SUITE_LOCATIONS}
    if key == "init" and isinstance(value, str) and value not in ("kmeans", "random"):
        return str(Path(value).expanduser().resolve())
    if key == "preset" and value in (None, "none"):
        return None
    return value


def resume_changes(recorded: dict, job: dict, where: str) -> list[str]:
    """What ``--resume``'s command line changes in a run's recorded job.

    Args:
        recorded: the run's job (:func:`recorded_job`). job: it with the command line's items
            (:func:`resolve_job`). where: the file that recorded it, for the message.

    Returns:
        ``key=new (the run's: old)`` for every training option given another value: they apply to what
        the run has left to train (an option on the command line wins, as it always did).

    Raises:
        UsageError: a key of :data:`FIXED_ON_RESUME` changed: the tasks, model, pools or recipe the run's
            finished stages were trained with; resuming with another would mix two runs in one directory.
    """
    defaults = {**TrainConfig().to_dict(), **DEFAULT_JOB}  # for keys a run recorded before they existed
    was = {k: recorded.get(k, defaults.get(k)) for k in job}
    changed = [k for k in job if k not in _HOW_IT_RUNS and _comparable(k, job[k]) != _comparable(k, was[k])]
    fixed = [k for k in changed if k in FIXED_ON_RESUME]
    if fixed:
        given = ", ".join(f"{_spelled(k, job[k], was[k])} (the run's: {_spelled(k, was[k], job[k])})" for k in fixed)
        raise UsageError(
            f"--resume: {given}: a run keeps the tasks, model, pools and recipe it started with ({where}); "
            "drop these items, or start a new run with out=OTHER_DIR"
        )
    return [f"{_spelled(k, job[k])} (the run's: {json.dumps(was[k])})" for k in changed]


def launch(job: dict, resume: bool = False, trust_code: bool = True, changes: list[str] | None = None) -> str:
    """Lock the run directory, record the job in it, then :func:`run_job` (the job already validated).

    ``changes``: :func:`resume_changes`' list, said (stderr, ``metrics.jsonl``) once the run is open.

    Raises:
        RunLockedError: another process writes the run. UsageError: ``out`` holds a run and ``resume`` is false.
    """
    job["out"] = default_out(job)
    train_config(job)  # the recipe with the job's options (head_epochs within its epochs): before anything is written
    main_rank = is_main_process()
    lock = None
    made = False  # this command makes the run's folder: a usage error takes it back
    if main_rank:
        from .runlock import RunLock

        made = not Path(job["out"]).exists()
        lock = RunLock.acquire(job["out"])
    refused = False
    try:
        run = RunDir(job["out"])
        if main_rank and not resume and run.exists():
            raise UsageError(f"{job['out']!r} already holds a run: add --resume to continue it, or out=OTHER_DIR")
        wrote = main_rank and not run.exists()
        job_file = run.path / JOB_FILE
        before = job_file.read_bytes() if wrote and job_file.is_file() else None  # a run stopped before its manifest
        if wrote:
            atomic_write_bytes(job_file, (json.dumps(job, indent=2) + "\n").encode())
        try:
            return run_job(job, resume=resume, trust_code=trust_code, changes=changes)
        except UsageError:
            # A bad job found once torch is loaded (a model keyword, the suite's channels): nothing started
            # under it, so --resume finds what was there before: no job, or the job the run was started with,
            # and no folder where this command made one.
            if wrote and not run.exists():
                if before is None:
                    job_file.unlink(missing_ok=True)
                else:
                    atomic_write_bytes(job_file, before)
            refused = True
            raise
    finally:
        if lock is not None:
            if refused and made:
                lock.release_and_remove()
            else:
                lock.release()
