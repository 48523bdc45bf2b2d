"""A task's float16 state stored as its changes against the base pack's state, losslessly.

A task's state (BatchNorm affine parameters and statistics, biases...) takes up to half of a
mobile network's task pack: MobileNetV2 keeps 17,056 BatchNorm channels, 4 float16 values
each (133 KB a task). Each task starts from the state the tasks before it reached, and that
chain starts at the base pack (the model at the end of pool learning), so a task's values sit
near the base's: most differ in the low bits of the float16 pattern only.

An entry is coded as the differences of its float16 bit patterns from the base entry's (the
base's float32 values rounded to float16 first), each pattern read as a monotone integer
(positive floats ascending from 0, negative ones descending from -1), zigzag-mapped
(``0, -1, 1, -2...`` to ``0, 1, 2, 3...``) and Rice-coded (:mod:`nwsconvert.formats.rice`).
Decoding gives the task's float16 bit patterns back exactly: NaN payloads, signed zeros and
infinities included. A pack keeps the coding only where it is smaller than the raw entry.

Bytes on trained runs (:mod:`benchmarks.state_bytes`, ``benchmarks/RESULTS.md``): ResNet-18's
demo tasks keep 67 % of their state's raw bytes.

numpy only: the torch-free runtime reads packs with it.
"""

from __future__ import annotations

import numpy as np

from .rice import rice_decode, rice_encode

__all__ = ["encode_state", "decode_state", "predictor"]

_LIMIT = 2 * 65535  # the largest zigzag difference of two 16-bit patterns


def predictor(base) -> np.ndarray | None:
    """The base entry as the float16 bit patterns a task entry is coded against (``(n,)`` uint16),
    or ``None`` when the base entry is not floating point (it cannot serve)."""
    a = np.asarray(base)
    if a.dtype.kind != "f":
        return None
    with np.errstate(over="ignore"):  # a base value beyond float16's range predicts infinity
        return np.ascontiguousarray(a.astype(np.float16, copy=False)).view(np.uint16).ravel()


def _monotone(bits: np.ndarray) -> np.ndarray:
    b = bits.astype(np.int64)
    return np.where(b < 0x8000, b, 0x7FFF - b)


def encode_state(values: np.ndarray, base: np.ndarray) -> bytes:
    """The coded form of a float16 entry ``values`` against ``base`` (:func:`predictor`'s patterns, same size)."""
    bits = np.ascontiguousarray(values, dtype=np.float16).view(np.uint16).ravel()
    if bits.size != base.size or bits.size == 0:
        raise ValueError(f"a state entry of {bits.size} values coded against a base entry of {base.size}")
    d = _monotone(bits) - _monotone(base)
    return rice_encode(np.where(d >= 0, 2 * d, -2 * d - 1))


def decode_state(raw: np.ndarray, base: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`encode_state`: the float16 entry of ``shape`` (its size is ``base``'s).

    Raises:
        ValueError: a coded entry that does not hold one difference per base value, or whose
            differences lead outside 16-bit patterns.
    """
    z = rice_decode(raw, base.size, _LIMIT, "a coded state entry", f"its base entry has {base.size}")
    m = _monotone(base) + np.where(z & 1, -(z >> 1) - 1, z >> 1)
    if int(m.min()) < -0x8000 or int(m.max()) > 0x7FFF:
        raise ValueError("a coded state entry whose differences lead outside float16's bit patterns")
    bits = np.where(m >= 0, m, 0x7FFF - m).astype(np.uint16)
    return bits.view(np.float16).reshape(shape)
