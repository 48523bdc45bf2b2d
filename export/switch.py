"""One ONNX graph for every task of a bundle: ``switch.onnx`` (the one-session mode).

The per-task graphs (``task_<t>.onnx``) hold their indices as constants, so
onnxruntime folds each task into a dense model when its session is built: fast
inference, but a task switch is a session creation (tens to hundreds of ms).
``switch.onnx`` instead takes each NWS layer's indices and each state entry
(BatchNorm statistics and affine parameters, biases) as graph inputs:

    inputs   input (B, C, H, W) float32
             indices/<layer> (N_layer,) int32        one per NWS layer
             state/<key> (entry's shape) float32      one per floating state entry
    output   logits (B, max_classes)

Every run gathers the weights from the shared pools (``pool/<layer>``, external
data in ``pools.safetensors``, as in the per-task graphs). A runtime keeps one
session for the bundle and, per task, the input values on the device; a task
switch re-binds them (:class:`nwsconvert.export.Runtime`, ``mode="switch"``).

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
        ``{'gather_nodes', 'inputs' (task inputs the graph takes), 'bytes', 'exporter'}``.
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
    proto, found, _, size, used = export_graph(
        wrapper, args, ["input", *names], axes, layers, pool_file, out_path, metadata, exporter
    )
    taken = [i.name for i in proto.graph.input if i.name != "input"]
    return {"gather_nodes": found, "inputs": len(taken), "bytes": size, "exporter": used}
