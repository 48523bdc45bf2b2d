"""The one-session mode's graph: the task's dense, BatchNorm-folded weights as initializers the runtime supplies.

:func:`dense_template` edits a traced ``switch`` graph (every NWS layer's indices and every
floating state entry as graph inputs, weights rebuilt by ``Reshape(Gather(pool, indices))``)
into the graph a task runs at dense speed:

* each NWS layer's gathered weight becomes an initializer ``weight/<layer>``;
* a convolution followed only by an inference ``BatchNormalization`` whose four parameters are
  state inputs is fused: the convolution takes ``fold/<layer>/weight`` and ``fold/<layer>/bias``
  (``W * s`` and ``(b - mean) * s + beta``, ``s = gamma / sqrt(var + eps)`` per output channel) and
  the BatchNormalization is gone;
* every other state input becomes an initializer of the same name;
* the Gathers, the index unpacking and the pools are removed.

Every new initializer is external data at :data:`PLACEHOLDER`, a location that does not exist:
the graph holds no task. The recipe, one row per tensor (:func:`dense_template`'s return value), goes
into ``bundle.json``. The runtime's switch mode turns those initializers into graph inputs, laid out
for the machine (:mod:`nwsconvert.export.layout`), and fills them at each switch from a task's values
(:func:`task_values`: its indices, and its BatchNorm folds computed once from its pack): with NumPy
(:func:`iter_dense_tensors`: one gather per layer, times the fold's scale, each written before the
next is computed), or on the session's device with onnxruntime (:func:`recipe_graph`: the same
computation as a graph whose outputs are the bound buffers).

Imported by the runtime for :func:`task_values` and :func:`iter_dense_tensors` (NumPy, no onnx, no torch);
:func:`recipe_graph` and the export half import ``onnx`` inside the functions that build graphs.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PLACEHOLDER", "dense_template", "task_values", "iter_dense_tensors", "dense_tensors", "recipe_graph"]

#: External-data location of the task tensors in the template: never a file, always supplied by name.
PLACEHOLDER = "task-tensors-supplied-by-the-runtime"

_PASS = ("Cast", "Reshape", "Identity")


def dense_template(proto, layers: dict[str, tuple[int, ...]]) -> list[dict]:
    """Edit a linked ``switch`` graph in place into the dense template; returns the recipe.

    Args:
        proto: the traced graph after its pools were linked (``pool/<layer>`` initializers,
            ``indices/<layer>`` and ``state/<key>`` graph inputs).
        layers: NWS layer name -> its weight shape (the head with the bundle's largest class count).

    Returns:
        One row per task tensor the template takes, in graph order: ``{"kind": "gather", "name",
        "layer", "shape"}``, ``{"kind": "fold", "name", "bias_name", "layer", "shape", "conv_bias",
        "scale", "shift", "mean", "var", "eps"}`` (the last four and ``conv_bias`` name state inputs;
        ``conv_bias`` may be None) or ``{"kind": "state", "name", "shape"}``.

    Raises:
        ValueError: a layer's Gather was not found (the graph is not a linked switch graph).
    """
    from onnx import TensorProto, helper

    from .graph_edits import consumers, prune

    graph = proto.graph
    reads = consumers(graph)  # tensor -> the nodes that read it
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in graph.input
    }
    recipe: list[dict] = []
    weights: dict[str, str] = {}  # tensor the layer's consumers read -> layer
    for node in list(graph.node):
        if node.op_type != "Gather" or not node.input[0].startswith("pool/"):
            continue
        layer = node.input[0][len("pool/") :]
        out = node.output[0]
        while len(reads.get(out, [])) == 1 and reads[out][0].op_type in _PASS:
            out = reads[out][0].output[0]  # through the Cast (float16 pools) and the Reshape to W's shape
        weights[out] = layer
    missing = sorted(set(layers) - set(weights.values()))
    if missing:
        raise ValueError(f"no pool Gather found for layer {missing[0]!r}: not a linked switch graph")
    folded: dict[str, dict] = {}
    for tensor, layer in weights.items():
        readers = reads.get(tensor, [])
        if len(readers) != 1 or readers[0].op_type != "Conv" or list(readers[0].input[1:2]) != [tensor]:
            continue
        conv = readers[0]
        after = reads.get(conv.output[0], [])
        if len(after) != 1 or after[0].op_type != "BatchNormalization" or len(after[0].output) != 1:
            continue
        bn = after[0]
        params = list(bn.input[1:5])
        bias = conv.input[2] if len(conv.input) > 2 and conv.input[2] else None
        if not all(p.startswith("state/") and p in shapes for p in params) or (bias and not bias.startswith("state/")):
            continue
        if any(a.name == "training_mode" and a.i for a in bn.attribute):
            continue
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        folded[tensor] = {
            "kind": "fold",
            "name": f"fold/{layer}/weight",
            "bias_name": f"fold/{layer}/bias",
            "layer": layer,
            "shape": list(layers[layer]),
            "conv_bias": bias,
            "scale": params[0],
            "shift": params[1],
            "mean": params[2],
            "var": params[3],
            "eps": float(eps),
        }
        conv.input[:] = [conv.input[0], f"fold/{layer}/weight", f"fold/{layer}/bias"]
        conv.output[0] = bn.output[0]
        graph.node.remove(bn)
    for tensor, layer in weights.items():
        if tensor in folded:
            continue
        for reader in reads.get(tensor, []):
            reader.input[:] = [f"weight/{layer}" if i == tensor else i for i in reader.input]
    prune(graph)  # the Gathers, index unpacking, BatchNorms' inputs only they read, the pools
    read = {name for n in graph.node for name in n.input}
    state = [i for i in graph.input if i.name.startswith("state/") and i.name in read]
    stale = [i.name for i in graph.input if i.name.startswith("indices/") and i.name in read]
    if stale:
        raise ValueError(f"the graph still reads {stale[0]!r} outside a pool Gather: not a linked switch graph")
    for tensor, layer in weights.items():
        row = folded.get(tensor) or {
            "kind": "gather",
            "name": f"weight/{layer}",
            "layer": layer,
            "shape": list(layers[layer]),
        }
        recipe.append(row)
    for value in state:
        if any(d is None for d in shapes[value.name]):
            raise ValueError(f"state input {value.name!r} has no fixed shape")
        recipe.append({"kind": "state", "name": value.name, "shape": shapes[value.name]})
    dims = _image_dims(proto)
    del graph.input[:]  # keep the image input only
    graph.input.append(helper.make_tensor_value_info("input", TensorProto.FLOAT, dims))
    for row in recipe:
        tensors = [(row["name"], row["shape"])]
        if row["kind"] == "fold":
            tensors.append((row["bias_name"], [row["shape"][0]]))
        for name, shape in tensors:
            t = graph.initializer.add()
            t.name, t.data_type = name, TensorProto.FLOAT
            t.dims.extend(int(d) for d in shape)
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", PLACEHOLDER), ("offset", "0"), ("length", str(4 * int(np.prod(shape))))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
    return recipe


def _image_dims(proto) -> list:
    for value in proto.graph.input:
        if value.name == "input":
            return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    raise ValueError("the graph has no 'input'")


def task_values(
    recipe: list[dict],
    raw: dict[str, np.ndarray],
    pool_shapes: dict[str, tuple[int, int]],
    index_dtype=np.int32,
    layer_dtypes: dict | None = None,
) -> dict[str, np.ndarray]:
    """A task's values as every switch to it uses them, computed once from its pack.

    Args:
        recipe: :func:`dense_template`'s rows.
        raw: the pack's ``indices/<layer>`` ``(N,)`` integer and ``state/<key>`` float32 arrays.
        pool_shapes: layer name -> its pool's ``(n, D)``.
        index_dtype: what the indices are kept as (``np.uint16`` halves them where pools have at most
            65,536 entries).
        layer_dtypes: layer name -> its own index type, over ``index_dtype`` (``np.uint8`` where a pool has at
            most 256 entries: a scalar pool's layer keeps one byte a weight).

    Returns:
        ``indices/<layer>`` ``(count,)`` padded with 0 to the template's count (a head narrower than
        the template's; ``raw``'s own array where it is already of ``index_dtype`` and full); per fold
        row ``scale/<layer>`` ``(O,)`` (``gamma / sqrt(var + eps)`` in float64, rounded once to float32,
        as a BatchNorm fusion does) and its folded bias under the row's
        ``bias_name`` (``(b - mean) * s + beta`` in float64, then float32); each state row padded.

    Raises:
        KeyError: a value the recipe needs is missing (the caller names the pack).
        ValueError: a value of another size than the template takes, or an index past its pool.
    """
    out: dict[str, np.ndarray] = {}
    for row in recipe:
        shape = tuple(row["shape"])
        if row["kind"] == "state":
            out[row["name"]] = _padded(raw[row["name"]], shape, row["name"])
            continue
        key = f"indices/{row['layer']}"
        idx = raw[key]
        n, dim = pool_shapes[row["layer"]]
        count = int(np.prod(shape)) // dim
        if idx.size > count:
            raise ValueError(f"{key}: {idx.size} indices, the template takes {count}")
        if idx.size and (int(idx.max()) >= n or (idx.dtype.kind == "i" and int(idx.min()) < 0)):
            raise ValueError(f"{key}: an index outside the pool's {n} entries")
        dtype = np.dtype(layer_dtypes.get(row["layer"], index_dtype) if layer_dtypes else index_dtype)
        if idx.size == count and idx.dtype == dtype:
            out[key] = idx  # already what the switch takes (the reader decoded it in this type): no copy
        else:
            full = np.zeros(count, dtype)
            full[: idx.size] = idx
            out[key] = full
        if row["kind"] == "fold":
            channels = (shape[0],)
            gamma, beta, mean, var = (
                _padded(raw[row[k]], channels, row[k]).astype(np.float64) for k in ("scale", "shift", "mean", "var")
            )
            bias = (
                _padded(raw[row["conv_bias"]], channels, row["conv_bias"]).astype(np.float64)
                if row["conv_bias"]
                else np.zeros(channels)
            )
            s = gamma / np.sqrt(var + row["eps"])
            out[f"scale/{row['layer']}"] = s.astype(np.float32)
            out[row["bias_name"]] = ((bias - mean) * s + beta).astype(np.float32)
    return out


def iter_dense_tensors(recipe: list[dict], pools: dict[str, np.ndarray], values: dict[str, np.ndarray]):
    """A task's dense tensors from its :func:`task_values`, one at a time: ``pool[indices]`` in the template's
    shape, times the fold's scale per output channel; the folded biases and state as prepared.

    A switch writes each into its buffer before the next is computed, so its temporaries are one layer's
    weights (and their float32 copy where the pool is float16), never a whole dense model's beside the buffers.

    Yields:
        ``(tensor name, C-contiguous float32 array of the recipe's shape)``, in recipe order.
    """
    for row in recipe:
        shape = tuple(row["shape"])
        if row["kind"] == "state":
            yield row["name"], values[row["name"]]
            continue
        pool = pools[row["layer"]]
        # (count, D); every index was checked against the pool (task_values): "clip" only skips numpy's own check
        weight = np.take(pool, values[f"indices/{row['layer']}"], axis=0, mode="clip")
        weight = (weight if weight.dtype == np.float32 else weight.astype(np.float32)).reshape(shape)
        if row["kind"] == "fold":
            scale = values[f"scale/{row['layer']}"]
            np.multiply(weight, scale.reshape(-1, *[1] * (len(shape) - 1)), out=weight)  # in place
            yield row["bias_name"], values[row["bias_name"]]
        yield row["name"], weight
        del weight  # written by the caller: not alive while the next layer is gathered


def dense_tensors(
    recipe: list[dict], pools: dict[str, np.ndarray], values: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Every tensor :func:`iter_dense_tensors` yields, at once.

    Returns:
        Tensor name -> C-contiguous float32 array of the recipe's shape.
    """
    return dict(iter_dense_tensors(recipe, pools, values))


def recipe_graph(
    recipe: list[dict], pools: dict[str, tuple[tuple[int, int], str]], index_type: str = "int32", out_type="float32"
) -> bytes:
    """:func:`dense_tensors` as an ONNX graph, for onnxruntime to write a task's tensors where they live
    (on a GPU: into the switch session's bound device buffers, with no copy through the host).

    Args:
        recipe: :func:`dense_template`'s rows.
        pools: layer name -> ``((n, D), dtype)`` of its pool (``float32`` or ``float16``).
        index_type: the indices' type (``int32`` or ``int64``).
        out_type: the outputs' type: ``float32``, or ``float16`` (computed in float32, then cast: what
            numpy's float32 to float16 conversion gives, round to nearest even).

    Returns:
        The serialised graph. Inputs: ``pool/<layer>``, ``indices/<layer>`` ``(count,)``, per fold row
        ``scale/<layer>`` ``(O,)`` and its folded bias, each state row (all from :func:`task_values`).
        Outputs: every tensor of the recipe (fold biases and state passed through), the values
        :func:`dense_tensors` computes, bit for bit: a gather, a float32 product, copies.
    """
    from onnx import TensorProto, helper

    types = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
    itype = {"int32": TensorProto.INT32, "int64": TensorProto.INT64}[index_type]
    nodes, inputs, outputs, inits = [], [], [], []
    for row in recipe:
        shape = [int(d) for d in row["shape"]]
        if row["kind"] == "state":
            inputs.append(helper.make_tensor_value_info(row["name"], TensorProto.FLOAT, shape))
            outputs.append((row["name"], row["name"], shape))
            continue
        layer = row["layer"]
        (n, dim), dtype = pools[layer]
        count = int(np.prod(shape)) // dim
        inputs.append(helper.make_tensor_value_info(f"pool/{layer}", types[dtype], [n, dim]))
        inputs.append(helper.make_tensor_value_info(f"indices/{layer}", itype, [count]))
        gathered = f"{layer}/gathered"
        nodes.append(helper.make_node("Gather", [f"pool/{layer}", f"indices/{layer}"], [gathered], axis=0))
        if dtype != "float32":
            nodes.append(helper.make_node("Cast", [gathered], [f"{layer}/wide"], to=TensorProto.FLOAT))
            gathered = f"{layer}/wide"
        shape_name = f"{layer}/shape"
        inits.append(helper.make_tensor(shape_name, TensorProto.INT64, [len(shape)], shape))
        weight = f"{layer}/weight"
        nodes.append(helper.make_node("Reshape", [gathered, shape_name], [weight]))
        if row["kind"] == "fold":
            per = f"{layer}/per_channel"
            inits.append(helper.make_tensor(per, TensorProto.INT64, [len(shape)], [-1] + [1] * (len(shape) - 1)))
            inputs.append(helper.make_tensor_value_info(f"scale/{layer}", TensorProto.FLOAT, [shape[0]]))
            inputs.append(helper.make_tensor_value_info(row["bias_name"], TensorProto.FLOAT, [shape[0]]))
            nodes.append(helper.make_node("Reshape", [f"scale/{layer}", per], [f"{layer}/scale"]))
            nodes.append(helper.make_node("Mul", [weight, f"{layer}/scale"], [f"{layer}/folded"]))
            weight = f"{layer}/folded"
            outputs.append((row["bias_name"], row["bias_name"], [shape[0]]))
        outputs.append((weight, row["name"], shape))
    # Output names are the recipe's tensor names: an Identity (or the Cast to out_type) per output gives each
    # its own name.
    out = types[out_type]
    for produced, name, _ in outputs:
        if out == TensorProto.FLOAT:
            nodes.append(helper.make_node("Identity", [produced], [f"out:{name}"]))
        else:
            nodes.append(helper.make_node("Cast", [produced], [f"out:{name}"], to=out))
    graph = helper.make_graph(
        nodes,
        "nwsconvert-task-tensors",
        inputs,
        [helper.make_tensor_value_info(f"out:{name}", out, shape) for _, name, shape in outputs],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="nwsconvert")
    model.ir_version = 8
    return model.SerializeToString()


def _padded(arr: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    """``arr`` as float32 of ``shape``: equal, or zero-padded along dim 0 (a head narrower than the template's)."""
    arr = np.asarray(arr, dtype=np.float32)
    if arr.shape[1:] != tuple(shape[1:]) or arr.shape[0] > shape[0]:
        raise ValueError(f"{name} has shape {list(arr.shape)}, the template takes {list(shape)}")
    if arr.shape[0] < shape[0]:
        arr = np.concatenate([arr, np.zeros((shape[0] - arr.shape[0], *shape[1:]), np.float32)])
    return np.ascontiguousarray(arr)
