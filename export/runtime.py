"""onnxruntime deployment of a bundle, with fast task switching.

    rt = nwsconvert.export.Runtime("runs/mnist/export")     # CUDA when present, else CPU
    logits = rt.run(task=2, images)                         # (B, C, H, W) float32, normalised
    rt.predict(task=2, images, k=3)                          # [[(class name, probability), ...], ...]

The pool file is memory-mapped once; its tensors are handed to every task's
session by name (``SessionOptions.add_external_initializers``, which replaces
the graph's external-data references before any optimisation), so a task
switch costs one session creation (indices + small tensors) and never reads
``pools.safetensors`` again, and the tensors used are the ones at the offsets
the checked header gives, whatever offsets the graph was exported with.
(``add_initializer`` is not used: onnxruntime ignores it for initializers
stored as external data and reads the file at the graph's offsets.)
Sessions are cached, least recently used first out.

Everything it opens is checked first: ``bundle.json``'s fields, the pool file
against the bundle's pool-set hash (once, on the mapped file), and each task
graph against its recorded SHA-256 before its session is built. A bad file is
refused by name (:class:`~nwsconvert.errors.FormatError`), never answered with
NaN. Imports neither torch nor timm.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np

from nwsconvert.devices import cuda_device_count
from nwsconvert.errors import FormatError, TaskNotFoundError
from nwsconvert.stfile import nws_header, raw_digest, read_header

from .bundlefile import file_sha256, read_bundle

__all__ = ["Runtime"]


def _gpu_present() -> bool:
    return cuda_device_count() > 0


class Runtime:
    """Sessions over one bundle.

    Args:
        bundle: a folder written by ``nws-export --onnx``.
        device: ``auto`` (CUDA when onnxruntime-gpu and a GPU are present), ``cuda`` or ``cpu``.
        max_sessions: sessions kept (LRU).
        threads: intra-op threads of the CPU provider (``None``: onnxruntime's default).

    Attributes:
        providers: the providers requested; ``session(task).get_providers()`` says what runs.

    Raises:
        FileNotFoundError: no bundle there. FormatError: ``bundle.json``, the pool file
            or a graph is damaged or not the one the bundle records (named).
    """

    def __init__(self, bundle: str | os.PathLike, device: str = "auto", max_sessions: int = 4, threads: int | None = None):
        import onnxruntime as ort

        self.ort = ort
        self.path = Path(bundle)
        self.desc = read_bundle(self.path)
        if device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
        gpu = device != "cpu" and "CUDAExecutionProvider" in ort.get_available_providers() and _gpu_present()
        if device == "cuda" and not gpu:
            warnings.warn("CUDA requested but onnxruntime-gpu or a GPU is missing: running on CPU", stacklevel=2)
        if gpu and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA / cuDNN from torch's nvidia wheels
        self.requested_cuda = device == "cuda" or gpu
        self.providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if gpu else ["CPUExecutionProvider"]
        self.threads = threads
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[int, object] = OrderedDict()
        self._pools = self._map_pools(self.path / "pools.safetensors")
        self._verified: set[int] = set()
        self.last_switch_seconds = None

    def _map_pools(self, pool_file: Path) -> dict:
        """The pool file, mapped once, checked against the bundle's pool-set hash, shared by every session."""
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
            if t.dtype != "F32":
                raise FormatError(f"{pool_file}: tensor {name!r} is {t.dtype}, pools are float32")
            arr = data[t.start : t.end].view(np.float32).reshape(t.shape)
            pools[f"pool/{name}"] = self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr))
        return pools

    @property
    def tasks(self) -> list[int]:
        return sorted(int(t) for t, row in self.desc["tasks"].items() if "onnx" in row)

    def class_names(self, task: int) -> list[str]:
        return self._row(task).get("class_names") or [str(i) for i in range(self._row(task)["num_classes"])]

    def _row(self, task: int) -> dict:
        row = self.desc["tasks"].get(str(task))
        if row is None or "onnx" not in row:
            raise TaskNotFoundError(f"bundle {self.path} has no ONNX graph for task {task}; tasks with graphs: {self.tasks}")
        return row

    def session(self, task: int):
        """The task's session (created on first use, then cached)."""
        if task in self._sessions:
            self._sessions.move_to_end(task)
            return self._sessions[task]
        row = self._row(task)
        opts = self.ort.SessionOptions()
        opts.log_severity_level = 3
        if self.threads:
            opts.intra_op_num_threads = self.threads
        opts.add_external_initializers(list(self._pools), list(self._pools.values()))
        graph = self.path / row["onnx"]
        if not graph.is_file():
            raise FileNotFoundError(f"{graph}: task {task}'s graph is missing from the bundle")
        tic = time.perf_counter()
        if "onnx_sha256" in row and task not in self._verified:  # checked once per task and Runtime
            if file_sha256(graph) != row["onnx_sha256"]:
                raise FormatError(f"{graph}: content does not match the SHA-256 bundle.json records: the graph is corrupted or was replaced")
            self._verified.add(task)
        try:
            sess = self.ort.InferenceSession(str(graph), sess_options=opts, providers=self.providers)
        except Exception as e:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
            raise FormatError(f"{graph}: onnxruntime cannot load task {task}'s graph ({type(e).__name__}: {str(e)[:200]})") from None
        meta = sess.get_modelmeta().custom_metadata_map
        if meta.get("nwsconvert.task") not in (None, str(task)) or meta.get("nwsconvert.pool_sha256", self.desc["pool_sha256"]) != self.desc["pool_sha256"]:
            raise FormatError(f"{graph}: the graph is task {meta.get('nwsconvert.task')} of pool set {str(meta.get('nwsconvert.pool_sha256'))[:12]}..., bundle.json lists it as task {task}")
        self.last_switch_seconds = time.perf_counter() - tic
        if self.requested_cuda and "CUDAExecutionProvider" not in sess.get_providers():
            warnings.warn(f"task {task}: the CUDA provider was requested but the session runs on {sess.get_providers()}", stacklevel=2)
        self._sessions[task] = sess
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return sess

    def run(self, task: int, images) -> np.ndarray:
        """Logits ``(B, num_classes)`` for ``images`` ``(B, C, H, W)`` (normalised as the bundle's metadata says)."""
        x = np.ascontiguousarray(np.asarray(images, dtype=np.float32))
        return self.session(task).run(None, {"input": x})[0]

    def predict(self, task: int, images, k: int = 1) -> list[list[tuple[str, float]]]:
        """Top-``k`` ``(class name, probability)`` per image."""
        logits = self.run(task, images)
        e = np.exp(logits - logits.max(1, keepdims=True))
        prob = e / e.sum(1, keepdims=True)
        names = self.class_names(task)
        top = np.argsort(-prob, 1)[:, :k]
        return [[(names[j], float(prob[i, j])) for j in row] for i, row in enumerate(top)]
