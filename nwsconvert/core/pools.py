"""Pool sets: one frozen pool of kernels per NWS layer, shared by every task.

A :class:`PoolSet` maps layer names to ``(n, D)`` pool tensors. It is saved
as one safetensors file whose JSON header holds the format version, the layer
table and the SHA-256 of the content; task packs refer to a pool set by that
hash.

Initialisers (:func:`init_pool`):

* ``"random"``: Gaussian entries with the per-component mean and standard
  deviation of the layer's own kernels (not N(0, 1) regardless of scale).
* ``"kmeans"``: k-means++ seeding and Lloyd iterations over the layer's own
  kernels; a pretrained checkpoint gets useful pools in seconds.
* a :class:`PoolSet` or a pool file path: taken as stored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..formats.limits import MAX_POOL_SIZE, MAX_VECTOR_SIZE
from ..formats.schema import Fields
from ..formats.storage import FLOAT_DTYPES, FormatError, read_tensors, tensor_digest, write_tensors
from .kmeans import kmeans

__all__ = ["PoolSet", "init_pool", "POOLSET_FORMAT", "POOLSET_VERSION", "POOL_DTYPES"]

POOLSET_FORMAT = "nwsconvert.poolset"
POOLSET_VERSION = 2  # 2: the header carries header_sha256; version 1 files still load

#: ``pool_dtype`` name -> the dtype a pool file stores pools in.
POOL_DTYPES = FLOAT_DTYPES


def init_pool(
    vectors: torch.Tensor, pool_size: int, method: str, generator: torch.Generator, kmeans_iters: int = 3
) -> torch.Tensor:
    """A new pool for one layer.

    Args:
        vectors: ``(N, D)`` the layer's kernels.
        pool_size: n.
        method: ``"random"`` or ``"kmeans"``.
        kmeans_iters: Lloyd iterations for ``"kmeans"``.

    Returns:
        ``(n, D)`` float32 pool on ``vectors``' device.
    """
    vectors = vectors.detach().float()
    if method == "kmeans":
        return kmeans(vectors, pool_size, iters=kmeans_iters, generator=generator)
    if method == "random":
        mean = vectors.mean(0)
        std = vectors.std(0, unbiased=False) if vectors.shape[0] > 1 else vectors.abs().mean(0)
        noise = torch.randn(pool_size, vectors.shape[1], generator=generator).to(vectors.device)
        return mean + noise * std.clamp_min(1e-8)
    raise ValueError(f"unknown pool initialisation {method!r}: use 'kmeans', 'random', a PoolSet or a pool file path")


@dataclass
class PoolSet:
    """Pools of every NWS layer of a model.

    Attributes:
        pools: layer name -> ``(n, D)`` float tensor.
    """

    pools: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """Content hash; task packs record it and refuse other pool sets."""
        return tensor_digest(self.pools)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    def __len__(self) -> int:
        return len(self.pools)

    def __contains__(self, name: str) -> bool:
        return name in self.pools

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.pools[name]

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the pools (``None`` for an empty set)."""
        return next(iter(self.pools.values())).dtype if self.pools else None

    def astype(self, dtype: torch.dtype) -> PoolSet:
        """The pools cast to ``dtype`` (a new set). ``float16`` halves the pool file; every
        value must stay finite there.

        Raises:
            ValueError: a pool has a value that ``dtype`` cannot hold (names the layer).
        """
        out = {}
        for name, p in self.pools.items():
            q = p.to(dtype)
            if not bool(torch.isfinite(q).eq(torch.isfinite(p)).all()):
                raise ValueError(f"pool of layer {name!r}: values beyond {dtype}'s range, keep pool_dtype=float32")
            out[name] = q
        return PoolSet(out)

    def table(self) -> list[dict]:
        return [{"name": k, "pool_size": v.shape[0], "vector_size": v.shape[1]} for k, v in self.pools.items()]

    def save(self, path: str | os.PathLike) -> str:
        """Write the pool file atomically. Returns its SHA-256."""
        return write_tensors(path, self.pools, POOLSET_FORMAT, POOLSET_VERSION, layers=self.table())

    @classmethod
    def load(cls, path: str | os.PathLike) -> PoolSet:
        """Read a pool file.

        Raises:
            FileNotFoundError: no such file.
            FormatError: truncated, corrupted or foreign file, or a layer table that
                does not describe the file's tensors (the message names the file and field).
        """
        tensors, header = read_tensors(path, POOLSET_FORMAT, POOLSET_VERSION, hashed_since=2, check=_check_header)
        return cls({row["name"]: tensors[row["name"]] for row in header["layers"]})


def _check_header(header: dict, layout, path) -> None:
    """Every layer row names one float tensor of ``(pool_size, vector_size)`` and every tensor has a row."""
    f = Fields(header, path)
    rows = f.list("layers")
    names = []
    for i, row in enumerate(rows):
        r = f.sub(row, f"layers[{i}]")
        name = r.str("name")
        n = r.int("pool_size", lo=1, hi=MAX_POOL_SIZE)
        d = r.int("vector_size", lo=1, hi=MAX_VECTOR_SIZE)
        info = layout.tensors.get(name)
        if info is None:
            raise FormatError(f"{f.file}: field layers[{i}].name: layer {name!r} has no tensor in the file")
        if info.dtype not in ("F32", "F16", "BF16", "F64") or info.shape != (n, d):
            raise FormatError(
                f"{f.file}: tensor {name!r} is {info.dtype} {list(info.shape)}, its layer row says float ({n}, {d})"
            )
        names.append(name)
    if len(set(names)) != len(names):
        raise FormatError(f"{f.file}: field layers: a layer is listed twice")
    extra = sorted(set(layout.tensors) - set(names))
    if extra:
        raise FormatError(f"{f.file}: tensors {extra[:3]} are not in the layer table")
