"""Files on disk: atomic writes, safetensors + JSON header, content hashes.

Every file nwsconvert writes is a safetensors file whose ``__metadata__``
carries one JSON document under the key ``nwsconvert``. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

__all__ = ["FormatError", "atomic_write_bytes", "write_tensors", "read_tensors", "tensor_digest"]

META_KEY = "nwsconvert"
_UMASK = os.umask(0)  # read once: files get the permissions open() would give (mkstemp makes them 0600)
os.umask(_UMASK)


class FormatError(ValueError):
    """A file is missing, truncated, corrupted, or not the kind of file expected."""


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename.

    A reader (or a run killed mid-write) sees either the old file or the new
    one, never a partial file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):  # POSIX
            os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of ``tensors``, in name order.

    Independent of the file layout, so two files with equal content share a hash.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        h.update(json.dumps([name, str(t.dtype), list(tensors[name].shape)]).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], kind: str, version: int, **fields) -> str:
    """Save ``tensors`` with a JSON header as one safetensors file, atomically.

    The header holds ``format`` (= ``kind``), ``version``, the content
    ``sha256`` and ``fields``. Returns the SHA-256.
    """
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    digest = tensor_digest(tensors)
    header = {"format": kind, "version": version, "sha256": digest, **fields}
    atomic_write_bytes(path, st_save(tensors, metadata={META_KEY: json.dumps(header, sort_keys=True)}))
    return digest


def read_tensors(path: str | os.PathLike, kind: str, version: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a file written by :func:`write_tensors`: a ``kind`` file of at most ``version``.

    Raises:
        FileNotFoundError: no such file.
        FormatError: truncated, corrupted, not safetensors, or another kind of file;
            the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    data = path.read_bytes()
    if len(data) < 8:
        raise FormatError(f"{path}: file is {len(data)} bytes, too short to be a {kind} file (truncated?)")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > len(data) - 8:
        raise FormatError(f"{path}: header claims {hlen} bytes but the file holds {len(data) - 8}: truncated or not a {kind} file")
    try:
        meta = json.loads(data[8 : 8 + hlen]).get("__metadata__") or {}
        header = json.loads(meta[META_KEY])
    except (ValueError, KeyError, AttributeError) as e:
        raise FormatError(f"{path}: not a {kind} file (no nwsconvert header: {e})") from None
    if header.get("format") != kind:
        raise FormatError(f"{path}: is a {header.get('format')!r} file, expected {kind!r}")
    if header.get("version", 0) > version:
        raise FormatError(f"{path}: {kind} version {header['version']} is newer than this nwsconvert reads ({version})")
    try:
        tensors = st_load(data)
    except (SafetensorError, RuntimeError, ValueError) as e:
        raise FormatError(f"{path}: corrupted {kind} file ({e})") from None
    want = header.get("sha256")
    if want is not None and tensor_digest(tensors) != want:
        raise FormatError(f"{path}: content does not match its SHA-256 {want[:12]}...: the file is corrupted")
    return tensors, header
