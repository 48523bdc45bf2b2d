"""The change map of delta-coded layers: Rice-coded gaps (pack version 4), rANS per position (versions 1-3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nwsconvert as nc
from nwsconvert.formats.changemap import MASKS, decode_changes, encode_changes
from nwsconvert.formats.entropy import ans_decode
from nwsconvert.formats.indexcode import decode_indices, encode_indices
from nwsconvert.formats.packfile import PACK_VERSION
from nwsconvert.formats.storage import read_tensors, write_tensors


def _binary_entropy_bytes(count: int, k: int) -> float:
    p = k / count
    return count * -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) / 8


def _maps():
    rng = np.random.default_rng(3)
    for count in (1, 2, 9, 64, 1000, 40_000):
        for share in (0.0, 0.0005, 0.01, 0.2, 0.5, 0.97, 1.0):
            yield rng.random(count) < share
    clustered = np.zeros(50_000, bool)  # runs of changes, as trained tasks make them
    for start in rng.integers(0, 49_000, 40):
        clustered[start : start + rng.integers(1, 300)] = True
    yield clustered
    yield np.eye(1, 70_000, 69_999, dtype=bool)[0]  # one change, at the very end
    yield np.eye(1, 70_000, 0, dtype=bool)[0]


@pytest.mark.parametrize("mask", MASKS)
def test_every_map_round_trips_to_its_positions(mask):
    for changed in _maps():
        data = encode_changes(changed, mask)
        k = int(changed.sum())
        assert (len(data) == 0) == (k in (0, changed.size))
        got = decode_changes(data, changed.size, k, mask)
        assert got.dtype == np.int64 and np.array_equal(got, np.flatnonzero(changed))
        assert np.array_equal(decode_changes(np.frombuffer(data, np.uint8), changed.size, k, mask), got)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=3000), st.sampled_from(MASKS))
def test_any_map_round_trips_and_any_cut_or_extended_map_is_refused(bits, mask):
    """Any change pattern decodes to its positions; a Rice map cut by its last byte, or given one more (zero
    padding, or one more unary end), is refused with ValueError, never decoded to other positions."""
    changed = np.array(bits)
    k = int(changed.sum())
    data = encode_changes(changed, mask)
    assert np.array_equal(decode_changes(data, changed.size, k, mask), np.flatnonzero(changed))
    if mask == "rice" and data:
        for bad in (data[:-1], data + b"\0", data + b"\x80"):
            try:
                got = decode_changes(bad, changed.size, k, mask)
            except ValueError:
                continue
            raise AssertionError(f"{len(bad)} bytes decoded to {got[:5]} without an error")


def test_rice_maps_stay_near_the_binary_entropy():
    """Golomb-Rice with the best parameter is within a few percent of a geometric source's entropy (measured
    here under 1.6 %); on independent changes the rice map stays within 2 % (+ the parameter byte and the last
    byte's padding) of ``count * H(k / count)``, the least any code of independent positions spends."""
    rng = np.random.default_rng(1)
    for count in (20_000, 262_144):
        for share in (0.001, 0.01, 0.025, 0.1, 0.3, 0.5):
            changed = rng.random(count) < share
            bound = _binary_entropy_bytes(count, int(changed.sum()))
            assert len(encode_changes(changed)) <= bound * 1.02 + 2


def test_damaged_rice_maps_are_refused():
    changed = np.zeros(5000, bool)
    changed[[3, 40, 41, 900, 4999]] = True
    data = encode_changes(changed)
    count, k = changed.size, 5
    for bad, match in (
        (data[:-1], "holding"),  # the last change's unary bit gone
        (data + b"\0", "bytes after"),
        (data + b"\1", "holding"),
        (b"", "empty"),
        (bytes([40]) + data[1:], "Rice parameter 40"),
        (bytes([data[0] + 2]) + data[1:], "cannot hold|holding|beyond"),
    ):
        with pytest.raises(ValueError, match=match):
            decode_changes(bad, count, k)
    with pytest.raises(ValueError, match="the layer has 4"):
        decode_changes(data, count, 4)
    with pytest.raises(ValueError, match="beyond"):
        decode_changes(data, 4999, 5)  # the last position is past a shorter layer
    with pytest.raises(ValueError, match="none needed"):
        decode_changes(b"\0", count, 0)
    with pytest.raises(ValueError, match="unknown change map 'gaps'"):
        decode_changes(data, count, k, "gaps")
    old = encode_changes(changed, "ans")  # a rANS map of 5 changes read as 4: refused, never broadcast
    with pytest.raises(ValueError, match="the layer has 4|data left after the last symbol"):
        decode_changes(old, count, 4, "ans")


def test_the_encoder_writes_rice_maps_and_reads_maps_of_both_forms():
    n, bits = 512, 9
    rng = np.random.default_rng(4)
    base = rng.integers(0, n, 30_000)
    idx = base.copy()
    idx[rng.random(base.size) < 0.02] = rng.integers(0, n, 1)
    e = encode_indices(idx, n, bits, base)
    assert e.coding.startswith("delta") and e.mask == "rice"
    assert np.array_equal(decode_indices(e, idx.size, n, bits, base), idx)
    # The same layer as versions 1-3 stored it: a rANS map (mask None reads as "ans").
    changed = idx != base
    old = type(e)(
        e.coding, {**e.tensors, "indices": np.frombuffer(encode_changes(changed, "ans"), np.uint8)}, e.changes
    )
    assert np.array_equal(decode_indices(old, idx.size, n, bits, base), idx)
    assert np.array_equal(
        ans_decode(old.tensors["indices"].tobytes(), np.array([idx.size - e.changes, e.changes]), idx.size),
        changed.astype(np.int32),
    )


def _pack(base=None, seed=0):
    count, n = 20_000, 256
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (count,), generator=gen)
    if base is not None:
        idx = base.indices["l"].clone()
        moved = torch.rand(count, generator=gen) < 0.01
        idx[moved] = torch.randint(0, n, (int(moved.sum()),), generator=gen)
    row = {"name": "l", "pool": "l", "shape": [count, 1, 1, 1], "groups": 1, "vector_size": 1, "pool_size": n}
    row.update(bits=8, count=count, role="body")
    return nc.TaskPack(
        layers=[row],
        indices={"l": idx},
        state={"bn.weight": torch.ones(3)},
        pool_sha256="b" * 64,
        num_classes=None,
        model_spec="hand",
        meta={},
        base=base,
    )


