"""Runs of one onnxruntime session at fixed addresses, for onnxruntime's CUDA graph.

    runs = GraphRuns(ort, session, "cuda", "input", "logits")
    logits = runs.run(binding, x, slot=0)    # x: (B, C, H, W) float32 NumPy or OrtValue; None: run it yourself

With ``enable_cuda_graph`` onnxruntime's CUDA provider captures a run once and replays it, one launch for
the whole graph. A replay reads and writes the addresses of the capture, whatever the binding says then,
so every graphed run must bind the same buffers. This keeps them: per input shape one input buffer
``(B, C, H, W)`` and one output buffer ``(B, classes)`` on the session's device, into which each run's
images are copied (``OrtValue.update_inplace``) and out of which the logits are copied. Each pair (weight
buffer set, input shape) gets its own graph, ``gpu_graph_id`` ``1, 2, ...`` (onnxruntime keeps one
captured graph per id); the weight buffers are the caller's, bound at fixed addresses already, and may be
rewritten between runs (a replay reads what they hold then). Every other run of a session built with the
option must say ``gpu_graph_id=-1`` (:meth:`GraphRuns.ungraphed`): with the default id onnxruntime would
capture that run's addresses and replay them later. Graphs are per thread: run a session so from one.

NumPy and onnxruntime only (the Runtime's wheel imports it).
"""

from __future__ import annotations

import numpy as np

__all__ = ["GRAPH_SHAPES", "GraphRuns"]

#: Input shapes that get graphs (each once per weight buffer set); runs of further shapes go ungraphed.
GRAPH_SHAPES = 4


class GraphRuns:
    """Fixed-address runs of ``session`` on ``device`` (``cuda``; ``cpu`` runs the same bookkeeping without a
    graph). ``limit``: the input shapes that get buffers and graphs.

    Attributes:
        ids: ``{(slot, input shape): gpu_graph_id}``, the graphs asked for so far.
    """

    def __init__(self, ort, session, device: str, input_name: str, output_name: str, limit: int = GRAPH_SHAPES):
        self.ort, self.session, self.device = ort, session, device
        self.input_name, self.output_name, self.limit = input_name, output_name, limit
        self.buffers: dict[tuple[int, ...], tuple] = {}  # input shape -> (input OrtValue, output OrtValue)
        self.ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._next_id = 1  # ids are never given twice: a forgotten one's graph may still be onnxruntime's
        self.device_copy = True  # whether this onnxruntime's update_inplace takes an OrtValue (a device copy)
        self._options: dict[int, object] = {}

    def options(self, graph_id: int):
        """``RunOptions`` asking for graph ``graph_id`` (-1: none), made once per id."""
        opts = self._options.get(graph_id)
        if opts is None:
            opts = self._options[graph_id] = self.ort.RunOptions()
            opts.add_run_config_entry("gpu_graph_id", str(graph_id))
        return opts

    def ungraphed(self, binding) -> None:
        """Run ``binding`` as it is, outside every graph."""
        self.session.run_with_iobinding(binding, self.options(-1))

    def _buffers(self, shape: tuple[int, ...]):
        """The (input, output) buffer pair of ``shape``, made at its first run; None for a shape the session
        does not take (its plain run raises onnxruntime's own error), beyond ``limit``, or with an output of
        symbolic width (its size known only after a run)."""
        io = self.buffers.get(shape)
        if io is not None or len(self.buffers) >= self.limit:
            return io
        declared = next(i.shape for i in self.session.get_inputs() if i.name == self.input_name)
        if len(declared) != len(shape) or any(isinstance(d, int) and d != n for d, n in zip(declared, shape)):
            return None
        classes = next(o.shape for o in self.session.get_outputs() if o.name == self.output_name)[-1]
        if not isinstance(classes, int):
            return None
        new = self.ort.OrtValue.ortvalue_from_shape_and_type
        io = self.buffers[shape] = (
            new(list(shape), np.float32, self.device, 0),
            new([shape[0], classes], np.float32, self.device, 0),
        )
        return io

    def run(self, binding, images, slot: int = 0):
        """The logits of ``images`` through the graph of (``slot``, its shape), captured at its first runs
        and replayed after: NumPy in, a NumPy copy out; an OrtValue in, an OrtValue copy out on the session's
        device. ``binding`` holds the weight buffers of ``slot``; the input and output buffers are bound here.
        None where this run cannot be graphed (a shape beyond ``limit`` or one the session does not take, an
        OrtValue this onnxruntime cannot copy on the device): the caller runs it with :meth:`ungraphed`, its
        output bound to memory of its own, not the session's arena (a replay writes its intermediates where
        the capture had them, in arena memory free between runs). A run that raises forgets its graph id (the
        pair captures afresh at its next runs) and raises: the caller tells a graph refused from a bad run."""
        device = isinstance(images, self.ort.OrtValue)
        if device and not self.device_copy:
            return None
        shape = tuple(images.shape()) if device else images.shape
        io = self._buffers(shape)
        if io is None:
            return None
        x, y = io
        try:
            x.update_inplace(images)  # an OrtValue: onnxruntime 1.31 copies it on the device
        except TypeError:  # an onnxruntime whose update_inplace takes NumPy only
            self.device_copy = False
            return None
        key = (slot, shape)
        graph_id = self.ids.get(key)
        if graph_id is None:
            graph_id = self.ids[key] = self._next_id
            self._next_id += 1
        binding.bind_ortvalue_input(self.input_name, x)
        binding.bind_ortvalue_output(self.output_name, y)
        try:
            self.session.run_with_iobinding(binding, self.options(graph_id))
        except BaseException:
            del self.ids[key]
            raise
        if device:
            out = self.ort.OrtValue.ortvalue_from_shape_and_type(y.shape(), np.float32, self.device, 0)
            out.update_inplace(y)
            return out
        return np.array(y.numpy(), copy=True)  # the buffer is the next run's
