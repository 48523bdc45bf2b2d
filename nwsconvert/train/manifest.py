"""A run's manifest (``RUN/manifest.json``) as typed objects, and the checks that read it.

    manifest = RunDir("runs/r18").read()          # checked field by field, then typed
    manifest.model.spec                           # 'timm:resnet18'
    [t.id for t in manifest.tasks]                # finished tasks, in the order they finished
    manifest.task(2).metrics["val_acc"]

Schema (version 3)::

    format        "nwsconvert.run"
    version       3
    run_id        hex string; every pack of the run carries it
    model         {spec, kwargs, convert (an NWSConfig as a dict), layers}; pinned by model_sha256
    model_sha256  SHA-256 of the canonical JSON of ``model``
    data          what deployment must know of the input (channels, input_size, mean, std, suite...)
    config        the TrainConfig as a dict
    versions      library versions of the writer
    created       ISO time of the run's creation
    pools         {file, sha256, bytes, learned, metrics} or null before pool learning ends
    base          {file, sha256, file_sha256, num_classes} or null
    tasks         [{id, name, num_classes, class_names, file, sha256, file_sha256, bytes, metrics}]

``sha256`` of a pack is over the tensors it stores; ``file_sha256`` over the whole file (its header
says which base the indices are changes against): readers refuse a pack or base whose bytes differ
(runs written before ``file_sha256`` was recorded: the base a pack names must be one the run records).

Versions 1 and 2 still read (2 added ``model_sha256``; 3 made ``model.convert`` a whole
NWSConfig). A reader checks every field's type and range before building the objects
(:func:`check_manifest`), so a manifest from someone else is data: a bad field is a
:class:`~nwsconvert.errors.FormatError` naming it. Imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
import uuid
from dataclasses import asdict, dataclass, field, fields

from ..conversion.config import NWSConfig
from ..errors import FormatError, TaskNotFoundError, UsageError
from ..formats.limits import MAX_FACTORY_INT
from ..formats.schema import Fields

__all__ = [
    "Manifest",
    "ModelEntry",
    "PoolsEntry",
    "BaseEntry",
    "TaskEntry",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "check_manifest",
    "check_data_info",
    "library_versions",
    "model_sha256",
    "new_run_id",
]

MANIFEST_FORMAT = "nwsconvert.run"
# 2: model_sha256 pins the model entry (spec, kwargs, conversion options); 3: model.convert is a whole
# NWSConfig (nwsconvert.conversion.config); versions 1 and 2 still read.
MANIFEST_VERSION = 3


def model_sha256(model: dict) -> str:
    """SHA-256 of a manifest's ``model`` entry (canonical JSON: sorted keys, no spaces).

    The entry decides the architecture every pack is applied to; an edit to it
    (an ``act_layer``, a ``drop_rate``, a converter option) would rebuild another
    model from the same packs, so readers refuse a manifest whose entry does not
    match the hash written with it.
    """
    text = json.dumps(model, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def new_run_id() -> str:
    """A random identity for a new run; its packs carry it, so a pack of another run is refused."""
    return uuid.uuid4().hex


def library_versions() -> dict:
    """Versions of the libraries a run depends on (recorded in the manifest)."""
    import numpy
    import timm
    import torch
    import torchvision

    from .. import __version__

    return {
        "nwsconvert": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "timm": timm.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _from_json(cls, obj: dict | None):
    """``cls`` (a dataclass) from a checked JSON object: absent or null fields take their defaults,
    keys that are not fields are ignored; ``None`` stays ``None``."""
    if obj is None:
        return None
    return cls(**{f.name: obj[f.name] for f in fields(cls) if obj.get(f.name) is not None})


@dataclass
class ModelEntry:
    """How to rebuild the architecture every pack applies to.

    Attributes:
        spec: ``timm:<name>``, ``torchvision:<name>`` or ``<module>:<callable>``.
        kwargs: the factory's keyword arguments.
        convert: the :class:`~nwsconvert.NWSConfig` as a dict (version 2: loose converter options,
            which ``NWSConfig.from_dict`` translates); ``None`` in very old runs.
        layers: number of NWS layers the conversion made.
    """

    spec: str
    kwargs: dict = field(default_factory=dict)
    convert: dict | None = None
    layers: int | None = None

    def to_dict(self) -> dict:
        """The JSON entry (what :func:`model_sha256` hashes and what a bundle copies)."""
        return _drop_none(asdict(self))

    def config(self) -> NWSConfig:
        """The conversion config the run's model was converted with."""
        return NWSConfig.from_dict(self.convert or {})


