"""The task-pack file (``.nwspack``) without torch: its header checks, index decoding and a numpy reader.

:class:`nwsconvert.TaskPack` (torch) and the onnxruntime ``Runtime`` (numpy, on
a robot without torch) read packs through the same checks and the same
decoder, so both see exactly the same indices. The format is described in
:mod:`nwsconvert.formats.packs`; this module holds what does not need torch:

* :func:`check_header`: types, ranges and sizes of every header field against
  the file's tensors, before anything is decoded;
* :func:`decode_layers`: every layer's indices from its coding
  (:mod:`nwsconvert.formats.indexcode`), against the base's where delta-coded;
* :func:`decode_state_entries`: the state entries coded against the base's
  (:mod:`nwsconvert.formats.statecode`);
* :func:`read_pack_arrays`: a whole pack as :class:`PackArrays` (numpy), with
  its base found and verified as :meth:`TaskPack.load` does.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import FormatError, PackMismatchError
from .bitpack import packed_size
from .changemap import MASKS
from .indexcode import CODINGS, EncodedLayer, decode_indices
from .limits import MAX_KERNELS, MAX_POOL_SIZE, MAX_VECTOR_SIZE
from .schema import Fields
from .statecode import decode_groups, predictor
from .stfile import read_arrays

__all__ = [
    "PACK_FORMAT",
    "PACK_VERSION",
    "BASE_FILE",
    "STATE_DELTA",
    "STANDALONE",
    "PackArrays",
    "check_header",
    "decode_layers",
    "decode_state_entries",
    "expect",
    "base_candidates",
    "resolve_base",
    "read_pack_arrays",
    "clear_cached_bases",
]

PACK_FORMAT = "nwsconvert.taskpack"
# 3: header_sha256 and the pack's identity (run, task); 4: change maps Rice-coded (a delta layer's `mask`);
# 5: float16 state entries coded against the base's (`state_delta`). Versions 1-4 still load.
PACK_VERSION = 5
HASHED_SINCE = 3
BASE_FILE = "base.nwspack"  # the base's file name when it was never saved under another
SUFFIXES = ("indices", "table", "values", "values_table")
STATE_DELTA = "state_delta"  # the tensor prefix (and header field) of state entries coded against the base
ROLES = ("stem", "body", "shortcut", "head")


@dataclass
class PackArrays:
    """A pack as numpy arrays (what :func:`read_pack_arrays` returns).

    Attributes:
        header: the checked JSON header.
        layers: layer table rows (as :attr:`TaskPack.layers`).
        indices: layer name -> ``(count,)`` int64 (or the ``index_dtype`` the reader was given).
        state: state key -> array, in the file's dtype.
        encoded: layer name -> the layer's stored coding.
        base: the decoded base of a delta-coded pack, else ``None``.
        source: the file read.
    """

    header: dict
    layers: list
    indices: dict
    state: dict
    encoded: dict
    base: PackArrays | None = field(default=None, repr=False)
    source: Path | None = None
    predictors: dict = field(default_factory=dict, repr=False)  # as a base: its state's float16 patterns

    @property
    def sha256(self) -> str:
        return self.header["sha256"]

    @property
    def pool_sha256(self) -> str:
        return self.header["pool_sha256"]

    @property
    def base_sha256(self) -> str | None:
        return (self.header.get("base") or {}).get("sha256")


def expect(path: Path, header: dict, **want) -> None:
    """Refuse a pack that is not the one the caller expects (each expectation given is checked).

    Raises:
        PackMismatchError: naming the field (content hash, pool set, run, task).
    """
    names = {"sha256": "content SHA-256", "pool_sha256": "pool set", "run_id": "run", "task": "task"}
    run = header.get("run_id")
    if want.get("task") is not None and header.get("task") is None and run is not None:
        # A pack a run wrote that names no task is that run's base pack (pool learning's indices; a run
        # writes every task's id into its pack): never a task's pack, whatever its hash. Packs made
        # outside a run (no run, no task) and version <= 2 packs name neither: their hash pins them.
        expected = want.get("run_id")
        whose = "a run's" if expected is None else "the run's" if expected == run else f"run {run[:12]}...'s"
        raise PackMismatchError(
            f"{path} is {whose} base pack (pool learning's indices), not task {want['task']}'s pack"
        )
    for key, value in want.items():
        if value is None:
            continue
        have = header.get(key)
        if key in ("run_id", "task") and have is None:
            continue  # a pack that names no run or task (version <= 2, or made outside a run): its hash pins it
        if have != value:

            def show(v):
                return f"{v[:12]}..." if isinstance(v, str) and len(v) > 16 else repr(v)

            raise PackMismatchError(
                f"{path}: the pack's {names[key]} is {show(have)}, expected {show(value)} "
                "(a pack swapped for another task's or another run's, or read against the wrong pool set)"
            )


def check_header(header: dict, layout, path) -> None:
    """Types, ranges and cross-field sizes of a pack header against the file's tensors, before decoding.

    Raises:
        FormatError: naming the file and the field.
    """
    f = Fields(header, path)
    f.sha("pool_sha256")
    f.str("model_spec", optional=True)
    f.dict("meta", optional=True)
    f.str("run_id", optional=True)
    f.int("task", lo=0, optional=True)
    num_classes = f.int("num_classes", lo=1, optional=True)
    base = f.obj_fields("base", optional=True)
    if base is not None:
        base.sha("sha256")
        base.filename("file", optional=True)
    state_keys = f.strs("state_keys")
    if len(set(state_keys)) != len(state_keys):
        raise f.fail("state_keys", "unique names", state_keys)
    groups = f.list(STATE_DELTA, optional=True) or []
    coded = [k for g in groups if isinstance(g, list) for k in g]
    if (
        not all(isinstance(g, list) and g and all(isinstance(k, str) for k in g) for g in groups)
        or len(set(coded)) != len(coded)
        or not set(coded) <= set(state_keys)
    ):
        raise f.fail(STATE_DELTA, "lists of names from state_keys, each name in one list", groups)
    for i in range(len(groups)):
        info = layout.tensors.get(f"{STATE_DELTA}/{i}")
        if info is not None and (info.dtype != "U8" or len(info.shape) != 1):
            raise FormatError(
                f"{path}: tensor {STATE_DELTA}/{i} is {info.dtype} {list(info.shape)}, a coded state stream is uint8 bytes"
            )
    coded_keys = set(coded)
    expected = {f"state/{k}" for k in state_keys if k not in coded_keys} | {
        f"{STATE_DELTA}/{i}" for i in range(len(groups))
    }
    names, heads, delta = set(), [], False
    for i, row in enumerate(f.list("layers")):
        r = f.sub(row, f"layers[{i}]")
        name = r.str("name")
        if not name or name in names:
            raise r.fail("name", "a unique, non-empty layer name", name)
        names.add(name)
        r.str("pool")
        r.str("role", choices=ROLES)
        shape = r.ints("shape", lo=1, max_len=6)
        r.int("groups", lo=1)
        d = r.int("vector_size", lo=1, hi=MAX_VECTOR_SIZE)
        n = r.int("pool_size", lo=1, hi=MAX_POOL_SIZE)
        bits = r.int("bits", lo=1, hi=32)
        count = r.int("count", lo=0, hi=MAX_KERNELS)
        if bits != max(1, (n - 1).bit_length()):
            raise r.fail("bits", f"{max(1, (n - 1).bit_length())} (ceil(log2 pool_size))", bits)
        if math.prod(shape) != count * d:
            raise r.fail("count", f"{math.prod(shape) // d} (the weight shape {shape} over vectors of {d})", count)
        if row["role"] == "head":
            heads.append(shape[0])
        coding = r.str("coding", choices=CODINGS, optional=True, default="bits") or "bits"
        want = _coded_tensors(r, coding, count, bits, layout, name)
        delta = delta or coding.startswith("delta")
        expected |= {f"{s}/{name}" for s in want}
    if delta and base is None:
        raise FormatError(f"{path}: field base is missing, but some layers are stored as changes against a base")
    if coded and base is None:
        raise FormatError(f"{path}: field base is missing, but some state entries are stored as changes against a base")
    if heads and num_classes != heads[-1]:
        raise f.fail("num_classes", f"{heads[-1]} (the head layer's rows)", num_classes)
    extra = sorted(set(layout.tensors) - expected)
    missing = sorted(expected - set(layout.tensors))
    if missing or extra:
        raise FormatError(f"{path}: tensors do not match the header: missing {missing[:3]}, not described {extra[:3]}")


def _coded_tensors(r: Fields, coding: str, count: int, bits: int, layout, name: str) -> set[str]:
    """The suffixes a layer's coding stores, with the sizes that follow from the header checked."""

    def u8(suffix, size=None, words=False):
        info = layout.tensors.get(f"{suffix}/{name}")
        if info is None:
            raise FormatError(f"{r.file}: layer {name!r} ({coding}) has no tensor {suffix}/{name}")
        if (
            info.dtype != "U8"
            or len(info.shape) != 1
            or (size is not None and info.shape[0] != size)
            or (words and info.shape[0] % 4)
        ):
            expect = f"{size} bytes" if size is not None else "whole 32-bit words" if words else "bytes"
            raise FormatError(
                f"{r.file}: tensor {suffix}/{name} is {info.dtype} {list(info.shape)}, the header's {coding} coding needs uint8 {expect}"
            )

    if coding == "bits":
        u8("indices", packed_size(count, bits))
        return {"indices"}
    if coding == "ans":
        u8("indices", words=True)
        u8("table")
        return {"indices", "table"}
    changes = r.int("changes", lo=0, hi=count)
    mask = r.str("mask", choices=MASKS, optional=True, default="ans") or "ans"  # versions 1-3 name none
    u8("indices", 0 if changes in (0, count) else None, words=mask == "ans")
    if changes == 0:
        return {"indices"}
    if coding == "delta+bits":
        u8("values", packed_size(changes, bits))
        return {"indices", "values"}
    u8("values", words=True)
    u8("values_table")
    return {"indices", "values", "values_table"}


