"""The switch mode's graph for this machine: the bundle's dense template with every task tensor a graph input,
in the layout this machine's kernels read.

On a CPU, onnxruntime runs convolutions in its blocked NCHWc kernels: when a session is built from constant
weights it reorders each convolution's weight once (blocks of 8 or 16 channels, by the CPU's vector width).
Weights given as plain graph inputs skip that rewrite and run 1.2-3.9x slower (ResNet-18; RESULTS, "Many
tasks for the memory of one"). :func:`machine_graph` lets onnxruntime optimise the template here, with constant
stand-ins for the task tensors, and then turns the reordered weights back into graph inputs. Where each
element of a reordered weight comes from is read off the optimised graph itself: built once with each task
tensor holding its number in the recipe, and once per group of tensors (under 2**24, float32's exact
integers) with their elements numbered through the group (so that no two are equal, which onnxruntime would
merge), the optimised graph's weights say, element by element, which tensor and which element they hold (or
0: padding). The numbers start at 4097, clear of 0 and 1 (a Mul by ones is an identity onnxruntime removes)
and of the small constants a template holds. Each input's layout is then matched to a plain copy, a
zero-padded copy, or one of the NCHWc reorders (``OIHWBiBo``, ``OIHWBo``), and checked bit for bit against
onnxruntime's own rewrite of random tensors. A task then runs at the speed of a session built for it, while
a switch only rewrites the inputs' buffers (:meth:`MachineGraph.fill`). The optimised graphs are compared by
structure (:func:`_canonical`): onnxruntime writes independent nodes, and numbers the tensors it makes, in an
order that can change with the values.

onnxruntime also computes with some task tensors: it fuses a Mul and an Add by per-channel tensors into the
convolution before them (ConvNeXt's layer scale), turns a BatchNormalization no convolution absorbs
(pre-activation, DenseNet's) into a depthwise convolution whose weight and bias it computes from the four
parameters, folds a product of tensors into one constant. Which tensors such a constant comes from is found
by probes that move groups of suspects (the tensors a node reads other than as a weight or bias) to other
values. Where it is one of those fusions, the input is computed as onnxruntime computes it (a placement's
``op``: float32, step by step, checked bit for bit like the rest); otherwise those tensors stay graph inputs
of the template before it is optimised (an input is never folded), so only the layers that read them lose
the blocked layout (``MachineGraph.plain`` says which and why, ``layout`` how many: ``nchwc16 (3 tensors
plain)``), and the rest is derived again, for at most a few rounds. Where even that fails (the structure
changes with the values, say), the template runs as it is, its tensors graph inputs (``layout="plain"``,
slower on CPU, exact everywhere); the reason is recorded. On CUDA, cuDNN reads weights as they are: the
plain graph is the one to run.

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
#: The first number the probes give a task tensor or an element: clear of 0 and 1 (the identities an optimiser
#: removes), of -1, 2, 0.5 and of the small constants a template holds (equal constants are merged).
_FIRST = 4097
_LIMIT = _EXACT - _FIRST  # the elements one probe numbers: fewer than this


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
        op: how its values are computed from ``source`` and ``inputs`` before they are laid out, as
            onnxruntime computes a constant it fuses (``""``: they are ``source``'s own): ``mul`` (steps
            separated by commas, each taking the next of ``inputs``: ``mul`` multiplies by it per output
            channel, ``add`` adds it; a convolution's weight and bias with a scale and a shift fused in),
            ``bn_scale`` (``source / sqrt(inputs[0] + eps)``: a BatchNormalization's scale and variance) or
            ``bn_shift`` (``source - inputs[0] * inputs[1] / sqrt(inputs[2] + eps)``: its shift, mean, scale
            and variance), each step rounded to float32 as onnxruntime rounds it.
        inputs: the other template tensors ``op`` reads.
        eps: ``bn_scale``, ``bn_shift``: the BatchNormalization's epsilon.
        source_shape: where ``op`` is not empty, the shape of the values it computes (``source``'s).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    kind: str
    source: str
    block: int = 0
    perm: np.ndarray | None = field(default=None, repr=False)
    op: str = ""
    inputs: tuple[str, ...] = ()
    eps: float = 0.0
    source_shape: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def scales_in_place(self) -> bool:
        """Its op only multiplies per output channel: ``source`` is written as it comes, the factors then."""
        return bool(self.op) and set(self.op.split(",")) == {"mul"}

    def compute(self, values: dict[str, np.ndarray]) -> np.ndarray:
        """The values ``op`` computes from ``values`` (``source`` and ``inputs`` by name), float32."""
        x = np.asarray(values[self.source], np.float32)
        if self.op in ("bn_scale", "bn_shift"):
            eps = np.float32(self.eps)
            if self.op == "bn_scale":
                return x / np.sqrt(values[self.inputs[0]] + eps)
            mean, scale, var = (values[n] for n in self.inputs)
            return x - mean * (scale / np.sqrt(var + eps))
        for step, name in zip(self.op.split(","), self.inputs):
            operand = np.asarray(values[name], np.float32)
            if step == "mul":
                x = x * _per_channel(operand, x.shape)
            else:
                x = x + operand.reshape(x.shape)
        return x

    def scale(self, dst: np.ndarray, factors: list[np.ndarray]) -> None:
        """Multiply ``dst``, this input's buffer already written from ``source``, by ``factors`` in turn, each
        per output channel of ``source`` (the padding stays 0)."""
        for factor in factors:
            per = np.broadcast_to(_per_channel(np.asarray(factor, np.float32), self.source_shape), self.source_shape)
            laid = np.zeros(self.shape, np.float32)
            Placement(self.name, self.shape, 0, self.kind, self.source, self.block, self.perm).write(laid, per)
            np.multiply(dst, laid, out=dst)

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
            np.take(np.ascontiguousarray(src).reshape(-1), np.maximum(self.perm, 0), out=flat)
            flat[self.perm < 0] = 0


def _per_channel(factor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``factor`` (one value, or one per output channel) shaped to broadcast over a tensor of ``shape``."""
    if factor.size == 1:
        return factor.reshape(())
    return factor.reshape(-1, *[1] * (len(shape) - 1))