@dataclass
class PoolsEntry:
    """The run's pool set: ``RUN/<file>``, its SHA-256, size, whether it was learned, and the
    last pool-learning epoch's metrics."""

    sha256: str
    file: str | None = None
    bytes: int | None = None
    learned: bool | None = None
    metrics: dict = field(default_factory=dict)


@dataclass
class BaseEntry:
    """The base pack (the model at the end of pool learning), against which task packs are delta-coded."""

    sha256: str
    file: str | None = None
    num_classes: int | None = None
    file_sha256: str | None = None  # the whole file's SHA-256 (see TaskEntry)


@dataclass
class TaskEntry:
    """One finished task: its pack ``RUN/<file>`` (relative, inside the run), the pack's SHA-256 (of
    the tensors it stores), the whole file's SHA-256 (header included: which base its indices are
    changes against, how they are coded; absent in runs written before it was recorded), its byte
    counts (``indices``, ``state``, ``file``) and metrics (``val_acc``, ``rebuilt_acc``...)."""

    id: int
    name: str
    num_classes: int
    file: str
    sha256: str
    metrics: dict = field(default_factory=dict)
    class_names: list[str] | None = None
    bytes: dict | None = None
    file_sha256: str | None = None


@dataclass
class Manifest:
    """A run directory's manifest. :meth:`from_dict` checks a JSON object and builds it;
    :meth:`to_dict` gives the JSON written (format, version and ``model_sha256`` stamped).

    Attributes:
        model: the architecture (:class:`ModelEntry`).
        run_id: the run's identity (packs carry it).
        data: input info for deployment and the job that made the run (``data['job']``).
        config: the :class:`~nwsconvert.train.config.TrainConfig` as a dict.
        versions: the writer's library versions.
        created: ISO time the run was created.
        pools, base: ``None`` until pool learning (or the first task) wrote them.
        tasks: the finished tasks.
        version: the schema version the manifest was read as (written: always the current one).
    """

    model: ModelEntry
    run_id: str | None = None
    data: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    created: str | None = None
    pools: PoolsEntry | None = None
    base: BaseEntry | None = None
    tasks: list[TaskEntry] = field(default_factory=list)
    version: int = MANIFEST_VERSION

    @classmethod
    def new(
        cls, spec: str, kwargs: dict | None, convert: dict, layers: int, data: dict | None, config: dict
    ) -> Manifest:
        """The manifest of a new run, before any stage: a fresh ``run_id``, creation time and library versions."""
        return cls(
            model=ModelEntry(spec, dict(kwargs or {}), convert, layers),
            run_id=new_run_id(),
            data=dict(data or {}),
            config=config,
            versions=library_versions(),
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )

    @classmethod
    def from_dict(cls, d: dict, path="manifest.json") -> Manifest:
        """Check ``d`` (every field a reader uses, see :func:`check_manifest`) and build the manifest.

        Raises:
            FormatError: a field missing, of the wrong type or out of range (named, with ``path``).
        """
        check_manifest(d, path)
        nested = {
            "model": _from_json(ModelEntry, d["model"]),
            "pools": _from_json(PoolsEntry, d.get("pools")),
            "base": _from_json(BaseEntry, d.get("base")),
            "tasks": [_from_json(TaskEntry, e) for e in d["tasks"]],
        }
        return _from_json(cls, {**d, **nested})

    def to_dict(self) -> dict:
        """The JSON object written: always the current version, with ``model_sha256`` of the model entry."""
        model = self.model.to_dict()
        return {
            "format": MANIFEST_FORMAT,
            **asdict(self),
            "model": model,
            "version": MANIFEST_VERSION,
            "model_sha256": model_sha256(model),
        }

    # ------------------------------------------------------------- tasks
    @property
    def finished(self) -> list[int]:
        """Ids of the finished tasks, ascending."""
        return sorted(t.id for t in self.tasks)

    def task(self, task: int) -> TaskEntry:
        """The entry of finished task ``task``.

        Raises:
            TaskNotFoundError: (a ``KeyError``) no such finished task; the message lists the finished ones.
        """
        for entry in self.tasks:
            if entry.id == task:
                return entry
        raise TaskNotFoundError(f"no finished task {task}; finished tasks: {self.finished or 'none'}")

    def put_task(self, entry: TaskEntry) -> None:
        """Record a finished task (replacing an entry of the same id)."""
        self.tasks = [e for e in self.tasks if e.id != entry.id] + [entry]


