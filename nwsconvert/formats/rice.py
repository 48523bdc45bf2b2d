"""Golomb-Rice coding of non-negative integers: the coder of change maps and coded state entries.

A stream is one byte ``r``, then every value's low ``r`` bits bit-packed
(:mod:`nwsconvert.formats.bitpack`), then every value's high part ``v >> r`` in
unary (that many 0 bits, then a 1; bits in little-endian order, the last byte
padded with 0 bits). The encoder picks the ``r`` that makes the stream smallest
(the smaller ``r`` on ties), so a stream of values with a geometric-like
distribution lands within a few percent of its entropy.

numpy only: the torch-free runtime reads packs with it.
"""

from __future__ import annotations

import numpy as np

from .bitpack import pack_bits, packed_size, unpack_bits

__all__ = ["rice_encode", "rice_decode", "rice_size", "rice_parameter"]


def rice_size(values: np.ndarray, r: int) -> int:
    """Bytes of the stream of ``values`` (int64, ``>= 0``) at parameter ``r``."""
    return 1 + packed_size(values.size, r) + (int((values >> r).sum()) + values.size + 7) // 8


def rice_parameter(values: np.ndarray) -> int:
    """The ``r`` that makes the stream of ``values`` (int64, ``>= 0``, at least one) smallest (the smaller on ties)."""
    return min(range(int(values.max()).bit_length() + 1), key=lambda b: (rice_size(values, b), b))


def rice_encode(values: np.ndarray) -> bytes:
    """The smallest Rice stream of ``values`` (``(n,)`` integers ``>= 0``, ``n >= 1``)."""
    v = np.asarray(values, dtype=np.int64).ravel()
    if v.size == 0 or int(v.min()) < 0:
        raise ValueError("Rice coding takes one or more non-negative integers")
    r = rice_parameter(v)
    high = v >> r
    unary = np.zeros(int(high.sum()) + v.size, dtype=np.uint8)
    unary[np.cumsum(high + 1) - 1] = 1
    low = pack_bits(v & ((1 << r) - 1), r).tobytes() if r else b""
    return bytes([r]) + low + np.packbits(unary, bitorder="little").tobytes()


def rice_decode(raw: np.ndarray, n: int, limit: int, what: str, expect: str) -> np.ndarray:
    """Inverse of :func:`rice_encode`: the ``(n,)`` values (int64), each at most ``limit``.

    Args:
        raw: the stream (uint8 array).
        n: how many values it must hold (``>= 1``).
        limit: the largest value allowed (a parameter ``r`` above its bit length is refused).
        what, expect: the stream and its expected count in words, for the error messages
            (``"a change map"``, ``"the layer has 5"``).

    Raises:
        ValueError: a stream that does not hold exactly ``n`` values, each at most ``limit``,
            with no bytes after them.
    """
    if n < 1:
        raise ValueError(f"{what} where no value is expected; {expect}")
    if raw.size == 0:
        raise ValueError(f"{what} that is empty")
    r = int(raw[0])
    if r > limit.bit_length():
        raise ValueError(f"{what} whose Rice parameter {r} exceeds its values' largest, {limit}")
    n_low = packed_size(n, r) if r else 0
    if raw.size < 1 + n_low:
        raise ValueError(f"{what} of {raw.size} bytes cannot hold {n} low parts of {r} bits")
    low = unpack_bits(raw[1 : 1 + n_low], r, n) if r else np.zeros(n, dtype=np.int64)
    ends = np.flatnonzero(np.unpackbits(raw[1 + n_low :], bitorder="little"))
    if ends.size != n or raw.size - 1 - n_low != int(ends[-1]) // 8 + 1:
        raise ValueError(f"{what} holding {ends.size} values, or bytes after them; {expect}")
    high = np.diff(ends, prepend=-1) - 1
    if int(high.max()) > limit >> r:  # and so no overflow below
        raise ValueError(f"{what} with a value beyond {limit}")
    values = (high << r) + low
    if int(values.max()) > limit:
        raise ValueError(f"{what} with a value beyond {limit}")
    return values
