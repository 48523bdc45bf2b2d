"""Edits of a traced ONNX graph before its pools are linked and it is written (:mod:`.onnx_graph`).

* :func:`consumers`: who reads each tensor;
* :func:`inline_shared_initializers`: undo the TorchScript exporter's merging of equal initializers,
  so every NWS layer's Gather reads its own pool and index tensors;
* :func:`index_source`: the initializer behind a Gather's index input;
* :func:`prune`: drop nodes and initializers nothing reads;
* :func:`guard_zero_pad_pools`: rewrite ``MaxPool(Pad(x, 0))`` so that no runtime can fold the zero
  pad into the pool's own (-inf) padding.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

__all__ = ["consumers", "inline_shared_initializers", "index_source", "prune", "read_names", "guard_zero_pad_pools"]


def consumers(graph) -> dict[str, list]:
    """Tensor name -> the nodes of ``graph`` that read it, in graph order."""
    out: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def inline_shared_initializers(graph) -> None:
    """Undo the TorchScript exporter's merging of equal initializers: it keeps one and feeds the others
    through ``Identity`` nodes, so two layers whose indices (or pools, or BatchNorm vectors) are equal
    share a tensor. Every reader of such an ``Identity`` reads the initializer itself (graph outputs
    excepted), so each layer's pool Gather finds its tensors as initializers."""
    inits = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    alias = {
        n.output[0]: n.input[0]
        for n in graph.node
        if n.op_type == "Identity" and n.input[0] in inits and n.output[0] not in outputs
    }
    if not alias:
        return
    for node in graph.node:
        node.input[:] = [alias.get(name, name) for name in node.input]
    for node in [n for n in graph.node if n.op_type == "Identity" and n.output[0] in alias]:
        graph.node.remove(node)