@dataclass
class MachineGraph:
    """The graph a switch-mode session runs, and where each task tensor goes in its inputs.

    Attributes:
        model: the graph (serialised ONNX) with one input per placement besides the image.
        placements: its weight inputs, in buffer order.
        floats: the size of one slot's buffer, in floats (every placement, aligned).
        layout: ``nchwc8`` / ``nchwc16`` (reordered for this CPU's blocked kernels), ``plain``.
        optimised: the graph is already optimised for this machine (its session runs no optimiser).
        reason: why the layout is ``plain`` where an optimised one was asked for, or which task tensors stay
            plain graph inputs in an optimised one and why (else ``None``).
        plain: the task tensors that stay graph inputs in the template's own shape (a ``copy`` placement each)
            in an optimised graph, each with why (onnxruntime computes with it: the layers that read it run
            without the blocked layout); empty where every tensor is placed, or the whole graph is plain.
        external: the bundle files the template's external data names (beyond the placeholder), as
            :func:`prepare` checked them (``external=``), to check again where it hands out a kept graph.
    """

    model: bytes
    placements: list[Placement]
    floats: int
    layout: str
    optimised: bool
    reason: str | None = None
    plain: dict[str, str] = field(default_factory=dict)
    external: list[str] = field(default_factory=list)

    def fill(self, buffer: np.ndarray, tensors) -> None:
        """Write a task's dense tensors into a slot's ``buffer`` (flat float32 of ``floats``), every placement.

        Args:
            tensors: name -> float32 array of the template's shape, or an iterable of ``(name, array)``
                pairs (:func:`~nwsconvert.export.densify.iter_dense_tensors`: each written, then dropped).

        Raises:
            KeyError: a placement's tensor is not among ``tensors`` (named).
        """
        pairs = tensors.items() if isinstance(tensors, dict) else tensors
        by_tensor: dict[str, list[Placement]] = {}
        waiting: dict[int, set[str]] = {}  # a computed placement -> the tensors it still waits for
        for p in self.placements:
            for name in dict.fromkeys((p.source, *p.inputs)):
                by_tensor.setdefault(name, []).append(p)
            waiting[id(p)] = {p.source, *p.inputs}
        held: dict[str, np.ndarray] = {}  # what a computed placement reads besides a weight written as it came
        for name, tensor in pairs:
            for p in by_tensor.pop(name, ()):
                dst = buffer[p.offset : p.offset + p.size].reshape(p.shape)
                left = waiting[id(p)]
                left.discard(name)
                if not p.op:
                    p.write(dst, tensor)
                elif p.scales_in_place:  # the weight as it comes; the factors once the weight and all are here
                    if name == p.source:
                        p.write(dst, tensor)
                    else:
                        held[name] = tensor
                    if not left:
                        p.scale(dst, [held[n] for n in p.inputs])
                else:  # vectors: computed once all are here
                    held[name] = tensor
                    if not left:
                        p.write(dst, p.compute(held).reshape(p.source_shape))
            del tensor  # not alive while the next one is computed (unless a computed placement holds it)
        if by_tensor:
            raise KeyError(f"no tensor {next(iter(by_tensor))!r} for the switch graph's inputs")

    def views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Input name -> its array in a slot's ``buffer`` (views: what a session binds)."""
        return {p.name: buffer[p.offset : p.offset + p.size].reshape(p.shape) for p in self.placements}


