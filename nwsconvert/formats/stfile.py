"""safetensors files without torch: the header, checked against the file's length, and content digests.

The one reader of the safetensors layout in nwsconvert (the storage layer,
the ONNX exporter and the onnxruntime ``Runtime`` all use it). It imports only
the standard library, so deployment and the command lines can check a file
before torch is loaded.

Layout: 8 bytes little-endian header length ``H``, ``H`` bytes of JSON
(``{name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {str: str}}``),
then the tensor data; offsets count from the end of the header.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError

__all__ = [
    "file_sha256",
    "TensorInfo",
    "Header",
    "read_header",
    "parse_header",
    "raw_digest",
    "header_digest",
    "file_kind",
    "nws_header",
    "verify",
    "read_arrays",
    "TORCH_DTYPE",
    "ITEMSIZE",
]

#: safetensors dtype -> ``str(torch dtype)``, as :func:`nwsconvert.formats.storage.tensor_digest` hashes it.
TORCH_DTYPE = {
    "F64": "torch.float64",
    "F32": "torch.float32",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "I64": "torch.int64",
    "I32": "torch.int32",
    "I16": "torch.int16",
    "I8": "torch.int8",
    "U64": "torch.uint64",
    "U32": "torch.uint32",
    "U16": "torch.uint16",
    "U8": "torch.uint8",
    "BOOL": "torch.bool",
    "F8_E4M3": "torch.float8_e4m3fn",
    "F8_E5M2": "torch.float8_e5m2",
}
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
#: safetensors dtype -> numpy dtype name, for :func:`read_arrays` (bfloat16 and float8 have none).
NUMPY_DTYPE = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: ``dtype`` (safetensors name), ``shape``, ``start``/``end`` absolute byte offsets."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A checked safetensors header: ``metadata`` (str -> str), ``tensors`` (name -> :class:`TensorInfo`)."""

    size: int
    metadata: dict
    tensors: dict


