"""The switch mode's graph for this machine (nwsconvert/export/layout.py): task tensors as graph inputs in the
layout onnxruntime's kernels read, found by numbering the tensors' elements and checked bit for bit against
onnxruntime's own rewrite of random tensors.

The templates here are small graphs built directly: channel counts that are not whole NCHWc blocks (20, 36,
24: padded), a depthwise and a grouped convolution, a 3-channel stem (its own reorder), a Gemm head.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nwsconvert.export.densify import PLACEHOLDER
from nwsconvert.export.layout import ALIGN, aligned_empty, machine_graph, plain_graph, prepare


def _placeholder(name: str, shape: list[int]) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", PLACEHOLDER), ("offset", "0"), ("length", str(4 * int(np.prod(shape))))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


ROWS = [
    ("stem/w", (20, 3, 3, 3)),
    ("stem/b", (20,)),
    ("dw/w", (20, 1, 3, 3)),
    ("dw/b", (20,)),
    ("conv/w", (36, 20, 3, 3)),
    ("conv/b", (36,)),
    ("group/w", (24, 18, 1, 1)),
    ("group/b", (24,)),
    ("head/w", (5, 24)),
    ("head/b", (5,)),
]


def _template(computed: bool = False) -> bytes:
    """A small CNN whose weights are placeholders; ``computed``: the head's weight doubled by a Mul with a
    constant first (an optimiser folds that into a new constant: not a layout a switch can rewrite)."""
    nodes = [
        helper.make_node("Conv", ["input", "stem/w", "stem/b"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["a1"]),
        helper.make_node("Conv", ["a1", "dw/w", "dw/b"], ["b"], pads=[1, 1, 1, 1], group=20),
        helper.make_node("Relu", ["b"], ["b1"]),
        helper.make_node("Conv", ["b1", "conv/w", "conv/b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["c1"]),
        helper.make_node("Conv", ["c1", "group/w", "group/b"], ["d"], group=2),
        helper.make_node("GlobalAveragePool", ["d"], ["e"]),
        helper.make_node("Flatten", ["e"], ["f"]),
    ]
    inits = [_placeholder(name, list(shape)) for name, shape in ROWS]
    head = "head/w"
    if computed:
        inits.append(helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]))
        nodes.append(helper.make_node("Mul", ["head/w", "two"], ["head/w2"]))
        head = "head/w2"
    nodes.append(helper.make_node("Gemm", ["f", head, "head/b"], ["logits"], transB=1))
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 12, 12])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in ROWS}


def _constant_session(template: bytes, tensors: dict[str, np.ndarray]):
    """What a session built for one task runs: the template with the task's tensors as constants."""
    opts = ort.SessionOptions()
    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in tensors.items()}
    opts.add_external_initializers(list(values), list(values.values()))
    return ort.InferenceSession(template, opts, providers=["CPUExecutionProvider"]), values


def _switch_session(graph, tensors_by_task):
    """A session of ``graph`` with one aligned buffer, refilled per task; yields (task, logits)."""
    opts = ort.SessionOptions()
    if graph.optimised:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(graph.model, opts, providers=["CPUExecutionProvider"])
    buffer = aligned_empty(graph.floats)
    inputs = {n: ort.OrtValue.ortvalue_from_numpy(v) for n, v in graph.views(buffer).items()}
    binding = sess.io_binding()
    for n, v in inputs.items():
        binding.bind_ortvalue_input(n, v)
    return sess, buffer, binding