def aligned_empty(floats: int, dtype=np.float32) -> np.ndarray:
    """A flat array of ``floats`` elements of ``dtype`` (float32, or float16) whose data starts on an
    ``ALIGN``-byte boundary."""
    size = np.dtype(dtype).itemsize
    raw = np.empty(floats * size + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + floats * size].view(dtype)


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


def _with_inputs(template: bytes, plain: list[str]) -> bytes:
    """The template with the task tensors ``plain`` graph inputs (onnxruntime folds no input into a constant)."""
    import onnx

    if not plain:
        return template
    return _as_inputs(onnx.load_from_string(template), list(plain))


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


def _digest(*parts) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


def _canonical(model) -> tuple[list[str], dict[str, str]]:
    """The optimised graph's structure, and a name for each initializer that does not depend on the order
    onnxruntime wrote the nodes in or numbered its new tensors by (both can depend on the values).

    Each node is known by what it computes from the graph's inputs (its operator, attributes and inputs, up
    to initializers known by shape and type) and by where its outputs go (its readers, down to the graph's
    outputs); each initializer by its shape, type and readers. Returns the sorted keys of every node and
    initializer (two graphs of the same structure give the same list) and initializer name -> its key (keys
    that two initializers share are told apart by their order in the graph: such initializers are read
    alike, and a wrong pairing fails the checks against random tensors).
    """
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    outputs = {v.name: k for k, v in enumerate(graph.output)}
    nodes = list(graph.node)
    made = {t: k for k, n in enumerate(nodes) for t in n.output if t}
    readers: dict[str, list[tuple[int, int]]] = {}
    for k, n in enumerate(nodes):
        for slot, t in enumerate(n.input):
            if t:
                readers.setdefault(t, []).append((k, slot))
    # Kahn's order: a node after every node that makes one of its inputs.
    waiting = [len({made[t] for t in n.input if t in made}) for n in nodes]
    after: dict[int, set[int]] = {}
    for k, n in enumerate(nodes):
        for t in n.input:
            if t in made:
                after.setdefault(made[t], set()).add(k)
    order, ready = [], [k for k, w in enumerate(waiting) if w == 0]
    while ready:
        k = ready.pop()
        order.append(k)
        for j in after.get(k, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) != len(nodes):
        raise LayoutError("the optimised graph has a cycle")

    def leaf(t: str) -> str:
        if not t:
            return ""
        if t in inits:
            return _digest("init", tuple(inits[t].dims), inits[t].data_type)
        return _digest("input", t)  # the image and the plain task tensors: named by the template

    up: dict[str, str] = {}
    node_up: dict[int, str] = {}
    for k in order:
        n = nodes[k]
        attrs = tuple(sorted((a.name, a.SerializeToString()) for a in n.attribute))
        node_up[k] = _digest(n.op_type, n.domain, attrs, tuple(up.get(t) or leaf(t) for t in n.input))
        for slot, t in enumerate(n.output):
            if t:
                up[t] = _digest(node_up[k], slot)
    down: dict[int, str] = {}
    for k in reversed(order):
        uses = [
            (slot, outputs.get(t, -1), sorted((down[j], s) for j, s in readers.get(t, [])))
            for slot, t in enumerate(nodes[k].output)
            if t
        ]
        down[k] = _digest(node_up[k], uses)
    names: dict[str, str] = {}
    seen: dict[str, int] = {}
    for i in graph.initializer:
        key = _digest("init", tuple(i.dims), i.data_type, sorted((down[j], s) for j, s in readers.get(i.name, [])))
        seen[key] = seen.get(key, 0) + 1
        names[i.name] = f"{key}#{seen[key]}"
    return sorted(down.values()) + sorted(names.values()), names


