"""ONNX graphs that rebuild every NWS weight with Gather at load time.

The task's model is traced with every NWS layer in export mode, so each weight
appears in the graph as ``Reshape(Gather(pool, Cast(indices)))`` and constant
folding is off (the exporters would otherwise fold the Gather into a dense
weight). Then, with ``onnx``:

* each pool initializer is renamed ``pool/<layer>`` and turned into external
  data pointing into the bundle's ``pools.safetensors`` (safetensors stores
  raw little-endian tensors, so ONNX can address them by offset): every task
  graph shares that one file, and a task's ``.onnx`` holds only its indices
  and small tensors;
* each layer's indices are stored at ``ceil(log2 n)`` bits and unpacked in the
  graph (:func:`index_nodes`): pools of up to 256 entries as uint8 + Cast;
  up to 65,536 entries (the paper's 512: 9 bits) as a uint8 low byte plus the
  high bits as packed bit planes, rebuilt with BitShift / Mod / Mul / ReduceSum;
  larger pools as int32. onnxruntime folds all of it, like the Gather, once at
  session creation, so inference runs the dense graph;
* the input's normalisation, size, class names, task and pool-set hash are
  stored as metadata; the batch dimension is dynamic.

Opset 17, IR version 10 (onnxruntime >= 1.16 reads it).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch.nn.utils import parametrize

from nwsconvert import nws_layers
from nwsconvert.errors import NWSError
from nwsconvert.formats.stfile import read_header
from nwsconvert.formats.storage import atomic_write_bytes

from .densify import PLACEHOLDER
from .graph_edits import consumers, guard_zero_pad_pools, index_source, inline_shared_initializers, prune
from .indexplanes import pack_index_planes

__all__ = [
    "export_onnx",
    "export_graph",
    "index_nodes",
    "safetensors_offsets",
    "ExportError",
    "EXPORTERS",
    "OPSET",
    "IR_VERSION",
]

OPSET = 17  # TorchScript exporter
DYNAMO_OPSET = 18  # torch.export-based exporter (its lowest)
IR_VERSION = 10


#: Pool-file dtypes a graph can gather from: safetensors name -> ONNX element type.
_POOL_TYPES = {"F32": TensorProto.FLOAT, "F16": TensorProto.FLOAT16}


def safetensors_offsets(path: str | os.PathLike) -> dict[str, tuple[int, int, str, list[int]]]:
    """``name -> (absolute offset, length, dtype, shape)`` of every tensor in a safetensors file (checked header)."""
    header = read_header(path)
    return {name: (t.start, t.end - t.start, t.dtype, list(t.shape)) for name, t in header.tensors.items()}


def index_nodes(name: str, indices: np.ndarray, pool_size: int) -> tuple[list, list, str, str]:
    """Initializers and nodes that rebuild ``indices`` as int64 inside an ONNX graph.

    Args:
        name: prefix of the new tensors (``indices/<layer>``).
        indices: ``(N,)`` integers in ``[0, pool_size)``.
        pool_size: ``n``; the stored width is ``ceil(log2 n)`` bits.

    Returns:
        ``(initializers, nodes, output name, storage)``; ``storage`` is ``uint8``,
        ``uint8+<k>bit`` (low byte + k packed high-bit planes) or ``int32``.
        Bytes stored: N (<= 256 entries), N + k * ceil(N / 8) (<= 65,536), 4N beyond.
    """
    count = np.asarray(indices).size
    out = f"{name}/int64"
    parts = pack_index_planes(indices, pool_size)
    if "high" not in parts:
        kind, stored = ("int32", parts["i32"]) if "i32" in parts else ("uint8", parts["low"])
        init = numpy_helper.from_array(stored, name)
        return [init], [helper.make_node("Cast", [name], [out], to=TensorProto.INT64, name=f"{name}/cast")], out, kind
    packed = parts["high"]  # (high, ceil(N / 8))
    high = packed.shape[0]
    c = lambda suffix, value: numpy_helper.from_array(np.asarray(value), f"{name}/{suffix}")  # noqa: E731
    inits = [
        numpy_helper.from_array(parts["low"], f"{name}/low"),
        numpy_helper.from_array(packed, f"{name}/high"),
        c("axis2", np.array([2], np.int64)),
        c("shifts", np.arange(8, dtype=np.uint8)),
        c("two", np.array(2, np.uint8)),
        c("shape", np.array([high, 8 * packed.shape[1]], np.int64)),
        c("start", np.array([0], np.int64)),
        c("end", np.array([count], np.int64)),
        c("axis1", np.array([1], np.int64)),
        c("weights", (np.int64(1) << (8 + np.arange(high, dtype=np.int64)))[:, None]),
        c("axis0", np.array([0], np.int64)),
    ]

    def n(op, ins, outs, **kw):
        return helper.make_node(
            op, [f"{name}/{i}" for i in ins], [f"{name}/{o}" for o in outs], name=f"{name}/{outs[0]}_{op}", **kw
        )  # noqa: E731

    nodes = [
        n("Unsqueeze", ["high", "axis2"], ["h3"]),  # (high, M, 1)
        n("BitShift", ["h3", "shifts"], ["shifted"], direction="RIGHT"),  # (high, M, 8)
        n("Mod", ["shifted", "two"], ["bit"]),
        n("Reshape", ["bit", "shape"], ["flat"]),  # (high, 8M), bit i of plane j at [j, i]
        n("Slice", ["flat", "start", "end", "axis1"], ["planes"]),  # (high, N)
        n("Cast", ["planes"], ["planes64"], to=TensorProto.INT64),
        n("Mul", ["planes64", "weights"], ["scaled"]),
        n("ReduceSum", ["scaled", "axis0"], ["hi"], keepdims=0),  # (N,)
        n("Cast", ["low"], ["low64"], to=TensorProto.INT64),
        helper.make_node("Add", [f"{name}/low64", f"{name}/hi"], [out], name=f"{name}/add"),
    ]
    return inits, nodes, out, f"uint8+{high}bit"


class ExportError(NWSError, RuntimeError):
    """torch cannot export this architecture to ONNX (the message names the operator and the exporters tried)."""


EXPORTERS = ("auto", "torchscript", "dynamo")


_ATEN = re.compile(r"aten(?:::|\.)(\w+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(e: BaseException) -> str:
    """``operator aten::<op> (<ExceptionType>)`` when the exporter's message (or its cause) names one, else its first line."""
    chain, link = [], e
    while link is not None and len(chain) < 4:
        chain.append(str(link))
        link = link.__cause__ or link.__context__
    text = _ANSI.sub("", "\n".join(chain))
    op = _ATEN.search(text)
    if op:
        return f"operator aten::{op.group(1)} ({type(e).__name__})"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


