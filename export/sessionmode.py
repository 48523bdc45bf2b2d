"""The Runtime's session mode: one onnxruntime session per task graph (``task_<t>.onnx``), cached.

onnxruntime folds the task's Gathers and BatchNorms into dense weights when the session is built. A cached
session is a look-up; another task costs a session creation; each cached session holds its own dense weights
(``max_sessions`` of them, least recently used out; on a CPU the sessions share one memory arena).

Threads: ``InferenceSession.run`` may be called from many threads at once, so runs go in parallel, on the
same task or on different ones. One lock guards the cache (its order, the counters, which sessions are
being built). A session is built outside it: callers of cached tasks go on meanwhile, and a second caller of
the task being built waits for that build rather than building it again. A session evicted while another
thread runs it stays alive until that run ends.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict

import numpy as np

from nwsconvert.errors import FormatError

from .ortsetup import OrtSetup, release_freed_memory

__all__ = ["SessionMode"]


class SessionMode:
    """Cached task sessions over one bundle (see the module docstring).

    Attributes:
        last_switch_seconds: the last session creation, in seconds. switches: sessions built.
        rebuilds: sessions built again after their eviction.
    """

    def __init__(self, setup: OrtSetup, max_sessions: int):
        self.setup, self.max_sessions = setup, max_sessions
        self._sessions: OrderedDict[int, object] = OrderedDict()
        self._evicted: set[int] = set()
        self._lock = threading.Lock()
        self._building: dict[int, threading.Event] = {}  # task -> set when its build ends
        self.rebuilds = 0
        self.switches = 0
        self.last_switch_seconds: float | None = None

    def session(self, task: int):
        """``task``'s session: cached, or built now (its graph checked first). A build runs outside the lock:
        callers of cached tasks go on meanwhile; a second caller of the task being built waits for it."""
        while True:
            with self._lock:
                if task in self._sessions:
                    self._sessions.move_to_end(task)
                    return self._sessions[task]
                building = self._building.get(task)
                if building is None:
                    building = self._building[task] = threading.Event()
                    break
            building.wait()  # then cached; or that build failed and this caller tries it itself
        try:
            return self._build(task)
        finally:
            with self._lock:
                del self._building[task]
            building.set()

    def _build(self, task: int):
        setup = self.setup
        row = setup.row(task)
        tic = time.perf_counter()
        sess = setup.open_graph(row["onnx"], row.get("onnx_sha256"), f"task {task}'s graph")
        meta = sess.get_modelmeta().custom_metadata_map
        if meta.get("nwsconvert.task") not in (None, str(task)):
            raise FormatError(
                f"{setup.path / row['onnx']}: the graph is task {meta.get('nwsconvert.task')}, bundle.json lists it as task {task}"
            )
        release_freed_memory()
        seconds = time.perf_counter() - tic
        with self._lock:
            self.last_switch_seconds = seconds
            self.switches += 1
            self._sessions[task] = sess
            rebuilt = task in self._evicted
            if rebuilt:
                self.rebuilds += 1
            while len(self._sessions) > self.max_sessions:
                self._evicted.add(self._sessions.popitem(last=False)[0])
            warn = rebuilt and self.rebuilds == self.max_sessions
        if warn:
            warnings.warn(
                f"Runtime({setup.path}): {self.rebuilds} task sessions built again after eviction "
                f"({1e3 * seconds:.0f} ms each; max_sessions={self.max_sessions} for more tasks "
                "in turn): raise max_sessions, or use mode='switch' (one session for every task)",
                stacklevel=5,
            )
        return sess

    def input_shape(self, task: int) -> list:
        """The declared shape of ``task``'s graph input (``(B, C, H, W)``; symbolic dimensions as names)."""
        return self.session(task).get_inputs()[0].shape

    def run(self, task: int, x: np.ndarray) -> np.ndarray:
        """Logits ``(B, num_classes)`` of ``x`` (checked float32 ``(B, C, H, W)``); runs in parallel."""
        return self.session(task).run(None, {"input": x})[0]

    def info(self) -> dict:
        with self._lock:
            sessions = list(self._sessions.values())
            cached = list(self._sessions)
        providers = sorted({p for s in sessions for p in s.get_providers()})
        return {"mode": "session", "providers": providers, "cached_tasks": cached}
