"""One ONNX graph for every task of a bundle: ``switch.onnx``, the dense template of the one-session mode.

The per-task graphs (``task_<t>.onnx``) hold their indices as constants, so
onnxruntime folds each task into a dense model when its session is built: fast
inference, but a task switch is a session creation over a graph of Gathers.
``switch.onnx`` is traced with each NWS layer's indices and each state entry
(BatchNorm statistics and affine parameters, biases) as graph inputs, then edited
into a dense template (:func:`nwsconvert.export.densify.dense_template`): the
gathered weights, the convolutions with their BatchNorm folded in and the other
state entries become placeholders that the runtime fills with a task's tensors,
computed from its pack with NumPy (:class:`nwsconvert.export.Runtime`,
``mode="switch"``). The recipe for those tensors is returned and stored in
``bundle.json`` (``switch.tensors``).

Tasks with different class counts share the graph: the head is exported with
the bundle's largest class count; a task with fewer classes pads its head
indices and bias with zeros (the first ``C x F`` weights are its own, row-major)
and the runtime keeps the first ``C`` logits.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from nwsconvert import nws_layers
from nwsconvert.formats.packs import _nws_keys

from .densify import dense_template
from .onnx_graph import _same_folder, export_graph

__all__ = ["SWITCH_FILE", "export_switch", "switch_input_names"]

SWITCH_FILE = "switch.onnx"


def switch_input_names(model: nn.Module) -> dict[str, str]:
    """Graph input name -> the model's buffer or parameter it replaces: ``indices/<layer>`` for each
    NWS layer, ``state/<key>`` for each floating entry of the state a task pack stores."""
    names = {f"indices/{layer.name}": f"{layer.name}.parametrizations.weight.0.indices" for layer in nws_layers(model)}
    nws = _nws_keys(model)
    for fqn, t in model.state_dict().items():
        if fqn not in nws and t.is_floating_point():
            names[f"state/{fqn}"] = fqn
    return names


class _Functional(nn.Module):
    """``model`` with some buffers and parameters taken from the call's arguments.

    Under the TorchScript tracer (which ``torch.func.functional_call`` refuses to
    run under) the tensors are swapped into the owning modules' dicts for the
    call; under ``torch.export`` (which refuses that mutation) ``functional_call``
    does it.
    """

    def __init__(self, model: nn.Module, fqns: list[str]):
        super().__init__()
        self.model = model
        self.fqns = list(fqns)
        self.slots = []
        for fqn in fqns:
            owner, _, attr = fqn.rpartition(".")
            module = model.get_submodule(owner)
            table = module._buffers if attr in module._buffers else module._parameters
            self.slots.append((table, attr))

    def forward(self, x, *values):
        if not torch.jit.is_tracing():
            return torch.func.functional_call(self.model, dict(zip(self.fqns, values)), (x,), strict=False)
        saved = [table[attr] for table, attr in self.slots]
        try:
            for (table, attr), value in zip(self.slots, values):
                table[attr] = value
            return self.model(x)
        finally:
            for (table, attr), value in zip(self.slots, saved):
                table[attr] = value


@torch.no_grad()
def export_switch(
    model: nn.Module,
    out_path: str | os.PathLike,
    pool_file: str | os.PathLike,
    *,
    input_shape,
    metadata: dict,
    exporter: str = "auto",
) -> dict:
    """Write ``switch.onnx`` for a converted model whose head has the bundle's largest class count.

    Args:
        model: NWS model in eval mode (its indices and state are only example values).
        out_path, pool_file: as :func:`nwsconvert.export.onnx_graph.export_onnx`.
        input_shape: ``(C, H, W)``.
        exporter: as :func:`nwsconvert.export.onnx_graph.export_onnx`.

    Returns:
        ``{'gather_nodes' (of the traced graph), 'tensors' (the recipe: one row per task tensor), 'bytes', 'exporter'}``.
    """
    out_path, pool_file = Path(out_path), Path(pool_file)
    _same_folder(out_path, pool_file)
    layers = nws_layers(model)
    model = model.eval()
    names = switch_input_names(model)
    state = model.state_dict()
    values = tuple(state[fqn] for fqn in names.values())
    axes = {"input": {0: "batch"}, "logits": {0: "batch"}}
    wrapper = _Functional(model, list(names.values())).eval()  # the exporter restores the wrapper's mode, recursively
    args = (torch.zeros(1, *input_shape), *values)
    shapes = {layer.name: tuple(layer.nws.weight_shape) for layer in layers}
    _, found, _, size, used, recipe = export_graph(
        wrapper,
        args,
        ["input", *names],
        axes,
        layers,
        pool_file,
        out_path,
        metadata,
        exporter,
        edit=lambda proto: dense_template(proto, shapes),
    )
    return {"gather_nodes": found, "tensors": recipe, "bytes": size, "exporter": used}
