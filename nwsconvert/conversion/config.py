"""The conversion config: every choice :func:`nwsconvert.convert` makes, in one serialisable object.

    config = NWSConfig(pool_size=256, layers={"conv1": LayerConfig(pool_size=192), "head.*": None})
    model = nwsconvert.convert(model, config)          # or convert(model, pool_size=256, ...)
    json.dumps(config.to_dict())                       # recorded whole in a run's manifest
    NWSConfig.from_dict(d) == config

``layers`` is one ordered map of fnmatch patterns over module names. A pattern mapped to
``None`` leaves every layer it matches dense. Otherwise each :class:`LayerConfig` field
comes from the first matching entry that sets it, else from the model-wide value, so
``{"layer1.*": LayerConfig(pool_size=8), "*.fc": LayerConfig(group_size=2)}`` sets both
fields independently.

The older keyword options still work and are translated on the way in:
``skip=[p]`` → ``layers={p: None}``, ``layer_pool_size={p: n}`` →
``{p: LayerConfig(pool_size=n)}``, ``layer_group_size={p: g}`` →
``{p: LayerConfig(group_size=g)}`` (skip patterns first: they win, as before).

This module imports nothing heavy: run-directory readers check a manifest's config
without torch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from ..formats.limits import MAX_POOL_SIZE, MAX_VECTOR_SIZE

__all__ = ["NWSConfig", "LayerConfig", "Budget", "CONFIG_VERSION", "INITS"]

CONFIG_VERSION = 1
#: pool initialisations a config can name; ``"pools"``: a pool set given to ``convert`` (``init=PoolSet | path``).
INITS = ("kmeans", "random", "pools")
_LEGACY = ("skip", "layer_pool_size", "layer_group_size")
_BUDGET_KEYS = ("bits_per_weight", "budget", "group_sizes", "planned_for")


def _int(key: str, value, lo: int, hi: int | None = None) -> int:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        span = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{key} must be an integer {span}, got {value!r}")
    return value


@dataclass(frozen=True)
class Budget:
    """What a task may store: index bits per converted weight, or bytes per task (indices + state).

    Exactly one is set. ``bits_per_weight`` counts fixed-width indices over every converted weight
    (head included); ``bytes_per_task`` adds the task's state at float16. Task packs store the same
    indices and state or fewer bytes (rANS and delta coding, state coded against the base pack's),
    never more.
    """

    bits_per_weight: float | None = None
    bytes_per_task: int | None = None

    def __post_init__(self):
        if (self.bits_per_weight is None) == (self.bytes_per_task is None):
            raise UsageError("a budget is either bits_per_weight or budget (bytes per task), not both nor neither")
        if self.bits_per_weight is not None:
            b = self.bits_per_weight
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not (0 < b <= 32):
                raise UsageError(f"bits_per_weight must be a number in (0, 32], got {b!r}")
        if self.bytes_per_task is not None:
            n = self.bytes_per_task
            if type(n) is not int or n < 1:
                raise UsageError(f"budget must be a whole number of bytes per task (at least 1), got {n!r}")

    def describe(self) -> str:
        if self.bits_per_weight is not None:
            return f"bits_per_weight={self.bits_per_weight:g}"
        return f"budget={self.bytes_per_task}"


@dataclass(frozen=True)
class LayerConfig:
    """Per-layer overrides; ``None`` fields fall through to later patterns, then to the model-wide value.

    Args:
        pool_size: n, pool entries of the layer.
        group_size: g, input weights per pool vector (1x1 convs and linear layers only).
    """

    pool_size: int | None = None
    group_size: int | None = None

    def __post_init__(self):
        if self.pool_size is not None:
            _int("pool_size", self.pool_size, 1, MAX_POOL_SIZE)  # 1 as run manifests of version 2 allowed
        if self.group_size is not None:
            _int("group_size", self.group_size, 1, MAX_VECTOR_SIZE)

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class NWSConfig:
    """What :func:`nwsconvert.convert` does to a model (JSON round trip: :meth:`to_dict` / :meth:`from_dict`).

    Args:
        pool_size: n, pool entries per layer (512 in the paper: 9-bit indices).
        group_size: g for 1x1 convs and linear layers: g consecutive input weights of one
            output form one pool vector (g = 1 is the paper). A layer whose input width is
            not a multiple of g falls back to g = 1 (the plan notes it).
        init: ``"kmeans"`` (pools clustered from each layer's own kernels), ``"random"``
            (Gaussian with the layer's weight statistics) or ``"pools"`` (a pool set given
            to ``convert`` as ``init=``; pool sizes then come from it).
        seed: seeds pool initialisation.
        kmeans_iters: Lloyd iterations of ``init="kmeans"``.
        layers: ``{pattern: LayerConfig | None}``, see the module docstring.
        bits_per_weight: a budget: the planner (:mod:`nwsconvert.conversion.budget`) chooses every
            non-head layer's vector size and pool size so that a task's indices take at most this
            many bits per converted weight at fixed width (packs store that or less).
        budget: the same as bytes per task, the task's float16 state included (``None``: no budget).
        group_sizes: the vector sizes the planner may give 1x1 convs and linear layers (``None``:
            1, 2, 4, 8 and 16; ``(1,)``: scalar pools, each layer's pool size planned).
        planned_for: a record, not an input: the budget the ``layers`` entries were planned for
            (``"bits_per_weight=2"``); the config a run records has its budget spent into ``layers``.
    """

    pool_size: int = 512
    group_size: int = 1
    init: str = "kmeans"
    seed: int = 0
    kmeans_iters: int = 3
    layers: dict[str, LayerConfig | None] = field(default_factory=dict)
    bits_per_weight: float | None = None
    budget: int | None = None
    group_sizes: tuple[int, ...] | None = None
    planned_for: str | None = None

    def __post_init__(self):
        _int("pool_size", self.pool_size, 2, MAX_POOL_SIZE)
        _int("group_size", self.group_size, 1, MAX_VECTOR_SIZE)
        _int("kmeans_iters", self.kmeans_iters, 0)
        if type(self.seed) is not int:
            raise UsageError(f"seed must be an integer, got {self.seed!r}")
        if self.init not in INITS:
            raise UsageError(
                f"init must be one of {', '.join(INITS)} (or a PoolSet / pool file given to convert), got {self.init!r}"
            )
        if self.bits_per_weight is not None or self.budget is not None:
            Budget(self.bits_per_weight, self.budget)  # validates: one of the two, in range
        if self.group_sizes is not None:
            sizes = self.group_sizes
            if isinstance(sizes, list):
                object.__setattr__(self, "group_sizes", sizes := tuple(sizes))
            if not isinstance(sizes, tuple) or not sizes:
                raise UsageError(f"group_sizes must be a non-empty list of vector sizes, got {sizes!r}")
            for g in sizes:
                _int("group_sizes", g, 1, MAX_VECTOR_SIZE)
            if self.bits_per_weight is None and self.budget is None:  # nothing would read them
                raise UsageError(
                    f"group_sizes={list(sizes)} bounds the budget planner's vector sizes: give bits_per_weight= or "
                    "budget= with it (or group_size= for one vector size everywhere)"
                )
        if self.planned_for is not None and not isinstance(self.planned_for, str):
            raise UsageError(f"planned_for must be a string, got {self.planned_for!r}")
        if not isinstance(self.layers, dict):
            raise UsageError(f"layers must be a dict {{pattern: LayerConfig | None}}, got {type(self.layers).__name__}")
        for pattern, entry in self.layers.items():
            if not isinstance(pattern, str) or not pattern:
                raise UsageError(f"layers: a pattern must be a non-empty string, got {pattern!r}")
            if entry is not None and not isinstance(entry, LayerConfig):
                raise UsageError(f"layers[{pattern!r}] must be a LayerConfig or None (leave dense), got {entry!r}")

    # ------------------------------------------------------------ resolution
    def skipped(self, name: str) -> str | None:
        """The pattern that leaves layer ``name`` dense, or ``None``."""
        return next((p for p, e in self.layers.items() if e is None and fnmatch.fnmatchcase(name, p)), None)

    def resolve(self, name: str) -> LayerConfig:
        """Layer ``name``'s pool and group size (both set): first matching entry per field, then the defaults."""
        pool = group = None
        for pattern, entry in self.layers.items():
            if entry is None or not fnmatch.fnmatchcase(name, pattern):
                continue
            pool = entry.pool_size if pool is None else pool
            group = entry.group_size if group is None else group
        return LayerConfig(self.pool_size if pool is None else pool, self.group_size if group is None else group)

    # ------------------------------------------------------------- building
    def replace(self, **changes) -> NWSConfig:
        """A copy with fields changed; the old keyword options (``skip``, ``layer_pool_size``,
        ``layer_group_size``) are accepted and put in front of ``layers``."""
        legacy = {k: changes.pop(k) for k in _LEGACY if k in changes}
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            known = ", ".join([f.name for f in dataclasses.fields(self)] + list(_LEGACY))
            raise UsageError(f"unknown conversion option {unknown[0]!r}; known options: {known}")
        config = dataclasses.replace(self, **changes)
        if legacy:
            config = dataclasses.replace(config, layers={**_legacy_layers(**legacy), **config.layers})
        return config

    # -------------------------------------------------------- serialisation
    def budget_of(self) -> Budget | None:
        """The :class:`Budget` this config asks for, or ``None``."""
        if self.bits_per_weight is None and self.budget is None:
            return None
        return Budget(self.bits_per_weight, self.budget)

    def to_dict(self) -> dict:
        """JSON-able: ``{"version", "pool_size", "group_size", "init", "seed", "kmeans_iters", "layers"}``,
        plus ``bits_per_weight`` / ``budget`` / ``group_sizes`` / ``planned_for`` where set."""
        out = {
            "version": CONFIG_VERSION,
            "pool_size": self.pool_size,
            "group_size": self.group_size,
            "init": self.init,
            "seed": self.seed,
            "kmeans_iters": self.kmeans_iters,
            "layers": {p: (None if e is None else e.to_dict()) for p, e in self.layers.items()},
        }
        for key in _BUDGET_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NWSConfig:
        """The config :meth:`to_dict` wrote, or the conversion options of a run written before
        configs existed (``pool_size``, ``group_size``, ``skip``, ``layer_pool_size``,
        ``layer_group_size``, no ``version``).

        Raises:
            UsageError: an unknown key, a wrong type or range, or a newer version (the message names the key).
        """
        if not isinstance(data, dict):
            raise UsageError(f"a conversion config is a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.pop("version", None)
        if version is None:  # the options runs recorded before NWSConfig
            unknown = sorted(set(data) - {"pool_size", "group_size", *_LEGACY})
            if unknown:
                raise UsageError(f"unknown conversion option {unknown[0]!r}")
            return cls().replace(**data)
        if type(version) is not int or version < 1:
            raise UsageError(f"version must be an integer >= 1, got {version!r}")
        if version > CONFIG_VERSION:
            raise UsageError(
                f"conversion config version {version} is newer than this nwsconvert reads ({CONFIG_VERSION}): upgrade nwsconvert"
            )
        layers = data.pop("layers", {})
        if not isinstance(layers, dict):
            raise UsageError(f"layers must be an object {{pattern: {{pool_size, group_size}} | null}}, got {layers!r}")
        parsed = {}
        for pattern, entry in layers.items():
            if entry is not None and (not isinstance(entry, dict) or set(entry) - {"pool_size", "group_size"}):
                raise UsageError(
                    f"layers[{pattern!r}] must be null or an object with pool_size / group_size, got {entry!r}"
                )
            parsed[pattern] = None if entry is None else LayerConfig(**entry)
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(f"unknown conversion config key {unknown[0]!r}")
        return cls(**data, layers=parsed)


def _legacy_layers(skip=(), layer_pool_size=None, layer_group_size=None) -> dict[str, LayerConfig | None]:
    """The ``layers`` map equivalent to the old keyword options (skip patterns first)."""
    skip = [skip] if isinstance(skip, str) else list(skip or ())
    out: dict[str, LayerConfig | None] = {}
    for p in skip:
        if not isinstance(p, str):
            raise UsageError(f"skip must be module names or fnmatch patterns, got {p!r}")
        out[p] = None
    for key, table in (("layer_pool_size", layer_pool_size), ("layer_group_size", layer_group_size)):
        if table is None:
            continue
        if not isinstance(table, dict):
            raise UsageError(f"{key} must be a dict {{pattern: int}}, got {table!r}")
        for p, value in table.items():
            if p in out and out[p] is None:
                continue  # skipped anyway
            out[p] = dataclasses.replace(out.get(p) or LayerConfig(), **{key[len("layer_") :]: value})
    return out
