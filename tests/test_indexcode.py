"""Index codings: rANS tables and streams, delta codings against a base, pack files that use them.

Every coding must decode to exactly the indices it was given; the encoder must
pick the smallest; files written by an earlier format or another machine must
still decode (a committed golden file guards the rANS coder's stability).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import nwsconvert as nc
from nwsconvert.formats.bitpack import pack_bits
from nwsconvert.formats.entropy import (
    PRECISION,
    ans_decode,
    ans_encode,
    decode_table,
    decode_varints,
    encode_table,
    encode_varints,
    entropy_bits,
    quantize,
)
from nwsconvert.formats.indexcode import CODINGS, decode_indices, encode_indices
from nwsconvert.formats.packs import PACK_FORMAT
from nwsconvert.formats.storage import write_tensors

GOLDEN = Path(__file__).parent / "data" / "golden"


def _skewed(n, count, alpha, seed):
    """``count`` indices in ``[0, n)`` with Zipf-like frequencies (exponent ``alpha``)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n + 1) ** alpha
    return rng.choice(n, size=count, p=p / p.sum()).astype(np.int64)


def test_quantize_is_exact_and_deterministic():
    for counts in ([1], [5, 1], [10**6, 1, 1, 3], list(range(1, 513)), [1] * 70_000):
        f = quantize(np.array(counts))
        assert int(f.sum()) == 1 << PRECISION and (f >= 1).all()
        assert np.array_equal(f, quantize(np.array(counts)))
    f = quantize(np.array([3, 1]))
    assert f.tolist() == [3 << (PRECISION - 2), 1 << (PRECISION - 2)]  # proportional when exact
    with pytest.raises(ValueError):
        quantize(np.array([1, 0]))


def test_varints_and_tables_round_trip():
    values = np.array([0, 1, 127, 128, 300, 2**21, 2**40])
    data = encode_varints(values)
    assert len(data) == 1 + 1 + 1 + 2 + 2 + 4 + 6
    out, pos = decode_varints(data, values.size)
    assert np.array_equal(out, values) and pos == len(data)
    for symbols in ([3], [0, 1, 2, 511], list(range(0, 512, 2)), [7, 400]):
        symbols = np.array(symbols)
        counts = np.arange(1, symbols.size + 1) * 1000
        table = encode_table(symbols, counts, 512)
        s, c = decode_table(table, 512)
        assert np.array_equal(s, symbols) and np.array_equal(c, counts)
    dense, sparse = encode_table(np.arange(512), np.ones(512), 512), encode_table(np.array([5]), np.ones(1), 512)
    assert dense[2] == 0 and sparse[1] == 1  # bitmap for many symbols, gap list for few
    with pytest.raises(ValueError):
        decode_table(table[:-1], 512)


@pytest.mark.parametrize("alpha", [0.0, 0.8, 1.5, 3.0])
def test_ans_round_trip_and_size_near_entropy(alpha):
    x = _skewed(512, 50_000, alpha, seed=int(alpha * 10))
    symbols, ranks, counts = np.unique(x, return_inverse=True, return_counts=True)
    payload = ans_encode(ranks, counts)
    assert np.array_equal(symbols[ans_decode(payload, counts, x.size)], x)
    # rANS with 24-bit probabilities loses < 0.1 % to the order-0 entropy on 50k symbols,
    # plus at most 8 bytes of final state (two 32-bit words).
    assert len(payload) <= entropy_bits(x) / 8 * 1.001 + 8


def test_ans_single_symbol_and_empty():
    assert ans_encode(np.zeros(100, np.int64), np.array([100])) == b""
    assert ans_decode(b"", np.array([100]), 100).tolist() == [0] * 100
    assert ans_decode(b"", np.array([1, 1]), 0).size == 0


@pytest.mark.parametrize("coding", CODINGS)
def test_every_coding_round_trips(coding):
    n, bits = 512, 9
    base = torch.from_numpy(_skewed(n, 20_000, 1.0, seed=1))
    idx = base.clone()
    idx[::37] = torch.from_numpy(_skewed(n, idx[::37].numel(), 1.0, seed=2))
    e = encode_indices(idx, n, bits, base, codings=(coding,))
    assert e.coding == coding
    assert np.array_equal(decode_indices(e, idx.numel(), n, bits, base), idx.numpy())
    if coding.startswith("delta"):
        assert e.changes == int((idx != base).sum())
        with pytest.raises(ValueError, match="base"):
            decode_indices(e, idx.numel(), n, bits, None)
    # The runtime's narrow types: the same values, in the type asked for, from a base kept narrow too.
    narrow = base.numpy().astype(np.uint16)
    for dtype in (np.uint16, np.int32):
        out = decode_indices(e, idx.numel(), n, bits, narrow, dtype=dtype)
        assert out.dtype == dtype and np.array_equal(out, idx.numpy())
        assert not np.shares_memory(out, narrow)  # the base is never written
    with pytest.raises(ValueError, match="a pool of 512 cannot be held as uint8"):
        decode_indices(e, idx.numel(), n, bits, base, dtype=np.uint8)


