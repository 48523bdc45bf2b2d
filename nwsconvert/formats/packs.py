"""Task packs: what one task adds to the shared pool set.

A task pack holds, for one task:

* every NWS layer's indices, in the smallest of four codings
  (:mod:`nwsconvert.formats.indexcode`): fixed width at ``ceil(log2 n)`` bits, static
  rANS over the layer's index histogram, or the changes against a *base*
  task's indices (fixed width or rANS);
* every other parameter and buffer of the model that no pool owns (BatchNorm
  affine parameters and running statistics, biases, LayerNorm, layer scale,
  dense-left layers...), so the task round-trips completely; from version 5 a
  float16 entry is stored as its changes against the base pack's entry where
  that is smaller (:mod:`nwsconvert.formats.statecode`: a few Rice-coded
  streams, the header's ``state_delta`` listing each stream's keys):
  MobileNetV2's 137 KB of state a task take 65 KB;
* the class count of the head, the model spec, and the SHA-256 of the pool set
  it was built on.

File: safetensors (``indices/<layer>``, ``table/<layer>``, ``values/<layer>``,
``values_table/<layer>`` uint8 as the coding needs, ``state/<key>``,
``state_delta/<i>`` uint8) with a
JSON header (format version, layer table with each layer's coding, pool-set
hash, model spec, content hash, and the base pack's hash when a layer is
delta-coded). Version 4 Rice-codes a delta layer's change map (each such row
names its ``mask``, :mod:`nwsconvert.formats.changemap`); version 5 codes
state entries against the base's; files of versions 1-4 are read as before.

A delta-coded pack decodes from the pool set, its base and itself: a base is
never delta-coded itself, so no chain is longer than one step. The header names
the base's file and hash; :meth:`TaskPack.load` looks for it next to the pack,
then one folder up. Trainer runs code every task against ``base.nwspack``, the
model at the end of pool learning, which the run keeps beside its pool file
(each task starts from kernels chosen during pool learning and changes a few
percent of them, so every pack is a fraction of a standalone one and depends on
no other task); ``TrainConfig.pack_base`` selects task 0 or no base instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..core.nwsmodel import _require, pool_set
from ..errors import PackMismatchError
from .indexcode import CODINGS, EncodedLayer, encode_indices
from .limits import MAX_KERNELS
from .packfile import (
    BASE_FILE,
    HASHED_SINCE,
    PACK_FORMAT,
    PACK_VERSION,
    STANDALONE,
    STATE_DELTA,
    check_header,
    decode_layers,
    decode_state_entries,
    expect,
    resolve_base,
    same_layer,
)
from .statecode import encode_groups, predictor
from .storage import FLOAT_DTYPES, read_tensors, tensor_digest, write_tensors

__all__ = [
    "TaskPack",
    "PackMismatchError",
    "extract_task",
    "apply_task",
    "clear_base_caches",
    "round_state_",
    "STATE_DTYPES",
    "PACK_FORMAT",
    "PACK_VERSION",
    "MAX_KERNELS",
]

#: ``state_dtype`` name -> the dtype float32 state entries are stored in (``float32``: as they are).
STATE_DTYPES = FLOAT_DTYPES


def _stored_form(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a pack stores it: a float32 entry in ``dtype`` when every value stays finite there
    (a BatchNorm variance above 65504 keeps float32), anything else unchanged."""
    if t.dtype != torch.float32 or dtype == torch.float32:
        return t
    low = t.to(dtype)
    return low if bool(torch.isfinite(low).eq(torch.isfinite(t)).all()) else t