def test_packs_name_their_map_and_version_3_packs_with_rans_maps_still_load(tmp_path):
    base = _pack()
    base.save(tmp_path / "base.nwspack")
    task = _pack(base, seed=1)
    task.save(tmp_path / "task.nwspack")
    tensors, header = read_tensors(tmp_path / "task.nwspack", "nwsconvert.taskpack", PACK_VERSION)
    (row,) = header["layers"]
    assert header["version"] == PACK_VERSION >= 4 and row["coding"].startswith("delta") and row["mask"] == "rice"
    # Rewritten as a version 3 pack: its map in rANS, and the row naming no map (what versions 1-3 wrote).
    changed = (task.indices["l"] != base.indices["l"]).numpy()
    tensors["indices/l"] = torch.from_numpy(np.frombuffer(encode_changes(changed, "ans"), np.uint8).copy())
    del row["mask"]
    fields = {k: v for k, v in header.items() if k not in ("format", "version", "sha256", "header_sha256")}
    write_tensors(tmp_path / "v3.nwspack", tensors, "nwsconvert.taskpack", 3, **fields)
    loaded = nc.TaskPack.load(tmp_path / "v3.nwspack")
    assert torch.equal(loaded.indices["l"], task.indices["l"])
    assert loaded.content_sha256() == task.content_sha256()
    # A version 4 row naming a map the file does not hold is refused, naming the file.
    row["mask"] = "rice"
    write_tensors(tmp_path / "lies.nwspack", tensors, "nwsconvert.taskpack", 4, **fields)
    with pytest.raises(nc.FormatError, match=r"lies\.nwspack"):
        nc.TaskPack.load(tmp_path / "lies.nwspack")
    row["mask"] = "gaps"
    write_tensors(tmp_path / "odd.nwspack", tensors, "nwsconvert.taskpack", 4, **fields)
    with pytest.raises(nc.FormatError, match=r"odd\.nwspack.*mask.*'rice', 'ans'"):
        nc.TaskPack.load(tmp_path / "odd.nwspack")
