"""Indices as the ONNX graphs store them: a low byte plus packed high bit planes.

``task_<t>.onnx`` holds each NWS layer's indices as constants in this layout
and rebuilds ``int32`` indices in the graph (:mod:`nwsconvert.export.onnx_graph`):

* ``low`` (uint8, one byte per index) and, for pools of more than 256 entries,
* ``high``: the ``ceil(log2 n) - 8`` high bits as packed bit planes;
* pools of more than 65,536 entries: plain ``int32``.

numpy only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack_index_planes"]


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
