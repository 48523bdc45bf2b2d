"""A task's float16 state stored as changes against the base pack's (pack version 5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nwsconvert as nc
from nwsconvert.formats.packfile import PACK_FORMAT, PACK_VERSION, read_pack_arrays
from nwsconvert.formats.statecode import decode_groups, decode_state, encode_groups, encode_state, predictor
from nwsconvert.formats.storage import read_tensors, write_tensors

# every float16 pattern class: zeros of both signs, subnormals, the extremes, infinities, NaNs with payloads
SPECIAL = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=300),
    st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=300),
)
def test_any_float16_patterns_round_trip_against_any_base(values, base):
    """Every 16-bit pattern, NaN payloads and signed zeros included, comes back exactly, whatever the base."""
    n = min(len(values), len(base))
    x = np.array(values[:n], dtype=np.uint16).view(np.float16)
    ref = np.array(base[:n], dtype=np.uint16)
    out = decode_state(np.frombuffer(encode_state(x, ref), np.uint8), ref, (n,))
    assert out.dtype == np.float16 and np.array_equal(out.view(np.uint16), x.view(np.uint16))


def test_extremes_round_trip_and_a_base_in_float32_is_rounded_to_float16_first():
    x = SPECIAL.astype(np.uint16).view(np.float16)
    ref = SPECIAL[::-1].astype(np.uint16).copy()  # the largest differences: +0 against a NaN, -inf against +inf
    assert np.array_equal(
        decode_state(np.frombuffer(encode_state(x, ref), np.uint8), ref, x.shape).view(np.uint16), x.view(np.uint16)
    )
    base32 = np.array([1.0, 1.0001, -3.5, 7e4], dtype=np.float32)  # 7e4 rounds to float16's inf
    with np.errstate(over="ignore"):
        assert np.array_equal(predictor(base32), base32.astype(np.float16).view(np.uint16))
    assert predictor(np.arange(3)) is None  # an integer entry cannot serve


def test_values_near_the_base_cost_a_few_bits_each():
    """A trained BatchNorm moves its values a little: the coded entry is a fraction of the raw one."""
    rng = np.random.default_rng(0)
    base = rng.normal(1.0, 0.2, 4096).astype(np.float32)
    task = (base * (1 + rng.normal(0, 1e-3, base.size))).astype(np.float16)
    coded = encode_state(task, predictor(base))
    assert len(coded) < 0.4 * task.nbytes  # ~1e-3 relative: differences of a few units in the last place


def test_damaged_coded_entries_are_refused():
    rng = np.random.default_rng(1)
    ref = predictor(rng.normal(size=500).astype(np.float32))
    x = (ref.view(np.float16) + np.float16(0.01)).astype(np.float16)
    data = encode_state(x, ref)
    for bad, match in (
        (data[:-1], "holding"),
        (data + b"\0", "bytes after"),
        (b"", "empty"),
        (bytes([40]) + data[1:], "Rice parameter 40"),
    ):
        with pytest.raises(ValueError, match=match):
            decode_state(np.frombuffer(bad, np.uint8), ref, ref.shape)
    with pytest.raises(ValueError, match="no value is expected"):  # a header listing an entry its base holds empty
        decode_state(np.frombuffer(data, np.uint8), ref[:0], (0,))
    with pytest.raises(ValueError, match="base entries hold 499"):
        decode_state(np.frombuffer(data, np.uint8), ref[:499], (499,))
    far = encode_state(np.full(3, -np.inf, np.float16), np.full(3, 0x7C00, np.uint16))  # +inf -> -inf: a long way down
    with pytest.raises(ValueError, match="outside float16"):
        decode_state(np.frombuffer(far, np.uint8), np.full(3, 0x8400, np.uint16), (3,))  # from -6e-5: past -inf


def _pack(base=None, seed=0, state=None):
    gen = torch.Generator().manual_seed(seed)
    count, n = 4000, 16
    idx = torch.randint(0, n, (count,), generator=gen) if base is None else base.indices["l"].clone()
    row = {"name": "l", "pool": "l", "shape": [count, 1, 1, 1], "groups": 1, "vector_size": 1, "pool_size": n}
    row.update(bits=4, count=count, role="body")
    if state is None:
        state = {
            "bn.weight": torch.rand(300, generator=gen) + 0.5,
            "bn.running_var": torch.rand(300, generator=gen) + 0.1,
            "bn.num_batches_tracked": torch.tensor(7),
            "tiny.bias": torch.ones(1),
        }
    return nc.TaskPack(
        layers=[row], indices={"l": idx}, state=state, pool_sha256="b" * 64, model_spec="hand", meta={}, base=base
    )


def _task_state(base, seed=1):
    """The base's float entries in float16, moved as training moves them: BatchNorm weights by 0.1 %,
    the variances by 10 % (another Rice parameter: another stream)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.state.items():
        if v.is_floating_point():
            scale = 1e-1 if k.endswith("running_var") else 1e-3
            v = (v * (1 + scale * torch.randn(v.shape, generator=gen))).half()
        out[k] = v.clone()
    return out


