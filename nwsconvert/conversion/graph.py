"""Graph analysis for conversion: which weight layers a model calls, and their roles.

A torch.fx symbolic trace (with timm's leaf-module registry, and every
weight layer kept as a leaf) gives each convolution and linear layer a role:

* ``stem``: no weight layer before it on any path from the input;
* ``head``: no weight layer after it on any path to the output;
* ``shortcut``: on the shorter weighted branch of a residual ``add`` (the
  1x1 downsample of a ResNet block, for instance);
* ``body``: everything else.

Models that do not trace fall back to a module walk with name-based roles;
:func:`analyse` says which path it took.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
from torch import fx, nn

__all__ = ["GraphInfo", "analyse", "is_weight_layer"]

_ADD_TARGETS = {operator.add, operator.iadd, torch.add}
_SHORTCUT_NAME = re.compile(r"(downsample|shortcut|skip|residual|proj)", re.IGNORECASE)


def _cond_conv_type():
    try:
        from timm.layers import CondConv2d
    except ImportError:  # timm absent or too old
        return None
    return CondConv2d


def is_weight_layer(module: nn.Module) -> bool:
    """Modules ``convert`` handles: Conv2d and subclasses, Linear and subclasses, timm CondConv2d."""
    cond = _cond_conv_type()
    return isinstance(module, (nn.Conv2d, nn.Linear)) or (cond is not None and isinstance(module, cond))


@dataclass
class GraphInfo:
    """Result of :func:`analyse`.

    Attributes:
        roles: module name -> role, for weight layers seen in the graph.
        path: ``"torch.fx"`` or ``"module walk (<why>)"``.
    """

    roles: dict[str, str] = field(default_factory=dict)
    path: str = "torch.fx"


class _Tracer(fx.Tracer):
    def __init__(self):
        notrace_fns = ()
        self._notrace = ()
        try:
            from timm.layers import _fx as timm_fx

            self._notrace = tuple(timm_fx.get_notrace_modules())
            notrace_fns = tuple(timm_fx.get_notrace_functions())
        except (ImportError, AttributeError):
            pass
        super().__init__(autowrap_functions=notrace_fns)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if is_weight_layer(m) or (self._notrace and isinstance(m, self._notrace)):
            return True
        return super().is_leaf_module(m, qualname)


def _is_add(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _ADD_TARGETS:
        return True
    return node.op == "call_method" and node.target in ("add", "add_")


def _weight_reach(order, neighbours, weight_nodes: set) -> dict:
    """For every node of ``order`` (a topological order, or its reverse), the names of the weight
    layers reached through ``neighbours`` (inputs: ancestors; users: descendants), itself included."""
    reach: dict[fx.Node, frozenset] = {}
    for node in order:
        found = set().union(*(reach[n] for n in neighbours(node)))
        if node in weight_nodes:
            found.add(node.target)
        reach[node] = frozenset(found)
    return reach


def _roles_from_graph(graph: fx.Graph, model: nn.Module) -> dict[str, str]:
    modules = dict(model.named_modules())
    weight_nodes = {
        n for n in graph.nodes if n.op == "call_module" and n.target in modules and is_weight_layer(modules[n.target])
    }
    # Weight-layer ancestors of every node (the node itself included), and descendants (not included).
    anc = _weight_reach(graph.nodes, lambda n: n.all_input_nodes, weight_nodes)
    below = _weight_reach(reversed(graph.nodes), lambda n: n.users, weight_nodes)
    desc = {node: frozenset().union(*(below[u] for u in node.users)) for node in graph.nodes}
    roles: dict[str, str] = {}
    shortcut: set[str] = set()
    for node in graph.nodes:
        if not _is_add(node) or len(node.all_input_nodes) != 2:
            continue
        a, b = node.all_input_nodes
        only_a, only_b = anc[a] - anc[b], anc[b] - anc[a]
        if 0 < len(only_a) < len(only_b):
            shortcut |= only_a
        elif 0 < len(only_b) < len(only_a):
            shortcut |= only_b
    for node in graph.nodes:
        if node not in weight_nodes:
            continue
        name = node.target
        if len(anc[node]) == 1:  # only itself
            role = "stem"
        elif not desc[node]:
            role = "head"
        elif name in shortcut:
            role = "shortcut"
        else:
            role = "body"
        # A module called at several places keeps its first role.
        roles.setdefault(name, role)
    return roles


def roles_by_name(model: nn.Module, names: list[str], known: dict[str, str]) -> dict[str, str]:
    """Name-based roles for weight layers the graph did not show (module walk)."""
    head = None
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        try:
            clf = get_classifier()
        except Exception:  # noqa: BLE001 - any model-specific failure: no hint
            clf = None
        for n, m in model.named_modules():
            if clf is not None and m is clf:
                head = n
    if head is None:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        head = linears[-1] if linears else None
    out = {}
    first = not any(r == "stem" for r in known.values())
    for n in names:
        if n in known:
            continue
        if first:
            out[n], first = "stem", False
        elif n == head:
            out[n] = "head"
        elif _SHORTCUT_NAME.search(n.rsplit(".", 1)[-1]) or _SHORTCUT_NAME.search(n):
            out[n] = "shortcut"
        else:
            out[n] = "body"
    return out


def analyse(model: nn.Module) -> GraphInfo:
    """Trace ``model`` and give its weight layers roles.

    Returns:
        :class:`GraphInfo`; on a trace failure ``roles`` is empty and ``path``
        names the error, and the caller assigns roles by module walk.
    """
    try:
        tracer = _Tracer()
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure falls back to the walk
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return GraphInfo({}, f"module walk (fx trace failed: {type(e).__name__}: {msg[:120]})")
    return GraphInfo(_roles_from_graph(graph, model), "torch.fx")
