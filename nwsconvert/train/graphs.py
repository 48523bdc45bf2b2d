"""CUDA-graph replay of a task's training step (``TrainConfig.cuda_graph``, ``nws-train`` key ``cuda_graph``).

A training step of an NWS model launches a few hundred kernels; on a GPU each launch costs host time,
and for small images or batches the host, not the GPU, sets the pace. :class:`GraphedStep` captures the
whole step (the engine's search update in the forward pre-hook, forward, loss, backward, optimiser
step) once in a CUDA graph and replays it: one launch per step, no Python per layer. The engine's update
has no host sync and fixed launch shapes, which is what makes it capturable.

What it needs, each checked with a one-line error naming the option (:func:`check_graphable`): a CUDA
device, the search engine (``search`` ``auto`` or ``engine``; the layers' own search reads the device
back), one process (not torchrun), and no GradScaler (``amp`` ``off`` or ``bf16``: float16's scaler
reads the device back every step). Pool learning runs eagerly (its EMA update and reseeding have
host syncs); task stages replay.
"""

from __future__ import annotations

import torch

from ..errors import UsageError

__all__ = ["GraphedStep", "check_graphable"]


def check_graphable(cfg, device: torch.device, distributed: bool) -> None:
    """Raise :class:`~nwsconvert.errors.UsageError` when ``cfg.cuda_graph`` or ``cfg.engine_graph`` asks for what
    cannot be captured here."""
    from ..core import fused_search
    from .loop import amp_dtype

    if cfg.engine_graph:
        if cfg.cuda_graph:
            raise UsageError(
                "engine_graph=true and cuda_graph=true: the whole step's graph already holds the engine's update; set one"
            )
        if device.type != "cuda" or cfg.search == "layer" or not fused_search.available(device):
            raise UsageError(
                f"engine_graph=true captures the search engine's Triton update on CUDA (device {device.type}, "
                f"search={cfg.search}, Triton {'installed' if fused_search.available(device) else 'missing'}): "
                "set engine_graph=false, or train on CUDA with search=auto or engine"
            )
    if not cfg.cuda_graph:
        return
    if device.type != "cuda":
        raise UsageError(f"cuda_graph=true needs a CUDA device; this run trains on {device.type}: set cuda_graph=false")
    if cfg.search == "layer" or not fused_search.available(device):
        raise UsageError(
            f"cuda_graph=true needs the search engine's Triton kernels (search={cfg.search}, Triton "
            f"{'installed' if fused_search.available(device) else 'missing'}): the layers' own search reads "
            "the device back every step; set search=auto or engine with Triton installed"
        )
    if distributed:
        raise UsageError("cuda_graph=true runs in one process; under torchrun set cuda_graph=false")
    if amp_dtype(device, cfg.amp) == torch.float16:
        raise UsageError(
            f"cuda_graph=true cannot capture float16 autocast (amp={cfg.amp}; its GradScaler reads the device "
            "back every step): set amp=bf16 or amp=off"
        )


class GraphedStep:
    """A :class:`~nwsconvert.train.loop.TrainStep` replayed from a CUDA graph (see the module docstring).

    It runs ``warmup`` eager steps on a side stream (the allocator, cuDNN's algorithm choice and
    Triton's compilation settle there), captures the next step, and replays it for every batch of the
    captured shapes while the optimiser's learning rates stay those it captured (a learning rate is a
    constant of the graph). A batch of another shape (a smaller last batch) runs eagerly; a new learning
    rate (the schedule's next epoch) starts warm-up and capture again, the new graph in a memory pool
    of its own (the old graph's pool is released with it). Replays run the captured kernels in their
    order, so the weights and indices equal eager training's wherever the kernels themselves are
    deterministic (``deterministic=true``: cuDNN's default backward kernels differ from run to run,
    eager or replayed).

    Args:
        step: the task's step; its model must have the search engine attached.
        warmup: eager steps before each capture.

    Returns (call):
        ``(logits (B, classes), cross-entropy)``; from a replay these are the graph's output buffers,
        valid until the next call (the epoch loop reads them at once).
    """

    def __init__(self, step, warmup: int = 3):
        self.step, self.warmup = step, warmup
        self.model, self.device = step.model, step.device  # what the epoch loop reads of a step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0  # graphs captured so far
        self.replays = 0
        self._lrs: tuple | None = None
        self._shapes: tuple | None = None
        self._warm = 0
        self._static: tuple | None = None  # (x, y, logits, loss) of the captured step

    def _learning_rates(self) -> tuple:
        return tuple(group["lr"] for group in self.step.optimizer.param_groups)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lrs, shapes = self._learning_rates(), (x.shape, x.dtype, y.shape, y.dtype)
        if lrs != self._lrs:  # a new constant for the graph: warm up and capture again
            self.graph, self._static, self._lrs, self._shapes, self._warm = None, None, lrs, None, 0
        if self.graph is not None:
            if shapes != self._shapes:
                return self.step(x, y)
            sx, sy, out, loss = self._static
            sx.copy_(x)
            sy.copy_(y)
            self.graph.replay()
            self.replays += 1
            return out, loss
        if self._warm < self.warmup:
            self._warm += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                result = self.step(x, y)
            torch.cuda.current_stream().wait_stream(side)
            return result
        return self._capture(x, y, shapes)

    def _capture(self, x, y, shapes):
        sx, sy = x.clone(), y.clone()
        self.step.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients
        graph = torch.cuda.CUDAGraph()
        # A private pool per graph (pool=None). One handle shared by successive graphs fails: the first
        # graph's release leaves its pool with no user until its blocks are freed, and the allocator's
        # next capture into it stops at an internal assert (torch 2.11, seen on an H100).
        # thread_local: the DataLoader's pin-memory thread may use CUDA while this thread captures.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out, loss = self.step(sx, sy)
        self.graph, self._static, self._shapes = graph, (sx, sy, out, loss), shapes
        self.captures += 1
        graph.replay()  # capturing records the step without running it: this batch's step
        self.replays += 1
        return out, loss
