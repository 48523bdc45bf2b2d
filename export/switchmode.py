"""The Runtime's switch mode: one onnxruntime session of the bundle's dense template runs every task.

The template's weights are graph inputs bound to buffers through IOBinding, laid out as this machine's kernels
read them (:mod:`nwsconvert.export.layout`). A **slot** is one set of those buffers with its own IOBinding; it
holds one task at a time. A switch rewrites a slot's buffers from the shared pools and the task's indices (one
gather per layer, BatchNorm folded: NumPy on a CPU, an onnxruntime graph whose outputs are the buffers on
CUDA). ``ready`` slots keep that many tasks ready; a switch between tasks held only picks the slot.

Threads. An IOBinding may not be used by two threads at once (two threads on one binding crash the process
or read each other's logits), so a slot serves one run at a time:

* a caller takes the slot holding its task when it is free, and waits for it when another caller runs it
  (a run is cheaper than a switch);
* a caller whose task no slot holds takes a free slot (empty first, then the least recently used one) and
  writes its task there, outside the lock: other slots keep running meanwhile;
* with every slot busy, it waits;
* callers are served in the order they came: one takes a slot only where no caller waiting before it could
  take that slot, so a thread calling in a loop cannot keep a slot from the others.

So runs on different slots go in parallel (one session, ``InferenceSession`` runs concurrently), and each
extra slot costs one dense model's weights. One condition variable guards which slot holds which task and
which is busy; nothing else is shared between runs. With ``cuda_graph`` the graphed runs share their input
and output buffers and onnxruntime keeps graphs per thread: runs are then one at a time, and graphed on the
thread that ran first (other threads' runs go without the graph).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nwsconvert.errors import FormatError
from nwsconvert.formats.packfile import STANDALONE, clear_cached_bases, read_pack_arrays

from .bundlefile import bundle_file, recipe_sha256
from .densify import PLACEHOLDER, iter_dense_tensors, task_values
from .graphruns import GraphRuns
from .layout import aligned_empty, prepare
from .ortsetup import DISABLED_OPTIMIZERS, OrtSetup, release_freed_memory, session_providers

__all__ = ["SwitchMode"]


@dataclass
class _Slot:
    """One buffer set of the switch session's weight inputs, the task it holds, and whether a run uses it."""

    inputs: dict  # input name -> OrtValue over the buffer (CPU: views of ``buffer``; CUDA: device tensors)
    binding: object  # IOBinding with ``inputs`` bound
    buffer: np.ndarray | None = None  # CPU: the flat, aligned float32 buffer the inputs view
    task: int | None = None
    busy: bool = False  # a caller runs it, or writes a task into it
    filled: bool = False  # its buffers hold ``task``'s tensors (not being written)
    logits: np.ndarray | None = None  # CPU: the ``(B, max classes)`` logits buffer bound as the output (last B)


class _Waiter:
    """A caller waiting for a slot, for ``task`` (equal only to itself)."""

    __slots__ = ("task",)

    def __init__(self, task: int):
        self.task = task


@dataclass
class _Task:
    """What the switch mode keeps of a task: its values (``keep="indices"``) or the error its pack gave."""

    values: dict | None = None
    device_values: dict = field(default_factory=dict)  # CUDA: the values as device tensors
    error: Exception | None = None


