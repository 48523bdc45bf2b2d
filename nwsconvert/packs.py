"""Task packs: what one task adds to the shared pool set.

A task pack holds, for one task:

* every NWS layer's indices, bit-packed at ``ceil(log2 n)`` bits;
* every other parameter and buffer of the model that no pool owns (BatchNorm
  affine parameters and running statistics, biases, LayerNorm, layer scale,
  dense-left layers...), so the task round-trips completely;
* the class count of the head, the model spec, and the SHA-256 of the pool set
  it was built on.

File: safetensors (``indices/<layer>`` uint8, ``state/<key>``) with a JSON
header (format version, layer table, pool-set hash, model spec, content hash).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .bitpack import pack_bits, packed_size, unpack_bits
from .nwsmodel import _require, pool_set
from .storage import FormatError, read_tensors, write_tensors

__all__ = ["TaskPack", "PackMismatchError", "extract_task", "apply_task", "PACK_FORMAT", "PACK_VERSION"]

PACK_FORMAT = "nwsconvert.taskpack"
PACK_VERSION = 1


class PackMismatchError(ValueError):
    """A pack does not fit the model or pool set it is applied to; the message names the mismatch."""


@dataclass
class TaskPack:
    """One task's indices and non-pool state.

    Attributes:
        layers: layer table, one dict per NWS layer: ``name``, ``pool`` (pool-set
            key), ``shape`` (weight shape), ``groups``, ``vector_size``,
            ``pool_size``, ``bits``, ``count``, ``role``.
        indices: layer name -> ``(count,)`` int64 chosen pool entries.
        state: state-dict key -> tensor, for everything no pool owns.
        pool_sha256: hash of the pool set the indices point into.
        num_classes: output classes of the head, when the model has one.
        model_spec: e.g. ``timm:resnet18``; informative.
        meta: free JSON-able metadata (task name, metrics...).
    """

    layers: list[dict]
    indices: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    pool_sha256: str
    num_classes: int | None = None
    model_spec: str | None = None
    meta: dict = field(default_factory=dict)

    def layer_index_bytes(self) -> dict[str, int]:
        """Layer name -> bytes its indices take in the pack file."""
        return {r["name"]: packed_size(r["count"], r["bits"]) for r in self.layers}

    @property
    def index_bytes(self) -> int:
        """Bytes of the stored indices, all layers."""
        return sum(self.layer_index_bytes().values())

    @property
    def state_bytes(self) -> int:
        """Bytes of the non-pool tensors (BatchNorm statistics, biases, ...)."""
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {f"indices/{r['name']}": pack_bits(self.indices[r["name"]], r["bits"]) for r in self.layers}
        out.update({f"state/{k}": v.detach().cpu() for k, v in self.state.items()})
        return out

    def save(self, path: str | os.PathLike) -> str:
        """Write the pack atomically. Returns the file's content SHA-256."""
        return write_tensors(
            path,
            self._tensors(),
            PACK_FORMAT,
            PACK_VERSION,
            pool_sha256=self.pool_sha256,
            num_classes=self.num_classes,
            model_spec=self.model_spec,
            layers=self.layers,
            state_keys=list(self.state),
            meta=self.meta,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TaskPack":
        """Read a pack file; truncated, corrupted or foreign files raise :class:`FormatError`."""
        tensors, header = read_tensors(path, PACK_FORMAT, PACK_VERSION)
        try:
            layers = header["layers"]
            indices = {}
            for r in layers:
                idx = unpack_bits(tensors[f"indices/{r['name']}"], r["bits"], r["count"])
                if idx.numel() and int(idx.max()) >= r["pool_size"]:
                    raise FormatError(f"{path}: layer {r['name']!r} has an index >= its pool size {r['pool_size']}")
                indices[r["name"]] = idx
            state = {k: tensors[f"state/{k}"] for k in header["state_keys"]}
        except (KeyError, ValueError) as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{path}: inconsistent task pack ({type(e).__name__}: {e})") from None
        return cls(
            layers=layers,
            indices=indices,
            state=state,
            pool_sha256=header["pool_sha256"],
            num_classes=header.get("num_classes"),
            model_spec=header.get("model_spec"),
            meta=header.get("meta") or {},
        )


def _nws_keys(model: nn.Module) -> set[str]:
    prefixes = tuple(f"{layer.name}.parametrizations.weight." for layer in _require(model))
    return {k for k in model.state_dict() if k.startswith(prefixes)}


def _num_classes(layers) -> int | None:
    heads = [layer for layer in layers if layer.nws.role == "head"]
    return int(heads[-1].nws.weight_shape[0]) if heads else None


def model_spec_of(model: nn.Module) -> str:
    """``timm:<architecture>`` for timm models, else the class's import path."""
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and cfg.get("architecture"):
        return f"timm:{cfg['architecture']}"
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


@torch.no_grad()
def extract_task(model: nn.Module, *, model_spec: str | None = None, meta: dict | None = None) -> TaskPack:
    """The current task of a converted model as a :class:`TaskPack`.

    Indices are taken as stored (the ones the last forward used).
    """
    layers = _require(model)
    table = [
        {
            "name": layer.name,
            "pool": layer.name,  # key of this layer's pool in the pool set
            "shape": list(layer.nws.weight_shape),
            "groups": int(getattr(layer.module, "groups", 1)),
            "vector_size": layer.nws.vector_size,
            "pool_size": layer.nws.pool_size,
            "bits": layer.nws.bits,
            "count": layer.nws.num_vectors,
            "role": layer.nws.role,
        }
        for layer in layers
    ]
    skip = _nws_keys(model)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in skip}
    return TaskPack(
        layers=table,
        indices={layer.name: layer.nws.indices.detach().cpu().clone() for layer in layers},
        state=state,
        pool_sha256=pool_set(model).sha256,
        num_classes=_num_classes(layers),
        model_spec=model_spec or model_spec_of(model),
        meta=dict(meta or {}),
    )


