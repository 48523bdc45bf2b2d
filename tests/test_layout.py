"""The switch mode's graph for this machine (nwsconvert/export/layout.py): task tensors as graph inputs in the
layout onnxruntime's kernels read, found by numbering the tensors' elements and checked bit for bit against
onnxruntime's own rewrite of random tensors.

The templates here are small graphs built directly: channel counts that are not whole NCHWc blocks (20, 36,
24: padded), a depthwise and a grouped convolution, a 3-channel stem (its own reorder), a Gemm head. Then the
uses of task tensors onnxruntime computes with, each of which made the whole template plain before: a scale
and a shift it fuses into the convolution before them (ConvMulFusion, ConvAddFusion: ConvNeXt's layer scale)
and a BatchNormalization no convolution absorbs (pre-activation, as DenseNet's: the blocked layout turns it
into a depthwise convolution whose weight and bias it computes from the four parameters), which a switch now
computes as onnxruntime does; a product with a constant and a sum of two tensors it folds (ConstantFolding),
whose tensors alone now stay plain graph inputs. And what made whole templates plain for no reason: a Mul by
a tensor a probe filled with ones (an identity onnxruntime removed), nodes written in another order (GhostNet,
HGNet, MixNet, FastViT).

Outputs are compared with a session built with the tensors as constants, to 1e-5 of the largest logit: where a
tensor stays plain the two graphs compute differently (a Mul or an Add at each run instead of once, into a
constant), and float32 rounds each such operation apart by an ulp or so (6e-8 relative) per layer; a Gemm
head whose weight is an input is not prepacked and sums in another order. Computed inputs are compared bit
for bit with onnxruntime's own constants.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from nwsconvert.export.densify import PLACEHOLDER
from nwsconvert.export.layout import ALIGN, aligned_empty, machine_graph, plain_graph, prepare

IMAGE = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 12, 12])
LOGITS = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])


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


def _graph(rows, nodes, extra=()) -> bytes:
    """A template of ``nodes``: the image in, the logits out, ``rows`` as placeholders, ``extra`` constants."""
    inits = [_placeholder(name, list(shape)) for name, shape in rows] + list(extra)
    graph = helper.make_graph(nodes, "t", [IMAGE], [LOGITS], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _head(x: str, width: int) -> tuple[list, list]:
    """Rows and nodes of a head on ``x``: global pooling, a Gemm to 5 logits."""
    rows = [("head/w", (5, width)), ("head/b", (5,))]
    nodes = [
        helper.make_node("GlobalAveragePool", [x], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "head/w", "head/b"], ["logits"], transB=1),
    ]
    return rows, nodes


def _tensors(seed: int, rows=ROWS) -> dict[str, np.ndarray]:
    """Random tensors; a BatchNormalization's variance (``.../var``) positive."""
    rng = np.random.default_rng(seed)
    out = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in rows}
    return {n: np.abs(v) + np.float32(0.5) if n.endswith("/var") else v for n, v in out.items()}


_BLOCKED: list[bool] = []


def _skip_without_blocked_layout() -> None:
    """Skip where onnxruntime has no NCHWc kernels (not x86): nothing is reordered, nothing is left plain."""
    if not _BLOCKED:
        _BLOCKED.append(machine_graph(_template(), ROWS).layout.startswith("nchwc"))
    if not _BLOCKED[0]:
        pytest.skip("this onnxruntime / CPU has no blocked layout")


def _assert_plain_exactly(graph, rows, plain: set[str], blocked: set[str]) -> None:
    """``plain`` and nothing else stays graph inputs, in the template's shape; every other tensor is placed,
    the weights ``blocked`` in a blocked reorder; the layout says how many tensors are plain and the reason
    names each."""
    assert graph.optimised and set(graph.plain) == plain
    assert graph.layout.startswith("nchwc")
    if plain:
        assert graph.layout.endswith(f"({len(plain)} tensor{'s' * (len(plain) > 1)} plain)")
        assert graph.reason is not None and all(repr(n) in graph.reason for n in plain)
    else:
        assert "plain" not in graph.layout and graph.reason is None
    shapes = dict(rows)
    by_source: dict[str, list] = {}
    for p in graph.placements:
        by_source.setdefault(p.source, []).append(p)
    read = {n for p in graph.placements for n in (p.source, *p.inputs)}
    assert read == set(shapes)  # every task tensor fills inputs
    for name in plain:
        assert [(p.name, p.kind, p.shape) for p in by_source[name]] == [(name, "copy", shapes[name])]
    for name in blocked:
        assert {p.kind for p in by_source[name]} <= {"bibo", "bo"}, name


