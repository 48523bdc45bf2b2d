"""Task packs and pool files: exact round trips, mismatches and damaged files fail with clear errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

import nwsconvert as nc
from nwsconvert.formats.bitpack import pack_bits, packed_size, unpack_bits


def _model(num_classes=5, seed=0):
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.layer1[0].bn1.running_mean.normal_()  # non-trivial BN statistics
    return model


@pytest.fixture()
def saved(tmp_path):
    model = nc.convert(_model(), pool_size=512, init="random")
    model.train()
    model(torch.randn(4, 3, 32, 32))  # updates BN statistics and indices
    model.eval()
    nc.pool_set(model).save(tmp_path / "pools.safetensors")
    pack = nc.extract_task(model, meta={"task": "t0"})
    pack.save(tmp_path / "t0.nwspack")
    return model, pack, tmp_path


@pytest.mark.parametrize("bits", [1, 2, 5, 8, 9, 10, 13, 16])
def test_bitpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    for count in (0, 1, 7, 1001):
        v = torch.randint(0, 2**bits, (count,), generator=g)
        if count:
            v[0], v[-1] = 0, 2**bits - 1
        packed = pack_bits(v, bits)
        assert packed.dtype == np.uint8 and packed.size == packed_size(count, bits)
        assert np.array_equal(unpack_bits(packed, bits, count), v.numpy())
    with pytest.raises(ValueError, match="must lie in"):
        pack_bits(torch.tensor([2**bits]), bits)


def test_pack_round_trip_is_exact(saved):
    model, pack, tmp = saved
    loaded = nc.TaskPack.load(tmp / "t0.nwspack")
    assert loaded.layers == pack.layers and loaded.meta == {"task": "t0"}
    assert loaded.num_classes == 5 and loaded.pool_sha256 == nc.pool_set(model).sha256
    for name in pack.indices:
        assert torch.equal(loaded.indices[name].long(), pack.indices[name].long())
    assert loaded.state.keys() == pack.state.keys()
    for k in pack.state:
        assert torch.equal(loaded.state[k], pack.state[k]), k
    assert "layer1.0.bn1.running_mean" in loaded.state and "fc.bias" in loaded.state
    # At most 9 bits per kernel on disk (the smallest coding per layer), exactly 9 when asked.
    nine = sum((r["count"] * 9 + 7) // 8 for r in loaded.layers)
    assert loaded.index_bytes <= nine
    assert os.path.getsize(tmp / "t0.nwspack") < loaded.index_bytes + loaded.state_bytes + 20_000
    pack.save(tmp / "t0_bits.nwspack", codings=("bits",))
    fixed = nc.TaskPack.load(tmp / "t0_bits.nwspack")
    assert fixed.index_bytes == nine and set(fixed.layer_codings().values()) == {"bits"}
    assert all(torch.equal(fixed.indices[n], loaded.indices[n]) for n in pack.indices)

    fresh = nc.convert(_model(seed=1), pool_size=512, init=tmp / "pools.safetensors")
    nc.apply_task(fresh, loaded).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    for a, b in zip(nc.nws_layers(fresh), nc.nws_layers(model)):
        assert torch.equal(a.weight, b.nws.gather())  # W restarts from the chosen kernels


def test_pool_file_round_trip(saved):
    model, _, tmp = saved
    ps = nc.PoolSet.load(tmp / "pools.safetensors")
    orig = nc.pool_set(model)
    assert ps.sha256 == orig.sha256 and list(ps.pools) == list(orig.pools)
    assert all(torch.equal(ps[n], orig[n]) for n in ps.pools)


def test_pack_on_another_pool_set_is_refused(saved):
    _, pack, _ = saved
    other = nc.convert(_model(), pool_size=512, init="random", seed=123)
    with pytest.raises(nc.PackMismatchError, match="pool set"):
        nc.apply_task(other, pack)


def test_pack_on_another_head_is_refused(saved):
    _, pack, tmp = saved
    with pytest.raises(nc.ConversionError, match="layers the model does not convert: \\['fc'\\]"):
        nc.convert(_model(num_classes=10), pool_size=512, init=tmp / "pools.safetensors", skip=["fc"])
    pools = nc.pool_set(nc.convert(_model(num_classes=10), pool_size=512, init=tmp / "pools.safetensors"))
    pools.save(tmp / "p10.safetensors")
    pack.pool_sha256 = pools.sha256  # same pools, other head: the shape check names the layer
    other = nc.convert(_model(num_classes=10), pool_size=512, init=tmp / "p10.safetensors")
    with pytest.raises(nc.PackMismatchError, match=r"layer 'fc'.*class count"):
        nc.apply_task(other, pack)


def test_damaged_files_fail_clearly(saved):
    _, _, tmp = saved
    path = tmp / "t0.nwspack"
    data = path.read_bytes()
    (tmp / "trunc").write_bytes(data[: len(data) // 2])
    with pytest.raises(nc.FormatError, match="trunc.*(truncated|corrupted)"):
        nc.TaskPack.load(tmp / "trunc")
    (tmp / "tiny").write_bytes(data[:5])
    with pytest.raises(nc.FormatError, match="too short"):
        nc.TaskPack.load(tmp / "tiny")
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    (tmp / "flip").write_bytes(bytes(flipped))
    with pytest.raises(nc.FormatError, match="SHA-256"):
        nc.TaskPack.load(tmp / "flip")
    (tmp / "text").write_bytes(b"not a pack at all, just some text" * 10)
    with pytest.raises(nc.FormatError, match="text"):
        nc.TaskPack.load(tmp / "text")
    with pytest.raises(nc.FormatError, match="is a 'nwsconvert.poolset' file, expected 'nwsconvert.taskpack'"):
        nc.TaskPack.load(tmp / "pools.safetensors")
    with pytest.raises(FileNotFoundError, match="missing.nwspack"):
        nc.TaskPack.load(tmp / "missing.nwspack")
    with pytest.raises(nc.FormatError):
        nc.PoolSet.load(tmp / "trunc")
    from nwsconvert.formats.storage import write_tensors

    write_tensors(tmp / "future", {"x": torch.zeros(1)}, "nwsconvert.taskpack", 99)
    with pytest.raises(nc.FormatError, match="version 99 is newer"):
        nc.TaskPack.load(tmp / "future")


def test_writes_are_atomic(saved, monkeypatch):
    model, pack, tmp = saved
    before = (tmp / "t0.nwspack").read_bytes()
    import nwsconvert.formats.storage as storage

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(storage.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        pack.save(tmp / "t0.nwspack")
    assert (tmp / "t0.nwspack").read_bytes() == before  # old file intact
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith(".")) == []  # no temp left


def test_state_covers_layernorm_and_layers_left_dense(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 1), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 6, 6))
    nc.convert(model, pool_size=8, init="random", skip=["2"])
    pack = nc.extract_task(model)
    assert {"1.weight", "1.bias", "2.weight", "2.bias", "4.bias", "0.bias"} <= set(pack.state)
    assert not any("parametrizations" in k for k in pack.state)


def test_float16_state_halves_the_state_and_round_trips_exactly(saved):
    """``state_dtype=float16``: float32 entries stored in float16, integer ones unchanged; a model rounded
    with ``round_state_`` and the model rebuilt from its pack compute the same outputs bit for bit."""
    model, full, tmp = saved
    model.layer2[0].bn1.running_var[0] = 1e6  # beyond float16's 65504: this entry keeps float32
    nc.round_state_(model, "float16")
    half = nc.extract_task(model, state_dtype="float16")
    big = "layer2.0.bn1.running_var"
    assert half.state[big].dtype == torch.float32 and half.state[big][0] == 1e6
    for k, v in half.state.items():
        if k != big:
            assert v.dtype == (torch.float16 if full.state[k].is_floating_point() else full.state[k].dtype), k
    n_float = sum(v.numel() for k, v in full.state.items() if v.is_floating_point() and k != big)
    assert full.state_bytes - half.state_bytes == 2 * n_float
    half.save(tmp / "half.nwspack")
    loaded = nc.TaskPack.load(tmp / "half.nwspack")
    assert all(
        torch.equal(loaded.state[k], half.state[k]) and loaded.state[k].dtype == half.state[k].dtype for k in half.state
    )
    fresh = nc.convert(_model(seed=1), pool_size=512, init=tmp / "pools.safetensors")
    nc.apply_task(fresh, loaded).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    assert all(v.dtype == model.state_dict()[k].dtype for k, v in fresh.state_dict().items())  # the model keeps float32


def test_round_state_changes_values_by_at_most_float16_rounding(saved):
    model, full, _ = saved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    nc.round_state_(model, "float16")
    after = model.state_dict()
    changed = 0
    for k, v in full.state.items():
        if v.is_floating_point():
            # float16 keeps 11 significant bits: a relative error of at most 2^-11 for normal values
            # (BatchNorm statistics and affine parameters are far above float16's smallest normal, 6e-5,
            # or exactly zero/one here)
            assert torch.allclose(after[k], before[k], rtol=2**-11, atol=6e-8), k
            assert torch.equal(after[k], before[k].half().float()), k
            changed += int(not torch.equal(after[k], before[k]))
        else:
            assert torch.equal(after[k], before[k]), k
    assert changed > 0  # the random running_mean of layer1.0.bn1 is not float16-exact
    nc.round_state_(model, "float32")
    assert all(torch.equal(model.state_dict()[k], after[k]) for k in after)
