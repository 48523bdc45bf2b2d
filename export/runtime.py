"""onnxruntime deployment of a bundle, with fast task switching.

    rt = nwsconvert.export.Runtime("runs/mnist/export")     # CUDA when present, else CPU; one session, every task
    logits = rt.run(2, images)                              # images: (B, C, H, W) float32, normalised
    rt.predict(2, images, k=3)                               # [[(class name, probability), ...], ...]
    rt = Runtime("runs/mnist/export", mode="session")       # one session per task graph

Two modes (measured side by side in ``benchmarks/RESULTS.md``, "Many tasks for the memory of one"):

``switch`` (the default when the bundle holds ``switch.onnx``)
    one onnxruntime session of the bundle's dense template (:mod:`nwsconvert.export.densify`) runs every
    task. Its weights are graph inputs bound to buffers through IOBinding, laid out as this machine's
    kernels read them (:mod:`nwsconvert.export.layout`: onnxruntime's blocked NCHWc layout on a CPU, so
    inference runs at the speed of a session built for the task). A switch rewrites the buffers from the
    shared pools and the task's indices (one gather per layer, BatchNorm folded, with NumPy on a CPU; a
    graph on the GPU whose outputs are the buffers, on CUDA). No session is built after start-up, and the
    memory is one dense model (``ready`` of them: the tasks kept ready, a switch between them only
    rebinds) plus the pools plus what each task keeps: its decoded indices (``keep="indices"``, the
    default, 2 bytes a kernel) or only its pack (``keep="pack"``: decoded at each switch).
``session``
    one session per task graph (``task_<t>.onnx``): onnxruntime folds the task's Gathers and BatchNorms
    into dense weights when the session is built. A cached session is a look-up; another task costs a
    session creation; each cached session holds its own dense weights (``max_sessions`` of them, least
    recently used out; the sessions share one memory arena).

The pool file is memory-mapped once and checked against the bundle's pool-set hash. Session mode hands
its tensors to every task graph by name (``SessionOptions.add_external_initializers``, which replaces
the graph's external-data references before any optimisation): the tensors at the offsets the checked
header gives, whatever offsets the graph was exported with.

Everything it opens is checked first: ``bundle.json``'s fields, the pool file against the bundle's
pool-set hash, each graph against its recorded SHA-256, each pack against its hash, its pool set and the
base the bundle records. A bad file is refused by name (:class:`~nwsconvert.errors.FormatError`), never
answered with NaN; a switch to a task whose pack is damaged raises and leaves the task selected before
it working. Imports neither torch nor timm.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nwsconvert.devices import cuda_device_count
from nwsconvert.errors import FormatError, TaskNotFoundError
from nwsconvert.formats.packfile import STANDALONE, clear_cached_bases, read_pack_arrays
from nwsconvert.formats.stfile import nws_header, raw_digest, read_header

from .bundlefile import file_sha256, read_bundle, recipe_sha256
from .densify import iter_dense_tensors, task_values
from .graphruns import GraphRuns
from .layout import aligned_empty, prepare

#: onnxruntime graph rewrites every session runs without. ``Pad_Fusion`` folds a zero-valued
#: constant Pad into a following MaxPool, whose own padding counts as -inf, so a window that
#: sees only negatives and padding returns the negative maximum instead of 0 (onnxruntime
#: 1.17 to at least 1.31). timm's BiT ResNetV2 stem (pad 0, then MaxPool) hits it: 3 % off
#: the largest logit. Running a bundle's graphs with your own session: pass the same.
DISABLED_OPTIMIZERS = ["Pad_Fusion"]

__all__ = ["DISABLED_OPTIMIZERS", "Runtime", "session_providers"]

#: Pool-file dtypes the graphs gather from (``pool_dtype``), as NumPy views of the mapped file.
_POOL_NUMPY = {"F32": np.float32, "F16": np.float16}


def session_providers(cuda: bool, tf32: bool = False, graph: bool = False) -> list:
    """The ``providers`` a session is built with: the CUDA provider first when ``cuda``, with TF32 as asked
    (onnxruntime's own default rounds to TF32) and its CUDA graph when ``graph`` (runs then go through
    :class:`~nwsconvert.export.graphruns.GraphRuns`), then the CPU's. What :class:`Runtime` and a dense
    baseline meant to match it pass to ``InferenceSession``."""
    if not cuda:
        return ["CPUExecutionProvider"]
    options = {"use_tf32": "1" if tf32 else "0"}
    if graph:
        options["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def _gpu_present() -> bool:
    return cuda_device_count() > 0


def _release_freed_memory() -> None:
    """Hand the memory freed while building sessions back to the system (glibc's ``malloc_trim``): a
    session's build leaves its temporaries (folded weights before their reorder, the optimiser's copies)
    in the heap, which the process would otherwise keep as if the session held them. Nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class _Slot:
    """One buffer set of the switch session's weight inputs, and the task it holds."""

    inputs: dict  # input name -> OrtValue over the buffer (CPU: views of ``buffer``; CUDA: device tensors)
    binding: object  # IOBinding with ``inputs`` bound
    buffer: np.ndarray | None = None  # CPU: the flat, aligned float32 buffer the inputs view
    task: int | None = None