def _match(src_shape: tuple[int, ...], positions: np.ndarray) -> tuple[str, int] | None:
    """The layout ``(kind, block)`` whose element map is ``positions`` (each element's source element + 1, 0
    for padding), trying a copy, a zero-padded copy and the NCHWc reorders (:func:`_fit` of the numbered
    source)."""
    numbered = np.arange(1, int(np.prod(src_shape, dtype=np.int64)) + 1, dtype=np.float32).reshape(src_shape)
    return _fit(numbered, positions)


#: Rounds of :func:`machine_graph`: each leaves the tensors the last one could not place as graph inputs.
_ROUNDS = 4


def machine_graph(
    template: bytes,
    rows: list[tuple[str, tuple[int, ...]]],
    *,
    threads: int | None = None,
    disabled_optimizers: list[str] | None = None,
    seed: int = 0,
) -> MachineGraph:
    """The template optimised by onnxruntime for this CPU, its reordered task tensors graph inputs.

    An input onnxruntime computes from task tensors as one of the fusions :func:`_fusions` knows (a scale and a
    shift fused into a convolution, a BatchNormalization's blocked depthwise convolution) is computed the same
    way at each switch (a placement's ``op``). A task tensor it computes with otherwise (folds into another
    constant, say) stays a graph input in the template before the optimisation, in its own shape: only the
    layers that read it lose the blocked layout. Round after round (at most ``_ROUNDS``) the tensors that could
    not be placed are left plain and the rest derived again.

    Args:
        template: ``switch.onnx``'s bytes (task tensors as placeholder initializers).
        rows: ``(name, shape)`` of every task tensor, in the order of the recipe.
        threads, disabled_optimizers: as the session that will run it.
        seed: the random tensors the layout is checked with.

    Returns:
        The optimised graph (``plain`` names the tensors left graph inputs, and why), or :func:`plain_graph`
        with the reason when the optimised graph could not be matched at all.
    """
    sizes = {name: int(np.prod(shape, dtype=np.int64)) for name, shape in rows}
    plain = {n: f"{size:,} elements, too many to number exactly" for n, size in sizes.items() if size >= _LIMIT}
    disabled = list(disabled_optimizers or [])
    for _ in range(_ROUNDS):
        if len(plain) == len(rows):
            return plain_graph(template, rows, _plain_note(plain, rows) + ": none left to place")
        try:
            return _derive(template, rows, plain, threads, disabled, seed)
        except _Unplaced as e:
            if not set(e.tensors) - set(plain):
                return plain_graph(template, rows, str(e))
            plain.update((n, why) for n, why in e.tensors.items() if n not in plain)
        except LayoutError as e:
            return plain_graph(template, rows, str(e))
    return plain_graph(template, rows, f"{_ROUNDS} rounds left task tensors to place; {_plain_note(plain, rows)}")


class _Unplaced(LayoutError):
    """Task tensors the optimised graph computes with: ``tensors`` (name -> why) are to stay graph inputs."""

    def __init__(self, message: str, tensors: dict[str, str]):
        super().__init__(message)
        self.tensors = tensors


def _plain_note(plain: dict[str, str], rows) -> str:
    order = [n for n, _ in rows if n in plain]
    shown = "; ".join(f"{n!r} ({plain[n]})" for n in order[:6])
    more = f"; and {len(order) - 6} more" if len(order) > 6 else ""
    many = len(order) != 1
    return f"{len(order)} task tensor{'s' * many} {'stay' if many else 'stays'} plain graph input{'s' * many}: {shown}{more}"


def _groups(rows: list[tuple[str, tuple[int, ...]]]) -> list[list[str]]:
    """The task tensors in groups small enough to number exactly in float32: each group is numbered
    ``_FIRST``, ``_FIRST + 1``, ... through all its tensors at once (no two of its tensors equal, which
    onnxruntime would merge)."""
    groups: list[list[str]] = [[]]
    total = 0
    for name, shape in rows:
        size = int(np.prod(shape, dtype=np.int64))
        if total + size >= _LIMIT:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size
    return groups


_READ_AS_WEIGHT = {
    ("Conv", 1), ("Conv", 2), ("ConvTranspose", 1), ("ConvTranspose", 2), ("Gemm", 1), ("Gemm", 2),
    ("MatMul", 1), ("LayerNormalization", 1), ("LayerNormalization", 2),
}  # fmt: skip
_LAYOUT_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Cast", "Flatten"}