def parse_header(head: bytes, file_size: int, path, kind: str = "safetensors") -> Header:
    """Check the header bytes ``head`` (the file's first bytes, at least the whole header) against ``file_size``.

    Every tensor must have a known dtype, a shape of non-negative integers whose
    size matches its byte range, and a byte range inside the file; ranges may
    not overlap. Nothing is allocated from the sizes the header claims.

    Raises:
        FormatError: naming ``path`` and what is wrong.
    """
    if file_size < 8 or len(head) < 8:
        raise FormatError(f"{path}: file is {file_size} bytes, too short to be a {kind} file (truncated?)")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > file_size - 8 or hlen > MAX_HEADER:
        raise FormatError(
            f"{path}: header claims {hlen} bytes but the file holds {file_size - 8}: truncated or not a {kind} file"
        )
    if len(head) < 8 + hlen:
        raise FormatError(f"{path}: header cut short (truncated?)")
    try:
        raw = json.loads(bytes(head[8 : 8 + hlen]))
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not a {kind} file (header is not JSON: {e})") from None
    if not isinstance(raw, dict):
        raise FormatError(f"{path}: not a {kind} file (header is not a JSON object)")
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError(f"{path}: not a {kind} file (__metadata__ is not a map of strings)")
    data_start, data_len = 8 + hlen, file_size - 8 - hlen
    tensors = {}
    for name, info in raw.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise FormatError(f"{where}: entry is not a JSON object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise FormatError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FormatError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise FormatError(f"{where}: data_offsets {offsets!r} is not two integers")
        start, end = offsets
        if not 0 <= start <= end <= data_len:
            raise FormatError(
                f"{where}: bytes {start}..{end} lie outside the file's {data_len} data bytes (truncated?)"
            )
        if math.prod(shape) * ITEMSIZE[dtype] != end - start:
            raise FormatError(
                f"{where}: shape {shape} of {dtype} needs {math.prod(shape) * ITEMSIZE[dtype]} bytes, the file gives {end - start}"
            )
        tensors[name] = TensorInfo(dtype, tuple(shape), data_start + start, data_start + end)
    spans = sorted((t.start, t.end, n) for n, t in tensors.items() if t.end > t.start)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise FormatError(f"{path}: tensors {a!r} and {b!r} overlap")
    return Header(hlen, meta, tensors)


def read_header(path: str | os.PathLike, kind: str = "safetensors") -> Header:
    """The checked header of a safetensors file, reading only its first bytes.

    Raises:
        FileNotFoundError: no such file. FormatError: see :func:`parse_header`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (hlen,) = struct.unpack("<Q", head)
            if hlen <= min(size - 8, MAX_HEADER):
                head += f.read(hlen)
    return parse_header(head, size, path, kind)


def nws_header(layout: Header, path, kind: str, version: int, hashed_since: int | None = None) -> dict:
    """The nwsconvert JSON header of a checked layout: its kind, version and ``header_sha256``
    (required from version ``hashed_since`` on; default ``version``) verified, and a content
    ``sha256`` present. Shared by the torch reader (:func:`nwsconvert.formats.storage.read_tensors`) and
    the onnxruntime ``Runtime``.

    Raises:
        FormatError: naming ``path`` and what is wrong.
    """
    if "nwsconvert" not in layout.metadata:
        raise FormatError(f"{path}: not a {kind} file (no nwsconvert header)")
    try:
        header = json.loads(layout.metadata["nwsconvert"])
    except ValueError as e:
        raise FormatError(f"{path}: not a {kind} file (nwsconvert header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: not a {kind} file (nwsconvert header is not a JSON object)")
    if header.get("format") != kind:
        raise FormatError(f"{path}: is a {str(header.get('format'))[:40]!r} file, expected {kind!r}")
    file_version = header.get("version")
    if type(file_version) is not int or file_version < 1:
        raise FormatError(f"{path}: field version: expected an integer >= 1, got {str(file_version)[:40]!r}")
    if file_version > version:
        raise FormatError(f"{path}: {kind} version {file_version} is newer than this nwsconvert reads ({version})")
    hashed = header.get("header_sha256")
    if hashed is not None or file_version >= (hashed_since or version):
        if hashed != header_digest(header):
            what = "has no header_sha256" if hashed is None else "does not match its header_sha256"
            raise FormatError(f"{path}: header {what}: the file is corrupted or was edited")
    want = header.get("sha256")
    if not isinstance(want, str) or len(want) != 64:
        raise FormatError(f"{path}: field sha256 is missing or not a SHA-256: the content cannot be checked")
    return header


def file_kind(path: str | os.PathLike) -> str | None:
    """The ``format`` an nwsconvert file declares (``nwsconvert.poolset``...), unverified; ``None`` for
    any other safetensors file. For telling file kinds apart in error messages before torch loads.

    Raises:
        FileNotFoundError: no such file. FormatError: not a safetensors file.
    """
    header = read_header(path)
    try:
        kind = json.loads(header.metadata.get("nwsconvert", "{}")).get("format")
    except (ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def raw_digest(data, header: Header, names=None) -> str:
    """SHA-256 of tensors straight from the file's bytes ``data`` (bytes, mmap or memoryview).

    Equal to :func:`nwsconvert.formats.storage.tensor_digest` of the loaded tensors
    (names in order; name, dtype and shape, then the little-endian bytes).
    """
    h = hashlib.sha256()
    view = memoryview(data)
    for name in sorted(header.tensors if names is None else names):
        t = header.tensors[name]
        short = len(name) <= _CACHED_NAME  # a file may hold any names: only the usual ones are kept
        h.update(_entry_bytes(name, t.dtype, t.shape) if short else _entry_json(name, t.dtype, t.shape))
        h.update(view[t.start : t.end])
    return h.hexdigest()


#: names up to this length have their :func:`raw_digest` entry kept (a layer's state-dict keys are far shorter).
_CACHED_NAME = 256


def _entry_json(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """What :func:`raw_digest` hashes before a tensor's bytes: ``[name, torch dtype, shape]`` as JSON."""
    return json.dumps([name, TORCH_DTYPE[dtype], list(shape)]).encode()


#: :func:`_entry_json`, kept: every pack of a bundle names the same tensors, and the runtime's packs-only switch
#: hashes one a switch (at most 16,384 entries of at most 256-character names: a few MB at worst).
_entry_bytes = functools.lru_cache(maxsize=1 << 14)(_entry_json)


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def header_digest(fields: dict) -> str:
    """SHA-256 of a JSON header without its ``header_sha256`` field (canonical form: sorted keys, no spaces)."""
    body = {k: v for k, v in fields.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def verify(data, path, kind: str, version: int, *, hashed_since: int | None = None, check=None) -> tuple[Header, dict]:
    """Check a whole nwsconvert file held in ``data`` (bytes or a buffer), before any tensor is built:
    the layout against its length, the kind, version and ``header_sha256`` (:func:`nws_header`), the
    kind's own field checks (``check(header, layout, path)``), then the content ``sha256``.
    Shared by the torch reader (:func:`nwsconvert.formats.storage.read_tensors`) and :func:`read_arrays`.

    Returns:
        ``(layout, header)``.

    Raises:
        FormatError: naming ``path`` and what is wrong.
    """
    layout = parse_header(data, len(data), path, kind)
    header = nws_header(layout, path, kind, version, hashed_since)
    if check is not None:
        check(header, layout, path)
    if raw_digest(data, layout) != header["sha256"]:
        raise FormatError(
            f"{path}: content does not match its SHA-256 {header['sha256'][:12]}...: the file is corrupted"
        )
    return layout, header


def read_arrays(
    path: str | os.PathLike, kind: str, version: int, *, hashed_since: int | None = None, check=None
) -> tuple[dict, dict]:
    """Load an nwsconvert file as numpy arrays, checked as :func:`nwsconvert.formats.storage.read_tensors`
    checks it (layout against the length, kind, version, ``header_sha256``, ``check(header, layout,
    path)``, content ``sha256``), without torch: ``(header, {name: array})``. The arrays are copies,
    aligned and writable.

    Raises:
        FileNotFoundError: no such file. FormatError: damaged, foreign, or a tensor of a dtype
            numpy has no type for (bfloat16, float8: read such files with torch).
    """
    import numpy as np  # the readers of JSON and of headers above need only the standard library

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    data = np.fromfile(path, dtype=np.uint8)
    layout, header = verify(memoryview(data), path, kind, version, hashed_since=hashed_since, check=check)
    arrays = {}
    for name, t in layout.tensors.items():
        if t.dtype not in NUMPY_DTYPE:
            raise FormatError(
                f"{path}: tensor {name!r} is {t.dtype}, which numpy cannot hold (load this file with torch)"
            )
        arrays[name] = data[t.start : t.end].view(NUMPY_DTYPE[t.dtype]).reshape(t.shape).copy()
    return header, arrays
