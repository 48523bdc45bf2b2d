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
* each index initializer is stored as uint16 (pools of at most 65,536 entries;
  int32 otherwise) followed by ``Cast(to=INT64)``: Gather takes int32/int64 only;
* the input's normalisation, size, class names, task and pool-set hash are
  stored as metadata; the batch dimension is dynamic.

Opset 17, IR version 10 (onnxruntime >= 1.16 reads it).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from nwsconvert import nws_layers
from nwsconvert.storage import atomic_write_bytes

__all__ = ["export_onnx", "safetensors_offsets", "OPSET", "IR_VERSION"]

OPSET = 17
IR_VERSION = 10


def safetensors_offsets(path: str | os.PathLike) -> dict[str, tuple[int, int, str, list[int]]]:
    """``name -> (absolute offset, length, dtype, shape)`` of every tensor in a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = (8 + n + start, end - start, info["dtype"], info["shape"])
    return out


def _consumers(graph) -> dict[str, list]:
    out: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


@torch.no_grad()
def export_onnx(model: torch.nn.Module, out_path: str | os.PathLike, pool_file: str | os.PathLike, *, input_shape, metadata: dict) -> dict:
    """Write ``model`` (a converted model holding one task) as an ONNX graph sharing ``pool_file``.

    Args:
        model: NWS model in the task's state (eval mode).
        out_path: the ``.onnx`` file; ``pool_file`` must be in the same folder.
        pool_file: the bundle's ``pools.safetensors`` (tensors named by layer).
        input_shape: ``(C, H, W)`` of one image.
        metadata: JSON-able values stored as ``metadata_props``.

    Returns:
        ``{'gather_nodes', 'index_dtype', 'bytes'}``.
    """
    out_path, pool_file = Path(out_path), Path(pool_file)
    if out_path.parent.resolve() != pool_file.parent.resolve():
        raise ValueError(f"{out_path} and {pool_file} must be in the same folder (ONNX external data is relative)")
    layers = nws_layers(model)
    model = model.eval()
    for layer in layers:
        layer.nws.export_gather = True
    x = torch.zeros(1, *input_shape)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "raw.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    model,
                    (x,),
                    str(raw),
                    dynamo=False,
                    do_constant_folding=False,
                    opset_version=OPSET,
                    input_names=["input"],
                    output_names=["logits"],
                    dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                )
            proto = onnx.load(str(raw))
    finally:
        for layer in layers:
            layer.nws.export_gather = False
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    pools = {layer.name: layer.nws.pool.detach().cpu().float().numpy() for layer in layers}
    offsets = safetensors_offsets(pool_file)
    consumers = _consumers(graph)
    producers = {out: n for n in graph.node for out in n.output}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    renamed: dict[str, str] = {}
    found = 0
    index_dtype = "uint16" if max(p.shape[0] for p in pools.values()) <= 65536 else "int32"
    new_nodes = []
    for node in gathers:
        data = numpy_helper.to_array(inits[node.input[0]])
        match = [name for name, p in pools.items() if p.shape == data.shape and np.array_equal(p, data)]
        if not match:
            continue
        layer = match[0]
        found += 1
        # Pool: external data inside pools.safetensors.
        if node.input[0] not in renamed:
            t = inits[node.input[0]]
            start, length, dtype, shape = offsets[layer]
            if dtype != "F32" or list(shape) != list(data.shape):
                raise ValueError(f"{pool_file}: pool {layer!r} is {dtype} {shape}, expected F32 {list(data.shape)}")
            new_name = f"pool/{layer}"
            for other in consumers.get(t.name, []):
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
        # Indices: the Cast the exporter wrote reads an int32 initializer; store it compactly.
        cast = producers.get(node.input[1])
        src = cast.input[0] if cast is not None and cast.op_type == "Cast" else node.input[1]
        if src in inits:
            idx = numpy_helper.to_array(inits[src]).astype(np.int64)
            compact = idx.astype(np.uint16 if index_dtype == "uint16" else np.int32)
            name = f"indices/{layer}"
            graph.initializer.remove(inits[src])
            graph.initializer.append(numpy_helper.from_array(compact, name))
            inits.pop(src)
            if cast is not None and cast.op_type == "Cast":
                cast.input[0] = name
                del cast.attribute[:]
                cast.attribute.append(helper.make_attribute("to", TensorProto.INT64))
            else:
                cast_out = f"{name}/int64"
                new_nodes.append((node, helper.make_node("Cast", [name], [cast_out], to=TensorProto.INT64, name=f"Cast_{name}")))
                node.input[1] = cast_out
    for before, cast in new_nodes:
        pos = list(graph.node).index(before)
        graph.node.insert(pos, cast)
    if found != len(layers):
        raise RuntimeError(f"ONNX export: found {found} pool Gathers for {len(layers)} NWS layers: the exporter folded some weights")
    proto.ir_version = IR_VERSION
    del proto.metadata_props[:]
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value)
    data = proto.SerializeToString()
    atomic_write_bytes(out_path, data)
    onnx.checker.check_model(str(out_path))
    return {"gather_nodes": found, "index_dtype": index_dtype, "bytes": len(data)}