def test_layouts_are_found_for_padded_depthwise_grouped_and_stem_convolutions():
    """On a CPU with onnxruntime's NCHWc kernels: each convolution weight is matched to a reorder (channel
    counts padded to whole blocks), biases to a padded copy, the head to a plain copy; every input's
    buffer starts on an aligned boundary. After refilling the buffers for one set of tensors, then
    another, then the first again, the logits match a session built with each as constants (the Gemm
    head is not prepacked when its weight is an input: float32 sums in another order, 1e-5 relative)."""
    template = _template()
    graph = machine_graph(template, ROWS)
    if graph.layout == "plain":
        pytest.skip(f"this onnxruntime / CPU has no layout to match ({graph.reason})")
    kinds = {p.source: (p.kind, p.block) for p in graph.placements}
    assert sorted(kinds) == sorted(n for n, _ in ROWS)  # every task tensor reaches exactly its inputs
    assert kinds["conv/w"][0] == "bibo" and kinds["stem/w"][0] == "bo" and kinds["head/w"][0] == "copy"
    padded = {p.source: p.shape for p in graph.placements}
    block = kinds["conv/w"][1]
    assert padded["conv/w"][0] % block == 0 and padded["conv/w"][0] >= 36  # 36 output channels: padded
    assert all(p.offset * 4 % ALIGN == 0 for p in graph.placements)
    sess, buffer, binding = _switch_session(graph, None)
    x = np.random.default_rng(9).standard_normal((2, 3, 12, 12)).astype(np.float32)
    for seed in (1, 2, 1):
        tensors = _tensors(seed)
        graph.fill(buffer, tensors)
        binding.bind_cpu_input("input", x)
        binding.bind_output("logits", "cpu")
        sess.run_with_iobinding(binding)
        got = binding.copy_outputs_to_cpu()[0]
        ref_sess, _keep = _constant_session(template, tensors)
        ref = ref_sess.run(None, {"input": x})[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_a_task_tensor_the_optimiser_computes_with_runs_the_plain_graph_and_says_why():
    """The head's weight multiplied by a constant: onnxruntime folds the product into one constant, which a
    switch cannot rewrite by moving elements. The template then runs as it is, its tensors inputs."""
    template = _template(computed=True)
    graph = machine_graph(template, ROWS)
    assert graph.layout == "plain" and not graph.optimised
    assert graph.reason and "head/w" in graph.reason
    sess, buffer, binding = _switch_session(graph, None)
    tensors = _tensors(3)
    graph.fill(buffer, tensors)
    x = np.random.default_rng(4).standard_normal((1, 3, 12, 12)).astype(np.float32)
    binding.bind_cpu_input("input", x)
    binding.bind_output("logits", "cpu")
    sess.run_with_iobinding(binding)
    ref_sess, _keep = _constant_session(template, tensors)
    ref = ref_sess.run(None, {"input": x})[0]
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_prepare_runs_in_a_child_and_returns_the_same_graph():
    """:func:`prepare` (what the Runtime calls): the same placements as :func:`machine_graph` in this process,
    the graph's bytes loadable, and the plain request the template's own shapes."""
    template = _template()
    here = machine_graph(template, ROWS)
    there, filler = prepare(template, ROWS)
    assert filler is None
    assert [(p.name, p.shape, p.offset, p.kind, p.block) for p in there.placements] == [
        (p.name, p.shape, p.offset, p.kind, p.block) for p in here.placements
    ]
    onnx.checker.check_model(onnx.load_from_string(there.model))
    plain, _ = prepare(template, ROWS, layout="plain")
    reference = plain_graph(template, ROWS)
    assert plain.layout == "plain" and [p.shape for p in plain.placements] == [tuple(s) for _, s in ROWS]
    assert [p.offset for p in plain.placements] == [p.offset for p in reference.placements]


def test_tensors_are_numbered_in_groups_that_float32_counts_exactly():
    """Each probe numbers a group of tensors 1, 2, ... through all of them (no two equal, which onnxruntime
    would merge into one constant); a group stays under 2**24 elements, float32's exact integers."""
    from nwsconvert.export.layout import _groups

    rows = [("a", (4096, 2048)), ("b", (4096, 2048)), ("c", (10,)), ("d", (1 << 23, 1))]
    groups = _groups(rows)
    assert groups == [["a"], ["b", "c"], ["d"]]
    sizes = dict(("a b c d".split()[i], int(np.prod(s))) for i, (_, s) in enumerate(rows))
    assert all(sum(sizes[n] for n in g) < 1 << 24 for g in groups)