@dataclass
class _Task:
    """What the switch mode keeps of a task: its values (``keep="indices"``) or the error its pack gave."""

    values: dict | None = None
    device_values: dict = field(default_factory=dict)  # CUDA: the values as device tensors
    error: Exception | None = None


_ENV_ARENAS: dict[str, bool] = {}  # "cpu" / "cuda" -> registered; absent: not tried yet in this process


def _shared_arena(ort, device: str = "cpu") -> bool:
    """Register one arena allocator on ``device`` for the process, which sessions asking for it share. On the
    CPU: every cached session of the session mode, not one each. On CUDA (device 0, growing by what is
    asked, not to the next power of two): the switch mode's graph and its fill graph, or every cached task
    session. False where this onnxruntime cannot."""
    if device not in _ENV_ARENAS:
        try:
            if device == "cpu":
                info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
                ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
            else:
                info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
                # OrtArenaCfg(max_mem: no limit, extend strategy 1: kSameAsRequested, initial chunk, max dead bytes)
                ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {}, ort.OrtArenaCfg(0, 1, -1, -1))
            _ENV_ARENAS[device] = True
        except Exception:  # noqa: BLE001 (one the caller registered already, or a build without it)
            _ENV_ARENAS[device] = False
    return _ENV_ARENAS[device]


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
            rebind; another task overwrites the least recently used buffer). Each costs one dense model.
        keep: switch mode: ``indices`` (every task's decoded indices kept from start-up: a switch is the
            gather alone) or ``pack`` (nothing kept but the pack file: each switch decodes it).
        layout: switch mode: ``auto`` (this machine's kernels' layout, see :mod:`nwsconvert.export.layout`)
            or ``plain`` (the template's own shapes; what CUDA runs).
        fill: switch mode: how a switch computes a task's tensors: ``numpy`` (on the host; the CPU's
            default), ``onnxruntime`` (a graph whose outputs are the buffers, on the session's device: the
            CUDA default, with no copy through the host; on a CPU with ``layout="plain"`` only), ``auto``.
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
            Without CUDA it warns and is off; with ``cuda_arena="shared"`` it is refused. Call ``run`` from
            one thread (onnxruntime keeps graphs per thread). Not measured on a GPU yet.

    Attributes:
        providers: the providers requested (names); ``session(task).get_providers()`` says what runs.
        cuda_arena: CUDA: ``own`` or ``shared``, the arena the sessions are built with (``own`` where a shared
            one could not be registered); None on a CPU.
        cuda_graph: whether the switch session runs through onnxruntime's CUDA graph (False once refused).
        last_switch_seconds: the work of the last switch to a task not held ready, in seconds: decoding
            (``keep="pack"``), the gather and fold, and writing the buffers (switch mode); the session
            creation (session mode). A switch to a task held ready or cached costs a look-up.

    Raises:
        FileNotFoundError: no bundle there. FormatError: ``bundle.json``, the pool file, the template or
            a graph is damaged or not the one the bundle records (named).
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
    ):
        import onnxruntime as ort

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
        if type(ready) is not int or ready < 1:
            raise ValueError(f"ready must be a whole number >= 1, got {ready!r}")
        if mode == "auto":
            mode = "switch" if "switch" in self.desc else "session"
        if mode == "switch" and "switch" not in self.desc:
            raise FileNotFoundError(
                f"{self.path} has no switch.onnx (one-session mode): export it again with nws-export --onnx"
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
        self.mode = mode
        gpu = device != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers() and _gpu_present()
        if device == "cuda" and not gpu:
            warnings.warn("CUDA requested but onnxruntime-gpu or a GPU is missing: running on CPU", stacklevel=2)
        if gpu and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA / cuDNN from torch's nvidia wheels
        self.requested_cuda = device == "cuda" or gpu
        self.cuda = gpu
        self.providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if gpu else ["CPUExecutionProvider"]
        self.tf32 = bool(tf32)
        self._provider_args = session_providers(gpu, self.tf32)  # what sessions are built with
        shared = gpu and cuda_arena == "shared" and _shared_arena(ort, "cuda")
        if gpu and cuda_arena == "shared" and not shared:
            warnings.warn(
                "cuda_arena='shared': this onnxruntime cannot register one; each session keeps its own", stacklevel=2
            )
        self.cuda_arena = ("shared" if shared else "own") if gpu else None  # what the sessions are built with
        if cuda_graph and not gpu:
            warnings.warn("cuda_graph=True needs onnxruntime's CUDA provider and a GPU: running without", stacklevel=2)
        self.cuda_graph = bool(cuda_graph) and gpu
        self._graph_runs: GraphRuns | None = None
        self.threads = threads
        self.max_sessions = max_sessions
        self.ready, self.keep, self.layout_request = ready, keep, layout
        self.fill = ("onnxruntime" if gpu else "numpy") if fill == "auto" else fill
        if self.fill == "numpy" and gpu and mode == "switch":
            raise ValueError("fill='numpy' writes host buffers; on CUDA the switch mode fills with onnxruntime")
        self._device_kind = "cuda" if gpu else "cpu"
        self._sessions: OrderedDict[int, object] = OrderedDict()
        self._evicted: set[int] = set()
        self.rebuilds = 0  # session mode: sessions built again after their eviction
        self._pool_arrays = self._map_pools(self.path / "pools.safetensors")
        self._pools = {f"pool/{n}": ort.OrtValue.ortvalue_from_numpy(a) for n, a in self._pool_arrays.items()}
        self._verified: set[int] = set()
        self.last_switch_seconds: float | None = None
        self.switches = 0  # switches that wrote a task's tensors (switch mode) or built a session
        self._template_bytes: bytes | None = None
        if mode == "switch":
            self._start_switch()

    def _map_pools(self, pool_file: Path) -> dict[str, np.ndarray]:
        """Layer name -> its pool, from the pool file mapped once and checked against the bundle's pool-set
        hash: handed to every task graph's session as ``pool/<layer>``, gathered from in switch mode."""
        header = read_header(pool_file, "pool")
        nws_header(header, pool_file, "nwsconvert.poolset", 2, hashed_since=2)  # kind, version, header hash
        data = np.memmap(pool_file, dtype=np.uint8, mode="r")
        if raw_digest(data, header) != self.desc["pool_sha256"]:
            raise FormatError(
                f"{pool_file}: its content does not match the pool set {self.desc['pool_sha256'][:12]}... this bundle "
                "was exported with (corrupted, or a pool file of another run): export the bundle again"
            )
        pools = {}
        for name, t in header.tensors.items():
            if t.dtype not in _POOL_NUMPY:
                raise FormatError(f"{pool_file}: tensor {name!r} is {t.dtype}, pools are float32 or float16")
            pools[name] = np.ascontiguousarray(data[t.start : t.end].view(_POOL_NUMPY[t.dtype]).reshape(t.shape))
        return pools

    @property
    def tasks(self) -> list[int]:
        return sorted(int(t) for t, row in self.desc["tasks"].items() if "onnx" in row)

    def class_names(self, task: int) -> list[str]:
        return self._row(task).get("class_names") or [str(i) for i in range(self._row(task)["num_classes"])]

    def num_classes(self, task: int) -> int:
        """Classes of ``task``: its logits are the first this many columns of the switch template's output."""
        return int(self._row(task)["num_classes"])

    def _row(self, task: int) -> dict:
        row = self.desc["tasks"].get(str(task))
        if row is None or "onnx" not in row:
            raise TaskNotFoundError(
                f"bundle {self.path} has no ONNX graph for task {task}; tasks with graphs: {self.tasks}"
            )
        return row

    def _options(self, external: dict | None = None, level=None, shared_arena: bool = False):
        """Session options: quiet, the thread count, the optimisation ``level``, and ``external`` (name ->
        OrtValue) handed over by name in place of the graph's external data."""
        opts = self.ort.SessionOptions()
        opts.log_severity_level = 3
        if self.threads:
            opts.intra_op_num_threads = self.threads
        if level is not None:
            opts.graph_optimization_level = level
        if external:
            opts.add_external_initializers(list(external), list(external.values()))
        if self.cuda_arena == "shared" or (shared_arena and not self.cuda and _shared_arena(self.ort)):
            opts.add_session_config_entry("session.use_env_allocators", "1")  # the arena registered with the process
        return opts

    def _check_providers(self, sess, what: str) -> None:
        if self.requested_cuda and "CUDAExecutionProvider" not in sess.get_providers():
            warnings.warn(
                f"{what}: the CUDA provider was requested but the session runs on {sess.get_providers()}",
                stacklevel=4,
            )

    def _open(self, graph: Path, sha256: str | None, what: str):
        """A checked session over ``graph`` (its SHA-256 against bundle.json, then its pool-set metadata)."""
        if not graph.is_file():
            raise FileNotFoundError(f"{graph}: {what} is missing from the bundle")
        if sha256 is not None and file_sha256(graph) != sha256:
            raise FormatError(
                f"{graph}: content does not match the SHA-256 bundle.json records: the graph is corrupted or was replaced"
            )
        try:
            sess = self.ort.InferenceSession(
                str(graph),
                sess_options=self._options(self._pools, shared_arena=True),
                providers=self._provider_args,
                disabled_optimizers=DISABLED_OPTIMIZERS,
            )
        except Exception as e:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
            raise FormatError(f"{graph}: onnxruntime cannot load {what} ({type(e).__name__}: {str(e)[:200]})") from None
        meta = sess.get_modelmeta().custom_metadata_map
        if meta.get("nwsconvert.pool_sha256", self.desc["pool_sha256"]) != self.desc["pool_sha256"]:
            raise FormatError(
                f"{graph}: the graph is of pool set {str(meta.get('nwsconvert.pool_sha256'))[:12]}..., the bundle's is {self.desc['pool_sha256'][:12]}..."
            )
        self._check_providers(sess, graph.name)
        return sess

    def session(self, task: int):
        """The session that runs ``task``: the bundle's one (switch mode) or its own (session mode, created
        on first use, then cached)."""
        if self.mode == "switch":
            self._row(task)
            return self._session
        if task in self._sessions:
            self._sessions.move_to_end(task)
            return self._sessions[task]
        row = self._row(task)
        tic = time.perf_counter()
        verified = task in self._verified  # the file's hash is checked once per task and Runtime
        sess = self._open(self.path / row["onnx"], None if verified else row.get("onnx_sha256"), f"task {task}'s graph")
        self._verified.add(task)
        meta = sess.get_modelmeta().custom_metadata_map
        if meta.get("nwsconvert.task") not in (None, str(task)):
            raise FormatError(
                f"{self.path / row['onnx']}: the graph is task {meta.get('nwsconvert.task')}, bundle.json lists it as task {task}"
            )
        _release_freed_memory()
        self.last_switch_seconds = time.perf_counter() - tic
        self.switches += 1
        self._sessions[task] = sess
        if task in self._evicted:
            self.rebuilds += 1
            if self.rebuilds == self.max_sessions:
                warnings.warn(
                    f"Runtime({self.path}): {self.rebuilds} task sessions built again after eviction "
                    f"({1e3 * self.last_switch_seconds:.0f} ms each; max_sessions={self.max_sessions} for more tasks "
                    "in turn): raise max_sessions, or use mode='switch' (one session for every task)",
                    stacklevel=3,
                )
        while len(self._sessions) > self.max_sessions:
            self._evicted.add(self._sessions.popitem(last=False)[0])
        return sess

    # ---------------------------------------------------------------- switch mode
    def _template(self) -> bytes:
        """``switch.onnx``'s bytes, checked against bundle.json."""
        if self._template_bytes is None:
            info = self.desc["switch"]
            graph = self.path / info["onnx"]
            if "tensors" not in info:
                raise FormatError(
                    f"{graph}: a one-session graph of an earlier kind (weights gathered at every run): "
                    "export the bundle again with nws-export --onnx"
                )
            if not graph.is_file():
                raise FileNotFoundError(f"{graph}: the one-session graph switch.onnx is missing from the bundle")
            if recipe_sha256(info["tensors"]) != info["tensors_sha256"]:
                raise FormatError(
                    f"{self.path / 'bundle.json'}: field switch.tensors does not match its SHA-256 "
                    "(switch.tensors_sha256): the recipe was edited; export the bundle again"
                )
            data = graph.read_bytes()
            if hashlib.sha256(data).hexdigest() != info["onnx_sha256"]:
                raise FormatError(
                    f"{graph}: content does not match the SHA-256 bundle.json records: the graph is corrupted or was replaced"
                )
            self._template_bytes = data
        return self._template_bytes

    def _start_switch(self) -> None:
        """Build the one session, its ``ready`` buffer sets and (``keep="indices"``) every task's values."""
        ort = self.ort
        self._recipe = self.desc["switch"]["tensors"]
        rows: list[tuple[str, tuple[int, ...]]] = []
        for r in self._recipe:
            rows.append((r["name"], tuple(int(d) for d in r["shape"])))
            if r["kind"] == "fold":
                rows.append((r["bias_name"], (int(r["shape"][0]),)))
        graph_file = self.path / self.desc["switch"]["onnx"]
        if self.fill == "onnxruntime" and not (self.cuda or self.layout_request == "plain"):
            raise ValueError("fill='onnxruntime' writes the template's own layout: give layout='plain' with it")
        pools = {
            n: (tuple(p.shape), "float32" if p.dtype == np.float32 else "float16") for n, p in self._pool_arrays.items()
        }
        try:
            self._graph, filler = prepare(
                self._template(),
                rows,
                layout="plain" if self.cuda or self.layout_request == "plain" else "auto",
                threads=self.threads,
                disabled_optimizers=DISABLED_OPTIMIZERS,
                fill=(self._recipe, pools) if self.fill == "onnxruntime" else None,
            )
            self._level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL if self._graph.optimised else None
            self._session = self._switch_session(self._level)
            self._filler = None
            if filler is not None:
                sess = ort.InferenceSession(filler, sess_options=self._options(), providers=self._provider_args)
                device_pools = {
                    f"pool/{n}": ort.OrtValue.ortvalue_from_numpy(a, self._device_kind, 0)
                    for n, a in self._pool_arrays.items()
                }
                self._filler = (sess, device_pools)
        except (FormatError, FileNotFoundError):
            raise
        except Exception as e:  # onnx and onnxruntime raise their own exception types
            raise FormatError(
                f"{graph_file}: onnxruntime cannot run it with its tensors as inputs ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        _release_freed_memory()
        self._check_providers(self._session, graph_file.name)
        self._output = self._session.get_outputs()[0].name
        self._input = self._session.get_inputs()[0].name
        if self.cuda_graph:
            self._graph_runs = GraphRuns(ort, self._session, self._device_kind, self._input, self._output)
        self._pool_shapes = {name: tuple(p.shape) for name, p in self._pool_arrays.items()}
        small = max((p.shape[0] for p in self._pool_arrays.values()), default=0) <= 1 << 16
        self._index_dtype = np.uint16 if small and self.fill == "numpy" else np.int32
        self._slots = [self._new_slot() for _ in range(self.ready)]
        self._held: OrderedDict[int, _Slot] = OrderedDict()  # task -> slot, least recently used first
        self._selected: int | None = None
        self._tasks: dict[int, _Task] = {}
        self._bases: dict[str, object] = {}  # keep="pack": each base decoded once
        if self.keep == "indices":
            for t in self.tasks:
                try:
                    self._tasks[t] = _Task(values=self._read_values(t))
                except (FormatError, FileNotFoundError, ValueError, KeyError) as e:
                    self._tasks[t] = _Task(error=e)  # raised at a switch to it; the others run
            clear_cached_bases()  # every task decoded: the base they were changes against is not needed again
            _release_freed_memory()

    def _switch_session(self, level):
        """The switch mode's session over the prepared template, with the CUDA graph where asked and taken."""
        build = lambda graph: self.ort.InferenceSession(  # noqa: E731
            self._graph.model,
            sess_options=self._options(level=level),
            providers=session_providers(True, self.tf32, graph=True) if graph else self._provider_args,
            disabled_optimizers=DISABLED_OPTIMIZERS,
        )
        if not self.cuda_graph:
            return build(False)
        try:
            return build(True)
        except Exception as e:  # noqa: BLE001 (onnxruntime's own types)
            self._graph_refused(e, stacklevel=5)  # the user's Runtime(...)
            return build(False)

    def _graph_refused(self, e: Exception, stacklevel: int) -> None:
        """Warn that the graph was refused; the session runs without it from here."""
        self.cuda_graph = False
        warnings.warn(
            f"cuda_graph=True: onnxruntime refused the CUDA graph ({type(e).__name__}: {str(e)[:200]}); "
            "running without",
            stacklevel=stacklevel,
        )

    def _drop_graph(self, e: Exception) -> None:
        """A graphed run failed where the same run without the graph works: warn, and build the session again
        without the option (no state of a capture that failed part-way), each buffer set bound to it."""
        self._graph_refused(e, stacklevel=4)  # the user's run(...)
        self._graph_runs = None
        self._session = self._switch_session(self._level)
        for slot in self._slots:
            slot.binding = self._session.io_binding()
            for name, value in slot.inputs.items():
                slot.binding.bind_ortvalue_input(name, value)

    def _new_slot(self) -> _Slot:
        ort = self.ort
        binding = self._session.io_binding()
        if self.fill == "onnxruntime":
            inputs = {
                p.name: ort.OrtValue.ortvalue_from_shape_and_type(list(p.shape), np.float32, self._device_kind, 0)
                for p in self._graph.placements
            }
            buffer = None
        else:
            buffer = aligned_empty(self._graph.floats)
            buffer.fill(0)
            inputs = {name: ort.OrtValue.ortvalue_from_numpy(view) for name, view in self._graph.views(buffer).items()}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        return _Slot(inputs, binding, buffer)

    def _base(self, row: dict):
        """The base a task's pack is coded against (``None``: it has none), as a path checked on each read,
        or with ``keep="pack"`` decoded once and kept, its indices in the kept index type."""
        if not row.get("base"):
            return None
        path, sha = self.path / row["base"], row.get("base_sha256")
        if self.keep != "pack" or sha is None:
            return {sha: path} if sha else path
        if sha not in self._bases:
            base = read_pack_arrays(path, STANDALONE, sha256=sha, pool_sha256=self.desc["pool_sha256"])
            compact = {k: v.astype(self._index_dtype) for k, v in base.indices.items()}
            self._bases[sha] = dataclasses.replace(base, indices=compact, encoded={})
        return self._bases[sha]

    def _read_values(self, task: int) -> dict[str, np.ndarray]:
        """Task ``task``'s :func:`task_values` from its pack (hash, pool set, task and base checked), in two
        contiguous arrays (its indices; its floats) that the returned arrays view."""
        row = self._row(task)
        path = self.path / row["pack"]
        raw = _switch_inputs(path, self._base(row), row.get("pack_sha256"), self.desc["pool_sha256"], task)
        try:
            values = task_values(self._recipe, raw, self._pool_shapes, self._index_dtype)
        except KeyError as e:
            raise FormatError(
                f"{path}: holds no {e.args[0]!r}, which bundle.json's switch.tensors (the recipe of switch.onnx) "
                "names: a pack or a bundle of another model?"
            ) from None
        except ValueError as e:  # sizes or indices the recipe does not take
            raise FormatError(f"{path}: {e} (bundle.json's switch.tensors): export the bundle again") from None
        return _compact(values)

    def _values(self, task: int) -> dict[str, np.ndarray]:
        held = self._tasks.get(task)
        if held is None:  # keep="pack"
            return self._read_values(task)
        if held.error is not None:
            raise held.error
        assert held.values is not None
        return held.values

    def _ready(self, task: int) -> _Slot:
        """The slot holding ``task``, after writing its tensors into the least recently used one if none does.
        A task whose pack fails its checks raises before any buffer is touched."""
        slot = self._held.get(task)
        if slot is not None:
            self._held.move_to_end(task)
            self._selected = task
            return slot
        self._row(task)
        tic = time.perf_counter()
        values = self._values(task)
        device = self._device_values(task, values) if self.fill == "onnxruntime" else None
        slot = self._take_slot(task)
        try:
            if device is not None:
                self._run_filler(slot, device)
            else:
                assert slot.buffer is not None
                self._graph.fill(slot.buffer, iter_dense_tensors(self._recipe, self._pool_arrays, values))
        except BaseException:  # a buffer half written holds no task
            self._held.pop(task, None)
            slot.task = None
            if self._selected not in self._held:  # its buffer was the one overwritten
                self._selected = None
            raise
        self.last_switch_seconds = time.perf_counter() - tic
        self.switches += 1
        self._selected = task
        return slot

    def _take_slot(self, task: int) -> _Slot:
        """A free slot, or the least recently used one, now holding ``task``."""
        free = [s for s in self._slots if s.task is None]
        if free:
            slot = free[0]
        else:
            old, slot = self._held.popitem(last=False)
        slot.task = task
        self._held[task] = slot
        return slot

    def _device_values(self, task: int, values: dict) -> dict:
        """The task's values as tensors on the session's device (kept with ``keep="indices"``: uploaded once;
        the indices and state, never a weight)."""
        held = self._tasks.get(task)
        if held is not None and held.device_values:
            return held.device_values
        kind = self._device_kind
        device = {k: self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), kind, 0) for k, v in values.items()}
        if held is not None:
            held.device_values = device
        return device

    def _run_filler(self, slot: _Slot, device: dict) -> None:
        sess, pools = self._filler
        binding = sess.io_binding()
        for name, value in {**pools, **device}.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in slot.inputs.items():
            binding.bind_ortvalue_output(f"out:{name}", value)
        sess.run_with_iobinding(binding)

    def info(self) -> dict:
        """What this Runtime uses: ``mode``, ``providers`` (of the sessions built so far), ``layout`` and the
        tasks held ready with the bytes of the weight buffers and of what each task keeps (switch mode),
        ``cached_tasks`` (session mode: each cached session holds its folded dense weights), and ``cuda_arena``
        (CUDA: ``own`` or ``shared``, as the sessions were built; None on a CPU)."""
        if self.mode == "switch":
            kept = {t: sum(v.nbytes for v in h.values.values()) for t, h in self._tasks.items() if h.values}
            return {
                "mode": "switch",
                "providers": self._session.get_providers(),
                "layout": self._graph.layout,
                "layout_note": self._graph.reason,
                "ready_tasks": list(self._held),
                "selected": self._selected,
                "weight_buffer_bytes": 4 * self._graph.floats * len(self._slots),
                "bytes_per_task": kept,
                "keep": self.keep,
                "cuda_arena": self.cuda_arena,
                "cuda_graph": self.cuda_graph,
                "graphs": len(self._graph_runs.ids) if self._graph_runs is not None else 0,
            }
        sessions = list(self._sessions.values())
        providers = sorted({p for s in sessions for p in s.get_providers()})
        return {
            "mode": "session",
            "providers": providers or self.providers,
            "cached_tasks": list(self._sessions),
            "cuda_arena": self.cuda_arena,
        }

    def metadata(self, task: int) -> dict:
        """The ONNX metadata of the graph that runs ``task`` (input size, normalisation...)."""
        return self.session(task).get_modelmeta().custom_metadata_map

    def run(self, task: int, images):
        """Logits of ``task`` for ``images`` (normalised as the bundle's metadata says).

        Args:
            images: ``(B, C, H, W)`` float32 as NumPy (logits come back as NumPy ``(B, num_classes)``), or an
                ``onnxruntime.OrtValue`` (switch mode: on the GPU with CUDA, then the logits stay there too, an
                OrtValue of ``(B, max classes)`` whose first :meth:`num_classes` columns are the task's).
        """
        if self.mode == "session":
            x = np.ascontiguousarray(np.asarray(images, dtype=np.float32))
            return self.session(task).run(None, {"input": x})[0]
        slot = self._ready(task)
        binding = slot.binding
        device = isinstance(images, self.ort.OrtValue)
        x = images if device else np.ascontiguousarray(np.asarray(images, dtype=np.float32))
        graphs = self._graph_runs
        if graphs is not None:
            try:
                out = graphs.run(binding, x, self._slots.index(slot))
            except Exception as e:  # noqa: BLE001 (onnxruntime's own types)
                logits = self._run_plain(task, binding, x, graphs)  # a bad run raises here as it would plain
                self._drop_graph(e)  # the run is fine: the graph is not
                return logits
            if out is not None:
                return out if device else out[:, : self.num_classes(task)]
        return self._run_plain(task, binding, x, graphs)

    def _run_plain(self, task: int, binding, x, graphs: GraphRuns | None):
        """``x`` (NumPy or an OrtValue) through ``binding`` outside any graph: NumPy logits of the task's
        classes, or an OrtValue on the session's device."""
        device = isinstance(x, self.ort.OrtValue)
        if device:
            binding.bind_ortvalue_input(self._input, x)
            width = self._session.get_outputs()[0].shape[-1] if graphs is not None else None
            if not isinstance(width, int):
                binding.bind_output(self._output, self._device_kind)
            else:  # logits the caller keeps: not in the arena memory a later replay writes
                logits = self.ort.OrtValue.ortvalue_from_shape_and_type(
                    [x.shape()[0], width], np.float32, self._device_kind, 0
                )
                binding.bind_ortvalue_output(self._output, logits)
        else:
            binding.bind_cpu_input(self._input, x)
            binding.bind_output(self._output, "cpu")
        if graphs is not None:
            graphs.ungraphed(binding)  # the session was built with the graph: this run must say it has none
        else:
            self._session.run_with_iobinding(binding)
        if device:
            return binding.get_outputs()[0]
        return binding.copy_outputs_to_cpu()[0][:, : self.num_classes(task)]

    def predict(self, task: int, images, k: int = 1) -> list[list[tuple[str, float]]]:
        """Top-``k`` ``(class name, probability)`` per image."""
        logits = self.run(task, images)
        e = np.exp(logits - logits.max(1, keepdims=True))
        prob = e / e.sum(1, keepdims=True)
        names = self.class_names(task)
        top = np.argsort(-prob, 1)[:, :k]
        return [[(names[j], float(prob[i, j])) for j in row] for i, row in enumerate(top)]