class SwitchMode:
    """One session, ``ready`` slots, every task (see the module docstring).

    Attributes:
        last_switch_seconds: the work of the last switch to a task no slot held: decoding (``keep="pack"``),
            the gather and fold, writing the buffers. switches: switches that wrote a task's tensors.
        cuda_graph: whether runs go through onnxruntime's CUDA graph (False once refused).
        precision: ``float32``, or ``float16`` (:mod:`nwsconvert.export.precision`: the graph and its weight
            buffers in float16, the template's own layout).
    """

    def __init__(
        self,
        setup: OrtSetup,
        *,
        ready: int,
        keep: str,
        layout: str,
        fill: str,
        cuda_graph: bool,
        precision: str = "float32",
    ):
        self.setup, self.ready, self.keep, self.layout_request, self.fill = setup, ready, keep, layout, fill
        self.cuda_graph, self.precision = cuda_graph, precision
        self._dtype = np.float16 if precision == "float16" else np.float32  # the weight buffers' elements
        self.last_switch_seconds: float | None = None
        self.switches = 0
        self._graph_runs: GraphRuns | None = None
        self._lock = threading.Lock()  # not re-entered: a plain lock, cheaper
        self._cond = threading.Condition(self._lock)  # taken as ``self._lock`` where nothing waits (a C call)
        self._queue: list[_Waiter] = []  # callers waiting for a slot, in the order they came
        self._exclusive = False  # a caller rebuilds the session: no slot is handed out meanwhile
        self._graph_thread: int | None = None  # cuda_graph: the thread whose runs are graphed
        self._template_bytes: bytes | None = None
        self._start()

    # ------------------------------------------------------------------ start-up
    def _template(self) -> bytes:
        """``switch.onnx``'s bytes, checked against bundle.json (hash, recipe). Its external-data locations are
        checked by :func:`~nwsconvert.export.layout.prepare`'s child process (``external=``), before anything
        reads the graph: the check parses it with onnx, which this process then never imports (12 MB of RSS)."""
        if self._template_bytes is None:
            setup, info = self.setup, self.setup.desc["switch"]
            graph = setup.path / info["onnx"]
            if "tensors" not in info:
                raise FormatError(
                    f"{graph}: a one-session graph of an earlier kind (weights gathered at every run): "
                    "export the bundle again with nws-export --onnx"
                )
            graph = bundle_file(setup.path, info["onnx"], "the one-session graph switch.onnx")
            if recipe_sha256(info["tensors"]) != info["tensors_sha256"]:
                raise FormatError(
                    f"{setup.path / 'bundle.json'}: field switch.tensors does not match its SHA-256 "
                    "(switch.tensors_sha256): the recipe was edited; export the bundle again"
                )
            data = graph.read_bytes()
            if hashlib.sha256(data).hexdigest() != info["onnx_sha256"]:
                raise FormatError(
                    f"{graph}: content does not match the SHA-256 bundle.json records: the graph is corrupted or was replaced"
                )
            self._template_bytes = data
        return self._template_bytes

    def _start(self) -> None:
        """Build the one session, its ``ready`` slots and (``keep="indices"``) every task's values."""
        setup, ort = self.setup, self.setup.ort
        template = self._template()  # checked first: it names a bundle.json without the recipe
        self._recipe = setup.desc["switch"]["tensors"]
        rows: list[tuple[str, tuple[int, ...]]] = []
        for r in self._recipe:
            rows.append((r["name"], tuple(int(d) for d in r["shape"])))
            if r["kind"] == "fold":
                rows.append((r["bias_name"], (int(r["shape"][0]),)))
        graph_file = setup.path / setup.desc["switch"]["onnx"]
        plain = setup.cuda or self.layout_request == "plain" or self.precision != "float32"
        if self.fill == "onnxruntime" and not plain:
            raise ValueError("fill='onnxruntime' writes the template's own layout: give layout='plain' with it")
        self._pool_arrays = setup.pool_arrays
        pools = {
            n: (tuple(p.shape), "float32" if p.dtype == np.float32 else "float16") for n, p in self._pool_arrays.items()
        }
        try:
            self._graph, filler = prepare(
                template,
                rows,
                layout="plain" if plain else "auto",
                threads=setup.threads,
                disabled_optimizers=DISABLED_OPTIMIZERS,
                fill=(self._recipe, pools) if self.fill == "onnxruntime" else None,
                precision=self.precision,
                external=(str(graph_file), str(setup.path), PLACEHOLDER),
            )
            self._level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL if self._graph.optimised else None
            self._session = self._switch_session(self._level)
            self._filler = None
            if filler is not None:
                sess = ort.InferenceSession(filler, sess_options=setup.options(), providers=setup.provider_args)
                device_pools = {
                    f"pool/{n}": ort.OrtValue.ortvalue_from_numpy(a, setup.device_kind, 0)
                    for n, a in self._pool_arrays.items()
                }
                self._filler = (sess, device_pools)
        except (FormatError, FileNotFoundError):
            raise
        except Exception as e:  # onnx and onnxruntime raise their own exception types
            raise FormatError(
                f"{graph_file}: onnxruntime cannot run it with its tensors as inputs ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        release_freed_memory()
        if not plain and self._graph.layout == "plain":
            warnings.warn(
                f"{graph_file}: the switch mode runs this template without this CPU's blocked layout "
                f"({self._graph.reason}); its runs may be 1.1-3x slower than mode='session' here: "
                "nws-infer --bench measures both",
                stacklevel=4,  # the user's Runtime(...)
            )
        setup.check_providers(self._session, graph_file.name)
        self._output = self._session.get_outputs()[0].name
        self._input = self._session.get_inputs()[0].name
        self._input_shape = self._session.get_inputs()[0].shape
        self._width = self._session.get_outputs()[0].shape[-1]  # the most classes of any task (an int, as exported)
        if self.cuda_graph:
            self._graph_runs = GraphRuns(ort, self._session, setup.device_kind, self._input, self._output)
        self._pool_shapes = {name: tuple(p.shape) for name, p in self._pool_arrays.items()}
        small = max((p.shape[0] for p in self._pool_arrays.values()), default=0) <= 1 << 16
        self._index_dtype = np.uint16 if small and self.fill == "numpy" else np.int32
        # Kept indices (keep="indices"): a layer whose pool has at most 256 entries (a scalar pool's) keeps one
        # byte an index, half of uint16; NumPy gathers from either as fast. A one-switch read stays uint16.
        self._kept_dtypes = (
            {name: np.uint8 for name, (n, _) in self._pool_shapes.items() if n <= 256} if self.fill == "numpy" else {}
        )
        self._slots = [self._new_slot() for _ in range(self.ready)]
        self._held: OrderedDict[int, _Slot] = OrderedDict()  # task -> slot, least recently used first
        self._selected: int | None = None
        self._tasks: dict[int, _Task] = {}
        self._bases: dict[str, object] = {}  # keep="pack": each base decoded once
        if self.keep == "indices":
            for t in setup.tasks:
                try:
                    self._tasks[t] = _Task(values=self._read_values(t))
                except (FormatError, FileNotFoundError, ValueError, KeyError) as e:
                    self._tasks[t] = _Task(error=e)  # raised at a switch to it; the others run
            clear_cached_bases()  # every task decoded: the base they were changes against is not needed again
            release_freed_memory()

    def _switch_session(self, level):
        """The switch mode's session over the prepared template, with the CUDA graph where asked and taken."""
        setup = self.setup
        build = lambda graph: setup.ort.InferenceSession(  # noqa: E731
            self._graph.model,
            sess_options=setup.options(level=level),
            providers=session_providers(setup.cuda, setup.tf32, graph=graph, nhwc=self.precision == "float16"),
            disabled_optimizers=DISABLED_OPTIMIZERS,
        )
        if not self.cuda_graph:
            return build(False)
        try:
            return build(True)
        except Exception as e:  # noqa: BLE001 (onnxruntime's own types)
            self._graph_refused(e, stacklevel=6)  # the user's Runtime(...)
            return build(False)

    def _graph_refused(self, e: Exception, stacklevel: int) -> None:
        """Warn that the graph was refused; the session runs without it from here."""
        self.cuda_graph = False
        warnings.warn(
            f"cuda_graph=True: onnxruntime refused the CUDA graph ({type(e).__name__}: {str(e)[:200]}); "
            "running without",
            stacklevel=stacklevel,
        )

    def _new_slot(self) -> _Slot:
        ort, setup = self.setup.ort, self.setup
        binding = self._session.io_binding()
        if self.fill == "onnxruntime":
            inputs = {
                p.name: ort.OrtValue.ortvalue_from_shape_and_type(list(p.shape), self._dtype, setup.device_kind, 0)
                for p in self._graph.placements
            }
            buffer = None
        else:
            buffer = aligned_empty(self._graph.floats, self._dtype)
            buffer.fill(0)
            inputs = {name: ort.OrtValue.ortvalue_from_numpy(view) for name, view in self._graph.views(buffer).items()}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        return _Slot(inputs, binding, buffer)

    # ------------------------------------------------------------------ a task's values
    def _base(self, row: dict):
        """The base a task's pack is coded against (``None``: it has none), as a path checked on each read,
        or with ``keep="pack"`` decoded once and kept, its indices in the kept index type."""
        if not row.get("base"):
            return None
        path, sha = self._inside(row["base"], "a base pack"), row.get("base_sha256")
        if self.keep != "pack" or sha is None:
            return {sha: path} if sha else path
        if sha not in self._bases:
            pool_sha256 = self.setup.desc["pool_sha256"]
            base = read_pack_arrays(
                path, STANDALONE, sha256=sha, pool_sha256=pool_sha256, index_dtype=self._index_dtype
            )
            self._bases[sha] = dataclasses.replace(base, encoded={})
        return self._bases[sha]

    def _inside(self, name: str, what: str) -> Path:
        """The bundle's file ``name``, a link only to a file in the bundle folder (:func:`bundle_file`); a
        missing one as its path (the pack reader says which file is missing, and for what)."""
        path = self.setup.path / name
        return bundle_file(self.setup.path, name, what) if path.exists() else path

    def _read_values(self, task: int, keep: bool = True) -> dict[str, np.ndarray]:
        """Task ``task``'s :func:`task_values` from its pack (hash, pool set, task and base checked). Values
        to ``keep`` come in a few contiguous blocks (:func:`_compact`) that the returned arrays view, each
        layer's indices in its kept type; values for one switch (``keep="pack"``) as decoded, with no copy
        into blocks."""
        row = self.setup.row(task)
        path = self._inside(row["pack"], f"task {task}'s pack")
        raw = _switch_inputs(
            path, self._base(row), row.get("pack_sha256"), self.setup.desc["pool_sha256"], task, self._index_dtype
        )
        try:
            values = task_values(
                self._recipe, raw, self._pool_shapes, self._index_dtype, self._kept_dtypes if keep else None
            )
        except KeyError as e:
            raise FormatError(
                f"{path}: holds no {e.args[0]!r}, which bundle.json's switch.tensors (the recipe of switch.onnx) "
                "names: a pack or a bundle of another model?"
            ) from None
        except ValueError as e:  # sizes or indices the recipe does not take
            raise FormatError(f"{path}: {e} (bundle.json's switch.tensors): export the bundle again") from None
        return _compact(values) if keep else values

    def _values(self, task: int) -> dict[str, np.ndarray]:
        held = self._tasks.get(task)
        if held is None:  # keep="pack": read for this switch only
            return self._read_values(task, keep=False)
        if held.error is not None:
            raise held.error
        assert held.values is not None
        return held.values

    def _device_values(self, task: int, values: dict) -> dict:
        """The task's values as tensors on the session's device (kept with ``keep="indices"``: uploaded once;
        the indices and state, never a weight)."""
        held = self._tasks.get(task)
        if held is not None and held.device_values:
            return held.device_values
        kind, ort = self.setup.device_kind, self.setup.ort
        device = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), kind, 0) for k, v in values.items()}
        if held is not None:
            held.device_values = device
        return device

    # ------------------------------------------------------------------ slots
    def _pick(self, task: int, held: dict, taken: set) -> _Slot | None:
        """The slot ``task``'s caller would take now (None: it waits), given ``held`` (task -> slot) and the
        slots ``taken`` by callers ahead of it: the one holding the task when free; for a task no slot holds,
        an empty slot, else the least recently used one free."""
        slot = held.get(task)
        if slot is not None:
            return None if slot.busy or id(slot) in taken else slot
        for s in self._slots:
            if s.task is None and not s.busy and id(s) not in taken:
                return s
        return next((s for s in held.values() if not s.busy and id(s) not in taken), None)

    def _acquire(self, task: int) -> tuple[_Slot, bool]:
        """A slot for ``task``, marked busy: the one holding it (waiting while another caller runs it), or a
        free one now registered for it (``True``: the caller writes the task's tensors into it).

        Callers are served in the order they came: one takes a slot only where no caller waiting before it
        could take that slot (a caller that has just run goes behind the ones waiting, so none waits for ever;
        a caller waiting for a busy slot holds up none that another slot can serve)."""
        with self._lock:
            if not (self._queue or self._exclusive or self._graph_runs is not None):  # nobody waits: no queue
                slot = self._pick(task, self._held, set())
                if slot is not None:
                    return self._take(slot, task)
            me = _Waiter(task)  # this caller's place in the queue (compared by identity)
            self._queue.append(me)
            try:
                while True:
                    # cuda_graph: graphed runs share their input and output buffers, so one run at a time
                    alone = self._graph_runs is not None and any(s.busy for s in self._slots)
                    if not (self._exclusive or alone):
                        held, taken = dict(self._held), set()
                        slot = None
                        for waiter in self._queue:  # who gets which slot, first come first served
                            pick = self._pick(waiter.task, held, taken)
                            if waiter is me:
                                slot = pick
                                break
                            if pick is not None:
                                taken.add(id(pick))
                                if pick.task != waiter.task:  # it will write its task there
                                    held.pop(pick.task, None)
                                    held[waiter.task] = pick
                        if slot is not None:
                            return self._take(slot, task)
                    self._cond.wait()
            finally:
                self._queue.remove(me)
                if self._queue:
                    self._cond.notify_all()  # the next in the queue may now take a slot

    def _take(self, slot: _Slot, task: int) -> tuple[_Slot, bool]:
        """Mark ``slot`` busy for ``task`` (under the lock); True: the task's tensors are to be written."""
        slot.busy = True
        if slot.task == task:
            self._held.move_to_end(task)
            self._selected = task
            return slot, False
        if slot.task is not None:
            del self._held[slot.task]
        slot.task, slot.filled = task, False
        self._held[task] = slot  # a caller of the same task waits for this write
        return slot, True

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.busy = False
            if self._queue or self._exclusive:  # callers waiting for a slot, or for every slot idle
                self._cond.notify_all()

    def _write(self, slot: _Slot, task: int, values: dict | None) -> None:
        """Write ``task``'s tensors (its ``values``, read here where None) into ``slot`` (busy, registered for
        it). A write that fails leaves the slot holding no task."""
        try:
            tic = time.perf_counter()
            values = self._values(task) if values is None else values
            if self.fill == "onnxruntime":
                self._run_filler(slot, self._device_values(task, values))
            else:
                assert slot.buffer is not None
                self._graph.fill(slot.buffer, iter_dense_tensors(self._recipe, self._pool_arrays, values))
            seconds = time.perf_counter() - tic
        except BaseException:  # a buffer half written holds no task
            with self._cond:
                self._held.pop(task, None)
                slot.task, slot.busy, slot.filled = None, False, False
                if self._selected not in self._held:  # its buffer was the one overwritten
                    self._selected = None
                self._cond.notify_all()
            raise
        with self._cond:
            slot.filled = True
            self.last_switch_seconds = seconds
            self.switches += 1
            self._selected = task

    def _run_filler(self, slot: _Slot, device: dict) -> None:
        assert self._filler is not None
        sess, pools = self._filler
        binding = sess.io_binding()
        for name, value in {**pools, **device}.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in slot.inputs.items():
            binding.bind_ortvalue_output(f"out:{name}", value)
        sess.run_with_iobinding(binding)

    @contextmanager
    def _alone(self, own: _Slot):
        """No other run while the body runs: no slot handed out, and every other slot idle."""
        with self._cond:
            self._exclusive = True
            while any(s.busy for s in self._slots if s is not own):
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    # ------------------------------------------------------------------ runs
    def input_shape(self, task: int) -> list:
        self.setup.row(task)
        return self._input_shape

    def session(self, task: int):
        self.setup.row(task)
        return self._session

    def run(self, task: int, x, num_classes: int):
        """Logits of ``x`` (checked: float32 NumPy ``(B, C, H, W)``, or an OrtValue) for ``task``: NumPy
        ``(B, num_classes)``, or an OrtValue of ``(B, max classes)`` on the session's device. ``task`` is one
        of the bundle's (the Runtime checked it)."""
        values = None
        if task not in self._held:  # a hint only (read without the lock): a pack that fails its checks raises
            # here, before any slot is taken
            values = self._values(task)
        slot, write = self._acquire(task)
        if write:
            self._write(slot, task, values)  # on failure it has freed the slot and raises
        try:
            if self._graph_runs is not None:  # then this is the only run (see _acquire)
                return self._run_graphed(slot, x, num_classes)
            return self._run_plain(slot, x, num_classes, None)
        finally:
            self._release(slot)

    def _run_graphed(self, slot: _Slot, x, num_classes: int):
        graphs = self._graph_runs
        assert graphs is not None
        me = threading.get_ident()
        if self._graph_thread is None:
            self._graph_thread = me
        if self._graph_thread != me:  # onnxruntime keeps graphs per thread
            return self._run_plain(slot, x, num_classes, graphs)
        try:
            out = graphs.run(slot.binding, x, self._slots.index(slot))
        except Exception as e:  # noqa: BLE001 (onnxruntime's own types)
            logits = self._run_plain(slot, x, num_classes, graphs)  # a bad run raises here as it would plain
            self._drop_graph(e, slot)  # the run is fine: the graph is not
            return logits
        if out is None:
            return self._run_plain(slot, x, num_classes, graphs)
        return out if isinstance(x, self.setup.ort.OrtValue) else out[:, :num_classes]

    def _drop_graph(self, e: Exception, own: _Slot) -> None:
        """A graphed run failed where the same run without the graph works: warn, and build the session again
        without the option (no state of a capture that failed part-way), each buffer set bound to it."""
        self._graph_refused(e, stacklevel=6)  # the user's run(...)
        with self._alone(own):
            self._graph_runs = None
            self._session = self._switch_session(self._level)
            for slot in self._slots:
                slot.binding, slot.logits = self._session.io_binding(), None
                for name, value in slot.inputs.items():
                    slot.binding.bind_ortvalue_input(name, value)

    def _run_plain(self, slot: _Slot, x, num_classes: int, graphs: GraphRuns | None):
        """``x`` (NumPy or an OrtValue) through ``slot``'s binding outside any graph: NumPy logits of the
        task's classes, or an OrtValue on the session's device."""
        ort, binding, out = self.setup.ort, slot.binding, None
        device = isinstance(x, ort.OrtValue)
        kind = self.setup.device_kind
        if device:
            binding.bind_ortvalue_input(self._input, x)
            slot.logits = None  # the output is bound to another value below
            width = self._width if graphs is not None else None
            if not isinstance(width, int):
                binding.bind_output(self._output, kind)
            else:  # logits the caller keeps: not in the arena memory a later replay writes
                logits = ort.OrtValue.ortvalue_from_shape_and_type([x.shape()[0], width], np.float32, kind, 0)
                binding.bind_ortvalue_output(self._output, logits)
        else:
            binding.bind_cpu_input(self._input, x)
            if graphs is None:
                out = self._logits_buffer(slot, len(x))
            else:  # the graphs bind buffers of their own to this binding: none kept across runs
                binding.bind_output(self._output, "cpu")
        if graphs is not None:
            graphs.ungraphed(binding)  # the session was built with the graph: this run must say it has none
        else:
            self._session.run_with_iobinding(binding)
        if device:
            return binding.get_outputs()[0]
        if out is not None:  # the slot's buffer: the next run on this slot writes it again
            return out[:, :num_classes].copy()
        return binding.copy_outputs_to_cpu()[0][:, :num_classes]

    def _logits_buffer(self, slot: _Slot, batch: int) -> np.ndarray | None:
        """On a CPU session without CUDA graphs, ``slot``'s ``(batch, max classes)`` float32 logits buffer,
        bound as the output once per batch size (else each run allocates its output and copies it out: 2-3 %
        of a 0.25 ms run); None where the output is left to onnxruntime (CUDA, or no fixed class count)."""
        out = slot.logits
        if out is not None and out.shape[0] == batch:
            return out
        if self.setup.cuda or not isinstance(self._width, int):
            slot.binding.bind_output(self._output, "cpu")
            return None
        out = np.empty((batch, self._width), np.float32)
        slot.binding.bind_ortvalue_output(self._output, self.setup.ort.OrtValue.ortvalue_from_numpy(out))
        slot.logits = out
        return out

    def info(self) -> dict:
        with self._cond:
            kept = {t: sum(v.nbytes for v in h.values.values()) for t, h in self._tasks.items() if h.values}
            return {
                "mode": "switch",
                "providers": self._session.get_providers(),
                "layout": self._graph.layout,
                "layout_note": self._graph.reason,
                "ready_tasks": [t for t, s in self._held.items() if s.filled],
                "selected": self._selected,
                "weight_buffer_bytes": np.dtype(self._dtype).itemsize * self._graph.floats * len(self._slots),
                "precision": self.precision,
                "bytes_per_task": kept,
                "keep": self.keep,
                "cuda_graph": self.cuda_graph,
                "graphs": len(self._graph_runs.ids) if self._graph_runs is not None else 0,
            }


