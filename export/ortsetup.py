"""What every onnxruntime session of a :class:`~nwsconvert.export.runtime.Runtime` is built with, in one place:
the providers, the session options, the shared arenas, the bundle's checked pool file, and the checked
opening of a task graph. Both modes (:mod:`~nwsconvert.export.sessionmode`, :mod:`~nwsconvert.export.switchmode`)
build their sessions through an :class:`OrtSetup`; it holds no per-run state, so every thread may use it.

NumPy, onnxruntime and the bundle readers only (the runtime wheel imports it).
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nwsconvert.errors import FormatError, TaskNotFoundError
from nwsconvert.formats.stfile import nws_header, raw_digest, read_header

from .bundlefile import bundle_file, check_external_data

__all__ = ["DISABLED_OPTIMIZERS", "OrtSetup", "release_freed_memory", "session_providers", "shared_arena"]

#: onnxruntime graph rewrites every session runs without. ``Pad_Fusion`` folds a zero-valued
#: constant Pad into a following MaxPool, whose own padding counts as -inf, so a window that
#: sees only negatives and padding returns the negative maximum instead of 0 (onnxruntime
#: 1.17 to at least 1.31). timm's BiT ResNetV2 stem (pad 0, then MaxPool) hits it: 3 % off
#: the largest logit. Running a bundle's graphs with your own session: pass the same.
DISABLED_OPTIMIZERS = ["Pad_Fusion"]

#: Pool-file dtypes the graphs gather from (``pool_dtype``), as NumPy views of the mapped file.
_POOL_NUMPY = {"F32": np.float32, "F16": np.float16}


def session_providers(cuda: bool, tf32: bool = False, graph: bool = False, nhwc: bool = False) -> list:
    """The ``providers`` a session is built with: the CUDA provider first when ``cuda``, with TF32 as asked
    (onnxruntime's own default rounds to TF32), its CUDA graph when ``graph`` (runs then go through
    :class:`~nwsconvert.export.graphruns.GraphRuns`) and its channels-last kernels when ``nhwc`` (what
    tensor cores prefer in float16; builds without them run as before), then the CPU's. What
    :class:`Runtime` and a dense baseline meant to match it pass to ``InferenceSession``."""
    if not cuda:
        return ["CPUExecutionProvider"]
    options = {"use_tf32": "1" if tf32 else "0"}
    if graph:
        options["enable_cuda_graph"] = "1"
    if nhwc:
        options["prefer_nhwc"] = "1"
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def release_freed_memory() -> None:
    """Hand the memory freed while building sessions back to the system (glibc's ``malloc_trim``): a
    session's build leaves its temporaries (folded weights before their reorder, the optimiser's copies)
    in the heap, which the process would otherwise keep as if the session held them. Nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_ENV_ARENAS: dict[str, bool] = {}  # "cpu" / "cuda" -> registered; absent: not tried yet in this process
_ENV_LOCK = threading.Lock()


def shared_arena(ort, device: str = "cpu") -> bool:
    """Register one arena allocator on ``device`` for the process, which sessions asking for it share. On the
    CPU: every cached session of the session mode, not one each. On CUDA (device 0, growing by what is
    asked, not to the next power of two): the switch mode's graph and its fill graph, or every cached task
    session. False where this onnxruntime cannot."""
    with _ENV_LOCK:
        if device not in _ENV_ARENAS:
            try:
                kind = ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR
                if device == "cpu":
                    info = ort.OrtMemoryInfo("Cpu", kind, 0, ort.OrtMemType.DEFAULT)
                    ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
                else:
                    info = ort.OrtMemoryInfo("Cuda", kind, 0, ort.OrtMemType.DEFAULT)
                    # OrtArenaCfg(max_mem: no limit, extend strategy 1: kSameAsRequested, initial chunk, max dead bytes)
                    cfg = ort.OrtArenaCfg(0, 1, -1, -1)
                    ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {}, cfg)
                _ENV_ARENAS[device] = True
            except Exception:  # noqa: BLE001 (one the caller registered already, or a build without it)
                _ENV_ARENAS[device] = False
        return _ENV_ARENAS[device]


@dataclass
class OrtSetup:
    """The bundle and the choices every session of one Runtime shares.

    Attributes:
        ort: the ``onnxruntime`` module.
        path: the bundle folder. desc: its checked ``bundle.json``.
        cuda: sessions run on the CUDA provider. requested_cuda: the caller asked for it (warned otherwise).
        tf32, threads: as :class:`Runtime` takes them. cuda_arena: ``own``/``shared`` on CUDA, else None.
        pool_arrays: layer -> its pool ``(n, g)``, views of the mapped, checked pool file.
        pools: ``pool/<layer>`` -> an OrtValue over it (what task graphs are handed by name).
    """

    ort: object
    path: Path
    desc: dict
    cuda: bool
    requested_cuda: bool
    tf32: bool
    threads: int | None
    cuda_arena: str | None

    def __post_init__(self) -> None:
        self.provider_args = session_providers(self.cuda, self.tf32)
        self.device_kind = "cuda" if self.cuda else "cpu"
        self.pool_arrays = self._map_pools(bundle_file(self.path, "pools.safetensors", "the pool file"))
        self.pools = {f"pool/{n}": self.ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.pool_arrays.items()}

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

    def row(self, task: int) -> dict:
        """``bundle.json``'s row of ``task``, which must have a graph."""
        row = self.desc["tasks"].get(str(task))
        if row is None or "onnx" not in row:
            raise TaskNotFoundError(
                f"bundle {self.path} has no ONNX graph for task {task}; tasks with graphs: {self.tasks}"
            )
        return row

    def options(self, external: dict | None = None, level=None, shared_arena_cpu: bool = False):
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
        if self.cuda_arena == "shared" or (shared_arena_cpu and not self.cuda and shared_arena(self.ort)):
            opts.add_session_config_entry("session.use_env_allocators", "1")  # the arena registered with the process
        return opts

    def check_providers(self, sess, what: str) -> None:
        if self.requested_cuda and "CUDAExecutionProvider" not in sess.get_providers():
            warnings.warn(
                f"{what}: the CUDA provider was requested but the session runs on {sess.get_providers()}",
                stacklevel=5,
            )

    def open_graph(self, name: str, sha256: str | None, what: str):
        """A checked session over the bundle's graph file ``name``: inside the bundle, its SHA-256 against
        bundle.json, every external-data location a file of the bundle, then its pool-set metadata."""
        graph = bundle_file(self.path, name, what)
        data = graph.read_bytes()  # checked and opened from these bytes: no other file read in between
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise FormatError(
                f"{graph}: content does not match the SHA-256 bundle.json records: the graph is corrupted or was replaced"
            )
        check_external_data(data, graph, self.path)
        try:
            sess = self.ort.InferenceSession(
                data,  # its external data (the pools) handed over by name
                sess_options=self.options(self.pools, shared_arena_cpu=True),
                providers=self.provider_args,
                disabled_optimizers=DISABLED_OPTIMIZERS,
            )
        except Exception as e:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
            raise FormatError(f"{graph}: onnxruntime cannot load {what} ({type(e).__name__}: {str(e)[:200]})") from None
        meta = sess.get_modelmeta().custom_metadata_map
        if meta.get("nwsconvert.pool_sha256", self.desc["pool_sha256"]) != self.desc["pool_sha256"]:
            raise FormatError(
                f"{graph}: the graph is of pool set {str(meta.get('nwsconvert.pool_sha256'))[:12]}..., the bundle's is {self.desc['pool_sha256'][:12]}..."
            )
        self.check_providers(sess, graph.name)
        return sess