def _suspects(template: bytes, names: list[str]) -> list[tuple[int, list[str]]]:
    """The task tensors that onnxruntime may compute with, grouped by the node that reads them: every tensor
    read (through reshapes and transposes) other than as a convolution's, Gemm's or MatMul's weight or bias
    (a BatchNormalization's parameters, a Mul's or Add's operand, ...): ``(node index, its tensors in input
    order)``, in node order."""
    import onnx

    graph = onnx.load_from_string(template).graph
    readers: dict[str, list[tuple[int, int]]] = {}
    for k, n in enumerate(graph.node):
        for slot, t in enumerate(n.input):
            readers.setdefault(t, []).append((k, slot))
    units: dict[int, list[tuple[int, str]]] = {}
    for name in names:
        todo, done = [name], set()
        while todo:
            t = todo.pop()
            for k, slot in readers.get(t, []):
                n = graph.node[k]
                if (n.op_type, slot) in _READ_AS_WEIGHT:
                    continue
                if n.op_type in _LAYOUT_OPS and slot == 0:
                    todo.extend(o for o in n.output if o and o not in done)
                    done.update(n.output)
                    continue
                units.setdefault(k, []).append((slot, name))
    return [(k, list(dict.fromkeys(name for _, name in sorted(unit)))) for k, unit in sorted(units.items())]


def _derive(template, rows, plain, threads, disabled, seed) -> MachineGraph:
    from onnx import numpy_helper

    live = [(n, tuple(s)) for n, s in rows if n not in plain]
    names = [n for n, _ in live]
    shapes = dict(live)
    base = _with_inputs(template, [n for n, _ in rows if n in plain])
    rng = np.random.default_rng(seed)
    random = _probe(rng, base, live)
    # Each tensor holding its number (from _FIRST): which tensor each optimised element comes from.
    ids = {n: np.full(s, _FIRST + i, np.float32) for i, (n, s) in enumerate(live)}
    by_random = _optimised(base, random, threads, disabled)
    structure, renamed = _canonical(by_random)

    def arrays(model) -> dict[str, np.ndarray]:
        nodes, names_of = _canonical(model)
        if nodes != structure:
            raise LayoutError("onnxruntime optimised the template differently for different tensor values")
        return {names_of[i.name]: numpy_helper.to_array(i) for i in model.graph.initializer}

    rand, ident = arrays(by_random), arrays(_optimised(base, ids, threads, disabled))
    derived = [c for c in rand if not np.array_equal(rand[c], ident[c], equal_nan=True)]
    actual = {canonical: name for name, canonical in renamed.items()}  # by_random's own names
    sources: dict[str, str] = {}
    mixed: list[str] = []  # computed from several task tensors (or from one with others' numbers)
    unplaced: dict[str, str] = {}
    for c in derived:
        numbers = np.unique(ident[c][ident[c] != 0])
        number = float(numbers[0]) - _FIRST if numbers.size == 1 else 0.5
        if number != round(number) or not 0 <= number < len(names):
            mixed.append(c)
        elif rand[c].dtype != np.float32:
            unplaced[names[int(number)]] = f"onnxruntime stores it as {rand[c].dtype} {actual[c]!r}"
        else:
            sources[c] = names[int(number)]
    computed: list[Placement] = []
    if mixed:
        import onnx

        graph = onnx.load_from_string(base).graph
        units = _suspects(base, names)
        fused = _fused(graph, units, set(names), random, {c: rand[c] for c in mixed}, actual)
        computed = list(fused.values())
        left = [c for c in mixed if c not in fused]
        if left:  # which tensors those come from: to be left plain
            feeds = _mixers(base, units, random, rand, left, actual, arrays, threads, disabled, seed)
            for c in left:
                why = f"onnxruntime computes {actual[c]!r} from it"
                unplaced.update((n, why) for u in feeds[c] for n in units[u][1] if n not in unplaced)
    if unplaced:
        raise _Unplaced(_plain_note(unplaced, rows), unplaced)
    # Each group numbered through its tensors (the others random): where each element comes from in its tensor.
    positions: dict[str, np.ndarray] = {}
    for group in _groups(live):
        probe, offsets, at = dict(random), {}, _FIRST - 1
        for n in group:
            offsets[n] = at
            probe[n] = np.arange(at + 1, at + random[n].size + 1, dtype=np.float32).reshape(shapes[n])
            at += random[n].size
        numbered = arrays(_optimised(base, probe, threads, disabled))
        for c, source in sources.items():
            if source in offsets:
                v = numbered[c]
                if not np.array_equal(v == 0, ident[c] == 0):
                    unplaced[source] = f"onnxruntime computes {actual[c]!r} from it"
                positions[c] = np.where(v == 0, 0, v - offsets[source])
    placements: list[Placement] = []
    for c, source in sources.items():
        if source in unplaced:
            continue
        name, pos = actual[c], positions[c]
        flat = pos.reshape(-1)
        if not np.array_equal(flat, np.round(flat)) or flat.min() < 0 or flat.max() > random[source].size:
            unplaced[source] = f"onnxruntime computes {name!r} from it"
            continue
        shape = tuple(int(d) for d in pos.shape)
        found = _match(shapes[source], pos)
        if found is None:
            kind, block, perm = "perm", 0, flat.astype(np.int64) - 1
        else:
            (kind, block), perm = found, None
        placement = Placement(name, shape, 0, kind, source, block, perm)
        out = np.zeros(shape, np.float32)
        placement.write(out, random[source])
        if not np.array_equal(out, rand[c]):
            unplaced[source] = f"onnxruntime computes {name!r} from it (not a {kind} of it)"
            continue
        placements.append(placement)
    placements += computed
    reached = set(sources.values()) | {n for p in computed for n in (p.source, *p.inputs)}
    unplaced.update((n, "no initializer of the optimised graph holds it") for n in names if n not in reached)
    if unplaced:
        raise _Unplaced(_plain_note(unplaced, rows), unplaced)
    placements += [Placement(n, tuple(int(d) for d in s), 0, "copy", n) for n, s in rows if n in plain]
    order = {name: i for i, (name, _) in enumerate(rows)}
    placements.sort(key=lambda p: order[p.source])
    offsets_, floats = _place([(p.name, p.shape) for p in placements])
    for p, off in zip(placements, offsets_):
        p.offset = off
    blocks = sorted({p.block for p in placements if p.block})
    layout = "+".join(f"nchwc{b}" for b in blocks) or "plain-optimised"
    if plain:
        layout += f" ({len(plain)} tensor{'s' * (len(plain) != 1)} plain)"
    model = _as_inputs(by_random, [p.name for p in placements if p.source not in plain])
    return MachineGraph(
        model, placements, floats, layout, True, _plain_note(plain, rows) if plain else None, dict(plain)
    )


