"""The switch mode's graph for this machine: the bundle's dense template with every task tensor a graph input,
in the layout this machine's kernels read.

On a CPU, onnxruntime runs convolutions in its blocked NCHWc kernels: when a session is built from constant
weights it reorders each convolution's weight once (blocks of 8 or 16 channels, by the CPU's vector width).
Weights given as plain graph inputs skip that rewrite and run 1.2-3.9x slower (ResNet-18; RESULTS, "Many
tasks for the memory of one"). :func:`machine_graph` lets onnxruntime optimise the template here, with constant
stand-ins for the task tensors, and then turns the reordered weights back into graph inputs. Where each
element of a reordered weight comes from is read off the optimised graph itself: built once with each task
tensor holding its number in the recipe, and once per group of tensors (under 2**24 elements, float32's
exact integers) with their elements numbered 1, 2, ... through the group (so that no two are equal, which
onnxruntime would merge), the optimised graph's weights say, element by element, which tensor and which
element they hold (or 0: padding). Each input's layout is then matched to a plain copy, a zero-padded
copy, or one of the NCHWc reorders (``OIHWBiBo``, ``OIHWBo``), and checked bit for bit against
onnxruntime's own rewrite of random tensors. A task then runs at the speed of a session built for it, while a switch only rewrites the
inputs' buffers (:meth:`MachineGraph.fill`).

Where the optimised graph does anything else with a task tensor (folds it into another constant, say), or a
tensor is too large to number exactly in float32, the template runs as it is, its tensors graph inputs
(``layout="plain"``, slower on CPU, exact everywhere); the reason is recorded. On CUDA, cuDNN reads weights
as they are: the plain graph is the one to run.

Needs ``onnx`` (to read and edit graphs) besides onnxruntime and NumPy; no torch. :func:`prepare` does the
work in a child process (``python -m nwsconvert.export.layout``): the probing sessions and ``onnx`` leave
25 MB behind in the process that ran them (ResNet-18), which a robot's runtime should not carry.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["ALIGN", "MachineGraph", "Placement", "LayoutError", "machine_graph", "plain_graph", "prepare"]

#: Each input's buffer starts on a multiple of this many bytes: onnxruntime's NCHWc kernels run at the
#: constant-weight speed only from 64-byte aligned weights (unaligned: 3-17 % slower).
ALIGN = 64
_FLOATS = ALIGN // 4
_EXACT = 1 << 24  # float32 numbers every integer up to here exactly


class LayoutError(ValueError):
    """The optimised graph uses a task tensor in a way a switch cannot rewrite (the plain graph runs instead)."""


@dataclass
class Placement:
    """One graph input of the machine graph and how a task's dense tensor fills it.

    Attributes:
        name: the graph input.
        shape: its shape (a reordered weight may be padded to whole blocks).
        offset: where it starts in a slot's buffer, in floats (a multiple of ``ALIGN`` bytes).
        kind: ``copy`` (the tensor as it is), ``pad`` (zero-padded along its first dimensions),
            ``bibo`` (``OIHWBiBo``: output and input channels in blocks of ``block``), ``bo``
            (``OIHWBo``: output channels in blocks), or ``perm`` (an explicit element map).
        source: the template tensor it is made of.
        block: the NCHWc block size (``bibo``, ``bo``).
        perm: ``perm``: the source's flat element each element takes, ``-1`` for padding.
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    kind: str
    source: str
    block: int = 0
    perm: np.ndarray | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def write(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Fill ``dst`` (this input's float32 buffer, ``shape``) from the dense tensor ``src``."""
        if self.kind == "copy":
            np.copyto(dst.reshape(src.shape), src)
        elif self.kind == "pad":
            dst.fill(0)
            dst[tuple(slice(0, n) for n in src.shape)] = src
        elif self.kind in ("bibo", "bo"):
            b = self.block
            o, i, *k = src.shape
            op = -(-o // b) * b
            ip = -(-i // b) * b if self.kind == "bibo" else i
            if (op, ip) != (o, i):
                padded = np.zeros((op, ip, *k), np.float32)
                padded[:o, :i] = src
                src = padded
            if self.kind == "bibo":
                view = src.reshape(op // b, b, ip // b, b, *k).transpose(0, 2, *range(4, 4 + len(k)), 3, 1)
                np.copyto(dst.reshape(op // b, ip // b, *k, b, b), view)
            else:
                view = src.reshape(op // b, b, ip, *k).transpose(0, 2, *range(3, 3 + len(k)), 1)
                np.copyto(dst.reshape(op // b, ip, *k, b), view)
        else:  # perm
            assert self.perm is not None
            flat = dst.reshape(-1)
            np.take(src.reshape(-1), np.maximum(self.perm, 0), out=flat)
            flat[self.perm < 0] = 0


@dataclass
class MachineGraph:
    """The graph a switch-mode session runs, and where each task tensor goes in its inputs.

    Attributes:
        model: the graph (serialised ONNX) with one input per placement besides the image.
        placements: its weight inputs, in buffer order.
        floats: the size of one slot's buffer, in floats (every placement, aligned).
        layout: ``nchwc8`` / ``nchwc16`` (reordered for this CPU's blocked kernels), ``plain``.
        optimised: the graph is already optimised for this machine (its session runs no optimiser).
        reason: why the layout is ``plain`` where an optimised one was asked for (else ``None``).
    """

    model: bytes
    placements: list[Placement]
    floats: int
    layout: str
    optimised: bool
    reason: str | None = None

    def fill(self, buffer: np.ndarray, tensors) -> None:
        """Write a task's dense tensors into a slot's ``buffer`` (flat float32 of ``floats``), every placement.

        Args:
            tensors: name -> float32 array of the template's shape, or an iterable of ``(name, array)``
                pairs (:func:`~nwsconvert.export.densify.iter_dense_tensors`: each written, then dropped).

        Raises:
            KeyError: a placement's tensor is not among ``tensors`` (named).
        """
        pairs = tensors.items() if isinstance(tensors, dict) else tensors
        by_source: dict[str, list[Placement]] = {}
        for p in self.placements:
            by_source.setdefault(p.source, []).append(p)
        for name, tensor in pairs:
            for p in by_source.pop(name, ()):
                p.write(buffer[p.offset : p.offset + p.size].reshape(p.shape), tensor)
            del tensor  # not alive while the next one is computed
        if by_source:
            raise KeyError(f"no tensor {next(iter(by_source))!r} for the switch graph's inputs")

    def views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Input name -> its array in a slot's ``buffer`` (views: what a session binds)."""
        return {p.name: buffer[p.offset : p.offset + p.size].reshape(p.shape) for p in self.placements}


def aligned_empty(floats: int) -> np.ndarray:
    """A flat float32 array of ``floats`` whose data starts on an ``ALIGN``-byte boundary."""
    raw = np.empty(floats * 4 + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + floats * 4].view(np.float32)


def _place(names_shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for _, shape in names_shapes:
        offsets.append(at)
        at += -(-int(np.prod(shape, dtype=np.int64)) // _FLOATS) * _FLOATS
    return offsets, at


def _with_tensors(template: bytes, values: dict[str, np.ndarray]):
    """The template (an ``onnx.ModelProto``) with its placeholder task tensors replaced by ``values``, inline."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load_from_string(template)
    for init in model.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(values[init.name]), init.name))
    return model


def _as_inputs(model, names: list[str]) -> bytes:
    """``model`` with the initializers ``names`` turned into graph inputs of the same shape."""
    from onnx import TensorProto, helper

    wanted = set(names)
    kept = [i for i in model.graph.initializer if i.name not in wanted]
    shapes = {i.name: list(i.dims) for i in model.graph.initializer if i.name in wanted}
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for name in names:
        model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes[name]))
    return model.SerializeToString()


def plain_graph(template: bytes, rows: list[tuple[str, tuple[int, ...]]], reason: str | None = None) -> MachineGraph:
    """The template as it is, its task tensors graph inputs in their own shapes (any provider)."""
    import onnx

    model = onnx.load_from_string(template)
    names = [name for name, _ in rows]
    present = {i.name for i in model.graph.initializer}
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(f"the template has no placeholder {missing[0]!r}")
    offsets, floats = _place(rows)
    placements = [
        Placement(name, tuple(int(d) for d in shape), off, "copy", name) for (name, shape), off in zip(rows, offsets)
    ]
    return MachineGraph(_as_inputs(model, names), placements, floats, "plain", False, reason)


def _optimised(template: bytes, values: dict[str, np.ndarray], threads: int | None, disabled: list[str]):
    """onnxruntime's CPU optimisation of the template holding ``values``: the optimised ``ModelProto``."""
    import onnx
    import onnxruntime as ort

    model = _with_tensors(template, values).SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimised.onnx")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = path
        if threads:
            so.intra_op_num_threads = threads
        ort.InferenceSession(model, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)
        return onnx.load(path)


def _canonical(model) -> tuple[list[tuple], dict[str, str]]:
    """The graph's nodes with every tensor renamed by its first appearance (onnxruntime numbers the tensors
    its rewrites make in an order that can depend on the values), and the renaming."""
    names: dict[str, str] = {i.name: i.name for i in model.graph.input}
    structure = []
    for n in model.graph.node:
        for t in (*n.input, *n.output):
            if t and t not in names:
                names[t] = f"t{len(names)}"
        structure.append(
            (n.op_type, n.domain, tuple(names.get(t, t) for t in n.input), tuple(names[t] for t in n.output))
        )
    return structure, names


def _match(src_shape: tuple[int, ...], shape: tuple[int, ...], positions: np.ndarray) -> tuple[str, int] | None:
    """The layout ``(kind, block)`` whose element map is ``positions`` (``shape``; each element's source
    element + 1, 0 for padding), trying a copy, a zero-padded copy and the NCHWc reorders."""
    numbered = np.arange(1, int(np.prod(src_shape, dtype=np.int64)) + 1, dtype=np.float32).reshape(src_shape)
    trials: list[tuple[str, int]] = [("copy", 0), ("pad", 0)]
    if len(src_shape) >= 3:
        trials += [(kind, b) for b in (16, 8, 4) for kind in ("bibo", "bo")]
    for kind, block in trials:
        if kind == "copy" and positions.size != numbered.size:
            continue
        if kind == "pad" and (len(shape) != len(src_shape) or any(a < b for a, b in zip(shape, src_shape))):
            continue
        out = np.zeros(shape, np.float32)
        try:
            Placement("trial", shape, 0, kind, "trial", block).write(out, numbered)
        except ValueError:  # the blocks do not tile this shape
            continue
        if np.array_equal(out, positions):
            return kind, block
    return None


def machine_graph(
    template: bytes,
    rows: list[tuple[str, tuple[int, ...]]],
    *,
    threads: int | None = None,
    disabled_optimizers: list[str] | None = None,
    seed: int = 0,
) -> MachineGraph:
    """The template optimised by onnxruntime for this CPU, its reordered task tensors graph inputs.

    Args:
        template: ``switch.onnx``'s bytes (task tensors as placeholder initializers).
        rows: ``(name, shape)`` of every task tensor, in the order of the recipe.
        threads, disabled_optimizers: as the session that will run it.
        seed: the random tensors the layout is checked with.

    Returns:
        The optimised graph, or :func:`plain_graph` with the reason when a task tensor is used in a way a
        switch cannot rewrite.
    """
    sizes = {name: int(np.prod(shape, dtype=np.int64)) for name, shape in rows}
    if max(sizes.values(), default=0) >= _EXACT:
        big = max(sizes, key=sizes.__getitem__)
        return plain_graph(template, rows, f"{big} has {sizes[big]:,} elements, too many to number exactly")
    try:
        return _derive(template, rows, threads, list(disabled_optimizers or []), seed)
    except LayoutError as e:
        return plain_graph(template, rows, str(e))


def _groups(rows: list[tuple[str, tuple[int, ...]]]) -> list[list[str]]:
    """The task tensors in groups of fewer than 2**24 elements in all: each group is numbered 1, 2, ... through
    all its tensors at once (exact in float32, and no two of its tensors equal, which onnxruntime would merge)."""
    groups: list[list[str]] = [[]]
    total = 0
    for name, shape in rows:
        size = int(np.prod(shape, dtype=np.int64))
        if total + size >= _EXACT:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size
    return groups


def _derive(template, rows, threads, disabled, seed) -> MachineGraph:
    from onnx import numpy_helper

    names = [name for name, _ in rows]
    shapes = dict(rows)
    rng = np.random.default_rng(seed)
    random = {n: rng.standard_normal(s).astype(np.float32) for n, s in rows}
    # Each tensor holding its number: which tensor each optimised element comes from.
    ids = {n: np.full(s, i + 1, np.float32) for i, (n, s) in enumerate(rows)}
    by_random = _optimised(template, random, threads, disabled)
    by_id = _optimised(template, ids, threads, disabled)
    structure, renamed = _canonical(by_random)

    def arrays(model) -> dict[str, np.ndarray]:
        nodes, names_of = _canonical(model)
        if nodes != structure:
            raise LayoutError("onnxruntime optimised the template differently for different tensor values")
        return {names_of.get(i.name, i.name): numpy_helper.to_array(i) for i in model.graph.initializer}

    rand, ident = arrays(by_random), arrays(by_id)
    if rand.keys() != ident.keys():
        raise LayoutError("the optimised graphs hold different initializers")
    derived = [c for c in rand if not np.array_equal(rand[c], ident[c], equal_nan=True)]
    actual = {canonical: name for name, canonical in renamed.items()}  # by_random's own names
    sources: dict[str, str] = {}
    for c in derived:
        name = actual.get(c, c)
        if rand[c].dtype != np.float32:
            raise LayoutError(f"optimised initializer {name!r} depends on a task tensor and is {rand[c].dtype}")
        numbers = np.unique(ident[c][ident[c] != 0])
        number = float(numbers[0]) if numbers.size == 1 else 0.5
        if number != round(number) or not 1 <= number <= len(names):
            raise LayoutError(f"optimised initializer {name!r} mixes task tensors, or is computed from one")
        sources[c] = names[int(number) - 1]
    # Each group numbered through its tensors (the others random): where each element comes from in its tensor.
    positions: dict[str, np.ndarray] = {}
    for group in _groups(rows):
        probe, offsets, at = dict(random), {}, 0
        for n in group:
            offsets[n] = at
            probe[n] = np.arange(at + 1, at + random[n].size + 1, dtype=np.float32).reshape(shapes[n])
            at += random[n].size
        numbered = arrays(_optimised(template, probe, threads, disabled))
        for c in derived:
            if sources[c] in offsets:
                v = numbered[c]
                if not np.array_equal(v == 0, ident[c] == 0):
                    raise LayoutError(
                        f"optimised initializer {actual.get(c, c)!r} is computed from {sources[c]!r}, not copied"
                    )
                positions[c] = np.where(v == 0, 0, v - offsets[sources[c]])
    placements: list[Placement] = []
    for c in derived:
        name, source, pos = actual.get(c, c), sources[c], positions[c]
        flat = pos.reshape(-1)
        if not np.array_equal(flat, np.round(flat)) or flat.min() < 0 or flat.max() > random[source].size:
            raise LayoutError(f"optimised initializer {name!r} is computed from {source!r}, not copied")
        shape = tuple(int(d) for d in pos.shape)
        found = _match(shapes[source], shape, pos)
        if found is None:
            kind, block, perm = "perm", 0, flat.astype(np.int64) - 1
        else:
            (kind, block), perm = found, None
        placement = Placement(name, shape, 0, kind, source, block, perm)
        out = np.zeros(shape, np.float32)
        placement.write(out, random[source])
        if not np.array_equal(out, rand[c]):
            raise LayoutError(f"optimised initializer {name!r} is not {source!r} reordered ({kind})")
        placements.append(placement)
    missing = [n for n in names if n not in set(sources.values())]
    if missing:
        raise LayoutError(f"task tensor {missing[0]!r} does not reach the optimised graph's initializers")
    order = {name: i for i, name in enumerate(names)}
    placements.sort(key=lambda p: order[p.source])
    offsets_, floats = _place([(p.name, p.shape) for p in placements])
    for p, off in zip(placements, offsets_):
        p.offset = off
    blocks = sorted({p.block for p in placements if p.block})
    layout = "+".join(f"nchwc{b}" for b in blocks) or "plain-optimised"
    model = _as_inputs(by_random, [p.name for p in placements])
    return MachineGraph(model, placements, floats, layout, True)


# ----------------------------------------------------------------------------- in a child process
_PREPARED: dict[str, tuple[MachineGraph, bytes | None]] = {}  # this process's graphs, by request digest


def prepare(
    template: bytes,
    rows: list[tuple[str, tuple[int, ...]]],
    *,
    layout: str = "auto",
    threads: int | None = None,
    disabled_optimizers: list[str] | None = None,
    fill: tuple[list[dict], dict] | None = None,
) -> tuple[MachineGraph, bytes | None]:
    """:func:`machine_graph` (``layout="auto"``) or :func:`plain_graph` (``"plain"``), worked out in a child
    process, and with ``fill = (recipe, pools)`` the :func:`~nwsconvert.export.densify.recipe_graph` too.
    Kept for the life of this process, per template and request.

    Raises:
        Whatever :func:`machine_graph` raises, when the work fails in this process too.
    """
    request = {
        "rows": [[name, list(shape)] for name, shape in rows],
        "layout": layout,
        "threads": threads,
        "disabled": list(disabled_optimizers or []),
        "fill": [fill[0], {k: [list(v[0]), v[1]] for k, v in fill[1].items()}] if fill else None,
    }
    key = hashlib.sha256(template + json.dumps(request, sort_keys=True).encode()).hexdigest()
    if key in _PREPARED:
        return _PREPARED[key]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "template.onnx").write_bytes(template)
        (work / "request.json").write_text(json.dumps(request))
        try:
            done = subprocess.run(
                [sys.executable, "-m", "nwsconvert.export.layout", str(work)], capture_output=True, text=True
            )
            ok = done.returncode == 0
        except OSError:
            ok = False
        if not ok:
            # No child to be had (a frozen application's interpreter, say), or it failed: the same work in
            # this process, which then raises the failure itself.
            _child(work)
        desc = json.loads((work / "graph.json").read_text())
        placements = [
            Placement(
                p["name"],
                tuple(p["shape"]),
                p["offset"],
                p["kind"],
                p["source"],
                p["block"],
                np.load(work / p["perm"], allow_pickle=False) if p["perm"] else None,
            )
            for p in desc["placements"]
        ]
        graph = MachineGraph(
            (work / "graph.onnx").read_bytes(),
            placements,
            desc["floats"],
            desc["layout"],
            desc["optimised"],
            desc["reason"],
        )
        filler = (work / "fill.onnx").read_bytes() if fill else None
    _PREPARED[key] = (graph, filler)
    return graph, filler


def _child(work: Path) -> None:
    """``python -m nwsconvert.export.layout WORK``: read ``template.onnx`` and ``request.json``, write the graph."""
    template = (work / "template.onnx").read_bytes()
    request = json.loads((work / "request.json").read_text())
    rows = [(name, tuple(shape)) for name, shape in request["rows"]]
    if request["layout"] == "plain":
        graph = plain_graph(template, rows)
    else:
        graph = machine_graph(template, rows, threads=request["threads"], disabled_optimizers=request["disabled"])
    placements = []
    for i, p in enumerate(graph.placements):
        perm = None
        if p.perm is not None:
            perm = f"perm_{i}.npy"
            np.save(work / perm, p.perm, allow_pickle=False)
        placements.append(
            {"name": p.name, "shape": list(p.shape), "offset": p.offset, "kind": p.kind, "source": p.source,
             "block": p.block, "perm": perm}
        )  # fmt: skip
    (work / "graph.onnx").write_bytes(graph.model)
    desc = {"placements": placements, "floats": graph.floats, "layout": graph.layout, "optimised": graph.optimised,
            "reason": graph.reason}  # fmt: skip
    (work / "graph.json").write_text(json.dumps(desc))
    if request["fill"]:
        from .densify import recipe_graph

        recipe, pools = request["fill"]
        (work / "fill.onnx").write_bytes(recipe_graph(recipe, {k: (tuple(v[0]), v[1]) for k, v in pools.items()}))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