def test_the_encoder_builds_only_codings_that_can_win_and_chooses_what_building_all_would(monkeypatch):
    """``encode_indices`` packs ``bits`` only when its exact size is not beaten and skips ``ans`` when the
    stream's entropy (less ``ANS_SLACK_BYTES``) exceeds a coding at hand. Over layers of every kind a pack
    holds (uniform and skewed full streams, tasks changing 0.1-60 % of their base, one symbol, a head of a
    few kernels), the choice and its bytes are those of building every coding and taking the smallest;
    on a ResNet-18-sized task layer (262,144 kernels, 2.5 % changed) neither full stream is built."""
    import nwsconvert.formats.indexcode as ic

    n, bits = 512, 9
    rng = np.random.default_rng(11)
    cases = []
    for count in (7, 300, 30_000):
        for skew in (0.0, 1.5, 4.0):
            base = _skewed(n, count, skew, seed=count + int(10 * skew))
            cases.append((base, None))
            for share in (0.0, 0.001, 0.025, 0.3, 0.6):
                idx = base.copy()
                moved = rng.random(count) < share
                idx[moved] = rng.integers(0, n, int(moved.sum()))
                cases.append((idx, base))
    cases.append((np.full(5000, 17), None))
    cases.append((np.full(5000, 17), np.full(5000, 3)))
    for idx, base in cases:
        every = []
        for coding in CODINGS:
            try:
                every.append(encode_indices(idx, n, bits, base, codings=(coding,)))
            except ValueError:  # not applicable: no base, or nothing changed (delta+ans)
                pass
        want = min(every, key=lambda e: (e.nbytes, CODINGS.index(e.coding)))
        got = encode_indices(idx, n, bits, base)
        assert (got.coding, got.changes) == (want.coding, want.changes)
        assert got.tensors.keys() == want.tensors.keys()
        assert all(np.array_equal(got.tensors[k], want.tensors[k]) for k in got.tensors)
    built = []
    real = ic._stream

    def spy(values, pool, width, entropy):
        built.append((values.size, entropy))
        return real(values, pool, width, entropy)

    base = _skewed(n, 262_144, 0.5, seed=5)
    idx = base.copy()
    moved = rng.random(base.size) < 0.025
    idx[moved] = rng.integers(0, n, int(moved.sum()))
    monkeypatch.setattr(ic, "_stream", spy)
    e = encode_indices(idx, n, bits, base)
    assert e.coding.startswith("delta") and all(size < base.size for size, _ in built)


def test_encoder_picks_the_smallest_coding():
    n, bits = 512, 9
    uniform = torch.from_numpy(_skewed(n, 30_000, 0.0, seed=3))
    skewed = torch.from_numpy(_skewed(n, 30_000, 1.5, seed=4))

    def size(idx, base, coding):
        try:
            return encode_indices(idx, n, bits, base, codings=(coding,)).nbytes
        except ValueError:  # not applicable: no base, or nothing changed (delta+ans)
            return None

    for idx, base in ((uniform, None), (skewed, None), (uniform, uniform.clone()), (skewed, uniform)):
        sizes = {c: size(idx, base, c) for c in CODINGS}
        sizes = {c: b for c, b in sizes.items() if b is not None}
        best = encode_indices(idx, n, bits, base)
        assert best.nbytes == min(sizes.values()) and sizes[best.coding] == best.nbytes
    assert encode_indices(uniform, n, bits).coding == "bits"  # uniform: the table does not pay
    assert encode_indices(skewed, n, bits).coding == "ans"
    same = encode_indices(uniform, n, bits, uniform.clone())
    assert same.coding == "delta+bits" and same.changes == 0 and same.nbytes == 0
    # Every position changed: the change map is free, the values are coded as usual.
    other = (uniform + 1) % n
    e = encode_indices(other, n, bits, uniform, codings=("delta+bits",))
    assert e.changes == other.numel() and e.tensors["indices"].size == 0
    assert np.array_equal(decode_indices(e, other.numel(), n, bits, uniform), other.numpy())
    # A base of another length (a resized head) is no base.
    assert encode_indices(uniform, n, bits, uniform[:-1]).coding == "bits"
    with pytest.raises(ValueError, match="must lie in"):
        encode_indices(torch.tensor([n]), n, bits)