def _probe(rng, template: bytes, rows) -> dict[str, np.ndarray]:
    """Random float32 tensors for ``rows``, those a BatchNormalization reads as its variance positive (so that
    what onnxruntime computes from them, and the checks against it, hold numbers, not NaN)."""
    import onnx

    variances = {n.input[4] for n in onnx.load_from_string(template).graph.node if n.op_type == "BatchNormalization"}
    out = {n: rng.standard_normal(s).astype(np.float32) for n, s in rows}
    return {n: np.abs(v) + np.float32(0.5) if n in variances else v for n, v in out.items()}


def _mixers(base, units, random, rand, mixed, actual, arrays, threads, disabled, seed):
    """Which of the groups of suspects ``units`` (:func:`_suspects`) each of the ``mixed`` initializers is
    computed from.

    Each group of suspects (the tensors one node reads) gets a binary number; two probes per bit move the
    groups whose bit is 1, then those whose bit is 0, to other random values. An initializer computed from
    one group changes in exactly one probe of each pair, which spells that group's number; one computed from
    several changes in both where their numbers differ, and every group those changes allow is named.

    Returns:
        Initializer -> the indices in ``units`` of the groups it is computed from.

    Raises:
        LayoutError: an initializer changes with no group (onnxruntime computes it from tensors read as
            weights: leaving suspects plain would not stop it).
    """
    bits = max(1, (len(units) - 1).bit_length())
    other = _probe(np.random.default_rng(seed + 1), base, [(n, random[n].shape) for _, unit in units for n in unit])
    changed: dict[str, list[tuple[bool, bool]]] = {c: [] for c in mixed}
    for k in range(bits if units else 0):
        pair = []
        for polarity in (1, 0):
            moved = [n for u, (_, unit) in enumerate(units) if (u >> k) & 1 == polarity for n in unit]
            if not moved:
                pair.append(dict.fromkeys(mixed, False))
                continue
            got = arrays(_optimised(base, {**random, **{n: other[n] for n in moved}}, threads, disabled))
            pair.append({c: not np.array_equal(got[c], rand[c], equal_nan=True) for c in mixed})
        for c in mixed:
            changed[c].append((pair[0][c], pair[1][c]))
    feeds: dict[str, list[int]] = {}
    for c in mixed:
        if not units or any(not (one or zero) for one, zero in changed[c]):
            raise LayoutError(f"onnxruntime computes {actual[c]!r} from task tensors it reads as weights")
        feeds[c] = [
            u
            for u in range(len(units))
            if all(one if (u >> k) & 1 else zero for k, (one, zero) in enumerate(changed[c]))
        ]
    return feeds


