"""Reading a deployment bundle's ``bundle.json``: every field checked, every file name kept inside the bundle.

Imports neither torch nor timm (the robot's runtime reads bundles with this).
A bundle from someone else is data: its files are named by plain file names
in the bundle folder, and the pool file, task graphs and packs carry SHA-256s
that the readers verify before use.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from nwsconvert.errors import FormatError
from nwsconvert.formats.limits import MAX_KERNELS
from nwsconvert.formats.schema import Fields
from nwsconvert.formats.stfile import file_sha256
from nwsconvert.train.manifest import check_data_info

__all__ = ["BUNDLE_FORMAT", "BUNDLE_VERSION", "read_bundle", "check_bundle", "file_sha256", "recipe_sha256"]

BUNDLE_FORMAT = "nwsconvert.bundle"
BUNDLE_VERSION = 2  # 2: pack_sha256, onnx_sha256 and base_sha256 per task; version 1 still reads


def check_bundle(desc: dict, path) -> None:
    """Types and ranges of every ``bundle.json`` field a reader uses.

    Raises:
        FormatError: naming the file and the field.
    """
    f = Fields(desc, path)
    if f.str("format") != BUNDLE_FORMAT:
        raise FormatError(f"{path}: not an nwsconvert bundle description (format {str(desc.get('format'))[:40]!r})")
    version = f.int("version", lo=1)
    if version > BUNDLE_VERSION:
        raise FormatError(
            f"{path}: bundle version {version} is newer than this nwsconvert reads ({BUNDLE_VERSION}): upgrade nwsconvert"
        )
    f.sha("pool_sha256")
    f.dict("model", optional=True)
    check_data_info(f)
    f.int("pool_bytes", lo=0, optional=True)
    tasks = f.dict("tasks")
    hashed = version >= 2
    for key, row in tasks.items():
        if not (key.isascii() and key.isdigit()):
            raise FormatError(f"{path}: field tasks: key {key[:20]!r} is not a task id")
        r = f.sub(row, f"tasks.{key}")
        r.str("name")
        classes = r.int("num_classes", lo=1)
        names = r.strs("class_names", optional=True)
        if names is not None and len(names) != classes:
            raise r.fail("class_names", f"{classes} names (num_classes)", names)
        r.filename("pack")
        r.int("pack_bytes", lo=0, optional=True)
        if hashed:
            r.sha("pack_sha256")
        if "base" in row and r.filename("base") and hashed:
            r.sha("base_sha256")
        if "onnx" in row and r.filename("onnx"):
            r.int("onnx_bytes", lo=0, optional=True)
            if hashed:
                r.sha("onnx_sha256")
    switch = f.obj_fields("switch", optional=True)
    if switch is not None:
        switch.filename("onnx")
        switch.sha("onnx_sha256")
        switch.int("max_classes", lo=1)
        switch.int("onnx_bytes", lo=0, optional=True)
        rows = switch.list("tensors", optional=True)
        if rows is not None:
            switch.sha("tensors_sha256")
            for i, row in enumerate(rows):
                _check_tensor_row(f.sub(row, f"switch.tensors[{i}]"))


def recipe_sha256(rows: list) -> str:
    """SHA-256 of a ``switch.tensors`` recipe (canonical JSON): bundle.json records it beside the rows,
    so an edited row is refused rather than computed with."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


#: What the runtime reads of a ``switch.tensors`` row, by kind (:func:`nwsconvert.export.densify.dense_template`).
_TENSOR_FIELDS = {
    "gather": ("name", "layer"),
    "fold": ("name", "bias_name", "layer", "scale", "shift", "mean", "var"),
    "state": ("name",),
}


def _check_tensor_row(r) -> None:
    kind = r.str("kind")
    if kind not in _TENSOR_FIELDS:
        raise r.fail("kind", f"one of {', '.join(_TENSOR_FIELDS)}", kind)
    for key in _TENSOR_FIELDS[kind]:
        r.str(key)
    shape = r.ints("shape", lo=1)
    if not 1 <= len(shape) <= 8 or math.prod(shape) > MAX_KERNELS:
        raise r.fail("shape", f"1 to 8 dimensions, at most {MAX_KERNELS} elements", shape)
    if kind == "fold":
        r.str("conv_bias", optional=True)
        eps = r.number("eps")
        if not eps >= 0:
            raise r.fail("eps", "a number >= 0", eps)


def read_bundle(bundle: str | os.PathLike) -> dict:
    """The checked ``bundle.json`` of a bundle folder.

    Raises:
        FileNotFoundError: no such folder, or no ``bundle.json`` in it.
        FormatError: not valid JSON, or a field out of type or range (named).
    """
    bundle = Path(bundle)
    if not bundle.is_dir():
        what = "is a file, not a bundle folder" if bundle.exists() else "does not exist"
        raise FileNotFoundError(f"{bundle} {what} (write a bundle with nws-export RUN --task all --onnx)")
    path = bundle / "bundle.json"
    if not path.is_file():
        raise FileNotFoundError(f"{bundle} is not a bundle: no bundle.json (write one with nws-export --onnx)")
    try:
        desc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    check_bundle(desc, path)
    return desc
