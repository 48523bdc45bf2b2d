"""nws-train weights=FILE: a user's dense checkpoint as the start of a run."""

from __future__ import annotations

import hashlib

import pytest
import timm
import torch
from safetensors.torch import save_file

import nwsconvert
from nwsconvert import RunDir
from nwsconvert.cli.train import train_main
from nwsconvert.errors import FormatError
from nwsconvert.train.weights import load_weights
from nwsconvert.zoo import get_suite

FAST = ["model=timm:test_resnet", "pool_size=32", "progress=false", "epochs=1", "tasks=1", "seed=11"]


def _checkpoint(path, num_classes: int, seed: int = 5, name: str = "test_resnet"):
    torch.manual_seed(seed)
    model = timm.create_model(name, in_chans=1, num_classes=num_classes)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


def test_load_weights_copies_every_tensor_and_keeps_a_head_of_another_size(tmp_path):
    dense = _checkpoint(tmp_path / "w.safetensors", num_classes=4)
    torch.manual_seed(0)
    same = timm.create_model("test_resnet", in_chans=1, num_classes=4)
    assert load_weights(same, tmp_path / "w.safetensors") == []
    for (k, a), b in zip(dense.state_dict().items(), same.state_dict().values()):
        assert torch.equal(a, b), k

    torch.manual_seed(0)
    other = timm.create_model("test_resnet", in_chans=1, num_classes=3)
    fresh_head = other.fc.weight.detach().clone()
    assert load_weights(other, tmp_path / "w.safetensors") == ["fc.bias", "fc.weight"]
    assert torch.equal(other.fc.weight, fresh_head)
    theirs = dense.state_dict()
    for k, v in other.state_dict().items():
        assert k.startswith("fc.") or torch.equal(v, theirs[k]), k


def test_load_weights_refuses_what_does_not_fit(tmp_path):
    _checkpoint(tmp_path / "r18.safetensors", num_classes=4, name="resnet18")
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", in_chans=1, num_classes=4)
    with pytest.raises(ValueError, match=r"r18.safetensors: tensor '.*' is not in the model .*another architecture"):
        load_weights(model, tmp_path / "r18.safetensors")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    first = next(iter(state))
    save_file({k: v for k, v in state.items() if k != first}, str(tmp_path / "part.safetensors"))
    with pytest.raises(ValueError, match=f"the model's tensor '{first}' is not in the file"):
        load_weights(model, tmp_path / "part.safetensors")
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(FormatError, match="torch.save / pickle files are not read"):
        load_weights(model, tmp_path / "w.pt")
    nwsconvert.pool_set(nwsconvert.convert(timm.create_model("test_resnet", in_chans=1), pool_size=8)).save(
        tmp_path / "pools.safetensors"
    )
    with pytest.raises(FormatError, match=r"pools.safetensors is a pool file \(give it as init=FILE\), not a model's"):
        load_weights(model, tmp_path / "pools.safetensors")


def test_a_run_starts_from_the_weights_it_is_given(tmp_path, capsys):
    _checkpoint(tmp_path / "w.safetensors", num_classes=7)  # another head than the suite's
    out = tmp_path / "r"
    args = [*FAST, "learn_pools=false", f"weights={tmp_path / 'w.safetensors'}", f"out={out}"]
    assert train_main(args) == 0
    assert "classifier fc.bias, fc.weight left fresh" in capsys.readouterr().out
    # Without pool learning the run's pools are the k-means pools of the checkpoint's kernels: the
    # same conversion of the same weights with the run's seed gives them bit for bit.
    suite = get_suite("split-mnist")
    torch.manual_seed(11)  # the run seeds the model's init (here: the fresh head's) with its seed
    model = timm.create_model(
        "test_resnet", in_chans=1, num_classes=suite.pretrain_classes or suite.tasks[0].num_classes
    )
    load_weights(model, tmp_path / "w.safetensors")
    nwsconvert.convert(model, pool_size=32, seed=11)
    manifest = RunDir(out).read()
    assert manifest.pools.sha256 == nwsconvert.pool_set(model).sha256
    assert manifest.data["job"]["weights"] == str(tmp_path / "w.safetensors")
    start = (tmp_path / "w.safetensors").read_bytes()
    assert manifest.data["weights_sha256"] == hashlib.sha256(start).hexdigest()
    # --resume builds the model as the run started: from the file again, and only from that file.
    _checkpoint(tmp_path / "w.safetensors", num_classes=7, seed=6)  # the same path, other weights
    assert train_main(["--resume", f"out={out}", "tasks=2"]) == 2
    err = capsys.readouterr().err
    assert "not the file the run started from" in err and err.count("\n") == 1, err
    assert [t.id for t in RunDir(out).read().tasks] == [0]  # nothing trained from the other file
    (tmp_path / "w.safetensors").write_bytes(start)
    assert train_main(["--resume", f"out={out}", "tasks=2"]) == 0
    assert capsys.readouterr().out.startswith(f"weights: {tmp_path / 'w.safetensors'}")
    assert [t.id for t in RunDir(out).read().tasks] == [0, 1]
    # Reloading a run reads its own files only: the checkpoint is not needed any more.
    (tmp_path / "w.safetensors").unlink()
    nwsconvert.load(out, task=1)
    assert train_main(["--resume", f"out={out}", "tasks=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nws-train: weights=") and "no such file" in err, err


def test_weights_errors_are_one_line(tmp_path, capsys):
    model = _checkpoint(tmp_path / "r18.safetensors", num_classes=10, name="resnet18")
    torch.save(model.state_dict(), tmp_path / "w.pt")
    for value, message in (
        (tmp_path / "none.safetensors", "no such file"),
        (tmp_path / "w.pt", "is not a safetensors file (torch.save / pickle files are not read"),
        (tmp_path / "r18.safetensors", "a checkpoint of another architecture?"),
    ):
        assert train_main([*FAST, f"weights={value}", f"out={tmp_path / 'x'}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nws-train: weights") and message in err and err.count("\n") == 1, err
