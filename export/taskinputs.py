"""A task's inputs to the bundle's one-session graph: ``task_<t>.inputs.safetensors``.

In the one-session mode (:mod:`nwsconvert.export.switch`) every task runs
through one ONNX graph, ``switch.onnx``, whose inputs are the image and, per
NWS layer, the indices into its pool; per state entry (BatchNorm statistics
and affine parameters, biases), its values. This file holds one task's values
of those inputs:

* ``indices/<layer>/low`` (uint8) and, for pools of more than 256 entries,
  ``indices/<layer>/high``: the ``ceil(log2 n) - 8`` high bits as packed bit
  planes (:func:`pack_index_planes`; pools of more than 65,536 entries:
  ``indices/<layer>/i32``);
* ``state/<key>``: float32.

The header (``format`` ``nwsconvert.taskinputs``) records the task, the pool
set, each layer's count and pool size, and the SHA-256s every nwsconvert file
carries. Reading imports neither torch nor timm: the robot's runtime reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from nwsconvert.errors import FormatError, PackMismatchError
from nwsconvert.limits import MAX_KERNELS, MAX_POOL_SIZE
from nwsconvert.schema import Fields
from nwsconvert.stfile import nws_header, raw_digest, read_header

__all__ = ["INPUTS_FORMAT", "INPUTS_VERSION", "pack_index_planes", "unpack_index_planes", "read_task_inputs"]

INPUTS_FORMAT = "nwsconvert.taskinputs"
INPUTS_VERSION = 1

_DTYPES = {"U8": np.uint8, "I32": np.int32, "F32": np.float32}


def _bits(pool_size: int) -> int:
    return max(1, int(np.ceil(np.log2(pool_size))))


def pack_index_planes(indices: np.ndarray, pool_size: int) -> dict[str, np.ndarray]:
    """``indices`` ``(N,)`` in ``[0, pool_size)`` at ``ceil(log2 n)`` bits.

    Returns:
        ``{'low': (N,) uint8}`` (n <= 256), plus ``'high': (k, ceil(N / 8)) uint8``
        bit planes (n <= 65,536; bit ``8 + j`` of index ``i`` is bit ``i % 8`` of
        ``high[j, i // 8]``), or ``{'i32': (N,) int32}`` beyond.
    """
    idx = np.asarray(indices, dtype=np.int64).ravel()
    bits = _bits(pool_size)
    if bits > 16:
        return {"i32": idx.astype(np.int32)}
    out = {"low": (idx & 0xFF).astype(np.uint8)}
    if bits > 8:
        planes = ((idx[None, :] >> (8 + np.arange(bits - 8)[:, None])) & 1).astype(np.uint8)
        out["high"] = np.packbits(planes, axis=1, bitorder="little")
    return out


def unpack_index_planes(parts: dict[str, np.ndarray], count: int, pool_size: int) -> np.ndarray:
    """Inverse of :func:`pack_index_planes`: ``(count,)`` int32.

    Raises:
        ValueError: the parts do not hold ``count`` indices of that width.
    """
    bits = _bits(pool_size)
    if bits > 16:
        out = np.asarray(parts["i32"], dtype=np.int32)
        if out.shape != (count,):
            raise ValueError(f"{out.shape[0]} indices stored, {count} expected")
        return out
    low = np.asarray(parts["low"], dtype=np.uint8)
    if low.shape != (count,):
        raise ValueError(f"{low.shape[0]} low bytes stored, {count} expected")
    out = low.astype(np.int32)
    if bits > 8:
        high = np.asarray(parts["high"], dtype=np.uint8)
        if high.shape != (bits - 8, (count + 7) // 8):
            raise ValueError(f"high bit planes of shape {high.shape}, expected {(bits - 8, (count + 7) // 8)}")
        planes = np.unpackbits(high, axis=1, bitorder="little")[:, :count].astype(np.int32)
        out |= (planes << (8 + np.arange(bits - 8, dtype=np.int32)[:, None])).sum(0, dtype=np.int32)
    if count and int(out.max()) >= pool_size:
        raise ValueError(f"an index is {int(out.max())}, the pool has {pool_size} entries")
    return out


def read_task_inputs(
    path: str | os.PathLike, *, sha256: str | None = None, pool_sha256: str | None = None, task: int | None = None
) -> tuple[dict, dict[str, np.ndarray]]:
    """One task's graph inputs, checked: ``(header, {input name: array})``.

    Input names are the graph's: ``indices/<layer>`` (int32, ``(N,)``) and
    ``state/<key>`` (float32, the entry's shape).

    Args:
        sha256, pool_sha256, task: what ``bundle.json`` records for it; each given one must match.

    Raises:
        FileNotFoundError: no such file. FormatError: damaged (named, with the field).
        PackMismatchError: another task's file, or another pool set's.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a task's inputs to switch.onnx; export the bundle again)")
    layout = read_header(path, INPUTS_FORMAT)
    data = np.fromfile(path, dtype=np.uint8)
    if len(data) != path.stat().st_size:
        raise FormatError(f"{path}: the file changed while it was read")
    header = nws_header(layout, path, INPUTS_FORMAT, INPUTS_VERSION, hashed_since=1)
    f = Fields(header, path)
    if raw_digest(data, layout) != f.sha("sha256"):
        raise FormatError(f"{path}: tensor bytes do not match the header's sha256 (corrupted)")
    if sha256 is not None and header["sha256"] != sha256:
        raise FormatError(f"{path}: content {header['sha256'][:12]}..., bundle.json records {sha256[:12]}...: the file was replaced")
    if pool_sha256 is not None and f.sha("pool_sha256") != pool_sha256:
        raise PackMismatchError(f"{path}: inputs of pool set {header['pool_sha256'][:12]}..., the bundle's is {pool_sha256[:12]}...")
    if task is not None and f.int("task", lo=0) != task:
        raise PackMismatchError(f"{path}: inputs of task {header['task']}, expected task {task}")
    arrays = {}
    for name, t in layout.tensors.items():
        if t.dtype not in _DTYPES:
            raise FormatError(f"{path}: tensor {name!r} is {t.dtype}; inputs are U8, I32 or F32")
        arrays[name] = data[t.start : t.end].view(_DTYPES[t.dtype]).reshape(t.shape).copy()  # aligned, owned
    out: dict[str, np.ndarray] = {}
    for i, row in enumerate(f.list("layers")):
        r = f.sub(row, f"layers[{i}]")
        name = r.str("name")
        count = r.int("count", lo=0, hi=MAX_KERNELS)
        pool_size = r.int("pool_size", lo=2, hi=MAX_POOL_SIZE)
        parts = {k.rsplit("/", 1)[1]: v for k, v in arrays.items() if k.rsplit("/", 1)[0] == f"indices/{name}"}
        try:
            out[f"indices/{name}"] = unpack_index_planes(parts, count, pool_size)
        except (KeyError, ValueError) as e:
            raise FormatError(f"{path}: field layers[{i}] ({name!r}): {e}") from None
    for key in f.strs("state_keys"):
        if f"state/{key}" not in arrays:
            raise FormatError(f"{path}: field state_keys: no tensor state/{key}")
        out[f"state/{key}"] = arrays[f"state/{key}"]
    return header, out