def test_a_pack_codes_its_float16_state_against_the_base_and_reads_it_back_exactly(tmp_path):
    base = _pack()  # float32 state, as a run's base.nwspack holds it
    base.save(tmp_path / "base.nwspack")
    task = _pack(base, state=_task_state(base))
    sha = task.save(tmp_path / "task.nwspack")
    tensors, header = read_tensors(tmp_path / "task.nwspack", PACK_FORMAT, PACK_VERSION)
    assert header["version"] == PACK_VERSION == 5
    # the two large float16 entries are coded, one stream each (their differences need other Rice parameters);
    # the integer entry and the one-value entry (its coding is not smaller) are stored raw
    assert sorted(header["state_delta"]) == [["bn.running_var"], ["bn.weight"]]
    assert {k for k in tensors if k.startswith("state")} == {
        "state_delta/0", "state_delta/1", "state/bn.num_batches_tracked", "state/tiny.bias"
    }  # fmt: skip
    stored = sum(t.numel() for k, t in tensors.items() if k.startswith("state_delta/")) + 8 + 2
    raw = sum(v.numel() * v.element_size() for v in task.state.values())
    assert task.state_bytes == stored < 0.7 * raw
    assert sum(task.layer_state_bytes().values()) == stored and task.layer_state_bytes()["tiny.bias"] == 2
    for loaded in (nc.TaskPack.load(tmp_path / "task.nwspack"), read_pack_arrays(tmp_path / "task.nwspack")):
        assert loaded.sha256 == sha
        for k, v in task.state.items():
            got = torch.as_tensor(loaded.state[k])
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    loaded = nc.TaskPack.load(tmp_path / "task.nwspack")
    assert loaded.state_bytes == task.state_bytes and loaded.content_sha256() == task.content_sha256()
    # Saved standalone (the paper's fixed-width indices: no base), the same state is stored raw.
    task.base = None
    task.save(tmp_path / "alone.nwspack", codings=("bits",))
    _, header = read_tensors(tmp_path / "alone.nwspack", PACK_FORMAT, PACK_VERSION)
    assert "state_delta" not in header and "base" not in header and task.state_bytes == raw


def test_entries_with_one_rice_parameter_share_one_stream_at_the_same_bytes():
    """Grouping is free: the entries of a stream cost what they would cost one stream each, less a byte each."""
    rng = np.random.default_rng(2)
    bases = {k: predictor(rng.normal(1, 0.3, 200 + 50 * i).astype(np.float32)) for i, k in enumerate("abcdef")}
    noise = {"a": 1e-3, "b": 1e-3, "c": 1e-1, "d": 1e-3, "e": 1e-1, "f": 3e-2}
    entries = {
        k: (bases[k].view(np.float16).astype(np.float32) * (1 + noise[k] * rng.normal(size=bases[k].size))).astype(
            np.float16
        )
        for k in bases
    }
    groups = encode_groups(entries, bases)
    alone = {k: len(encode_state(v, bases[k])) for k, v in entries.items()}
    assert sorted(k for keys, _ in groups for k in keys) == sorted(entries) and 2 <= len(groups) < len(entries)
    for keys, data in groups:
        assert len(data) <= sum(alone[k] for k in keys) - (len(keys) - 1)
        assert len({encode_state(entries[k], bases[k])[0] for k in keys}) == 1  # one Rice parameter
    out = decode_groups([k for k, _ in groups], [np.frombuffer(d, np.uint8) for _, d in groups], bases)
    assert all(np.array_equal(out[k].view(np.uint16), entries[k].view(np.uint16)) for k in entries)


def _rewrite(src, dst, edit):
    tensors, header = read_tensors(src, PACK_FORMAT, PACK_VERSION)
    edit(tensors, header)
    fields = {k: v for k, v in header.items() if k not in ("format", "version", "sha256", "header_sha256")}
    write_tensors(dst, tensors, PACK_FORMAT, PACK_VERSION, **fields)


def test_damaged_or_inconsistent_state_codings_are_refused_naming_the_file_and_entry(tmp_path):
    base = _pack()
    base.save(tmp_path / "base.nwspack")
    _pack(base, state=_task_state(base)).save(tmp_path / "task.nwspack")
    src = tmp_path / "task.nwspack"

    def cut(t, h):
        t["state_delta/0"] = t["state_delta/0"][:-3].clone()

    def unlisted(t, h):
        h["state_delta"] = h["state_delta"][1:]  # stream 0's tensor is no longer described

    def unknown(t, h):
        h["state_delta"] = [*h["state_delta"], ["nope"]]

    def twice(t, h):
        h["state_delta"] = [h["state_delta"][0] * 2, *h["state_delta"][1:]]

    def baseless(t, h):
        del h["base"]

    def wide(t, h):
        t["state_delta/0"] = t["state_delta/0"].to(torch.int16)

    for edit, match in (
        (cut, r"cut\.nwspack: state stream 0 \(entries"),
        (unlisted, r"unlisted\.nwspack: tensors do not match the header"),
        (unknown, r"unknown\.nwspack: field state_delta"),
        (twice, r"twice\.nwspack: field state_delta"),
        (baseless, r"baseless\.nwspack: field base is missing, but some"),
        (wide, r"wide\.nwspack: tensor state_delta/0 is I16"),
    ):
        _rewrite(src, tmp_path / f"{edit.__name__}.nwspack", edit)
        for read in (nc.TaskPack.load, read_pack_arrays):
            with pytest.raises(nc.FormatError, match=match):
                read(tmp_path / f"{edit.__name__}.nwspack")
    # A base whose entry is an integer (or absent) cannot serve: named.
    odd = _pack(state={**base.state, "bn.weight": torch.arange(300)})
    odd.sha256 = base.sha256  # stand-in, so that the pack's recorded base hash still matches
    with pytest.raises(
        nc.FormatError, match=r"state entry 'bn.weight' is stored as changes against its base, which holds it as int64"
    ):
        nc.TaskPack.load(src, base=odd)