def same_layer(row: dict, base_layers: list) -> bool:
    """Whether ``base_layers`` has the layer of ``row`` with the same index count and pool size."""
    other = next((r for r in base_layers if r["name"] == row["name"]), None)
    return other is not None and other["count"] == row["count"] and other["pool_size"] == row["pool_size"]


def decode_layers(
    header: dict,
    u8: dict,
    path,
    base_layers: list | None = None,
    base_indices: dict | None = None,
    index_dtype=np.int64,
):
    """Every layer's indices of a checked header: ``(layers, indices, encoded)``.

    Args:
        header: checked by :func:`check_header`.
        u8: tensor name (``indices/<layer>``...) -> uint8 array (or CPU tensor) of the file.
        base_layers, base_indices: the base pack's layer table and indices, for delta codings.
        index_dtype: the integer type of the decoded indices (default int64).

    Returns:
        ``layers`` (rows without their coding fields), ``indices`` (name -> ``(count,)`` of ``index_dtype``),
        ``encoded`` (name -> :class:`EncodedLayer`).

    Raises:
        FormatError: data inconsistent with the header (naming ``path``).
    """
    try:
        layers, indices, encoded = [], {}, {}
        for row in header["layers"]:
            r = {k: v for k, v in row.items() if k not in ("coding", "changes", "mask")}
            name = r["name"]
            e = EncodedLayer(
                row.get("coding", "bits"),
                {s: np.asarray(u8[f"{s}/{name}"]) for s in SUFFIXES if f"{s}/{name}" in u8},
                row.get("changes"),
                row.get("mask"),
            )
            ref = base_indices.get(name) if base_indices is not None and same_layer(r, base_layers) else None
            indices[name] = decode_indices(e, r["count"], r["pool_size"], r["bits"], ref, index_dtype)
            layers.append(r)
            encoded[name] = e
    except (KeyError, ValueError, TypeError, IndexError, OverflowError, RuntimeError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{path}: inconsistent task pack ({type(e).__name__}: {e})") from None
    return layers, indices, encoded


def decode_state_entries(
    header: dict, raw: dict, path, base_state: dict | None, cache: dict | None = None
) -> tuple[list, dict]:
    """The state entries a checked header codes in ``state_delta``, decoded against the base's.

    Args:
        raw: ``state_delta/<i>`` -> stream i's bytes (uint8 array) of the file.
        base_state: the base pack's state (key -> array); ``None`` when the pack has no base.
        cache: the base's predictors computed so far (key -> float16 patterns), kept with the base
            (a base serves every task: its entries are rounded once, not at every read).

    Returns:
        ``(streams, state)``: ``[(keys, bytes), ...]`` as stored, and key -> the decoded float16 array.

    Raises:
        FormatError: a base without an entry, or with it not floating point; a stream inconsistent
            with its entries (naming ``path`` and the stream's first key).
    """
    groups = header.get(STATE_DELTA) or []
    bases, shapes = {}, {}
    for k in (k for g in groups for k in g):
        ref = None if base_state is None else base_state.get(k)
        pred = None if ref is None else (cache or {}).get(k)
        if pred is None and ref is not None:
            pred = predictor(ref)
            if cache is not None and pred is not None:
                cache[k] = pred
        if pred is None:
            why = "has no such entry" if ref is None else f"holds it as {np.asarray(ref).dtype}"
            raise FormatError(f"{path}: state entry {k!r} is stored as changes against its base, which {why}")
        bases[k], shapes[k] = pred, np.shape(ref)
    streams, state = [], {}
    for i, keys in enumerate(groups):
        data = np.asarray(raw[f"{STATE_DELTA}/{i}"], dtype=np.uint8)
        try:
            flat = decode_groups([keys], [data], bases)
        except ValueError as e:
            raise FormatError(f"{path}: state stream {i} (entries {keys[0]!r}...): {e}") from None
        state.update((k, v.reshape(shapes[k])) for k, v in flat.items())
        streams.append((keys, data.tobytes()))
    return streams, state


def base_candidates(path: Path, info: dict) -> list[Path]:
    """Where a delta-coded pack's base is looked up: its recorded name next to the pack, then one folder up."""
    name = info.get("file") or BASE_FILE
    return [path.parent / name, path.parent.parent / name]


STANDALONE = object()  # the ``base`` of a pack read *as* a base: it must not be delta-coded itself


def resolve_base(path: Path, header: dict, given, *, kind: type, load):
    """The base a checked pack header is delta-coded against, verified; ``None`` when it is standalone.

    Shared by :meth:`nwsconvert.TaskPack.load` (``kind=TaskPack``) and :func:`read_pack_arrays`
    (``kind=PackArrays``).

    Args:
        given: a decoded base (an instance of ``kind``), a path, ``None`` (look it up as
            :func:`base_candidates` says), :data:`STANDALONE` (the file must not need a base),
            or a mapping of the base hashes a reader accepts to their files (a run's own base
            packs: a pack coded against any other base is refused, whatever file is beside it).
        load: ``load(resolved path, mtime_ns, size) -> kind``, reading a base file (cached by the caller).

    Raises:
        FormatError: a base is needed but missing, not the one recorded, not one the mapping
            accepts, or of another pool set.
    """
    info = header.get("base")
    if not info:
        return None
    if given is STANDALONE:
        raise FormatError(
            f"{path}: is delta-coded itself, so it cannot serve as a base pack (a task pack in place of {BASE_FILE}?)"
        )
    want = info["sha256"]
    if isinstance(given, Mapping):
        if want not in given:
            accepted = ", ".join(f"{sha[:12]}..." for sha in given) or "none"
            raise FormatError(
                f"{path}: coded against base pack {want[:12]}..., not the base its run or bundle records ({accepted})"
            )
        given = given[want]
    base = None
    if isinstance(given, kind):
        if given.sha256 != want:
            raise FormatError(
                f"{path}: coded against base pack {want[:12]}..., the base given is {str(given.sha256)[:12]}..."
            )
        base = given
    else:
        candidates = [Path(given)] if given is not None else base_candidates(path, info)
        seen = []
        for c in candidates:
            if c.is_file():
                st = c.stat()
                found = load(str(c.resolve()), st.st_mtime_ns, st.st_size)
                if found.sha256 == want:
                    base = found
                    break
                seen.append(f"{c} is {str(found.sha256)[:12]}...")
        if base is None:
            where = (
                "; ".join(seen)
                if seen
                else f"no {info.get('file') or BASE_FILE} at {' or '.join(str(c) for c in candidates)}"
            )
            raise FormatError(
                f"{path}: indices are stored as changes against base pack {want[:12]}... ({where}); pass base= or keep the base beside the pack"
            )
    if base.pool_sha256 != header["pool_sha256"]:
        raise FormatError(
            f"{path}: its base {base.source} is on pool set {base.pool_sha256[:12]}..., the pack on {header['pool_sha256'][:12]}..."
        )
    return base


def clear_cached_bases() -> None:
    """Forget the bases :func:`read_pack_arrays` decoded (it keeps the last four: 8 bytes a kernel each)."""
    _cached_base.cache_clear()


@functools.lru_cache(maxsize=4)
def _cached_base(path: str, mtime_ns: int, size: int) -> PackArrays:
    """Bases are shared by many packs: decode each file version once (read-only use)."""
    return read_pack_arrays(path, base=STANDALONE)


def read_pack_arrays(
    path: str | os.PathLike,
    base: PackArrays | str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
    *,
    sha256: str | None = None,
    pool_sha256: str | None = None,
    task: int | None = None,
    index_dtype=np.int64,
) -> PackArrays:
    """Read and verify a ``.nwspack`` without torch (every check :meth:`TaskPack.load` makes).

    Args:
        path: the pack file.
        base: for a delta-coded pack, its base (decoded, or a path); by default looked up
            as :func:`base_candidates` says and checked against the hash the pack records.
        sha256, pool_sha256, task: what the pack must be, when given.
        index_dtype: the integer type of the decoded indices (default int64; one that cannot hold a layer's
            pool size is refused as a :class:`FormatError` naming the file).

    Raises:
        FileNotFoundError: no such file. FormatError: damaged, foreign, or its base missing
            or not the one it was coded against. PackMismatchError: not the pack expected.
    """
    path = Path(path)
    header, arrays = read_arrays(path, PACK_FORMAT, PACK_VERSION, hashed_since=HASHED_SINCE, check=check_header)
    expect(path, header, sha256=sha256, pool_sha256=pool_sha256, task=task)
    base_pack = resolve_base(path, header, base, kind=PackArrays, load=_cached_base)
    layers, indices, encoded = decode_layers(
        header,
        arrays,
        path,
        base_pack.layers if base_pack else None,
        base_pack.indices if base_pack else None,
        index_dtype,
    )
    _, decoded_state = decode_state_entries(
        header, {k: v for k, v in arrays.items() if k.startswith(f"{STATE_DELTA}/")}, path,
        base_pack.state if base_pack else None, base_pack.predictors if base_pack else None,
    )  # fmt: skip
    state = {k: decoded_state[k] if k in decoded_state else arrays[f"state/{k}"] for k in header["state_keys"]}
    return PackArrays(header, layers, indices, state, encoded, base_pack, path)