def _assert_runs_as_constants(template: bytes, rows, graph, seeds=(1, 2)) -> None:
    """Each set of tensors written into one buffer (the first set again last) gives the logits of a session
    built with them as constants, to 1e-5 of the largest logit (the module docstring says why)."""
    sess, buffer, binding = _switch_session(graph, None)
    assert sorted(i.name for i in sess.get_inputs()) == sorted(["input", *(p.name for p in graph.placements)])
    x = np.random.default_rng(9).standard_normal((2, 3, 12, 12)).astype(np.float32)
    for seed in (*seeds, seeds[0]):
        tensors = _tensors(seed, rows)
        graph.fill(buffer, tensors)
        binding.bind_cpu_input("input", x)
        binding.bind_output("logits", "cpu")
        sess.run_with_iobinding(binding)
        ref_sess, _keep = _constant_session(template, tensors)
        ref = ref_sess.run(None, {"input": x})[0]
        got = binding.copy_outputs_to_cpu()[0]
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))


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


def test_a_task_tensor_the_optimiser_computes_with_stays_a_plain_input_alone():
    """The head's weight multiplied by a constant: onnxruntime folds the product into one constant, which a
    switch cannot rewrite by moving elements. That tensor alone stays a graph input (the Mul runs at each
    run) and says why; every convolution keeps its reordered weight. Before: the whole template ran plain."""
    _skip_without_blocked_layout()
    template = _template(computed=True)
    graph = machine_graph(template, ROWS)
    _assert_plain_exactly(graph, ROWS, {"head/w"}, {"stem/w", "conv/w"})
    assert "computes" in graph.plain["head/w"]
    _assert_runs_as_constants(template, ROWS, graph, seeds=(3, 4))


