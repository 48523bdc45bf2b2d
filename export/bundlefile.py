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
from nwsconvert.formats.schema import Fields, is_plain_name
from nwsconvert.formats.stfile import file_sha256
from nwsconvert.train.manifest import check_data_info

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "bundle_file",
    "check_bundle",
    "check_external_data",
    "file_sha256",
    "read_bundle",
    "recipe_sha256",
]

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


def bundle_file(bundle: str | os.PathLike, name: str, what: str) -> Path:
    """The bundle's file ``name`` (a plain file name), checked to be a file in the bundle folder itself: a
    symbolic link is followed only to a file in the same folder.

    Raises:
        FormatError: ``name`` is not a plain file name, or leads outside the folder (named, with where to).
        FileNotFoundError: no such file.
    """
    bundle = Path(bundle)
    path = bundle / name if is_plain_name(name) else None
    if path is None:
        raise FormatError(f"{bundle}: {what} is named {str(name)[:80]!r}, not a plain file name in the bundle folder")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} is missing from the bundle")
    real = Path(os.path.realpath(path))
    if real.parent != Path(os.path.realpath(bundle)):
        raise FormatError(
            f"{path}: {what} is a link to {real}, outside the bundle folder: a bundle's files must be in its folder"
        )
    return path


def _tensors(graph, where: str):
    """Every ``TensorProto`` of an ONNX graph, with where it is: initializers, sparse initializers, node
    attributes (``Constant`` values...), and the same in every subgraph (``If``, ``Loop``, ``Scan``)."""
    for t in graph.initializer:
        yield t, where
    for s in graph.sparse_initializer:
        yield s.values, where
        yield s.indices, where
    for node in graph.node:
        yield from _attribute_tensors(node, f"{where}, node {node.name or node.op_type!r}")


def _attribute_tensors(node, where: str):
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t, where
        for t in a.tensors:
            yield t, where
        sparse = [a.sparse_tensor] if a.HasField("sparse_tensor") else []
        for s in [*sparse, *a.sparse_tensors]:
            yield s.values, where
            yield s.indices, where
        if a.HasField("g"):
            yield from _tensors(a.g, f"{where}, subgraph {a.name}")
        for g in a.graphs:
            yield from _tensors(g, f"{where}, subgraph {a.name}")


def check_external_data(
    data: bytes, graph: Path, bundle: str | os.PathLike, placeholder: str | None = None
) -> list[str]:
    """Refuse an ONNX graph (``data``, the bytes of ``graph``) any of whose tensors keeps its data outside the
    bundle: every external-data ``location`` must be a plain name of a file in the bundle folder (a link
    only to one in the folder), or ``placeholder`` (the switch template's tensors, supplied at run time).
    Checked on the bytes before onnx or onnxruntime opens any file they name.

    Returns:
        The files of the bundle the graph's external data names (to check again later without onnx).

    Raises:
        FormatError: naming the graph, the tensor and the location; or the bytes are not an ONNX model.
    """
    from onnx import ModelProto

    model = ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as e:  # noqa: BLE001 (protobuf's DecodeError and friends)
        raise FormatError(f"{graph}: not an ONNX model ({type(e).__name__}: {str(e)[:120]})") from None
    found, named = list(_tensors(model.graph, "the graph")), []
    for f in model.functions:
        for node in f.node:
            found += _attribute_tensors(node, f"function {f.name!r}, node {node.name or node.op_type!r}")
    for t, where in found:
        if not t.external_data and t.data_location != t.EXTERNAL:
            continue
        location = next((e.value for e in t.external_data if e.key == "location"), None)
        if location is not None and location == placeholder:
            continue
        bad = None
        if location is None:
            bad = "no location"
        elif not is_plain_name(location):
            bad = "not a plain file name in the bundle folder"
        else:
            try:
                bundle_file(bundle, location, "external data")
            except (FormatError, FileNotFoundError) as e:
                bad = (
                    "a link that leaves the bundle folder"
                    if isinstance(e, FormatError)
                    else "no such file in the bundle"
                )
        if bad is not None:
            raise FormatError(
                f"{graph}: tensor {t.name!r} ({where}) keeps its data at {str(location)[:120]!r}, {bad}: a bundle's "
                "graphs may read only files in its folder; refused before anything read it"
            )
        named.append(str(location))
    return named