@torch.no_grad()
def apply_task(model: nn.Module, pack: TaskPack) -> nn.Module:
    """Load ``pack`` into a converted model with the pack's pool set.

    Sets every layer's indices, sets the temporary weights W to the chosen
    kernels (the paper's initialisation for the next task), loads the non-pool
    state, and restarts the lazy search.

    Raises:
        PackMismatchError: other pool set (hash), missing/extra layers, other
            shapes or pool sizes, missing/unexpected/misshaped state entries.
    """
    layers = _require(model)
    have = pool_set(model).sha256
    if pack.pool_sha256 != have:
        raise PackMismatchError(
            f"task pack was built on pool set {pack.pool_sha256[:12]}..., the model holds pool set {have[:12]}...: "
            "load the pool file the pack was trained with"
        )
    by_name = {layer.name: layer for layer in layers}
    rows = {r["name"]: r for r in pack.layers}
    missing = [n for n in by_name if n not in rows]
    extra = [n for n in rows if n not in by_name]
    if missing or extra:
        raise PackMismatchError(f"pack and model disagree on NWS layers: model-only {missing[:5]}, pack-only {extra[:5]}")
    for name, layer in by_name.items():
        r = rows[name]
        if tuple(r["shape"]) != layer.nws.weight_shape:
            hint = " (head: the pack has another class count)" if layer.nws.role == "head" else ""
            raise PackMismatchError(f"layer {name!r}: pack weight shape {tuple(r['shape'])}, model {layer.nws.weight_shape}{hint}")
        if r["pool_size"] != layer.nws.pool_size or r["vector_size"] != layer.nws.vector_size:
            raise PackMismatchError(
                f"layer {name!r}: pack pool {r['pool_size']}x{r['vector_size']}, model pool "
                f"{layer.nws.pool_size}x{layer.nws.vector_size}"
            )
    skip = _nws_keys(model)
    own = {k: v for k, v in model.state_dict().items() if k not in skip}
    missing = [k for k in own if k not in pack.state]
    extra = [k for k in pack.state if k not in own]
    if missing or extra:
        raise PackMismatchError(f"pack and model disagree on state entries: model-only {missing[:5]}, pack-only {extra[:5]}")
    for k, v in own.items():
        if tuple(pack.state[k].shape) != tuple(v.shape):
            raise PackMismatchError(f"state entry {k!r}: pack shape {tuple(pack.state[k].shape)}, model {tuple(v.shape)}")
    for name, layer in by_name.items():
        nws = layer.nws
        nws.indices.copy_(pack.indices[name].to(nws.indices.device))
        layer.weight.copy_(nws.gather().to(layer.weight.dtype))
        nws.reset_search()
    for k, v in own.items():
        v.copy_(pack.state[k].to(device=v.device, dtype=v.dtype))
    return model