@contextlib.contextmanager
def _quiet():
    """Silence what the exporters print at the file-descriptor level (the TorchScript exporter writes
    its whole IR graph to stderr on failure; the torch.export-based one reports progress)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _torchscript(module, args, path: Path, input_names, dynamic_axes) -> None:
    # torch.nn.MultiheadAttention's inference fast path (_native_multi_head_attention, taken under
    # no_grad) has no ONNX symbolic: trace the plain path, which computes the same function.
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            do_constant_folding=False,
            opset_version=OPSET,
            input_names=input_names,
            output_names=["logits"],
            dynamic_axes=dynamic_axes,
        )
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def _dynamo(module, args, path: Path, input_names, dynamic_axes) -> None:
    try:
        import onnxscript  # noqa: F401  (torch's torch.export-based exporter builds graphs with it)
    except ImportError:
        raise ExportError("the torch.export-based ONNX exporter needs onnxscript: pip install onnxscript") from None
    batch = torch.export.Dim("batch")
    flat = [{0: batch} if name in dynamic_axes else None for name in input_names]
    shapes = []  # structured as forward's signature: a *args parameter takes one tuple
    for param in inspect.signature(module.forward).parameters.values():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            shapes.append(tuple(flat[len(shapes) :]))
            break
        shapes.append(flat[len(shapes)])
    # torch.export specialises a dimension of size 1: trace the image input at batch 2.
    example = tuple(torch.cat([a, a]) if d else a for a, d in zip(args, flat))
    program = torch.export.export(module, example, dynamic_shapes=tuple(shapes), strict=False)
    onnx_program = torch.onnx.export(
        program,
        dynamo=True,
        optimize=False,
        opset_version=DYNAMO_OPSET,
        input_names=input_names,
        output_names=["logits"],
        verbose=False,
    )
    onnx_program.save(str(path))


def _trace(
    module: torch.nn.Module, args: tuple, input_names: list[str], dynamic_axes: dict, exporter: str = "auto"
) -> tuple[onnx.ModelProto, str]:
    """Export ``module(*args)`` without constant folding (the Gathers must stay in the graph).

    ``exporter``: ``torchscript`` (opset 17), ``dynamo`` (torch.export-based, opset 18, needs
    onnxscript) or ``auto``: TorchScript, and the torch.export-based exporter for the
    architectures TorchScript cannot lower (e.g. ``unfold`` in timm's HaloNets, adaptive
    pooling to a non-factor size).

    Returns:
        ``(graph, the exporter that wrote it)``.

    Raises:
        ExportError: no exporter tried can export the module; the message names each one's failure
            and says whether the dense model (parametrizations removed) exports.
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    order = {"auto": (_torchscript, _dynamo), "torchscript": (_torchscript,), "dynamo": (_dynamo,)}[exporter]
    with tempfile.TemporaryDirectory() as tmp:
        used, failures = _attempt(module, args, Path(tmp) / "raw.onnx", input_names, dynamic_axes, order)
        if used is not None:
            return onnx.load(str(Path(tmp) / "raw.onnx")), used
        dense_used, _ = _attempt(_dense_copy(module), args, Path(tmp) / "dense.onnx", input_names, dynamic_axes, order)
    verdict = (
        "the dense model exports, so the NWS layers are at fault: please report this model"
        if dense_used is not None
        else "the dense model fails too, so the operator belongs to the architecture"
    )
    raise ExportError(f"torch cannot export {type(module).__name__} to ONNX ({'; '.join(failures)}); {verdict}")