def check_data_info(f: Fields, key: str = "data") -> None:
    """The ``data`` entry of a manifest or bundle: what the exporter and the runtime read from it."""
    data = f.obj_fields(key, optional=True)
    if data is not None:
        data.int("channels", lo=1, hi=4096, optional=True)
        data.ints("input_size", lo=1, hi=1 << 16, optional=True, max_len=3)
        data.sha("weights_sha256", optional=True)  # nws-train weights=FILE: the file the run started from
        for name in ("mean", "std"):
            values = data.list(name, optional=True)
            if values is not None and not all(type(v) in (int, float) for v in values):
                raise data.fail(name, "a list of numbers", values)


def _check_model(f: Fields, manifest: dict, path) -> None:
    model = f.obj_fields("model")
    spec = model.str("spec")
    if ":" not in spec:
        raise model.fail("spec", "'timm:<name>', 'torchvision:<name>' or '<module>:<callable>'", spec)
    kwargs = model.dict("kwargs", optional=True) or {}
    for key, value in kwargs.items():  # ints size layers: bounded so a factory cannot be made to allocate gigabytes
        if type(value) is int and abs(value) > MAX_FACTORY_INT:
            raise model.fail(f"kwargs.{key}", f"an integer of at most {MAX_FACTORY_INT} in size", value)
    conv = model.dict("convert", optional=True)
    if conv is not None:
        try:
            NWSConfig.from_dict(conv)
        except UsageError as e:
            raise FormatError(f"{path}: field model.convert: {e}") from None
    model.int("layers", lo=0, optional=True)
    if manifest.get("version", MANIFEST_VERSION) >= 2 and f.sha("model_sha256") != model_sha256(manifest["model"]):
        raise FormatError(
            f"{path}: field model: the model entry (spec, kwargs, conversion options) does not match model_sha256: "
            "it was edited or corrupted; packs would be applied to another architecture"
        )


def _check_tasks(f: Fields) -> None:
    ids = set()
    for i, entry in enumerate(f.list("tasks")):
        e = f.sub(entry, f"tasks[{i}]")
        t = e.int("id", lo=0)
        if t in ids:
            raise e.fail("id", "a task id listed once", t)
        ids.add(t)
        e.str("name")
        e.int("num_classes", lo=1)
        e.strs("class_names", optional=True)
        e.relpath("file")
        e.sha("sha256")
        e.sha("file_sha256", optional=True)
        e.dict("bytes", optional=True)
        metrics = e.obj_fields("metrics")
        for key in ("val_acc", "val_loss", "train_acc", "train_loss"):
            metrics.number(key, optional=True)


def check_manifest(manifest: dict, path) -> None:
    """Types and ranges of every manifest field a reader uses (the message names the field).

    Raises:
        FormatError: a field missing, of the wrong type, or out of range.
    """
    f = Fields(manifest, path)
    f.str("run_id", optional=True)
    _check_model(f, manifest, path)
    check_data_info(f)
    f.dict("config", optional=True)
    f.dict("versions", optional=True)
    f.str("created", optional=True)
    _check_pools(f.obj_fields("pools", optional=True))
    _check_base(f.obj_fields("base", optional=True))
    _check_tasks(f)


def _check_pools(pools: Fields | None) -> None:
    if pools is not None:
        pools.filename("file", optional=True)
        pools.sha("sha256")
        pools.int("bytes", lo=0, optional=True)
        pools.bool("learned", optional=True)
        pools.dict("metrics", optional=True)


def _check_base(base: Fields | None) -> None:
    if base is not None:
        base.filename("file", optional=True)
        base.sha("sha256")
        base.int("num_classes", lo=1, optional=True)
        base.sha("file_sha256", optional=True)
