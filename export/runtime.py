"""onnxruntime deployment of a bundle, with fast task switching.

    rt = nwsconvert.export.Runtime("runs/mnist/export")     # CUDA when present, else CPU
    logits = rt.run(2, images)                              # images: (B, C, H, W) float32, normalised
    rt.predict(2, images, k=3)                               # [[(class name, probability), ...], ...]
    rt = Runtime("runs/mnist/export", mode="switch")        # one dense template, each task materialised from its pack

Two modes (measured side by side in ``benchmarks/RESULTS.md``, "Runtime modes"):

``session`` (default)
    one onnxruntime session per task graph (``task_<t>.onnx``): onnxruntime folds
    the task's Gathers and BatchNorms into dense weights when the session is
    built, so inference runs at dense speed; a switch to a task without a cached
    session costs a session creation, and each cached session holds its own
    dense weights.
``switch``
    every task runs the bundle's dense template (``switch.onnx``, see
    :mod:`nwsconvert.export.densify`): on a task's first use its pack is decoded (without
    torch, :func:`nwsconvert.formats.packfile.read_pack_arrays`), its dense weights gathered
    from the mapped pools and its BatchNorms folded into the convolutions with NumPy, and a
    session of the template is built with them as constants. Inference then runs the dense
    model (weights prepacked as onnxruntime does for any constant). The last
    ``max_sessions`` tasks stay materialised: a switch between them is a look-up
    (microseconds); a task not materialised costs only its pack, on disk, and its first use
    tens of milliseconds. No per-task ``.onnx`` is needed: the per-task file is the pack.

The pool file is memory-mapped once; its tensors are handed to every task's
session by name (``SessionOptions.add_external_initializers``, which replaces
the graph's external-data references before any optimisation), so a task
switch costs one session creation (indices + small tensors) and never reads
``pools.safetensors`` again, and the tensors used are the ones at the offsets
the checked header gives, whatever offsets the graph was exported with.
(``add_initializer`` is not used: onnxruntime ignores it for initializers
stored as external data and reads the file at the graph's offsets.)
Sessions are cached, least recently used first out; a Runtime that keeps rebuilding
sessions it evicted (more tasks in turn than ``max_sessions``) warns once.

Everything it opens is checked first: ``bundle.json``'s fields, the pool file
against the bundle's pool-set hash (once, on the mapped file), and each task
graph against its recorded SHA-256 before its session is built. A bad file is
refused by name (:class:`~nwsconvert.errors.FormatError`), never answered with
NaN. Imports neither torch nor timm.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np

from nwsconvert.devices import cuda_device_count
from nwsconvert.errors import FormatError, TaskNotFoundError
from nwsconvert.formats.packfile import read_pack_arrays
from nwsconvert.formats.stfile import nws_header, raw_digest, read_header

from .bundlefile import file_sha256, read_bundle, recipe_sha256
from .densify import materialise

#: onnxruntime graph rewrites every session runs without. ``Pad_Fusion`` folds a zero-valued
#: constant Pad into a following MaxPool, whose own padding counts as -inf, so a window that
#: sees only negatives and padding returns the negative maximum instead of 0 (onnxruntime
#: 1.17 to at least 1.31). timm's BiT ResNetV2 stem (pad 0, then MaxPool) hits it: 3 % off
#: the largest logit. Running a bundle's graphs with your own session: pass the same.
DISABLED_OPTIMIZERS = ["Pad_Fusion"]

__all__ = ["DISABLED_OPTIMIZERS", "Runtime"]

#: Pool-file dtypes the graphs gather from (``pool_dtype``), as NumPy views of the mapped file.
_POOL_NUMPY = {"F32": np.float32, "F16": np.float16}


def _gpu_present() -> bool:
    return cuda_device_count() > 0


class Runtime:
    """Sessions over one bundle.

    Args:
        bundle: a folder written by ``nws-export --onnx``.
        device: ``auto`` (CUDA when onnxruntime-gpu and a GPU are present), ``cuda`` or ``cpu``.
        max_sessions: sessions kept (LRU).
        threads: intra-op threads of the CPU provider (``None``: onnxruntime's default).
        mode: ``session`` or ``switch`` (see the module docstring).

    Attributes:
        providers: the providers requested; ``session(task).get_providers()`` says what runs.
        last_switch_seconds: time the last switch to a task not already selected took
            (session mode: the session creation; switch mode: materialising the task from its
            pack the first time, a look-up while it stays materialised).

    Raises:
        FileNotFoundError: no bundle there. FormatError: ``bundle.json``, the pool file
            or a graph is damaged or not the one the bundle records (named).
    """

    def __init__(
        self,
        bundle: str | os.PathLike,
        device: str = "auto",
        max_sessions: int = 4,
        threads: int | None = None,
        mode: str = "session",
    ):
        import onnxruntime as ort

        self.ort = ort
        self.path = Path(bundle)
        self.desc = read_bundle(self.path)
        if device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
        if mode not in ("session", "switch"):
            raise ValueError(f"mode must be session or switch, got {mode!r}")
        if mode == "switch" and "switch" not in self.desc:
            raise FileNotFoundError(
                f"{self.path} has no switch.onnx (one-session mode): export it again with nws-export --onnx"
            )
        self.mode = mode
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
        self._evicted: set[int] = set()
        self.rebuilds = 0  # sessions built again (switch mode: tasks materialised again) after their eviction
        self._pool_arrays = self._map_pools(self.path / "pools.safetensors")
        self._pools = {f"pool/{n}": ort.OrtValue.ortvalue_from_numpy(a) for n, a in self._pool_arrays.items()}
        self._verified: set[int] = set()
        self.last_switch_seconds = None
        self._template_bytes: bytes | None = None  # switch mode: the checked template graph
        self._dense: OrderedDict[int, tuple] = OrderedDict()  # switch mode: (session, classes, bytes, OrtValues)
        self._selected = None

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

    def _row(self, task: int) -> dict:
        row = self.desc["tasks"].get(str(task))
        if row is None or "onnx" not in row:
            raise TaskNotFoundError(
                f"bundle {self.path} has no ONNX graph for task {task}; tasks with graphs: {self.tasks}"
            )
        return row

    def _options(self, external: dict | None = None):
        """Session options: quiet, the thread count, and ``external`` (name -> OrtValue; default the
        mapped pools) handed over by name in place of the graph's external data."""
        external = self._pools if external is None else external
        opts = self.ort.SessionOptions()
        opts.log_severity_level = 3
        if self.threads:
            opts.intra_op_num_threads = self.threads
        opts.add_external_initializers(list(external), list(external.values()))
        return opts

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
                sess_options=self._options(),
                providers=self.providers,
                disabled_optimizers=DISABLED_OPTIMIZERS,
            )
        except Exception as e:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
            raise FormatError(f"{graph}: onnxruntime cannot load {what} ({type(e).__name__}: {str(e)[:200]})") from None
        meta = sess.get_modelmeta().custom_metadata_map
        if meta.get("nwsconvert.pool_sha256", self.desc["pool_sha256"]) != self.desc["pool_sha256"]:
            raise FormatError(
                f"{graph}: the graph is of pool set {str(meta.get('nwsconvert.pool_sha256'))[:12]}..., the bundle's is {self.desc['pool_sha256'][:12]}..."
            )
        if self.requested_cuda and "CUDAExecutionProvider" not in sess.get_providers():
            warnings.warn(
                f"{graph.name}: the CUDA provider was requested but the session runs on {sess.get_providers()}",
                stacklevel=3,
            )
        return sess

    def session(self, task: int):
        """The session that runs ``task``: its own (session mode, created on first use, then cached) or the bundle's one."""
        if self.mode == "switch":
            return self._materialised(task)[0]
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
        self.last_switch_seconds = time.perf_counter() - tic
        self._sessions[task] = sess
        self._cached(self._sessions, task)
        return sess

    def _cached(self, cache: OrderedDict, task: int) -> None:
        """After ``task`` joined ``cache``: evict the least recently used beyond ``max_sessions``, and warn
        once when tasks evicted before keep coming back (more tasks in turn than the cache holds)."""
        if task in self._evicted:
            self.rebuilds += 1
            if self.rebuilds == self.max_sessions:
                cheaper = "" if self.mode == "switch" else ", or use mode='switch' (a cheaper rebuild)"
                warnings.warn(
                    f"Runtime({self.path}): {self.rebuilds} task sessions built again after eviction "
                    f"({1e3 * self.last_switch_seconds:.0f} ms each; max_sessions={self.max_sessions} for more tasks "
                    f"in turn): raise max_sessions{cheaper}",
                    stacklevel=3,
                )
        while len(cache) > self.max_sessions:
            self._evicted.add(cache.popitem(last=False)[0])

    # ---------------------------------------------------------------- switch mode
    def _template(self) -> bytes:
        """``switch.onnx``'s bytes, checked against bundle.json once (every task's session is built from them)."""
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

    def _materialised(self, task: int) -> tuple:
        """``(session, num_classes, bytes held)`` of ``task`` in switch mode: its dense tensors computed from
        its pack (one gather per layer, BatchNorm folded) and given to a session of the bundle's template
        as constants; kept for the ``max_sessions`` tasks used last."""
        if task in self._dense:
            self._dense.move_to_end(task)
            if self._selected != task:
                tic = time.perf_counter()
                self._selected = task
                self.last_switch_seconds = time.perf_counter() - tic
            return self._dense[task]
        row = self._row(task)
        template = self._template()
        tic = time.perf_counter()
        path = self.path / row["pack"]
        base = self.path / row["base"] if row.get("base") else None
        values = _switch_inputs(
            path,
            {row["base_sha256"]: base} if base is not None and row.get("base_sha256") else base,
            row.get("pack_sha256"),
            self.desc["pool_sha256"],
            task,
        )
        recipe = self.desc["switch"]["tensors"]
        try:
            tensors = materialise(recipe, self._pool_arrays, values)
        except KeyError as e:
            raise FormatError(
                f"{path}: holds no {e.args[0]!r}, which bundle.json's switch.tensors (the recipe of switch.onnx) "
                "names: a pack or a bundle of another model?"
            ) from None
        except (ValueError, IndexError) as e:  # sizes or indices the recipe does not take
            raise FormatError(f"{path}: {e} (bundle.json's switch.tensors): export the bundle again") from None
        held = {name: self.ort.OrtValue.ortvalue_from_numpy(t) for name, t in tensors.items()}  # the session reads them
        graph = self.path / self.desc["switch"]["onnx"]
        try:
            sess = self.ort.InferenceSession(
                template,
                sess_options=self._options(held),
                providers=self.providers,
                disabled_optimizers=DISABLED_OPTIMIZERS,
            )
        except Exception as e:  # onnxruntime raises its own exception types
            raise FormatError(
                f"{graph}: onnxruntime cannot load it with task {task}'s tensors, made as bundle.json's switch.tensors "
                f"says ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        if self.requested_cuda and "CUDAExecutionProvider" not in sess.get_providers():
            warnings.warn(
                f"{graph.name}: the CUDA provider was requested but the session runs on {sess.get_providers()}",
                stacklevel=3,
            )
        self._dense[task] = (sess, row["num_classes"], sum(t.nbytes for t in tensors.values()), held)
        self._selected = task
        self.last_switch_seconds = time.perf_counter() - tic
        self._cached(self._dense, task)
        return self._dense[task]

    def info(self) -> dict:
        """What this Runtime uses: ``mode``, ``providers`` (of the sessions built so far), ``cached_tasks`` and
        ``bytes_per_task`` (switch mode: the dense tensors materialised for each cached task, which its
        session holds as constants; session mode: ``None``, each cached session holds its folded dense
        weights, about the dense model's size)."""
        if self.mode == "switch":
            sessions = [v[0] for v in self._dense.values()]
            cached, per_task = list(self._dense), {t: v[2] for t, v in self._dense.items()}
        else:
            sessions = list(self._sessions.values())
            cached, per_task = list(self._sessions), None
        providers = sorted({p for s in sessions for p in s.get_providers()})
        return {
            "mode": self.mode,
            "providers": providers or self.providers,
            "cached_tasks": cached,
            "bytes_per_task": per_task,
        }

    def metadata(self, task: int) -> dict:
        """The ONNX metadata of the graph that runs ``task`` (input size, normalisation...)."""
        return self.session(task).get_modelmeta().custom_metadata_map

    def run(self, task: int, images) -> np.ndarray:
        """Logits ``(B, num_classes)`` for ``images`` ``(B, C, H, W)`` (normalised as the bundle's metadata says)."""
        x = np.ascontiguousarray(np.asarray(images, dtype=np.float32))
        if self.mode == "switch":
            sess, classes, _, _ = self._materialised(task)
            return sess.run(None, {"input": x})[0][:, :classes]
        return self.session(task).run(None, {"input": x})[0]

    def predict(self, task: int, images, k: int = 1) -> list[list[tuple[str, float]]]:
        """Top-``k`` ``(class name, probability)`` per image."""
        logits = self.run(task, images)
        e = np.exp(logits - logits.max(1, keepdims=True))
        prob = e / e.sum(1, keepdims=True)
        names = self.class_names(task)
        top = np.argsort(-prob, 1)[:, :k]
        return [[(names[j], float(prob[i, j])) for j in row] for i, row in enumerate(top)]


def _switch_inputs(
    path: Path, base: Path | dict[str, Path] | None, sha256: str | None, pool_sha256: str, task: int
) -> dict[str, np.ndarray]:
    """A task's values of switch.onnx's inputs, from its pack: ``indices/<layer>`` int32 ``(N,)`` and
    ``state/<key>`` float32 (floating state entries only, as the graph takes them). ``base``: the base
    file, or ``{its SHA-256: file}`` (bundle.json's ``base_sha256``: the only base the pack may name)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (task {task}'s pack, which the one-session mode reads)")
    pack = read_pack_arrays(path, base, sha256=sha256, pool_sha256=pool_sha256, task=task)
    out = {f"indices/{name}": idx.astype(np.int32) for name, idx in pack.indices.items()}
    for key, value in pack.state.items():
        if np.issubdtype(value.dtype, np.floating):
            out[f"state/{key}"] = value.astype(np.float32)
    return out