@torch.no_grad()
def round_state_(model: nn.Module, state_dtype: str = "float16") -> nn.Module:
    """Round the model's non-pool state in place to the values a pack with ``state_dtype`` stores.

    Run before the evaluation a pack's recorded accuracy comes from: the model in
    memory then equals the model rebuilt from the pack, bit for bit, so both
    score the same. Float16 halves the BatchNorm + head part of a pack (ResNet-18:
    77 KB -> 38 KB per task) at a relative rounding of at most 2^-11.
    """
    dtype = STATE_DTYPES[state_dtype]
    skip = _nws_keys(model)
    for k, v in model.state_dict().items():
        if k not in skip and v.dtype == torch.float32:
            v.copy_(_stored_form(v, dtype).to(v.dtype))
    return model


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
        base: the pack whose indices delta codings refer to (saved or loaded,
            so that it has a ``sha256``; never itself delta-coded), or ``None``.
        sha256: content hash, once the pack was saved or loaded.
        source: the file it was last saved to or loaded from.
        run_id: the run the pack belongs to (``None``: outside a run); checked by
            :meth:`load` when the caller expects a run.
        task: the task id (``None``: a base pack, or outside a run).
    """

    layers: list[dict]
    indices: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    pool_sha256: str
    num_classes: int | None = None
    model_spec: str | None = None
    meta: dict = field(default_factory=dict)
    base: TaskPack | None = field(default=None, repr=False, compare=False)
    sha256: str | None = field(default=None, compare=False)
    base_sha256: str | None = field(default=None, compare=False)
    source: Path | None = field(default=None, repr=False, compare=False)
    run_id: str | None = field(default=None, compare=False)
    task: int | None = field(default=None, compare=False)
    _encoded: dict | None = field(default=None, init=False, repr=False, compare=False)
    _encoded_state: list | None = field(default=None, init=False, repr=False, compare=False)
    _predictors: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # as a base

    def content_sha256(self) -> str:
        """SHA-256 of the decoded indices and the state, whatever coding a file uses."""
        return tensor_digest(
            {
                **{f"indices/{k}": v.long() for k, v in self.indices.items()},
                **{f"state/{k}": v for k, v in self.state.items()},
            }
        )

    def encode(self, codings=CODINGS) -> dict[str, EncodedLayer]:
        """Layer name -> the smallest allowed coding of its indices (delta codings against ``base``)."""
        base = self._checked_base() if any(c.startswith("delta") for c in codings) else None
        out = {}
        for r in self.layers:
            ref = base.indices.get(r["name"]) if base is not None else None
            if ref is not None and not same_layer(r, base.layers):
                ref = None
            out[r["name"]] = encode_indices(
                self.indices[r["name"]].cpu(), r["pool_size"], r["bits"], None if ref is None else ref.cpu(), codings
            )
        return out

    def encode_state(self) -> list[tuple[list[str], bytes]]:
        """The float16 entries coded against the base's (:mod:`nwsconvert.formats.statecode`), as streams
        ``[(keys, bytes), ...]``: every float16 entry whose base entry is floating point of its shape
        and whose coding is smaller than the entry."""
        base = self._checked_base()
        if base is None:
            return []
        entries, bases = {}, {}
        for k, v in self.state.items():
            ref = base.state.get(k)
            if v.dtype != torch.float16 or ref is None or tuple(ref.shape) != tuple(v.shape) or v.numel() == 0:
                continue
            pred = predictor(ref.detach().cpu().numpy())
            if pred is not None:
                entries[k], bases[k] = v.detach().cpu().numpy(), pred
        return encode_groups(entries, bases)

    def _checked_base(self) -> TaskPack | None:
        base = self.base
        if base is None:
            return None
        if base.sha256 is None:
            raise ValueError("the base pack must be saved (or loaded) before a pack is delta-coded against it")
        if base.base_sha256 is not None:
            raise ValueError("the base pack is delta-coded itself: a task must decode from its base in one step")
        if base.pool_sha256 != self.pool_sha256:
            raise PackMismatchError(
                f"base pack is on pool set {base.pool_sha256[:12]}..., this pack on {self.pool_sha256[:12]}..."
            )
        return base

    def _stored(self) -> dict[str, EncodedLayer]:
        """The layers' codings as saved or loaded; else as :meth:`save` would write them."""
        if self._encoded is None:
            self._encoded = self.encode()
        return self._encoded

    def layer_index_bytes(self) -> dict[str, int]:
        """Layer name -> bytes its indices take in the pack file."""
        return {name: e.nbytes for name, e in self._stored().items()}

    def layer_codings(self) -> dict[str, str]:
        """Layer name -> coding of its indices (see :mod:`nwsconvert.formats.indexcode`)."""
        return {name: e.coding for name, e in self._stored().items()}

    @property
    def index_bytes(self) -> int:
        """Bytes of the stored indices, all layers."""
        return sum(self.layer_index_bytes().values())

    def _stored_state(self) -> list[tuple[list[str], bytes]]:
        """The state streams coded against the base as saved or loaded; else as :meth:`save` would code them."""
        if self._encoded_state is None:
            self._encoded_state = self.encode_state()
        return self._encoded_state

    def layer_state_bytes(self) -> dict[str, int]:
        """State key -> bytes the entry takes in the pack file: its raw bytes, or for a coded entry its
        share of its stream by value count (the remainder on the stream's first entry; they sum to the file's)."""
        out = {k: t.numel() * t.element_size() for k, t in self.state.items()}
        for keys, data in self._stored_state():
            sizes = [self.state[k].numel() for k in keys]
            shares = [len(data) * n // sum(sizes) for n in sizes]
            shares[0] += len(data) - sum(shares)
            out.update(zip(keys, shares))
        return out

    @property
    def state_bytes(self) -> int:
        """Bytes of the non-pool tensors (BatchNorm statistics, biases, ...) in the pack file."""
        return sum(self.layer_state_bytes().values())

    def save(self, path: str | os.PathLike, codings=CODINGS) -> str:
        """Write the pack atomically, each layer in its smallest allowed coding.

        Args:
            path: the ``.nwspack`` file.
            codings: codings allowed (default all; ``("bits",)`` writes the paper's
                fixed 9-bit indices).

        Returns:
            The file's content SHA-256.
        """
        encoded = self.encode(codings)
        state_coded = self.encode_state() if any(c.startswith("delta") for c in codings) else []
        tensors = {
            f"{suffix}/{name}": torch.from_numpy(t) for name, e in encoded.items() for suffix, t in e.tensors.items()
        }
        coded_keys = {k for keys, _ in state_coded for k in keys}
        tensors.update({f"state/{k}": v.detach().cpu() for k, v in self.state.items() if k not in coded_keys})
        for i, (_, data) in enumerate(state_coded):
            tensors[f"{STATE_DELTA}/{i}"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = []
        for r in self.layers:
            e = encoded[r["name"]]
            coded = {"changes": e.changes, "mask": e.mask} if e.changes is not None else {}
            rows.append({**r, "coding": e.coding, **{k: v for k, v in coded.items() if v is not None}})
        delta = bool(state_coded) or any(e.coding.startswith("delta") for e in encoded.values())
        base_file = self.base.source.name if delta and self.base.source is not None else BASE_FILE
        base = {"sha256": self.base.sha256, "file": base_file} if delta else None
        self.sha256 = write_tensors(
            path,
            tensors,
            PACK_FORMAT,
            PACK_VERSION,
            pool_sha256=self.pool_sha256,
            num_classes=self.num_classes,
            model_spec=self.model_spec,
            layers=rows,
            state_keys=list(self.state),
            **({STATE_DELTA: [keys for keys, _ in state_coded]} if state_coded else {}),
            meta=self.meta,
            run_id=self.run_id,
            task=self.task,
            **({"base": base} if base else {}),
        )
        self._encoded = encoded
        self._encoded_state = state_coded
        self.base_sha256 = base["sha256"] if base else None
        self.source = Path(path)
        return self.sha256

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        base: TaskPack | str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
        *,
        sha256: str | None = None,
        pool_sha256: str | None = None,
        run_id: str | None = None,
        task: int | None = None,
    ) -> TaskPack:
        """Read a pack file and verify it: header and content hashes, every header field, its base.

        Args:
            path: the ``.nwspack`` file.
            base: for a delta-coded pack, its base (a pack or a path). By default
                ``base.nwspack`` is looked up next to ``path``, then in its parent
                folder (a run directory keeps task packs in ``tasks/``). A mapping of
                base hashes to files accepts only those bases (a run's own).
            sha256, pool_sha256, run_id, task: when given, what the pack must be:
                its content hash (as a manifest records it), the pool set it was
                built on, its run and its task id. A pack swapped for another
                task's, another run's or one of another pool set is refused by name
                (a pack that names no run or task, as packs before version 3, is
                checked by its hash alone).

        Raises:
            FileNotFoundError: no such file.
            FormatError: truncated, corrupted, edited or foreign file; a header field
                out of type or range; a delta-coded pack whose base is missing or is
                not the one it was coded against.
            PackMismatchError: the pack is not the one expected (``sha256``, ``pool_sha256``, ``run_id``, ``task``).
        """
        path = Path(path)
        tensors, header = read_tensors(path, PACK_FORMAT, PACK_VERSION, hashed_since=HASHED_SINCE, check=check_header)
        expect(path, header, sha256=sha256, pool_sha256=pool_sha256, run_id=run_id, task=task)
        base_info = header.get("base")
        base_pack = resolve_base(path, header, base, kind=TaskPack, load=_load_base)
        u8 = {k: v.numpy() for k, v in tensors.items() if not k.startswith(("state/", f"{STATE_DELTA}/"))}
        base_idx = {k: v.numpy() for k, v in base_pack.indices.items()} if base_pack is not None else None
        layers, decoded, encoded = decode_layers(
            header, u8, path, base_pack.layers if base_pack is not None else None, base_idx
        )
        indices = {k: torch.from_numpy(v) for k, v in decoded.items()}
        base_state = {k: v.numpy() for k, v in base_pack.state.items()} if base_pack is not None else None
        raw = {k: v.numpy() for k, v in tensors.items() if k.startswith(f"{STATE_DELTA}/")}
        coded, decoded_state = decode_state_entries(
            header, raw, path, base_state, base_pack._predictors if base_pack is not None else None
        )
        state = {
            k: torch.from_numpy(decoded_state[k]) if k in decoded_state else tensors[f"state/{k}"]
            for k in header["state_keys"]
        }
        pack = cls(
            layers=layers,
            indices=indices,
            state=state,
            pool_sha256=header["pool_sha256"],
            num_classes=header.get("num_classes"),
            model_spec=header.get("model_spec"),
            meta=header.get("meta") or {},
            base=base_pack,
            sha256=header["sha256"],
            base_sha256=base_info["sha256"] if base_info else None,
            source=path,
            run_id=header.get("run_id"),
            task=header.get("task"),
        )
        pack._encoded = encoded
        pack._encoded_state = coded
        return pack


def clear_base_caches() -> None:
    """Forget the base packs read so far (:meth:`TaskPack.load` and the torch-free reader each keep the
    last four, keyed by path, modification time and size): for tools that rewrite base files in place."""
    from .packfile import clear_cached_bases

    _load_base.cache_clear()
    clear_cached_bases()


@functools.lru_cache(maxsize=4)
def _load_base(path: str, mtime_ns: int, size: int) -> TaskPack:
    """Bases are shared by many packs: decode each file version once (read-only use)."""
    return TaskPack.load(path, base=STANDALONE)


def _nws_keys(model: nn.Module) -> set[str]:
    prefixes = tuple(f"{layer.name}.parametrizations.weight." for layer in _require(model))
    return {k for k in model.state_dict() if k.startswith(prefixes)}


def _num_classes(layers) -> int | None:
    heads = [layer for layer in layers if layer.nws.role == "head"]
    return int(heads[-1].nws.weight_shape[0]) if heads else None


def model_spec_of(model: nn.Module) -> str:
    """``timm:<architecture>`` for timm models, else ``<module>:<class>``.

    The second form rebuilds the model only when its class needs no
    constructor arguments besides the recorded kwargs; otherwise pass the
    model itself (``nwsconvert.load(..., model=...)``) or a ``model_spec``.
    """
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and cfg.get("architecture"):
        return f"timm:{cfg['architecture']}"
    cls = type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


@torch.no_grad()
def extract_task(
    model: nn.Module,
    *,
    model_spec: str | None = None,
    meta: dict | None = None,
    run_id: str | None = None,
    task: int | None = None,
    state_dtype: str = "float32",
) -> TaskPack:
    """The current task of a converted model as a :class:`TaskPack`.

    Indices are taken as stored (the ones the last forward used). ``run_id``
    and ``task`` are the pack's identity, written into its header and checked
    by :meth:`TaskPack.load` against what a reader expects. ``state_dtype``
    (``float16``: half the bytes) is what float32 state entries are stored in;
    :func:`round_state_` makes the model equal to what the pack then rebuilds.
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
    dtype = STATE_DTYPES[state_dtype]
    state = {k: _stored_form(v.detach().cpu(), dtype).clone() for k, v in model.state_dict().items() if k not in skip}
    return TaskPack(
        layers=table,
        indices={layer.name: layer.nws.indices.detach().cpu().clone() for layer in layers},
        state=state,
        pool_sha256=pool_set(model).sha256,
        num_classes=_num_classes(layers),
        model_spec=model_spec or model_spec_of(model),
        meta=dict(meta or {}),
        run_id=run_id,
        task=task,
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
    where = f"{pack.source}: " if pack.source is not None else ""
    have = pool_set(model).sha256
    if pack.pool_sha256 != have:
        raise PackMismatchError(
            f"{where}task pack was built on pool set {pack.pool_sha256[:12]}..., the model holds pool set {have[:12]}...: "
            "load the pool file the pack was trained with"
        )
    by_name = {layer.name: layer for layer in layers}
    rows = {r["name"]: r for r in pack.layers}
    missing = [n for n in by_name if n not in rows]
    extra = [n for n in rows if n not in by_name]
    if missing or extra:
        raise PackMismatchError(
            f"{where}pack and model disagree on NWS layers: model-only {missing[:5]}, pack-only {extra[:5]}"
        )
    for name, layer in by_name.items():
        r = rows[name]
        if tuple(r["shape"]) != layer.nws.weight_shape:
            hint = " (head: the pack has another class count)" if layer.nws.role == "head" else ""
            raise PackMismatchError(
                f"{where}layer {name!r}: pack weight shape {tuple(r['shape'])}, model {layer.nws.weight_shape}{hint}"
            )
        if r["pool_size"] != layer.nws.pool_size or r["vector_size"] != layer.nws.vector_size:
            raise PackMismatchError(
                f"{where}layer {name!r}: pack pool {r['pool_size']}x{r['vector_size']}, model pool "
                f"{layer.nws.pool_size}x{layer.nws.vector_size}"
            )
    skip = _nws_keys(model)
    own = {k: v for k, v in model.state_dict().items() if k not in skip}
    missing = [k for k in own if k not in pack.state]
    extra = [k for k in pack.state if k not in own]
    if missing or extra:
        raise PackMismatchError(
            f"{where}pack and model disagree on state entries: model-only {missing[:5]}, pack-only {extra[:5]}"
        )
    for k, v in own.items():
        if tuple(pack.state[k].shape) != tuple(v.shape):
            raise PackMismatchError(
                f"{where}state entry {k!r}: pack shape {tuple(pack.state[k].shape)}, model {tuple(v.shape)}"
            )
    for name, layer in by_name.items():
        nws = layer.nws
        nws.indices.copy_(pack.indices[name].to(nws.indices.device))
        layer.weight.copy_(nws.gather().to(layer.weight.dtype))
        nws.reset_search()
    for k, v in own.items():
        v.copy_(pack.state[k].to(device=v.device, dtype=v.dtype))
    return model