def _fit(value: np.ndarray, target: np.ndarray) -> tuple[str, int] | None:
    """The layout ``(kind, block)`` that lays ``value`` out as ``target``, bit for bit (NaN where NaN)."""
    trials: list[tuple[str, int]] = [("copy", 0), ("pad", 0)]
    if value.ndim >= 3:
        trials += [(kind, b) for b in (16, 8, 4) for kind in ("bibo", "bo")]
    for kind, block in trials:
        if kind == "copy" and value.size != target.size:
            continue
        if kind == "pad" and (value.ndim != target.ndim or any(a < b for a, b in zip(target.shape, value.shape))):
            continue
        out = np.zeros(target.shape, np.float32)
        try:
            Placement("trial", tuple(target.shape), 0, kind, "trial", block).write(out, value)
        except ValueError:  # the blocks do not tile this shape
            continue
        if np.array_equal(out, target, equal_nan=True):
            return kind, block
    return None


def _fusions(graph, node_index: int, live: set[str]) -> list[tuple[str, str, tuple[str, ...], float]]:
    """What onnxruntime may compute from the task tensors a node reads, as ``(op, source, inputs, eps)`` of a
    :class:`Placement`: a BatchNormalization's scale and shift (its blocked layout's depthwise convolution),
    or the weight and bias of the convolution before a chain of Mul and Add by task tensors (ConvMulFusion,
    ConvAddFusion)."""
    nodes = list(graph.node)
    made = {t: n for n in nodes for t in n.output}

    def operand(t: str) -> str | None:  # the task tensor behind reshapes, or None
        while t not in live and t in made and made[t].op_type in _LAYOUT_OPS:
            t = made[t].input[0]
        return t if t in live else None

    node = nodes[node_index]
    if node.op_type == "BatchNormalization":
        scale, shift, mean, var = node.input[1:5]
        if not {scale, shift, mean, var} <= live:
            return []
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        return [("bn_scale", scale, (var,), eps), ("bn_shift", shift, (mean, scale, var), eps)]
    chain: list[tuple[str, str]] = []
    while node.op_type in ("Mul", "Add") and len(node.input) == 2:
        found = [(operand(t), other) for t, other in (node.input, node.input[::-1])]
        found = [(t, other) for t, other in found if t is not None and other in made]
        if len(found) != 1:
            return []
        chain.insert(0, ("mul" if node.op_type == "Mul" else "add", found[0][0]))
        node = made[found[0][1]]
    if node.op_type != "Conv" or not chain:
        return []
    out = []
    weight, bias = node.input[1], (node.input[2] if len(node.input) > 2 else "")
    factors = tuple(t for step, t in chain if step == "mul")
    if weight in live and factors:
        out.append((",".join("mul" for _ in factors), weight, factors, 0.0))
    if bias in live:
        out.append((",".join(step for step, _ in chain), bias, tuple(t for _, t in chain), 0.0))
    return out


def _values_key(a: np.ndarray) -> bytes:
    """What a layout keeps of ``a``: its nonzero values, sorted (a copy, a padding or a reorder moves values
    and adds zeros; random values are never zero and almost never equal)."""
    return np.sort(a[a != 0], kind="stable").tobytes()