def _attempt(module, args, path: Path, input_names, dynamic_axes, order) -> tuple[str | None, list[str]]:
    """Try each exporter of ``order`` in turn: ``(the one that wrote path or None, the failures before it)``."""
    failures = []
    for export in order:
        name = export.__name__.strip("_")
        try:
            with _quiet():
                export(module, args, path, input_names, dynamic_axes)
            return name, failures
        except ExportError:
            raise
        except Exception as e:  # each exporter raises its own types (SymbolicValueError, TorchExportError, ...)
            failures.append(f"{name}: {_first_line(e)}")
    return None, failures


def _dense_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` with every parametrized weight made a plain tensor (the model as it was before ``convert``)."""
    dense = copy.deepcopy(module)
    for m in list(dense.modules()):
        if parametrize.is_parametrized(m):
            for name in list(m.parametrizations):
                parametrize.remove_parametrizations(m, name, leave_parametrized=True)
    return dense


def _link_pools(proto: onnx.ModelProto, layers, pool_file: Path) -> tuple[int, set[str]]:
    """Point every pool Gather at ``pool_file`` (external data ``pool/<layer>``); store constant indices at
    ``ceil(log2 n)`` bits (:func:`index_nodes`). Indices that are graph inputs are left as they are.

    Returns:
        ``(pool Gathers found, index storages used)``.
    """
    graph = proto.graph
    inline_shared_initializers(graph)
    inits = {t.name: t for t in graph.initializer}
    pools = {layer.name: layer.nws.pool.detach().cpu().float().numpy() for layer in layers}
    offsets = safetensors_offsets(pool_file)
    readers = consumers(graph)
    producers = {out: n for n in graph.node for out in n.output}
    gathers = [(n, n.input[0]) for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    renamed: dict[str, str] = {}
    linked: set[str] = set()
    found = 0
    storage: set[str] = set()
    new_nodes, after = [], []
    for node, pool_init in gathers:
        data = numpy_helper.to_array(inits[pool_init])
        match = [name for name, p in pools.items() if p.shape == data.shape and np.array_equal(p, data)]
        if not match:
            continue
        # Layers whose pools are equal (the exporter gave them one initializer) each keep their own name.
        layer = next((name for name in match if name not in linked), match[0])
        linked.add(layer)
        found += 1
        # Pool: external data inside pools.safetensors.
        start, length, dtype, shape = offsets[layer]
        if dtype not in _POOL_TYPES or list(shape) != list(data.shape):
            raise ValueError(f"{pool_file}: pool {layer!r} is {dtype} {shape}, expected F32 or F16 {list(data.shape)}")
        if dtype != "F32":
            # A float16 pool file: Gather the float16 rows, then Cast them to float32 (exact).
            gathered = node.output[0]
            node.output[0] = f"{gathered}/{dtype.lower()}"
            cast_back = helper.make_node(
                "Cast", [node.output[0]], [gathered], to=TensorProto.FLOAT, name=f"{node.name or gathered}/cast"
            )
            after.append((node, cast_back))
        if pool_init not in renamed:
            t = inits[pool_init]
            t.data_type = _POOL_TYPES[dtype]
            new_name = f"pool/{layer}"
            for other in readers.get(t.name, []):
                other.input[:] = [new_name if i == t.name else i for i in other.input]
            renamed[t.name] = new_name
            t.name = new_name
            t.ClearField("raw_data")
            t.ClearField("float_data")
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (("location", pool_file.name), ("offset", str(start)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
        # Indices: the exporter wrote an integer initializer reaching the Gather through Casts (and, from
        # the torch.export-based exporter, a Reshape to its own 1-D shape); store them at ceil(log2 n)
        # bits and rebuild them in the graph right before the Gather.
        src = index_source(node.input[1], producers, inits)
        if src is not None:
            idx = numpy_helper.to_array(inits[src]).astype(np.int64).reshape(-1)
            new_inits, nodes, out, kind = index_nodes(f"indices/{layer}", idx, pools[layer].shape[0])
            storage.add(kind)
            graph.initializer.extend(new_inits)
            node.input[1] = out
            new_nodes.append((node, nodes))
    for before, nodes in new_nodes:
        pos = list(graph.node).index(before)
        for k, extra in enumerate(nodes):
            graph.node.insert(pos + k, extra)
    for gather, cast_back in after:
        graph.node.insert(list(graph.node).index(gather) + 1, cast_back)
    prune(graph)  # the old Casts and Reshapes, and initializers nothing reads any more
    if found != len(layers):
        missing = sorted({layer.name for layer in layers} - linked)
        raise GraphLinkError(
            f"found {found} pool Gathers for the {len(layers)} NWS layers the forward uses, none for layer "
            f"{missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + ": the exporter folded or merged some weights"
        )
    return found, storage


def _write(proto: onnx.ModelProto, out_path: Path, metadata: dict) -> int:
    """Set IR version and metadata, check with onnx's checker, then write atomically; returns the file's bytes.

    The graph is checked as a file beside ``out_path`` (its pools are external data found relative to
    it) and renamed into place only when it passes, so a graph onnxruntime would refuse is never left
    at ``out_path``.

    Raises:
        onnx.checker.ValidationError: the graph is invalid (``out_path`` untouched).
    """
    proto.ir_version = IR_VERSION
    del proto.metadata_props[:]
    for node in proto.graph.node:  # the torch.export-based exporter's stack traces and scopes: ~25 KB a layer
        node.doc_string = ""
        del node.metadata_props[:]
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value)
    data = proto.SerializeToString()
    placeholders = [t for t in proto.graph.initializer if _location(t) == PLACEHOLDER]
    if placeholders:  # no file holds them: check the structure, with them as graph inputs
        probe = onnx.ModelProto()
        probe.CopyFrom(proto)
        held = {t.name for t in placeholders}
        kept = [t for t in probe.graph.initializer if t.name not in held]
        del probe.graph.initializer[:]
        probe.graph.initializer.extend(kept)
        probe.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in placeholders)
        onnx.checker.check_model(probe)
        atomic_write_bytes(out_path, data)
        return len(data)
    trial = out_path.with_name(f".{out_path.name}.check")
    atomic_write_bytes(trial, data)
    try:
        onnx.checker.check_model(str(trial))
        os.replace(trial, out_path)
    finally:
        trial.unlink(missing_ok=True)
    return len(data)


def _location(t) -> str | None:
    return next((e.value for e in t.external_data if e.key == "location"), None)


def _same_folder(out_path: Path, pool_file: Path) -> None:
    if out_path.parent.resolve() != pool_file.parent.resolve():
        raise ValueError(f"{out_path} and {pool_file} must be in the same folder (ONNX external data is relative)")


@torch.no_grad()
def export_onnx(
    model: torch.nn.Module,
    out_path: str | os.PathLike,
    pool_file: str | os.PathLike,
    *,
    input_shape,
    metadata: dict,
    exporter: str = "auto",
) -> dict:
    """Write ``model`` (a converted model holding one task) as an ONNX graph sharing ``pool_file``.

    Args:
        model: NWS model in the task's state (eval mode).
        out_path: the ``.onnx`` file; ``pool_file`` must be in the same folder.
        pool_file: the bundle's ``pools.safetensors`` (tensors named by layer).
        input_shape: ``(C, H, W)`` of one image.
        metadata: JSON-able values stored as ``metadata_props``.
        exporter: ``auto`` (TorchScript, else torch.export-based), ``torchscript`` or ``dynamo``.

    Returns:
        ``{'gather_nodes', 'index_dtype' (storage of the indices, e.g. ``uint8+1bit``), 'bytes', 'exporter'}``.

    Raises:
        ExportError: torch cannot export the architecture (names the operator).
    """
    out_path, pool_file = Path(out_path), Path(pool_file)
    _same_folder(out_path, pool_file)
    layers = nws_layers(model)
    model = model.eval()
    axes = {"input": {0: "batch"}, "logits": {0: "batch"}}
    args = (torch.zeros(1, *input_shape),)
    _, found, storage, size, used, _ = export_graph(
        model, args, ["input"], axes, layers, pool_file, out_path, metadata, exporter
    )
    return {"gather_nodes": found, "index_dtype": ",".join(sorted(storage)), "bytes": size, "exporter": used}


def export_graph(
    module,
    args: tuple,
    input_names: list[str],
    axes: dict,
    layers,
    pool_file: Path,
    out_path: Path,
    metadata,
    exporter,
    edit=None,
) -> tuple[onnx.ModelProto, int, set[str], int, str, object]:
    """Trace ``module(*args)`` with the NWS ``layers`` in export mode, link its pools to ``pool_file``,
    check the graph and write it to ``out_path``. Under ``exporter="auto"``, a TorchScript graph that
    cannot be linked or fails onnx's checker is traced again with the torch.export-based exporter.

    Args:
        edit: ``edit(graph) -> result``, applied to the linked graph before it is checked and
            written (the one-session template, :func:`nwsconvert.export.densify.dense_template`); its
            external data at :data:`~nwsconvert.export.densify.PLACEHOLDER` is supplied at run time.

    Returns:
        ``(graph, pool Gathers, index storages, bytes written, exporter used, edit's result)``.

    Raises:
        ExportError: no exporter gives a valid graph (the message names each one's problem and the layer).
    """
    problems: list[str] = []
    for again in (False, True):
        with export_mode(layers) as ran:
            proto, used = _trace(module, args, input_names, axes, "dynamo" if again else exporter)
        try:
            found, storage = _link_pools(proto, [layer for layer in layers if layer.name in ran], pool_file)
            guard_zero_pad_pools(proto)
            edited = edit(proto) if edit is not None else None
            size = _write(proto, out_path, metadata)
        except (onnx.checker.ValidationError, GraphLinkError) as e:
            problems.append(f"{used}: {_graph_problem(e)}")
            if exporter == "auto" and used == "torchscript" and not again:
                continue
            raise ExportError(
                f"no valid ONNX graph for {type(module).__name__} ({'; '.join(problems)}): please report this model"
            ) from e
        return proto, found, storage, size, used, edited
    raise AssertionError("unreachable")


class GraphLinkError(RuntimeError):
    """A traced graph whose pool Gathers cannot all be found (the exporter folded or merged some weights)."""


_LAYER = re.compile(r"'?([\w.]+?)\.parametrizations\.weight")


def _graph_problem(e: BaseException) -> str:
    """One line for a graph that failed linking or onnx's checker, naming the NWS layer where the message shows one."""
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    layer = _LAYER.search(str(e))
    return f"layer {layer.group(1)!r}: {text}" if layer else text


@contextlib.contextmanager
def export_mode(layers):
    """NWS ``layers`` in export mode for a trace (each weight is ``Reshape(Gather(pool, indices))``);
    yields the set of layer names the traced forward used (eval-time forwards may skip some, e.g.
    GoogLeNet's auxiliary heads), filled during the trace."""
    ran: set[str] = set()
    hooks = [layer.nws.register_forward_hook(lambda *_, name=layer.name: ran.add(name)) for layer in layers]
    for layer in layers:
        layer.nws.export_gather = True
    try:
        yield ran
    finally:
        for hook in hooks:
            hook.remove()
        for layer in layers:
            layer.nws.export_gather = False
