"""Files on disk: atomic writes, safetensors + JSON header, content hashes.

Every file nwsconvert writes is a safetensors file whose ``__metadata__``
carries one JSON document under the key ``nwsconvert``. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import FormatError
from .atomic import atomic_write_bytes, disk_error
from .stfile import header_digest, verify

__all__ = [
    "FormatError",
    "FLOAT_DTYPES",
    "atomic_write_bytes",
    "write_tensors",
    "read_tensors",
    "tensor_digest",
    "disk_error",
]

META_KEY = "nwsconvert"

#: The float widths a file may store values in (``state_dtype``, ``pool_dtype``): name -> dtype.
FLOAT_DTYPES = {"float16": torch.float16, "float32": torch.float32}


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
    ``sha256`` (:func:`tensor_digest`), ``fields``, and ``header_sha256``
    over all of these, so a reader detects any change to the header or the
    tensors. Returns the content SHA-256.
    """
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    digest = tensor_digest(tensors)
    header = {"format": kind, "version": version, "sha256": digest, **fields}
    header["header_sha256"] = header_digest(header)
    atomic_write_bytes(path, st_save(tensors, metadata={META_KEY: json.dumps(header, sort_keys=True)}))
    return digest


def read_tensors(
    path: str | os.PathLike, kind: str, version: int, *, hashed_since: int | None = None, check=None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a file written by :func:`write_tensors`: a ``kind`` file of at most ``version``.

    Order of checks, all before any tensor is allocated: the safetensors layout
    against the file's length (:func:`nwsconvert.formats.stfile.parse_header`), the
    header's kind and version, ``header_sha256`` (required from version
    ``hashed_since`` on; default ``version``), the kind's own field checks
    (``check(header, layout, path)``, which raises :class:`FormatError`), and the
    content ``sha256``, which every version must carry.

    Raises:
        FileNotFoundError: no such file.
        FormatError: truncated, corrupted, not safetensors, another kind of file,
            or a header field out of type or range; the message names the file (and field).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    data = path.read_bytes()
    _, header = verify(data, path, kind, version, hashed_since=hashed_since, check=check)
    try:
        tensors = st_load(data)
    except (SafetensorError, RuntimeError, ValueError) as e:
        raise FormatError(f"{path}: corrupted {kind} file ({e})") from None
    return tensors, header