#: Operators that pass a 1-D index tensor on unchanged but for its dtype or a no-op shape.
_INDEX_PASS = ("Cast", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten")


def index_source(name: str, producers: dict, inits: dict) -> str | None:
    """The initializer whose values reach a Gather's index input ``name`` through :data:`_INDEX_PASS`
    operators only (``None``: the indices are a graph input, as in ``switch.onnx``, or computed)."""
    for _ in range(8):
        if name in inits:
            return name
        node = producers.get(name)
        if node is None or node.op_type not in _INDEX_PASS:
            return None
        name = node.input[0]
    return None


def read_names(graph) -> set[str]:
    """Every tensor name a node of ``graph`` reads, inside its subgraphs (If, Loop, Scan) too."""
    read = set()
    for n in graph.node:
        read.update(n.input)
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                read |= read_names(sub)
    return read


def prune(graph) -> None:
    """Remove nodes whose outputs nothing reads (graph outputs excepted), then initializers nothing reads."""
    outputs = {o.name for o in graph.output}
    while True:
        read = read_names(graph) | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    read = read_names(graph)
    for t in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(t)


def _const_value(name: str, inits: dict, producers: dict, depth: int = 0):
    """The value of ``name`` when it follows from initializers and ``Constant`` nodes alone (the
    TorchScript exporter computes a Pad's pads with Reshape / Slice / Cast of constants), else ``None``."""
    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = producers.get(name)
    if (
        node is None
        or depth > 16
        or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
    ):
        return None
    feeds = {}
    for i in node.input:
        if i:
            value = _const_value(i, inits, producers, depth + 1)
            if value is None:
                return None
            feeds[i] = value
    from onnx.reference import ReferenceEvaluator

    try:
        outputs = ReferenceEvaluator(node).run(None, feeds)
    except Exception:  # an operator the reference evaluator lacks: not a constant we can use
        return None
    return np.asarray(outputs[list(node.output).index(name)])


def _ints(node, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return list(a.ints) if a.type == onnx.AttributeProto.INTS else a.i
    return default


def guard_zero_pad_pools(proto: onnx.ModelProto) -> int:
    """Rewrite every 2-D ``MaxPool(Pad(x, 0))`` as ``Max(MaxPool(x, pads), border)``; returns how many.

    onnxruntime's ``Pad_Fusion`` (1.17 to at least 1.31) folds a constant zero Pad into a following
    MaxPool's own padding, which counts as -inf: a window that sees only negatives and padding then
    returns the negative maximum instead of 0 (timm's BiT stem pads the stem convolution's output, then
    pools: 2-3 % off the largest logit). The rewrite pools ``x`` with the Pad's pads as the pool's own
    and takes the maximum with ``border``, a ``(1, 1, H_out, W_out)`` constant that is 0 where a window
    covers zero padding and -inf elsewhere: the same function, exactly, in any runtime, with no Pad
    left to fold. A Pad whose input size shape inference cannot tell is left as it is.
    """
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    readers = consumers(graph)
    shapes = None
    count = 0
    for pool in [n for n in graph.node if n.op_type == "MaxPool" and len(n.output) == 1]:
        pad = producers.get(pool.input[0])
        if pad is None or pad.op_type != "Pad" or len(readers.get(pad.output[0], [])) != 1:
            continue
        mode = next((a.s for a in pad.attribute if a.name == "mode"), b"constant")
        pads = _const_value(pad.input[1], inits, producers) if len(pad.input) > 1 else None
        value = _const_value(pad.input[2], inits, producers) if len(pad.input) > 2 and pad.input[2] else np.zeros(1)
        if mode != b"constant" or pads is None or value is None or len(pad.input) > 3 or np.any(value != 0):
            continue
        pads = [int(p) for p in np.asarray(pads).reshape(-1)]
        kernel = _ints(pool, "kernel_shape", [])
        if len(kernel) != 2 or len(pads) != 8 or any(pads[i] for i in (0, 1, 4, 5)) or min(pads) < 0:
            continue  # 2-D pools, padded on H and W only
        if any(a.name == "auto_pad" and a.s not in (b"", b"NOTSET") for a in pool.attribute):
            continue
        if shapes is None:
            inferred = onnx.shape_inference.infer_shapes(proto)
            shapes = {
                v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                for v in (*inferred.graph.value_info, *inferred.graph.input)
            }
        dims = shapes.get(pad.input[0])
        if dims is None or len(dims) != 4 or dims[2] is None or dims[3] is None:
            continue
        top, left, bottom, right = pads[2], pads[3], pads[6], pads[7]
        own = _ints(pool, "pads", [0, 0, 0, 0])
        strides = _ints(pool, "strides", [1, 1])
        dilations = _ints(pool, "dilations", [1, 1])
        ceil = bool(_ints(pool, "ceil_mode", 0))
        if own[0] != own[2] or own[1] != own[3]:
            continue  # torch's max_pool2d (which computes the border) pads symmetrically
        ring = torch.zeros(1, 1, dims[2] + top + bottom, dims[3] + left + right, dtype=torch.float64)
        ring[..., top : top + dims[2], left : left + dims[3]] = float("-inf")
        border = torch.nn.functional.max_pool2d(ring, kernel, strides, (own[0], own[1]), dilations, ceil_mode=ceil).to(
            torch.float32
        )
        name = f"{pool.output[0]}/zero_pad_border"
        graph.initializer.append(numpy_helper.from_array(border.numpy(), name))
        pooled = f"{pool.output[0]}/pooled"
        out = pool.output[0]
        pool.input[0] = pad.input[0]
        pool.output[0] = pooled
        del pool.attribute[:]
        pool.attribute.extend(
            [
                helper.make_attribute("kernel_shape", kernel),
                helper.make_attribute("strides", strides),
                helper.make_attribute("dilations", dilations),
                helper.make_attribute("ceil_mode", int(ceil)),
                helper.make_attribute("pads", [top + own[0], left + own[1], bottom + own[2], right + own[3]]),
            ]
        )
        position = list(graph.node).index(pool)
        graph.node.insert(position + 1, helper.make_node("Max", [pooled, name], [out], name=f"{out}/max_border"))
        count += 1
    if count:
        prune(graph)  # the Pads
    return count