def _compact(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``values`` as views of two contiguous arrays, one per dtype group (integers; floats): a task's kept
    values are two allocations, not one per layer."""
    out: dict[str, np.ndarray] = {}
    for kind in (np.integer, np.floating):
        names = [k for k, v in values.items() if np.issubdtype(v.dtype, kind)]
        if not names:
            continue
        dtype = np.result_type(*(values[k].dtype for k in names))
        block = np.empty(sum(values[k].size for k in names), dtype)
        at = 0
        for k in names:
            v = values[k]
            view = block[at : at + v.size].reshape(v.shape)
            view[...] = v
            out[k] = view
            at += v.size
    return out


def _switch_inputs(path: Path, base, sha256: str | None, pool_sha256: str, task: int) -> dict[str, np.ndarray]:
    """A task's values of switch.onnx's inputs, from its pack: ``indices/<layer>`` int32 ``(N,)`` and
    ``state/<key>`` float32 (floating state entries only, as the graph takes them). ``base``: the base
    file, ``{its SHA-256: file}`` (bundle.json's ``base_sha256``: the only base the pack may name), or the
    decoded base."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (task {task}'s pack, which the one-session mode reads)")
    pack = read_pack_arrays(path, base, sha256=sha256, pool_sha256=pool_sha256, task=task)
    out = {f"indices/{name}": idx.astype(np.int32) for name, idx in pack.indices.items()}
    for key, value in pack.state.items():
        if np.issubdtype(value.dtype, np.floating):
            out[f"state/{key}"] = value.astype(np.float32)
    return out
