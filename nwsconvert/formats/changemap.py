"""Which positions of a delta-coded layer changed against its base: the *change map*.

Two forms, named by a delta-coded layer's ``mask`` field in the pack header:

``rice`` (pack version 4 on)
    the gaps between changed positions, Golomb-Rice coded: one byte ``r``, then
    each gap's low ``r`` bits bit-packed (:mod:`nwsconvert.formats.bitpack`),
    then each gap's high part in unary (that many 0 bits, then a 1; bits in
    little-endian order, the last byte padded with 0 bits). The encoder picks
    the ``r`` that makes the map smallest. Decoding takes time in the number
    of changes, not of positions.
``ans`` (pack versions 1-3; read, no longer written)
    one symbol per position under a two-symbol rANS model whose only parameter
    is the number of changes (:func:`nwsconvert.formats.entropy.ans_decode`).
    Decoding walks every position: an EfficientNet-B0 task has 945,000
    positions, 1.2 % of them changed.

Bytes: on trained MobileNetV3-small and EfficientNet-B0 runs (20 tasks each)
the Rice maps came out 0.3 % smaller to 0.1 % larger than the rANS ones, and
within 2 % of the binary entropy on independent changes
(``tests/test_changemap.py``). A packs-only switch of EfficientNet-B0 went
from 25.7 to 20.2 ms (``benchmarks/RESULTS.md``).

A map is empty when no position or every position changed (the count says
which). numpy only: the torch-free runtime reads packs with it.
"""

from __future__ import annotations

import numpy as np

from .bitpack import pack_bits, packed_size, unpack_bits
from .entropy import ans_decode, ans_encode

__all__ = ["MASKS", "encode_changes", "decode_changes"]

MASKS = ("rice", "ans")  # the first is what the encoder writes


def _counts(count: int, k: int) -> np.ndarray:
    return np.array([count - k, k], dtype=np.int64)


def _rice_size(gaps: np.ndarray, r: int) -> int:
    return 1 + packed_size(gaps.size, r) + (int((gaps >> r).sum()) + gaps.size + 7) // 8


def encode_changes(changed: np.ndarray, mask: str = "rice") -> bytes:
    """The change map of ``changed`` (``(count,)`` bool, True where the index differs from the base)."""
    count, positions = changed.size, np.flatnonzero(changed)
    k = positions.size
    if k in (0, count):
        return b""
    if mask == "ans":
        return ans_encode(changed.astype(np.int64), _counts(count, k))
    if mask != "rice":
        raise ValueError(f"unknown change map {mask!r} (one of {', '.join(MASKS)})")
    gaps = np.diff(positions, prepend=-1) - 1  # unchanged positions before each change
    r = min(range(int(gaps.max()).bit_length() + 1), key=lambda b: (_rice_size(gaps, b), b))
    high = gaps >> r
    unary = np.zeros(int(high.sum()) + k, dtype=np.uint8)
    unary[np.cumsum(high + 1) - 1] = 1
    low = pack_bits(gaps & ((1 << r) - 1), r).tobytes() if r else b""
    return bytes([r]) + low + np.packbits(unary, bitorder="little").tobytes()


def decode_changes(data, count: int, k: int, mask: str = "rice") -> np.ndarray:
    """Inverse of :func:`encode_changes`: the ``(k,)`` changed positions, ascending, int64.

    Args:
        data: the map's bytes (``bytes`` or a uint8 array).
        count: the layer's positions.
        k: how many changed (the layer's ``changes``), ``0 <= k <= count``.

    Raises:
        ValueError: a map inconsistent with ``count`` and ``k``.
    """
    raw = np.asarray(np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data, dtype=np.uint8)
    if k in (0, count):
        if raw.size:
            raise ValueError(f"a change map of {raw.size} bytes where {k} of {count} positions changed (none needed)")
        return np.arange(count if k else 0, dtype=np.int64)
    if mask == "ans":
        positions = np.flatnonzero(ans_decode(raw.tobytes(), _counts(count, k), count))
        if positions.size != k:
            raise ValueError(f"a change map holding {positions.size} changes; the layer has {k}")
        return positions
    if mask != "rice":
        raise ValueError(f"unknown change map {mask!r} (this nwsconvert reads {', '.join(MASKS)})")
    if raw.size == 0:
        raise ValueError("an empty change map")
    r = int(raw[0])
    if r > count.bit_length():
        raise ValueError(f"a change map whose Rice parameter {r} exceeds the layer's {count} positions")
    n_low = packed_size(k, r) if r else 0
    if raw.size < 1 + n_low:
        raise ValueError(f"a change map of {raw.size} bytes cannot hold {k} low parts of {r} bits")
    low = unpack_bits(raw[1 : 1 + n_low], r, k) if r else np.zeros(k, dtype=np.int64)
    ends = np.flatnonzero(np.unpackbits(raw[1 + n_low :], bitorder="little"))
    if ends.size != k or raw.size - 1 - n_low != int(ends[-1]) // 8 + 1:
        raise ValueError(f"a change map holding {ends.size} changes, or bytes after them; the layer has {k}")
    high = np.diff(ends, prepend=-1) - 1
    if int(high.max()) > count >> r:  # and so no overflow below
        raise ValueError(f"a change map with a gap beyond the layer's {count} positions")
    positions = np.cumsum((high << r) + low + 1) - 1
    if int(positions[-1]) >= count:
        raise ValueError(f"a change map with a position beyond the layer's {count}")
    return positions