def _compact(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``values`` as views of a few contiguous arrays, one per integer type (indices: uint8, uint16...) and one
    for the floats: a task's kept values are two or three allocations, not one per layer."""
    out: dict[str, np.ndarray] = {}
    groups: dict = {}
    for k, v in values.items():
        if v.dtype.kind in "iuf":  # integers by type, floats together
            groups.setdefault(v.dtype if v.dtype.kind in "iu" else "floats", []).append(k)
    for names in groups.values():
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


def _switch_inputs(
    path: Path, base, sha256: str | None, pool_sha256: str, task: int, index_dtype=np.int32
) -> dict[str, np.ndarray]:
    """A task's values of switch.onnx's inputs, from its pack: ``indices/<layer>`` ``(N,)`` of
    ``index_dtype`` (decoded in that type: no wide copy) and ``state/<key>`` float32 (floating state entries
    only, as the graph takes them). ``base``: the base file, ``{its SHA-256: file}`` (bundle.json's
    ``base_sha256``: the only base the pack may name), or the decoded base."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (task {task}'s pack, which the one-session mode reads)")
    pack = read_pack_arrays(path, base, sha256=sha256, pool_sha256=pool_sha256, task=task, index_dtype=index_dtype)
    out = {f"indices/{name}": idx for name, idx in pack.indices.items()}
    for key, value in pack.state.items():
        if np.issubdtype(value.dtype, np.floating):
            out[f"state/{key}"] = value.astype(np.float32)
    return out
