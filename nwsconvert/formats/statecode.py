"""A task's float16 state stored as its changes against the base pack's state, losslessly.

A task's state (BatchNorm affine parameters and statistics, biases...) takes up to half of a
mobile network's task pack: MobileNetV2 keeps 17,056 BatchNorm channels, 4 float16 values
each (137 KB a task). Each task starts from the state the tasks before it reached, and that
chain starts at the base pack (the model at the end of pool learning), so a task's values sit
near the base's: most differ in the low bits of the float16 pattern only.

An entry is coded as the differences of its float16 bit patterns from the base entry's (the
base's float32 values rounded to float16 first), each pattern read as a monotone integer
(positive floats ascending from 0, negative ones descending from -1), zigzag-mapped
(``0, -1, 1, -2...`` to ``0, 1, 2, 3...``) and Golomb-Rice-coded (:mod:`nwsconvert.formats.rice`).
Entries whose best Rice parameter is the same share one stream (the same bytes as one stream
each, less a byte per entry): a task's few hundred entries decode as a handful of streams, which
keeps a packs-only switch's read short. Decoding gives the task's float16 bit patterns back
exactly: NaN payloads, signed zeros and infinities included. An entry is coded only where that
is smaller than the raw entry.

Bytes on trained runs (``benchmarks/state_bytes.py``, ``benchmarks/RESULTS.md``): a 20-task
MobileNetV2 run keeps 48 % of its state's raw bytes, ResNet-18's demo 67 %.

numpy only: the torch-free runtime reads packs with it.
"""

from __future__ import annotations

import numpy as np

from .rice import rice_decode, rice_encode, rice_parameter, rice_size

__all__ = ["encode_state", "decode_state", "encode_groups", "decode_groups", "predictor"]

_LIMIT = 2 * 65535  # the largest zigzag difference of two 16-bit patterns


def predictor(base) -> np.ndarray | None:
    """The base entry as the float16 bit patterns a task entry is coded against (``(n,)`` uint16),
    or ``None`` when the base entry is not floating point (it cannot serve)."""
    a = np.asarray(base)
    if a.dtype.kind != "f":
        return None
    with np.errstate(over="ignore"):  # a base value beyond float16's range predicts infinity
        return np.ascontiguousarray(a.astype(np.float16, copy=False)).view(np.uint16).ravel()


def _monotone(bits: np.ndarray, dtype=np.int64) -> np.ndarray:
    """float16 bit patterns as integers in value order: ``0x0000..0x7FFF`` -> 0..32767, ``0x8000..0xFFFF`` -> -1..-32768."""
    b = bits.astype(dtype)
    return np.where(b < 0x8000, b, 0x7FFF - b)


def _zigzag(values: np.ndarray, base: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float16).view(np.uint16).ravel()
    if bits.size != base.size or bits.size == 0:
        raise ValueError(f"a state entry of {bits.size} values coded against a base entry of {base.size}")
    d = _monotone(bits) - _monotone(base)
    return np.where(d >= 0, 2 * d, -2 * d - 1)


def encode_state(values: np.ndarray, base: np.ndarray) -> bytes:
    """The coded form of one float16 entry ``values`` against ``base`` (:func:`predictor`'s patterns, same size)."""
    return rice_encode(_zigzag(values, base))


def decode_state(raw: np.ndarray, base: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`encode_state`: the float16 entry of ``shape`` (its size is ``base``'s).

    Raises:
        ValueError: a coded entry that does not hold one difference per base value, or whose
            differences lead outside 16-bit patterns.
    """
    z = rice_decode(raw, base.size, _LIMIT, "a coded state stream", f"its base entries hold {base.size}")
    z = z.astype(np.int32)  # differences within +-65535: int32 arithmetic, half the memory traffic
    m = (z >> 1) ^ -(z & 1)  # zigzag undone
    m += _monotone(base, np.int32)
    if int(m.min()) < -0x8000 or int(m.max()) > 0x7FFF:
        raise ValueError("a coded state stream whose differences lead outside float16's bit patterns")
    np.copyto(m, 0x7FFF - m, where=m < 0)
    return m.astype(np.uint16).view(np.float16).reshape(shape)


def encode_groups(entries: dict[str, np.ndarray], bases: dict[str, np.ndarray]) -> list[tuple[list[str], bytes]]:
    """The entries worth coding, as streams: ``[(keys, bytes), ...]``.

    Args:
        entries: key -> a float16 entry; every key has its :func:`predictor` patterns in ``bases``.

    Returns:
        One stream per Rice parameter in use, its entries in ``entries``' order; an entry whose
        coding (at its best parameter) is not smaller than its raw bytes, and a stream not smaller
        than its entries, are left out (stored raw).
    """
    by_r: dict[int, list[tuple[str, np.ndarray]]] = {}
    for k, v in entries.items():
        z = _zigzag(v, bases[k])
        r = rice_parameter(z)
        if rice_size(z, r) - 1 < 2 * z.size:  # the stream's r byte is shared
            by_r.setdefault(r, []).append((k, z))
    out = []
    for _, group in sorted(by_r.items()):
        z = np.concatenate([z for _, z in group])
        data = rice_encode(z)
        if len(data) < 2 * z.size:  # a stream of one small entry may not pay for its r byte
            out.append(([k for k, _ in group], data))
    return out


def decode_groups(groups: list[list[str]], data: list, bases: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode_groups`: key -> the decoded float16 entry, flat (``(n,)``, ``n`` its base's size).

    Args:
        groups: each stream's keys; data: each stream's bytes (uint8 arrays); bases: key -> :func:`predictor` patterns.

    Raises:
        ValueError: a stream inconsistent with its entries' base sizes.
    """
    out = {}
    for keys, raw in zip(groups, data):
        preds = [bases[k] for k in keys]
        flat = decode_state(np.asarray(raw, dtype=np.uint8), np.concatenate(preds), (-1,))
        for k, piece in zip(keys, np.split(flat, np.cumsum([p.size for p in preds])[:-1])):
            out[k] = piece
    return out