def _hand_pack(seed, n=512, sizes=(4000, 900, 30), base=None, change_every=None):
    layers, indices = [], {}
    for i, count in enumerate(sizes):
        name = f"layer{i}"
        layers.append(
            {
                "name": name,
                "pool": name,
                "shape": [count, 1, 1, 1],
                "groups": 1,
                "vector_size": 1,
                "pool_size": n,
                "bits": math.ceil(math.log2(n)),
                "count": count,
                "role": "body",
            }
        )
        idx = torch.from_numpy(_skewed(n, count, 1.2 - 0.4 * i, seed=seed + i))
        if base is not None:
            idx = base.indices[name].clone()
            idx[::change_every] = torch.from_numpy(_skewed(n, idx[::change_every].numel(), 2.0, seed=seed + 10 + i))
        indices[name] = idx
    state = {"bn.running_mean": torch.arange(4, dtype=torch.float32)}
    return nc.TaskPack(
        layers=layers,
        indices=indices,
        state=state,
        pool_sha256="a" * 64,
        num_classes=None,
        model_spec="hand",
        meta={"seed": seed},
        base=base,
    )


def test_delta_pack_finds_its_base(tmp_path):
    base = _hand_pack(0)
    base.save(tmp_path / "base.nwspack")
    task = _hand_pack(1, base=base, change_every=50)
    (tmp_path / "tasks").mkdir()
    task.save(tmp_path / "tasks" / "task_0.nwspack")
    assert "delta+bits" in task.layer_codings().values() or "delta+ans" in task.layer_codings().values()
    assert task.index_bytes < base.index_bytes / 5  # 2 % of positions changed
    for where in (tmp_path / "tasks" / "task_0.nwspack",):
        loaded = nc.TaskPack.load(where)  # base.nwspack found in the parent folder
        assert loaded.base.sha256 == base.sha256 and loaded.base_sha256 == base.sha256
        assert all(torch.equal(loaded.indices[k], task.indices[k]) for k in task.indices)
        assert loaded.content_sha256() == task.content_sha256()
        assert loaded.index_bytes == task.index_bytes
    # Same folder works too, and an explicit base (pack or path) overrides the search.
    flat = tmp_path / "elsewhere" / "flat"
    flat.mkdir(parents=True)
    (flat / "t.nwspack").write_bytes((tmp_path / "tasks" / "task_0.nwspack").read_bytes())
    (flat / "base.nwspack").write_bytes((tmp_path / "base.nwspack").read_bytes())
    assert nc.TaskPack.load(flat / "t.nwspack").base.sha256 == base.sha256
    assert nc.TaskPack.load(flat / "t.nwspack", base=tmp_path / "base.nwspack").base.sha256 == base.sha256
    (flat / "base.nwspack").unlink()
    with pytest.raises(nc.FormatError, match=r"t\.nwspack.*changes against base pack .*no base\.nwspack"):
        nc.TaskPack.load(flat / "t.nwspack")
    other = _hand_pack(5)
    other.save(flat / "base.nwspack")
    with pytest.raises(nc.FormatError, match="base.nwspack is"):
        nc.TaskPack.load(flat / "t.nwspack")
    with pytest.raises(nc.FormatError, match="the base given is"):
        nc.TaskPack.load(flat / "t.nwspack", base=other)


def test_no_chains_and_unsaved_bases_are_refused(tmp_path):
    base = _hand_pack(0)
    task = _hand_pack(1, base=base, change_every=50)
    with pytest.raises(ValueError, match="saved"):
        task.save(tmp_path / "t.nwspack")
    base.save(tmp_path / "base.nwspack")
    task.save(tmp_path / "t.nwspack")
    chained = _hand_pack(2, base=task, change_every=40)
    with pytest.raises(ValueError, match="one step"):
        chained.save(tmp_path / "c.nwspack")
    foreign = _hand_pack(3, base=base, change_every=50)
    foreign.pool_sha256 = "q" * 64
    with pytest.raises(nc.PackMismatchError, match="pool set"):
        foreign.save(tmp_path / "f.nwspack")


