"""onnxruntime deployment of a bundle, with fast task switching, safe to call from many threads.

    rt = nwsconvert.export.Runtime("runs/mnist/export")     # CUDA when present, else CPU; one session, every task
    logits = rt.run(2, images)                              # images: (B, C, H, W) float32, normalised
    rt.predict(2, images, k=3)                               # [[(class name, probability), ...], ...]
    rt = Runtime("runs/mnist/export", mode="session")       # one session per task graph

Two modes (measured side by side in ``benchmarks/RESULTS.md``, "Many tasks for the memory of one"), each a
class of its own behind this facade:

``switch`` (:mod:`~nwsconvert.export.switchmode`; the default when the bundle holds ``switch.onnx``)
    one onnxruntime session of the bundle's dense template (:mod:`nwsconvert.export.densify`) runs every
    task. Its weights are graph inputs bound to buffers through IOBinding, laid out as this machine's
    kernels read them (:mod:`nwsconvert.export.layout`: onnxruntime's blocked NCHWc layout on a CPU, so
    inference runs at the speed of a session built for the task). A switch rewrites the buffers from the
    shared pools and the task's indices (one gather per layer, BatchNorm folded, with NumPy on a CPU; a
    graph on the GPU whose outputs are the buffers, on CUDA). No session is built after start-up, and the
    memory is one dense model (``ready`` of them: the tasks kept ready, a switch between them only
    picks the buffers) plus the pools plus what each task keeps: its decoded indices (``keep="indices"``,
    the default, 2 bytes a kernel) or only its pack (``keep="pack"``: decoded at each switch).
``session`` (:mod:`~nwsconvert.export.sessionmode`)
    one session per task graph (``task_<t>.onnx``): onnxruntime folds the task's Gathers and BatchNorms
    into dense weights when the session is built. A cached session is a look-up; another task costs a
    session creation; each cached session holds its own dense weights (``max_sessions`` of them, least
    recently used out; the sessions share one memory arena).

Threads: any number of threads may call :meth:`Runtime.run` and :meth:`Runtime.predict` on one Runtime at
once, each with any task; each gets what a single-threaded Runtime returns for that task and images. In
session mode every run goes in parallel. In switch mode each of the ``ready`` buffer sets serves one run at a
time: runs on different buffer sets go in parallel, a caller whose task a busy set holds waits for it, a
caller of a task no set holds takes a free set and writes its task there (each set costs one dense model),
and callers are served in the order they came.

The pool file is memory-mapped once and checked against the bundle's pool-set hash. Session mode hands
its tensors to every task graph by name (``SessionOptions.add_external_initializers``, which replaces
the graph's external-data references before any optimisation): the tensors at the offsets the checked
header gives, whatever offsets the graph was exported with.

Everything it opens is checked first: ``bundle.json``'s fields, every file it names (a plain name of a file
in the bundle folder; a link only to one there), the pool file against the bundle's pool-set hash, each graph
against its recorded SHA-256 and every external-data location in it (a file of the bundle, or the switch
template's placeholder: never an absolute path, ``..`` or a link out, refused before onnx or onnxruntime
reads it), each pack against its hash, its pool set and the base the bundle records. A bad file is refused
by name (:class:`~nwsconvert.errors.FormatError`), never answered with NaN; a switch to a task whose pack is
damaged raises and leaves the task selected before it working. Images are checked at the door
(:mod:`~nwsconvert.export.frames`): a wrong shape or integer pixels raise one
:class:`~nwsconvert.errors.UsageError` line. Imports neither torch nor timm.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

from nwsconvert.devices import cuda_device_count

from .bundlefile import read_bundle
from .frames import check_frames, fixed_chw
from .ortsetup import DISABLED_OPTIMIZERS, OrtSetup, session_providers, shared_arena
from .sessionmode import SessionMode
from .switchmode import SwitchMode

__all__ = ["DISABLED_OPTIMIZERS", "Runtime", "session_providers"]

_shared_arena = shared_arena  # the name benchmarks/runtime_memory.py imports


def _gpu_present() -> bool:
    return cuda_device_count() > 0


class Runtime:
    """Sessions over one bundle.

    Args:
        bundle: a folder written by ``nws-export --onnx``.
        device: ``auto`` (CUDA when onnxruntime-gpu and a GPU are present), ``cuda`` or ``cpu``.
        mode: ``switch`` (one session, every task), ``session`` (one session per task graph), or
            ``auto``: ``switch`` when the bundle holds ``switch.onnx`` (see the module docstring).
        max_sessions: session mode: task sessions kept (least recently used out).
        threads: intra-op threads of the CPU provider (``None``: onnxruntime's default).
        ready: switch mode: weight buffers, each holding one task ready (a switch between tasks held is a
            look-up; another task overwrites the least recently used free one). Each costs one dense model,
            and each serves one run at a time: threads on as many different tasks run in parallel.
        keep: switch mode: ``indices`` (every task's decoded indices kept from start-up: a switch is the
            gather alone) or ``pack`` (nothing kept but the pack file: each switch decodes it).
        layout: switch mode: ``auto`` (this machine's kernels' layout, see :mod:`nwsconvert.export.layout`)
            or ``plain`` (the template's own shapes; what CUDA runs).
        fill: switch mode: how a switch computes a task's tensors: ``numpy`` (on the host; the CPU's
            default), ``onnxruntime`` (a graph whose outputs are the buffers, on the session's device: the
            CUDA default, with no copy through the host, and float16's; on a CPU with ``layout="plain"`` or
            float16 only), ``auto``.
        tf32: CUDA: let cuDNN and cuBLAS round float32 products to TF32 on GPUs that have it (Ampere and
            later; onnxruntime's own default). Off by default: the logits then agree with the CPU's and
            PyTorch's to float32 rounding (about 1e-6 of the largest logit), where TF32 (10 bits of
            mantissa) moves them by about 1e-3.
        cuda_arena: CUDA: ``own`` (each session its own memory arena, onnxruntime's default) or ``shared``
            (one arena, registered with onnxruntime's environment, for all of this process's sessions that
            ask for it: the fill graph's temporaries reuse the memory the model's activations use, and
            cached task sessions share one). The shared arena lives as long as the process: memory it took
            is not handed back when a Runtime is dropped. Experimental: on an H100 the switch mode took 948 MB
            against the dense session's 778 MB with its own arenas; ``shared`` is not measured on a GPU yet
            (``info()`` says the arena was registered, not what the sessions drew from it).
        cuda_graph: CUDA, switch mode: run the session through onnxruntime's CUDA graph (experimental). Each
            pair (buffer set of ``ready``, input shape) is captured at its first runs and replayed after, one
            launch a run; a switch rewrites the weight buffers the graphs read, so it holds for every task.
            Images are copied into a fixed input buffer and the logits out of a fixed output buffer (an
            OrtValue in gives an OrtValue copy out, where onnxruntime's ``update_inplace`` copies OrtValues
            on the device; otherwise those run without the graph). Up to four input shapes get graphs;
            further ones run without. Where onnxruntime refuses the graph, it warns once and runs without.
            Without CUDA it warns and is off; with ``cuda_arena="shared"`` it is refused. Runs are then one at a
            time, graphed on the thread that ran first (onnxruntime keeps graphs per thread); other threads'
            runs go without the graph. Not measured on a GPU yet.
        precision: switch mode: ``float32``, or ``float16`` (:mod:`nwsconvert.export.precision`): the graph,
            its activations and the weight buffers a switch writes in float16 (half the buffers' memory),
            the image taken and the logits given in float32 as in ``float32``; the template's own layout.
            Meant for GPUs (Jetson-class boards, any CUDA GPU); a CPU runs it too, for checks. Not measured
            on a GPU yet.

    Attributes:
        providers: the providers requested (names); ``session(task).get_providers()`` says what runs.
        cuda_arena: CUDA: ``own`` or ``shared``, the arena the sessions are built with (``own`` where a shared
            one could not be registered); None on a CPU.
        cuda_graph: whether the switch session runs through onnxruntime's CUDA graph (False once refused).
        switches: switches that wrote a task's tensors (switch mode) or built a session (session mode).
        rebuilds: session mode: sessions built again after their eviction.
        last_switch_seconds: the work of the last switch to a task not held ready, in seconds: decoding
            (``keep="pack"``), the gather and fold, and writing the buffers (switch mode); the session
            creation (session mode). A switch to a task held ready or cached costs a look-up.

    Raises:
        FileNotFoundError: no bundle there. FormatError: ``bundle.json``, the pool file, the template or
            a graph is damaged, not the one the bundle records, or names a file outside the bundle (named).
    """

    def __init__(
        self,
        bundle: str | os.PathLike,
        device: str = "auto",
        mode: str = "auto",
        max_sessions: int = 4,
        threads: int | None = None,
        *,
        ready: int = 1,
        keep: str = "indices",
        layout: str = "auto",
        fill: str = "auto",
        tf32: bool = False,
        cuda_arena: str = "own",
        cuda_graph: bool = False,
        precision: str = "float32",
    ):
        import onnxruntime as ort

        from .precision import PRECISIONS

        self.ort = ort
        self.path = Path(bundle)
        self.desc = read_bundle(self.path)
        if device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
        if mode not in ("auto", "session", "switch"):
            raise ValueError(f"mode must be auto, switch or session, got {mode!r}")
        if keep not in ("indices", "pack"):
            raise ValueError(f"keep must be indices or pack, got {keep!r}")
        if layout not in ("auto", "plain"):
            raise ValueError(f"layout must be auto or plain, got {layout!r}")
        if fill not in ("auto", "numpy", "onnxruntime"):
            raise ValueError(f"fill must be auto, numpy or onnxruntime, got {fill!r}")
        if cuda_arena not in ("own", "shared"):
            raise ValueError(f"cuda_arena must be own or shared, got {cuda_arena!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be {' or '.join(PRECISIONS)}, got {precision!r}")
        if type(ready) is not int or ready < 1:
            raise ValueError(f"ready must be a whole number >= 1, got {ready!r}")
        if mode == "auto":
            mode = "switch" if "switch" in self.desc else "session"
        if mode == "switch" and "switch" not in self.desc:
            raise FileNotFoundError(
                f"{self.path} has no switch.onnx (one-session mode): export it again with nws-export --onnx"
            )
        if precision != "float32" and mode != "switch":
            raise ValueError(
                f"precision={precision!r} runs the switch mode's one session; mode='session' runs the task graphs "
                "in float32"
            )
        if cuda_graph and mode != "switch":
            raise ValueError(
                "cuda_graph=True runs the switch mode's one session through a CUDA graph; mode='session' has none"
            )
        if cuda_graph and cuda_arena == "shared":
            raise ValueError(
                "cuda_graph=True with cuda_arena='shared': a replay writes its intermediates into arena memory "
                "free between runs, which other sessions sharing the arena may hold; use cuda_arena='own'"
            )
        self.mode, self.precision = mode, precision
        gpu = device != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers() and _gpu_present()
        if device == "cuda" and not gpu:
            warnings.warn("CUDA requested but onnxruntime-gpu or a GPU is missing: running on CPU", stacklevel=2)
        if gpu and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA / cuDNN from torch's nvidia wheels
        self.requested_cuda = device == "cuda" or gpu
        self.cuda = gpu
        self.providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if gpu else ["CPUExecutionProvider"]
        self.tf32 = bool(tf32)
        shared = gpu and cuda_arena == "shared" and shared_arena(ort, "cuda")
        if gpu and cuda_arena == "shared" and not shared:
            warnings.warn(
                "cuda_arena='shared': this onnxruntime cannot register one; each session keeps its own", stacklevel=2
            )
        self.cuda_arena = ("shared" if shared else "own") if gpu else None  # what the sessions are built with
        if cuda_graph and not gpu:
            warnings.warn("cuda_graph=True needs onnxruntime's CUDA provider and a GPU: running without", stacklevel=2)
        self.threads = threads
        self.max_sessions = max_sessions
        self.ready, self.keep, self.layout_request = ready, keep, layout
        # onnxruntime casts a task's tensors to float16 some 10x faster than NumPy does: float16 fills with it
        self.fill = ("onnxruntime" if gpu or precision != "float32" else "numpy") if fill == "auto" else fill
        if self.fill == "numpy" and gpu and mode == "switch":
            raise ValueError("fill='numpy' writes host buffers; on CUDA the switch mode fills with onnxruntime")
        self._setup = OrtSetup(ort, self.path, self.desc, gpu, self.requested_cuda, self.tf32, threads, self.cuda_arena)
        self._norms: dict[int, str] = {}  # task -> its normalisation, for the frame check's errors
        self._doors: dict[int, tuple] = {}  # task -> (declared input shape, who expects it, classes)
        self._impl: SwitchMode | SessionMode
        if mode == "switch":
            self._impl = SwitchMode(
                self._setup,
                ready=ready,
                keep=keep,
                layout=layout,
                fill=self.fill,
                cuda_graph=bool(cuda_graph) and gpu,
                precision=precision,
            )
        else:
            self._impl = SessionMode(self._setup, max_sessions)

    # ------------------------------------------------------------------ what the bundle holds
    @property
    def tasks(self) -> list[int]:
        return self._setup.tasks

    def class_names(self, task: int) -> list[str]:
        return self._row(task).get("class_names") or [str(i) for i in range(self._row(task)["num_classes"])]

    def num_classes(self, task: int) -> int:
        """Classes of ``task``: its logits are the first this many columns of the switch template's output."""
        return int(self._row(task)["num_classes"])

    def _row(self, task: int) -> dict:
        return self._setup.row(task)

    # ------------------------------------------------------------------ the mode's state, as it is now
    @property
    def cuda_graph(self) -> bool:
        return isinstance(self._impl, SwitchMode) and self._impl.cuda_graph

    @property
    def switches(self) -> int:
        return self._impl.switches

    @property
    def last_switch_seconds(self) -> float | None:
        return self._impl.last_switch_seconds

    @property
    def rebuilds(self) -> int:
        return self._impl.rebuilds if isinstance(self._impl, SessionMode) else 0

    def session(self, task: int):
        """The session that runs ``task``: the bundle's one (switch mode) or its own (session mode, created
        on first use, then cached)."""
        return self._impl.session(task)

    def info(self) -> dict:
        """What this Runtime uses: ``mode``, ``providers`` (of the sessions built so far), ``layout`` and the
        tasks held ready with the bytes of the weight buffers and of what each task keeps (switch mode),
        ``cached_tasks`` (session mode: each cached session holds its folded dense weights), and ``cuda_arena``
        (CUDA: ``own`` or ``shared``, as the sessions were built; None on a CPU)."""
        info = self._impl.info()
        if info["mode"] == "session" and not info["providers"]:
            info["providers"] = self.providers
        info["cuda_arena"] = self.cuda_arena
        return info

    def metadata(self, task: int) -> dict:
        """The ONNX metadata of the graph that runs ``task`` (input size, normalisation...)."""
        return self.session(task).get_modelmeta().custom_metadata_map

    # ------------------------------------------------------------------ runs
    def _normalisation(self, task: int) -> str:
        """The normalisation ``task``'s metadata gives, as a hint for the frame check's errors."""
        norm = self._norms.get(task)
        if norm is None:
            meta = self.metadata(task)
            try:
                mean, std = json.loads(meta["nwsconvert.mean"]), json.loads(meta["nwsconvert.std"])
                norm = f"mean {mean}, std {std}" if mean or std else "no mean or std: pixels in [0, 1]"
            except (KeyError, ValueError, TypeError):
                norm = "its graph's metadata gives no mean or std"
            self._norms[task] = norm
        return norm

    def run(self, task: int, images):
        """Logits of ``task`` for ``images`` (normalised as the bundle's metadata says). Thread-safe.

        Args:
            images: ``(B, C, H, W)`` float32 as NumPy (logits come back as NumPy ``(B, num_classes)``; other
                floating dtypes are converted), or an ``onnxruntime.OrtValue`` (switch mode: on the GPU with
                CUDA, then the logits stay there too, an OrtValue of ``(B, max classes)`` whose first
                :meth:`num_classes` columns are the task's).

        Raises:
            TaskNotFoundError: no graph for ``task``. UsageError: images of another rank, channel count or
                size than the bundle's ``(B, C, H, W)`` (named), or integer pixels (not normalised).
        """
        door = self._doors.get(task)
        if door is None:  # the task checked, and what its frames must be, once
            declared = self._impl.input_shape(task)
            door = self._doors[task] = (
                declared,
                f"task {task} of bundle {self.path}",
                self.num_classes(task),
                fixed_chw(declared),
            )
        declared, what, classes, chw = door
        x = check_frames(images, declared, self.ort, what, lambda: self._normalisation(task), chw)
        if isinstance(self._impl, SessionMode):
            if isinstance(x, self.ort.OrtValue):
                x = np.ascontiguousarray(x.numpy(), dtype=np.float32)
            return self._impl.run(task, x)
        return self._impl.run(task, x, classes)

    def predict(self, task: int, images, k: int = 1) -> list[list[tuple[str, float]]]:
        """Top-``k`` ``(class name, probability)`` per image. Thread-safe."""
        logits = self.run(task, images)
        e = np.exp(logits - logits.max(1, keepdims=True))
        prob = e / e.sum(1, keepdims=True)
        names = self.class_names(task)
        top = np.argsort(-prob, 1)[:, :k]
        return [[(names[j], float(prob[i, j])) for j in row] for i, row in enumerate(top)]
