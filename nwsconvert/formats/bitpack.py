"""Fixed-width bit packing of index streams (little-endian bit order). numpy only: the
torch-free runtime decodes task packs with it."""

from __future__ import annotations

import numpy as np

__all__ = ["pack_bits", "unpack_bits", "packed_size"]


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for ``count`` values of ``bits`` bits."""
    return (count * bits + 7) // 8


def pack_bits(values, bits: int) -> np.ndarray:
    """Pack non-negative integers below ``2**bits`` into bytes.

    Args:
        values: ``(N,)`` integers (array-like; a CPU torch tensor works), every value in ``[0, 2**bits)``.
        bits: 1..32.

    Returns:
        ``(ceil(N * bits / 8),)`` uint8: value i occupies bits ``[i*bits, (i+1)*bits)``
        of the stream, least significant bit first.
    """
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in 1..32, got {bits}")
    v = np.asarray(values).astype(np.int64).ravel()
    if v.size and (v.min() < 0 or v.max() >= (1 << bits)):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack in {bits} bits, got [{v.min()}, {v.max()}]")
    planes = ((v[:, None] >> np.arange(bits, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(planes.ravel(), bitorder="little")


def unpack_bits(data, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`.

    Args:
        data: ``(M,)`` uint8 with ``M == packed_size(count, bits)``.

    Returns:
        ``(count,)`` int64.
    """
    raw = np.asarray(data).astype(np.uint8, copy=False).ravel()
    if raw.size != packed_size(count, bits):
        raise ValueError(
            f"{raw.size} bytes cannot hold exactly {count} values of {bits} bits ({packed_size(count, bits)} needed)"
        )
    planes = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    out = np.zeros(count, dtype=np.int64)
    for j in range(bits):  # one vector op per bit plane
        out |= planes[:, j].astype(np.int64) << j
    return out