def test_version_1_files_still_load(tmp_path):
    pack = _hand_pack(7)
    rows = pack.layers  # version 1 rows had no coding field
    tensors = {f"indices/{r['name']}": torch.from_numpy(pack_bits(pack.indices[r["name"]], r["bits"])) for r in rows}
    tensors.update({f"state/{k}": v for k, v in pack.state.items()})
    write_tensors(
        tmp_path / "v1.nwspack",
        tensors,
        PACK_FORMAT,
        1,
        pool_sha256=pack.pool_sha256,
        num_classes=None,
        model_spec="hand",
        layers=rows,
        state_keys=list(pack.state),
        meta={},
    )
    loaded = nc.TaskPack.load(tmp_path / "v1.nwspack")
    assert all(torch.equal(loaded.indices[k], pack.indices[k]) for k in pack.indices)
    assert set(loaded.layer_codings().values()) == {"bits"} and loaded.layers == rows


def test_golden_files_decode():
    """Files written by this format's first release decode to the same indices.

    ``tests/data/golden`` holds a base and a delta-coded task written by
    ``_hand_pack`` (seeds 0 and 1); a change in the rANS coder or the
    probability quantisation that breaks old files fails here.
    """
    base, task = _hand_pack(0), None
    base_loaded = nc.TaskPack.load(GOLDEN / "base.nwspack")
    assert all(torch.equal(base_loaded.indices[k], base.indices[k]) for k in base.indices)
    task = _hand_pack(1, base=base_loaded, change_every=50)
    loaded = nc.TaskPack.load(GOLDEN / "task.nwspack")
    assert {"ans", "delta+ans", "delta+bits"} & set(loaded.layer_codings().values())
    assert "ans" in base_loaded.layer_codings().values()
    assert all(torch.equal(loaded.indices[k], task.indices[k]) for k in task.indices)


def test_numpy_reader_decodes_what_torch_reads(tmp_path):
    """The torch-free reader (used by the onnxruntime Runtime) gives exactly TaskPack.load's
    indices and state, for every coding (golden files) and a base found beside the pack."""
    from nwsconvert.formats.packfile import read_pack_arrays

    torch_pack = nc.TaskPack.load(GOLDEN / "task.nwspack")
    arrays = read_pack_arrays(GOLDEN / "task.nwspack")
    assert (
        arrays.base is not None and arrays.base_sha256 == torch_pack.base.sha256 and arrays.sha256 == torch_pack.sha256
    )
    assert arrays.indices.keys() == torch_pack.indices.keys()
    assert all(np.array_equal(arrays.indices[k], torch_pack.indices[k].numpy()) for k in arrays.indices)
    assert all(np.array_equal(arrays.state[k], torch_pack.state[k].numpy()) for k in torch_pack.state)
    assert {e.coding for e in arrays.encoded.values()} == set(torch_pack.layer_codings().values())
    narrow = read_pack_arrays(GOLDEN / "task.nwspack", index_dtype=np.uint16)  # what the runtime reads
    assert all(v.dtype == np.uint16 and np.array_equal(v, arrays.indices[k]) for k, v in narrow.indices.items())
    with pytest.raises(nc.FormatError, match=r"task.nwspack: inconsistent task pack .*cannot be held as uint8"):
        read_pack_arrays(GOLDEN / "task.nwspack", index_dtype=np.uint8)
    with pytest.raises(nc.PackMismatchError, match="content SHA-256"):
        read_pack_arrays(GOLDEN / "task.nwspack", sha256="0" * 64)
    with pytest.raises(nc.FormatError, match="cannot serve as a base"):  # a task pack given as the base
        read_pack_arrays(GOLDEN / "task.nwspack", base=GOLDEN / "task.nwspack")
    (tmp_path / "task.nwspack").write_bytes((GOLDEN / "task.nwspack").read_bytes())
    with pytest.raises(nc.FormatError, match="base.nwspack"):  # no base beside it, nor one folder up
        read_pack_arrays(tmp_path / "task.nwspack")


def test_raw_digest_equals_tensor_digest_for_kept_and_long_names():
    """``raw_digest`` (from a file's bytes, its JSON entries kept for names up to 256 characters) hashes what
    ``tensor_digest`` hashes from the tensors, for short names, a name past the kept length, and twice
    (the second time from the kept entries)."""
    from safetensors.torch import save

    from nwsconvert.formats.stfile import parse_header, raw_digest
    from nwsconvert.formats.storage import tensor_digest

    tensors = {
        "layer.indices": torch.arange(7, dtype=torch.int64),
        "state/bn.weight": torch.linspace(0, 1, 5, dtype=torch.float16),
        "x" * 300: torch.ones(2, 3),
    }
    data = save(tensors)
    header = parse_header(data, len(data), "mem")
    want = tensor_digest(tensors)
    assert raw_digest(data, header) == want
    assert raw_digest(data, header) == want
