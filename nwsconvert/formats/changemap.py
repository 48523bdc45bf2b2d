"""Which positions of a delta-coded layer changed against its base: the *change map*.

Two forms, named by a delta-coded layer's ``mask`` field in the pack header:

``rice`` (pack version 4 on)
    the gaps between changed positions, Golomb-Rice coded
    (:mod:`nwsconvert.formats.rice`: one byte ``r``, the low bits packed, the
    high parts in unary). Decoding takes time in the number of changes, not
    of positions.
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

from .entropy import ans_decode, ans_encode
from .rice import rice_decode, rice_encode

__all__ = ["MASKS", "encode_changes", "decode_changes"]

MASKS = ("rice", "ans")  # the first is what the encoder writes


def _counts(count: int, k: int) -> np.ndarray:
    return np.array([count - k, k], dtype=np.int64)


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
    return rice_encode(np.diff(positions, prepend=-1) - 1)  # unchanged positions before each change


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
    gaps = rice_decode(raw, k, count - 1, "a change map", f"the layer has {k}")
    positions = np.cumsum(gaps + 1) - 1
    if int(positions[-1]) >= count:
        raise ValueError(f"a change map with a position beyond the layer's {count}")
    return positions