def _fused(graph, units, live: set[str], random, mixed: dict[str, np.ndarray], actual) -> dict[str, Placement]:
    """The ``mixed`` initializers (key -> their values from the random tensors) that one of the fusions
    :func:`_fusions` knows gives, bit for bit: key -> a placement computing it the same way at each switch.
    Each fusion of every group of suspects is computed once, from the random tensors, and found by its
    values (:func:`_values_key`), then laid out and compared."""
    by_values: dict[bytes, list[tuple[tuple, np.ndarray]]] = {}
    for k, _ in units:
        for op, source, inputs, eps in _fusions(graph, k, live):
            value = Placement("", (), 0, "copy", source, op=op, inputs=inputs, eps=eps).compute(random)
            by_values.setdefault(_values_key(value), []).append(((op, source, inputs, eps), value))
    out: dict[str, Placement] = {}
    for c, target in mixed.items():
        for (op, source, inputs, eps), value in by_values.get(_values_key(target), []):
            if value.ndim == 1 and target.ndim > 1:  # a vector laid out as a depthwise weight (C, 1, 1, 1)
                value = value.reshape(-1, *[1] * (target.ndim - 1))
            found = _fit(value, target)
            if found is not None:
                kind, block = found
                out[c] = Placement(
                    actual[c], tuple(int(d) for d in target.shape), 0, kind, source, block, None, op, inputs, eps,
                    tuple(value.shape),
                )  # fmt: skip
                break
    return out


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
    precision: str = "float32",
    external: tuple[str, str, str] | None = None,
) -> tuple[MachineGraph, bytes | None]:
    """:func:`machine_graph` (``layout="auto"``) or :func:`plain_graph` (``"plain"``), worked out in a child
    process, and with ``fill = (recipe, pools)`` the :func:`~nwsconvert.export.densify.recipe_graph` too.
    ``precision="float16"`` (``layout="plain"`` only): both graphs' weight tensors in float16
    (:func:`~nwsconvert.export.precision.half_graph`). ``external = (graph file, bundle folder,
    placeholder)``: the template's external-data locations are checked first
    (:func:`~nwsconvert.export.bundlefile.check_external_data`), so that the process asking never imports
    onnx. Kept for the life of this process, per template and request.

    Raises:
        FormatError: ``external``'s check refused the template (raised here after the child refused it).
        Whatever :func:`machine_graph` raises, when the work fails in this process too.
    """
    if precision != "float32" and layout != "plain":
        raise ValueError(f"precision={precision!r} runs the template's own layout: give layout='plain' with it")
    request = {
        "rows": [[name, list(shape)] for name, shape in rows],
        "layout": layout,
        "threads": threads,
        "disabled": list(disabled_optimizers or []),
        "fill": [fill[0], {k: [list(v[0]), v[1]] for k, v in fill[1].items()}] if fill else None,
        "precision": precision,
        "external": list(external) if external else None,
    }
    key = hashlib.sha256(template + json.dumps(request, sort_keys=True).encode()).hexdigest()
    if key in _PREPARED:
        graph, filler = _PREPARED[key]
        if external:  # the same bytes, checked in the child: the files they name checked again, as they are now
            from .bundlefile import bundle_file

            for name in graph.external:
                bundle_file(external[1], name, f"{Path(external[0]).name}'s external data")
        return graph, filler
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
                p["op"],
                tuple(p["inputs"]),
                p["eps"],
                tuple(p["source_shape"]),
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
            desc.get("plain", {}),
            desc.get("external", []),
        )
        filler = (work / "fill.onnx").read_bytes() if fill else None
    _PREPARED[key] = (graph, filler)
    return graph, filler


def _child(work: Path) -> None:
    """``python -m nwsconvert.export.layout WORK``: read ``template.onnx`` and ``request.json``, write the graph."""
    template = (work / "template.onnx").read_bytes()
    request = json.loads((work / "request.json").read_text())
    rows = [(name, tuple(shape)) for name, shape in request["rows"]]
    if request.get("external"):  # before anything reads the graph
        from .bundlefile import check_external_data

        graph_file, bundle, placeholder = request["external"]
        external = check_external_data(template, Path(graph_file), bundle, placeholder=placeholder)
    else:
        external = []
    half = request.get("precision") == "float16"
    if request["layout"] == "plain":
        graph = plain_graph(template, rows)
        if half:
            from .precision import half_graph

            graph.model = half_graph(graph.model, [p.name for p in graph.placements])
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
             "block": p.block, "perm": perm, "op": p.op, "inputs": list(p.inputs), "eps": p.eps,
             "source_shape": list(p.source_shape)}
        )  # fmt: skip
    (work / "graph.onnx").write_bytes(graph.model)
    desc = {"placements": placements, "floats": graph.floats, "layout": graph.layout, "optimised": graph.optimised,
            "reason": graph.reason, "plain": graph.plain, "external": external}  # fmt: skip
    (work / "graph.json").write_text(json.dumps(desc))
    if request["fill"]:
        from .densify import recipe_graph

        recipe, pools = request["fill"]
        pools = {k: (tuple(v[0]), v[1]) for k, v in pools.items()}
        (work / "fill.onnx").write_bytes(recipe_graph(recipe, pools, out_type="float16" if half else "float32"))


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