def _summed_bias() -> tuple[list, list]:
    """A head whose bias is the sum of two task tensors (onnxruntime folds the Add into one constant)."""
    rows = [
        ("stem/w", (16, 3, 3, 3)),
        ("stem/b", (16,)),
        ("conv/w", (32, 16, 3, 3)),
        ("conv/b", (32,)),
        ("head/w", (5, 32)),
        ("head/b1", (5,)),
        ("head/b2", (5,)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "stem/w", "stem/b"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["a1"]),
        helper.make_node("Conv", ["a1", "conv/w", "conv/b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["out"]),
        helper.make_node("GlobalAveragePool", ["out"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Add", ["head/b1", "head/b2"], ["head/b"]),
        helper.make_node("Gemm", ["flat", "head/w", "head/b"], ["logits"], transB=1),
    ]
    return rows, nodes


def test_task_tensors_folded_into_one_constant_together_stay_plain_and_the_rest_is_placed():
    """A head's bias computed by an Add of two task tensors: onnxruntime folds them into one constant
    ("mixes task tensors", the whole template plain, before) that is no fusion a switch computes. Those two
    alone stay graph inputs (the Add runs at each run); the convolutions keep their blocked reorders."""
    _skip_without_blocked_layout()
    rows, nodes = _summed_bias()
    template = _graph(rows, nodes)
    graph = machine_graph(template, rows)
    _assert_plain_exactly(graph, rows, {"head/b1", "head/b2"}, {"stem/w", "conv/w"})
    _assert_runs_as_constants(template, rows, graph)


def _scaled_block() -> tuple[list, list, list]:
    """A ConvNeXt-like block: a convolution, then a per-channel scale and a shift, each a task tensor reshaped
    to (1, C, 1, 1) (onnxruntime fuses both into the convolution's weight and bias)."""
    rows = [
        ("stem/w", (16, 3, 3, 3)),
        ("stem/b", (16,)),
        ("conv/w", (32, 16, 3, 3)),
        ("conv/b", (32,)),
        ("gamma", (32,)),
        ("shift", (32,)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "stem/w", "stem/b"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["a1"]),
        helper.make_node("Conv", ["a1", "conv/w", "conv/b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["gamma", "per_channel"], ["gamma4"]),
        helper.make_node("Mul", ["c", "gamma4"], ["scaled"]),
        helper.make_node("Reshape", ["shift", "per_channel"], ["shift4"]),
        helper.make_node("Add", ["scaled", "shift4"], ["shifted"]),
        helper.make_node("Relu", ["shifted"], ["out"]),
    ]
    head_rows, head_nodes = _head("out", 32)
    extra = [helper.make_tensor("per_channel", TensorProto.INT64, [4], [1, -1, 1, 1])]
    return rows + head_rows, nodes + head_nodes, extra


def test_a_scale_and_a_shift_fused_into_a_convolution_are_computed_as_onnxruntime_fuses_them():
    """onnxruntime multiplies the convolution's weight and bias by the scale and adds the shift (ConvNeXt's
    layer scale): constants computed from three task tensors ("mixes task tensors", the whole template plain,
    before). A switch computes them as onnxruntime did, bit for bit: the weight written in its blocked
    reorder and then scaled per output channel, the bias scaled and shifted. Nothing stays plain."""
    _skip_without_blocked_layout()
    rows, nodes, extra = _scaled_block()
    template = _graph(rows, nodes, extra)
    graph = machine_graph(template, rows)
    _assert_plain_exactly(graph, rows, set(), {"stem/w", "conv/w"})
    ops = {(p.source, p.op, p.inputs) for p in graph.placements if p.op}
    assert ops == {("conv/w", "mul", ("gamma",)), ("conv/b", "mul,add", ("gamma", "shift"))}
    _assert_runs_as_constants(template, rows, graph)


def _preactivation() -> tuple[list, list, list[str]]:
    """A pre-activation BatchNormalization (after a Concat, before ReLU and a convolution: as DenseNet's)."""
    norm = ["norm/scale", "norm/shift", "norm/mean", "norm/var"]
    rows = [
        ("stem/w", (16, 3, 3, 3)),
        ("stem/b", (16,)),
        ("side/w", (16, 3, 1, 1)),
        *((n, (32,)) for n in norm),
        ("conv/w", (32, 32, 3, 3)),
        ("conv/b", (32,)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "stem/w", "stem/b"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["input", "side/w"], ["s"]),
        helper.make_node("Concat", ["a", "s"], ["cat"], axis=1),
        helper.make_node("BatchNormalization", ["cat", *norm], ["n"], epsilon=1e-3),
        helper.make_node("Relu", ["n"], ["n1"]),
        helper.make_node("Conv", ["n1", "conv/w", "conv/b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["out"]),
    ]
    head_rows, head_nodes = _head("out", 32)
    return rows + head_rows, nodes + head_nodes, norm


def test_a_batchnorm_no_convolution_absorbs_is_computed_as_onnxruntime_computes_it():
    """A pre-activation BatchNormalization whose parameters are task tensors: the blocked layout turns it
    into a depthwise convolution whose weight (scale / sqrt(var + eps)) and bias (shift - mean * that)
    onnxruntime computes from all four ("mixes task tensors" before). A switch computes both the same way,
    bit for bit; every other tensor is placed; nothing stays plain."""
    _skip_without_blocked_layout()
    rows, nodes, norm = _preactivation()
    template = _graph(rows, nodes)
    graph = machine_graph(template, rows)
    _assert_plain_exactly(graph, rows, set(), {"stem/w", "conv/w"})
    ops = {(p.op, p.source, p.inputs) for p in graph.placements if p.op}
    scale, shift, mean, var = norm
    assert ops == {("bn_scale", scale, (var,)), ("bn_shift", shift, (mean, scale, var))}
    assert all(p.eps == pytest.approx(1e-3) for p in graph.placements if p.op)
    _assert_runs_as_constants(template, rows, graph)


def test_computed_inputs_are_written_whatever_order_the_tensors_come_in():
    """A switch streams a task's tensors one at a time in the recipe's order (weights, then the state): a
    computed input waits for all it reads, a scaled weight is written as it comes and scaled once its factor
    is there. Any order gives the same buffer, bit for bit, as onnxruntime's own constants; a tensor missing
    is named."""
    _skip_without_blocked_layout()
    from nwsconvert.export.layout import _optimised

    scaled_rows, nodes, extra = _scaled_block()
    pre_rows, pre_nodes, _ = _preactivation()
    for rows, template in ((scaled_rows, _graph(scaled_rows, nodes, extra)), (pre_rows, _graph(pre_rows, pre_nodes))):
        graph = machine_graph(template, rows)
        tensors = _tensors(7, rows)
        own = {i.name: onnx.numpy_helper.to_array(i) for i in _optimised(template, tensors, None, []).graph.initializer}
        for order in (list(tensors), list(tensors)[::-1]):
            buffer = aligned_empty(graph.floats)
            buffer.fill(np.nan)
            graph.fill(buffer, ((n, tensors[n]) for n in order))
            for name, view in graph.views(buffer).items():
                assert np.array_equal(view, own[name]), name
        with pytest.raises(KeyError, match="no tensor"):
            graph.fill(buffer, {n: v for n, v in tensors.items() if not n.endswith(("/var", "gamma"))})


def test_a_tensor_a_probe_once_filled_with_ones_is_not_taken_for_an_identity():
    """A Mul by the first task tensor: the probe that gave each tensor its number gave this one 1, onnxruntime
    removed the Mul as an identity, and the template, "optimised differently for different tensor values",
    ran plain. The numbers now start far from 0 and 1: every tensor is placed, none plain."""
    _skip_without_blocked_layout()
    rows = [("s", (1,)), ("stem/w", (16, 3, 3, 3)), ("stem/b", (16,))]
    nodes = [
        helper.make_node("Conv", ["input", "stem/w", "stem/b"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["a1"]),
        helper.make_node("Mul", ["a1", "s"], ["out"]),
    ]
    head_rows, head_nodes = _head("out", 16)
    rows += head_rows
    template = _graph(rows, nodes + head_nodes)
    graph = machine_graph(template, rows)
    assert graph.optimised and graph.plain == {} and graph.reason is None, graph.reason
    assert graph.layout.startswith("nchwc") and "plain" not in graph.layout
    assert {p.source for p in graph.placements} == {n for n, _ in rows}
    _assert_runs_as_constants(template, rows, graph)


def test_optimised_graphs_compare_alike_whatever_order_onnxruntime_writes_their_nodes_in():
    """onnxruntime writes independent nodes (two branches) and numbers the tensors it makes in an order that
    can change with the values (GhostNet's, HGNet's, MixNet's and FastViT's templates: "optimised differently"
    before, the whole template plain). The structure compared is the same for the graph with its nodes in
    another topological order and its tensors renamed, and each initializer keeps its key."""
    from nwsconvert.export.layout import _canonical, _optimised

    rows = [("stem/w", (16, 3, 3, 3)), ("stem/b", (16,)), ("left/w", (16, 16, 1, 1)), ("right/w", (16, 16, 3, 3))]
    nodes = [
        helper.make_node("Conv", ["input", "stem/w", "stem/b"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["a1"]),
        helper.make_node("Conv", ["a1", "left/w"], ["l"]),
        helper.make_node("Conv", ["a1", "right/w"], ["r"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["l", "r"], ["out"], axis=1),
    ]
    head_rows, head_nodes = _head("out", 32)
    rows += head_rows
    model = _optimised(_graph(rows, nodes + head_nodes), _tensors(5, rows), None, [])
    structure, names = _canonical(model)
    # Another topological order: always the last ready node first.
    made = {t: k for k, n in enumerate(model.graph.node) for t in n.output}
    todo, order = list(range(len(model.graph.node))), []
    while todo:
        ready = [k for k in todo if all(made[t] in order for t in model.graph.node[k].input if t in made)]
        order.append(ready[-1])
        todo.remove(ready[-1])
    assert order != sorted(order)  # there were independent nodes to reorder
    kept = {v.name for v in (*model.graph.input, *model.graph.output)}
    rename: dict[str, str] = {}
    for k in order:
        for t in (*model.graph.node[k].input, *model.graph.node[k].output):
            if t and t not in kept and t not in rename:
                rename[t] = f"renamed_{len(rename)}"
    other = onnx.ModelProto()
    other.CopyFrom(model)
    del other.graph.node[:]
    for k in order:
        node = other.graph.node.add()
        node.CopyFrom(model.graph.node[k])
        node.input[:] = [rename.get(t, t) for t in node.input]
        node.output[:] = [rename.get(t, t) for t in node.output]
    for init in other.graph.initializer:
        init.name = rename.get(init.name, init.name)
    structure2, names2 = _canonical(other)
    assert structure2 == structure
    assert names2 == {rename.get(n, n): key for n, key in names.items()}


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


def test_prepare_hands_back_the_tensors_left_plain_and_the_computed_inputs():
    """:func:`prepare`'s child hands back which tensors stay plain and why, and how each computed input is
    computed, as :func:`machine_graph` says."""
    _skip_without_blocked_layout()
    summed_rows, nodes = _summed_bias()
    pre_rows, pre_nodes, _ = _preactivation()
    for rows, template in ((summed_rows, _graph(summed_rows, nodes)), (pre_rows, _graph(pre_rows, pre_nodes))):
        there, _ = prepare(template, rows)
        here = machine_graph(template, rows)
        assert there.plain == here.plain and there.layout == here.layout and there.reason == here.reason
        fields = ("name", "shape", "offset", "kind", "source", "block", "op", "inputs", "eps", "source_shape")
        assert [[getattr(p, f) for f in fields] for p in there.placements] == [
            [getattr(p, f) for f in fields] for p in here.placements
        ]
        assert there.plain or any(p.op for p in there.placements)  # each case has what it is there for


def test_tensors_are_numbered_in_groups_that_float32_counts_exactly():
    """Each probe numbers a group of tensors from 4097 on through all of them (no two equal, which onnxruntime
    would merge into one constant, and none 0 or 1); a group's numbers stay under 2**24, float32's exact
    integers."""
    from nwsconvert.export.layout import _groups

    rows = [("a", (4096, 2048)), ("b", (4096, 2048)), ("c", (10,)), ("d", (1 << 23, 1))]
    groups = _groups(rows)
    assert groups == [["a"], ["b", "c"], ["d"]]
    sizes = dict(("a b c d".split()[i], int(np.prod(s))) for i, (_, s) in enumerate(rows))
    assert all(4097 + sum(sizes[n] for n in g) <= 1 << 24 for g in groups)
