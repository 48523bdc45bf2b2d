"""A fake ``cifar-100-python.tar.gz`` for tests: the real archive's layout and pickle format, images
that a network can tell apart (each fine class a bright square at its own place over noise)."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np


def write_fake_cifar100(path: Path, per_class: int = 2, seed: int = 0) -> Path:
    """Write an archive with ``per_class`` train and test images per fine class; superclass c holds
    the fine classes 5c..5c+4 (a stand-in grouping). Returns ``path``."""
    rng = np.random.default_rng(seed)
    fine = np.arange(100).repeat(per_class)
    coarse = fine // 5

    def images():
        x = rng.integers(0, 96, (fine.size, 3, 32, 32))
        for i, c in enumerate(fine):  # 10 x 10 places of 8 x 8 squares, 3 pixels apart: one per class
            r, col = 3 * (c // 10), 3 * (c % 10)
            x[i, :, r : r + 8, col : col + 8] = 255
        return x.reshape(fine.size, 3072).astype(np.uint8)

    def batch():
        return {
            "data": images(),
            "fine_labels": fine.tolist(),
            "coarse_labels": coarse.tolist(),
        }

    meta = {"fine_label_names": [f"f{i}" for i in range(100)], "coarse_label_names": [f"c{i}" for i in range(20)]}
    with tarfile.open(path, "w:gz") as tar:
        for name, obj in (("train", batch()), ("test", batch()), ("meta", meta)):
            data = pickle.dumps(obj)  # the archive's own format, written here to fake it
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
