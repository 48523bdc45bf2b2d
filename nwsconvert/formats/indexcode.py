"""How one layer's indices are stored in a task pack: the smallest of four codings.

``bits``
    fixed width, ``ceil(log2 n)`` bits per index (format version 1, the paper's 9 bits).
``ans``
    static order-0 rANS over the layer's index histogram (table + payload,
    :mod:`nwsconvert.formats.entropy`). Pays when some pool entries are chosen far
    more often than others (early layers, App. F of the paper).
``delta+bits`` / ``delta+ans``
    against a *base* task's indices for the same layer: a map of the positions
    that changed (:mod:`nwsconvert.formats.changemap`; the number of changes
    sits in the layer table) followed by the new indices at those positions,
    fixed width or rANS. Pays when a task keeps most of its base's kernels
    (task t starts from task t-1's kernels, so few change).

The encoder tries every coding that applies and keeps the smallest; decoding
is exact. Sizes count the tensors' bytes (the JSON layer table is extra).
numpy only: the torch-free runtime decodes task packs with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bitpack import pack_bits, packed_size, unpack_bits
from .changemap import MASKS, decode_changes, encode_changes
from .entropy import ans_decode, ans_encode, decode_table, encode_table, entropy_bits

__all__ = ["ANS_SLACK_BYTES", "CODINGS", "EncodedLayer", "encode_indices", "decode_indices"]

CODINGS = ("bits", "ans", "delta+bits", "delta+ans")


@dataclass
class EncodedLayer:
    """One layer's stored indices.

    Attributes:
        coding: one of :data:`CODINGS`.
        tensors: suffix -> ``(M,)`` uint8 array: ``indices`` (bit-packed stream, rANS
            payload, or the change map), ``table`` (rANS tables), ``values`` (delta
            codings: the new indices).
        changes: delta codings: how many positions differ from the base.
        mask: delta codings: the change map's form (:data:`~nwsconvert.formats.changemap.MASKS`;
            ``None`` reads as ``"ans"``, what pack versions 1-3 wrote).
    """

    coding: str
    tensors: dict[str, np.ndarray]
    changes: int | None = None
    mask: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(t.size) for t in self.tensors.values())


def _u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()


def _ints(values) -> np.ndarray:
    """``(N,)`` int64 from an array-like (a CPU torch tensor works), always a new array: callers change it."""
    return np.asarray(values).astype(np.int64).ravel()  # astype copies (copy=True, its default)


def _stream(values: np.ndarray, n: int, bits: int, entropy: bool) -> dict[str, np.ndarray]:
    """Fixed-width or rANS code of ``values`` in ``[0, n)``; suffixes ``indices``/``table``."""
    if not entropy:
        return {"indices": pack_bits(values, bits)}
    symbols, ranks, counts = np.unique(values, return_inverse=True, return_counts=True)
    return {"indices": _u8(ans_encode(ranks, counts)), "table": _u8(encode_table(symbols, counts, n))}


def _unstream(tensors: dict[str, np.ndarray], count: int, n: int, bits: int, entropy: bool) -> np.ndarray:
    if not entropy:
        values = unpack_bits(tensors["indices"], bits, count)
        if values.size and values.max() >= n:  # rANS tables are checked against n when read
            raise ValueError(f"an index >= the pool size {n}")
        return values
    symbols, counts = decode_table(np.asarray(tensors["table"]).tobytes(), n)
    if int(counts.sum()) != count:
        raise ValueError(f"table counts {int(counts.sum())} indices, the layer has {count}")
    return symbols[ans_decode(np.asarray(tensors["indices"]).tobytes(), counts, count)]


#: Bytes by which a rANS stream may come in under its data's order-0 entropy (the coder's initial state
#: carries a few bits for free); :func:`encode_indices` skips ``ans`` only when even its entropy, less this,
#: is larger than a coding it already has.
ANS_SLACK_BYTES = 16


def encode_indices(indices, pool_size: int, bits: int, base=None, codings=CODINGS) -> EncodedLayer:
    """The smallest coding of one layer's indices.

    Only codings that can win are built: ``bits`` has an exact size before packing (built when it is
    not beaten), and ``ans`` is skipped when the stream's order-0 entropy less :data:`ANS_SLACK_BYTES`
    exceeds the smallest coding at hand (no static code beats its data's entropy by more than the
    coder's state). A task's delta codings are usually 30x below either, so a task pack encodes only
    what changed.

    Args:
        indices: ``(N,)`` integers (array or CPU tensor), values in ``[0, pool_size)``.
        pool_size: ``n``, the layer's pool entries.
        bits: fixed width of the ``bits`` coding (``ceil(log2 n)``).
        base: ``(N,)`` indices of the same layer in the base task, or ``None``
            (delta codings are skipped when absent or of another length).
        codings: the codings allowed (default all).

    Returns:
        :class:`EncodedLayer`; ties go to the earlier coding in :data:`CODINGS`.
    """
    values = _ints(indices)
    if values.size and (values.min() < 0 or values.max() >= pool_size):
        raise ValueError(f"indices must lie in [0, {pool_size}), got [{values.min()}, {values.max()}]")
    candidates = []
    ref = _ints(base) if base is not None else None
    if ref is not None and ref.size == values.size and values.size:
        changed = values != ref
        k = int(changed.sum())
        mask = {"indices": _u8(encode_changes(changed, MASKS[0]))}
        for name, entropy in (("delta+bits", False), ("delta+ans", True)):
            if name in codings and (k or not entropy):
                new = _stream(values[changed], pool_size, bits, entropy) if k else {}
                candidates.append(
                    EncodedLayer(
                        name,
                        {**mask, **{("values" if s == "indices" else f"values_{s}"): t for s, t in new.items()}},
                        changes=k,
                        mask=MASKS[0],
                    )
                )
    best = min((e.nbytes for e in candidates), default=None)
    if "bits" in codings and (best is None or packed_size(values.size, bits) <= best):  # ties go to bits
        candidates.append(EncodedLayer("bits", _stream(values, pool_size, bits, False)))
        best = packed_size(values.size, bits)
    if "ans" in codings and values.size:
        floor = entropy_bits(values, pool_size) / 8 - ANS_SLACK_BYTES
        if best is None or floor <= best:
            candidates.append(EncodedLayer("ans", _stream(values, pool_size, bits, True)))
    if not candidates:
        raise ValueError(f"no coding in {codings} applies")
    return min(candidates, key=lambda e: (e.nbytes, CODINGS.index(e.coding)))


def decode_indices(
    encoded: EncodedLayer, count: int, pool_size: int, bits: int, base=None, dtype=np.int64
) -> np.ndarray:
    """Inverse of :func:`encode_indices`: a ``(count,)`` array of ``dtype``.

    Args:
        base: the base task's ``(count,)`` indices, for delta codings (copied in ``dtype``: a base kept in
            a narrow type is never widened).
        dtype: the integer type of the result (default int64; the runtime reads into its kept index type,
            e.g. uint16, sparing a wide copy of every index a switch).

    Raises:
        ValueError: unknown coding, inconsistent data, a delta coding without a base of ``count`` indices,
            or a ``dtype`` that cannot hold an index of a pool of ``pool_size``.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu" or int(np.iinfo(dtype).max) < pool_size - 1:
        raise ValueError(f"indices into a pool of {pool_size} cannot be held as {dtype}")
    coding, t = encoded.coding, encoded.tensors
    if coding in ("bits", "ans"):
        values = _unstream(t, count, pool_size, bits, coding == "ans")
    elif coding in ("delta+bits", "delta+ans"):
        ref = np.asarray(base).astype(dtype).ravel() if base is not None else None  # astype copies
        if ref is None or ref.size != count:
            raise ValueError(f"{coding} indices need the base task's {count} indices")
        k = encoded.changes
        if k is None or not 0 <= k <= count:
            raise ValueError(f"{coding} indices need a change count in [0, {count}], got {k}")
        values = ref  # its own copy: changed in place
        positions = decode_changes(t["indices"], count, k, encoded.mask or "ans")
        if k:
            sub = {
                s.removeprefix("values_") if s != "values" else "indices": v
                for s, v in t.items()
                if s.startswith("values")
            }
            values[positions] = _unstream(sub, k, pool_size, bits, coding == "delta+ans")
    else:
        raise ValueError(f"unknown index coding {coding!r} (this nwsconvert reads {', '.join(CODINGS)})")
    return np.ascontiguousarray(values, dtype=dtype)
