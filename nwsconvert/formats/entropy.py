"""Static order-0 entropy coding of integer streams (rANS, via ``constriction``).

A stream of ``N`` symbols from ``[0, n)`` is stored as

* a **table**: which symbols occur and how often (bytes, see :func:`encode_table`);
* a **payload**: the rANS code of the stream under the table's distribution,
  as little-endian 32-bit words.

The coder is ``constriction``'s ``AnsCoder`` (64-bit state, 32-bit words,
24-bit probabilities, implemented in Rust). The probabilities it receives are
computed here with integer arithmetic (:func:`quantize`): every symbol that
occurs gets a frequency of at least 1 out of ``2**24`` and the frequencies sum
to exactly ``2**24``, so the float64 probabilities handed to the coder are
exact dyadic numbers and encoder and decoder build the same model on every
machine. Symbols that do not occur are not in the model at all (they cost
nothing); the stream is coded as ranks among the occurring symbols.

The payload is within a few bytes of ``-sum log2(freq / 2**24)``; rounding the
probabilities to 24 bits costs under 0.1 % against the order-0 empirical
entropy :func:`entropy_bits` (checked in ``tests/test_indexcode.py``), so the
table is the only real overhead.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "PRECISION",
    "entropy_bits",
    "quantize",
    "encode_table",
    "decode_table",
    "ans_encode",
    "ans_decode",
    "encode_varints",
    "decode_varints",
]

PRECISION = 24  # bits of the coder's fixed-point probabilities


def entropy_bits(values: np.ndarray, minlength: int = 0) -> float:
    """Order-0 empirical entropy of ``values`` in bits, times their count.

    This is the size, in bits, that any static per-stream code (ignoring the
    cost of describing its table) cannot beat: ``-sum_u h_u log2(h_u / N)``.
    """
    values = np.asarray(values).ravel()
    if values.size == 0:
        return 0.0
    h = np.bincount(values, minlength=minlength)
    h = h[h > 0].astype(np.float64)
    return float(-(h * np.log2(h / values.size)).sum())


def quantize(counts: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to ``2**PRECISION``, each >= 1, proportional to ``counts``.

    Args:
        counts: ``(k,)`` positive integers, ``1 <= k <= 2**PRECISION``.

    Returns:
        ``(k,)`` int64. Deterministic (integer arithmetic only): rounding
        ``counts * 2**P / N`` down, raising zeros to 1, then giving the
        remainder to (or taking the excess from) the most frequent symbols.
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = 1 << PRECISION
    if counts.ndim != 1 or counts.size == 0 or (counts <= 0).any() or counts.size > total:
        raise ValueError("quantize needs 1..2**24 positive counts")
    freq = np.maximum(1, counts * total // int(counts.sum()))
    diff = total - int(freq.sum())
    order = np.argsort(-counts, kind="stable")
    i = 0
    while diff != 0:  # a handful of passes at most: every step moves the sum towards 2**P
        j = order[i % counts.size]
        step = diff if diff > 0 else -min(-diff, int(freq[j]) - 1)
        freq[j] += step
        diff -= step
        i += 1
    return freq


def encode_varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128: 7 bits per byte, high bit set on every byte but the last of a value."""
    out = bytearray()
    for v in np.asarray(values, dtype=np.int64).ravel().tolist():
        if v < 0:
            raise ValueError(f"varints are unsigned, got {v}")
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def decode_varints(data: bytes, count: int, pos: int = 0) -> tuple[np.ndarray, int]:
    """Read ``count`` LEB128 values from ``data[pos:]``; returns ``(values (count,) int64, next position)``."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), pos
    buf = np.frombuffer(data, dtype=np.uint8)[pos:]
    ends = np.flatnonzero(buf < 0x80)[:count]  # last byte of each value
    if ends.size < count:
        raise ValueError("truncated varint table")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 9:
        raise ValueError("varint longer than 63 bits")
    stop = int(ends[-1]) + 1
    digit = np.arange(stop) - np.repeat(starts, lengths)  # 7-bit digit number within its value
    parts = (buf[:stop].astype(np.int64) & 0x7F) << (7 * digit)
    return np.add.reduceat(parts, starts), pos + stop


def encode_table(symbols: np.ndarray, counts: np.ndarray, n: int) -> bytes:
    """Describe which of ``n`` symbols occur (ascending ``symbols``) and their ``counts``.

    Layout: ``varint k``, one byte ``0`` + an ``n``-bit presence bitmap or ``1`` +
    ``k`` varint gaps between consecutive symbols (whichever is shorter), then
    ``k`` varint counts.
    """
    symbols = np.asarray(symbols, dtype=np.int64)
    gaps = encode_varints(np.diff(symbols, prepend=0))
    bitmap = np.zeros(n, dtype=np.uint8)
    bitmap[symbols] = 1
    bitmap = np.packbits(bitmap, bitorder="little").tobytes()
    which = b"\x01" + gaps if len(gaps) < len(bitmap) else b"\x00" + bitmap
    return encode_varints([symbols.size]) + which + encode_varints(counts)


def decode_table(data: bytes, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_table`: ``(symbols (k,), counts (k,))`` int64."""
    (k,), pos = decode_varints(data, 1)
    if pos >= len(data):
        raise ValueError("truncated table")
    kind, pos = data[pos], pos + 1
    if kind == 0:
        size = (n + 7) // 8
        bits = np.unpackbits(np.frombuffer(data[pos : pos + size], dtype=np.uint8), count=n, bitorder="little")
        symbols, pos = np.flatnonzero(bits).astype(np.int64), pos + size
    elif kind == 1:
        gaps, pos = decode_varints(data, int(k), pos)
        symbols = np.cumsum(gaps)
    else:
        raise ValueError(f"unknown table kind {kind}")
    if symbols.size != k or (symbols.size and (symbols[-1] >= n or (np.diff(symbols) <= 0).any())):
        raise ValueError("inconsistent table")
    counts, pos = decode_varints(data, int(k), pos)
    if pos != len(data) or (counts <= 0).any():
        raise ValueError("inconsistent table")
    return symbols, counts


def _model(counts: np.ndarray):
    import constriction  # submodules are attributes of the extension, not importable modules

    return constriction.stream.model.Categorical(
        quantize(counts).astype(np.float64) / float(1 << PRECISION), perfect=False
    )


def ans_encode(ranks: np.ndarray, counts: np.ndarray) -> bytes:
    """rANS-code ``ranks`` (values in ``[0, k)``) under the distribution ``counts`` ``(k,)``.

    Returns the payload: little-endian uint32 words (empty when ``k == 1``:
    a stream of one symbol carries no information).
    """
    if len(counts) <= 1 or len(ranks) == 0:
        return b""
    import constriction

    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(np.ascontiguousarray(ranks, dtype=np.int32), _model(counts))
    return coder.get_compressed().astype("<u4").tobytes()


def ans_decode(payload: bytes, counts: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`ans_encode`: ``(count,)`` integer ranks (int32, or int64 when trivial)."""
    if len(counts) <= 1 or count == 0:
        return np.zeros(count, dtype=np.int64)
    if len(payload) % 4:
        raise ValueError(f"rANS payload of {len(payload)} bytes is not whole 32-bit words")
    import constriction

    coder = constriction.stream.stack.AnsCoder(np.frombuffer(payload, dtype="<u4").astype(np.uint32, copy=False))
    ranks = coder.decode(_model(counts), count)
    if not coder.is_empty():
        raise ValueError("rANS payload has data left after the last symbol")
    return ranks
