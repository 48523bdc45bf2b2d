"""The switch mode in half precision: its graph in float16, its weight buffers float16.

``Runtime(bundle, precision="float16")`` runs the one-session graph with every float
tensor in float16: the weight buffers a switch writes (gathered from the pools, the
BatchNorm still folded into them, then rounded to float16), the activations, and the
constants. The image goes in and the logits come out in float32, through a ``Cast`` at
each edge, so a caller's code is the same in both precisions.

The conversion is onnxruntime's own (``onnxruntime.transformers.float16``, shipped
with onnxruntime and onnxruntime-gpu: no further dependency). Operators it keeps in
float32 (its default block list) get ``Cast`` nodes around them. The blocked CPU
layout (:mod:`nwsconvert.export.layout`) is worked out in float32, so a float16
graph runs the template's own layout. On a CPU, onnxruntime runs the float16
operators it has kernels for and casts around the others: enough to check the
numbers; the speed and memory that matter are a GPU's. An activation beyond float16's
range (65,504) becomes infinite: ``benchmarks/parity.py --precision float16`` checks
a run's test sets against float32.
"""

from __future__ import annotations

__all__ = ["PRECISIONS", "half_graph"]

PRECISIONS = ("float32", "float16")


def half_graph(model: bytes, weights: list[str]) -> bytes:
    """The serialised ONNX graph ``model`` in float16, but for its inputs and outputs other than ``weights``.

    Args:
        model: a switch-mode graph whose ``weights`` are graph inputs (float32).
        weights: the inputs that become float16 (the buffers a switch writes).

    Returns:
        The converted graph: ``weights`` float16 inputs; every other input and output as it was.
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = onnx.load_from_string(model)
    half = set(weights)
    missing = half - {i.name for i in proto.graph.input}
    if missing:
        raise ValueError(f"the graph has no input {sorted(missing)[0]!r}")
    edges = [i.name for i in proto.graph.input if i.name not in half] + [o.name for o in proto.graph.output]
    converted = convert_float_to_float16(proto, keep_io_types=edges, force_fp16_initializers=True)
    return converted.SerializeToString()
