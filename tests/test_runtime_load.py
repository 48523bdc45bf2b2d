"""The Runtime under a robot's load: many threads on one Runtime, frames checked at the door, and bundles from
someone else that point at files outside them.

A robot calls one Runtime from several threads (a multi-threaded ROS 2 executor, a camera thread beside a
planner), often for different tasks. onnxruntime's ``InferenceSession.run`` may be called from many threads;
an ``IOBinding`` may not (two threads on one binding crash the process or read each other's outputs), so the
switch mode gives each buffer set (slot) one run at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from trainer_utils import train_run

import nwsconvert
from nwsconvert.errors import UsageError
from nwsconvert.export import Runtime, export_bundle

TASKS = (3, 2, 4, 2)  # classes of the four tasks


@pytest.fixture(scope="module")
def bundle4(tmp_path_factory):
    """A run of four tasks and its bundle (nws-export --task all --onnx)."""
    out = tmp_path_factory.mktemp("load") / "run"
    train_run(out, learn_pools=False, tasks=TASKS)
    export_bundle(out, out / "export", "all", onnx=True)
    return out / "export"


def _images(n: int, seed: int, batch: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, 1, 16, 16)).astype(np.float32) for _ in range(n)]


# --------------------------------------------------------------------------- threads
def _in_threads(target, args) -> None:
    """``target(a)`` for every ``a`` of ``args``, each in a thread of its own, all at once; returns when all end."""
    threads = [threading.Thread(target=target, args=(a,)) for a in args]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


_STRESS = r"""
import json, sys, threading, faulthandler
import numpy as np
from nwsconvert.export import Runtime
faulthandler.enable()
bundle, mode, ready, per_thread = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
xs = [rng.standard_normal((b, 1, 16, 16)).astype(np.float32) for b in (1, 2, 3)]
single = Runtime(bundle, device="cpu", mode=mode, ready=ready, threads=1)
tasks = single.tasks
want = {(t, i): single.run(t, x) for t in tasks for i, x in enumerate(xs)}
rt = Runtime(bundle, device="cpu", mode=mode, ready=ready, threads=1)
wrong, errors = [], []
def work(k):
    r = np.random.default_rng(k)
    for n in range(per_thread):
        t = tasks[k % len(tasks)] if k < len(tasks) else int(r.choice(tasks))  # own task; the rest mixed
        i = n % len(xs)
        try:
            y = rt.run(t, xs[i])
        except Exception as e:
            errors.append(repr(e)[:200])
            continue
        if not np.array_equal(y, want[(t, i)]):
            wrong.append((t, i))
threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
for th in threads: th.start()
for th in threads: th.join()
print(json.dumps({"runs": 6 * per_thread, "wrong": len(wrong), "errors": errors[:3], "switches": rt.switches}))
"""


@pytest.mark.parametrize("mode,ready", [("switch", 1), ("switch", 2), ("session", 1)])
def test_six_threads_on_one_runtime_get_the_single_thread_logits(bundle4, mode, ready):
    """Six threads call one Runtime at once (four on a task of their own, two on random tasks), 150 runs each,
    images of three batch sizes: no crash, no error, and every output equal, bit for bit, to what a
    single-threaded Runtime returns for that task and images (one intra-op thread: the same sums in the same
    order). Run in a child process, so that a crash fails this test rather than the suite."""
    args = [sys.executable, "-c", _STRESS, str(bundle4), mode, str(ready), "150"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {**result, "runs": 900, "wrong": 0, "errors": []}


class _Recorder:
    """Stands in for the switch session: records how many runs each binding and the session have at once."""

    def __init__(self, real, pause: float = 0.003):
        self.real, self.pause = real, pause
        self.lock = threading.Lock()
        self.now: dict[int, int] = {}
        self.most_per_binding = 0
        self.total = 0
        self.most_total = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def run_with_iobinding(self, binding, options=None):
        key = id(binding)
        with self.lock:
            self.now[key] = self.now.get(key, 0) + 1
            self.total += 1
            self.most_per_binding = max(self.most_per_binding, self.now[key])
            self.most_total = max(self.most_total, self.total)
        try:
            time.sleep(self.pause)  # long enough for another thread to come in
            self.real.run_with_iobinding(binding, options)
        finally:
            with self.lock:
                self.now[key] -= 1
                self.total -= 1


@pytest.mark.parametrize("ready", [1, 2, 4])
def test_each_buffer_set_serves_one_run_at_a_time_and_sets_run_in_parallel(bundle4, ready):
    """Four threads, each on a task of its own: no binding ever has two runs at once; with ``ready`` buffer
    sets up to ``ready`` runs go in parallel; with a set per task each task is written once (no thread
    evicts another's task), and with fewer each set is taken over only between runs."""
    rt = Runtime(bundle4, device="cpu", ready=ready, threads=1)
    single = Runtime(bundle4, device="cpu", threads=1)
    xs = _images(3, seed=1)
    want = {(t, i): single.run(t, x) for t in rt.tasks for i, x in enumerate(xs)}
    rec = _Recorder(rt._impl._session)
    rt._impl._session = rec
    wrong: list = []
    barrier = threading.Barrier(4)

    def work(t):
        barrier.wait()
        for n in range(24):
            if not np.array_equal(rt.run(t, xs[n % 3]), want[(t, n % 3)]):
                wrong.append(t)

    _in_threads(work, rt.tasks)
    assert wrong == [] and rec.most_per_binding == 1
    assert 2 <= rec.most_total <= ready if ready > 1 else rec.most_total == 1  # not one lock around every run
    if ready == 4:
        assert rt.switches == 4 and sorted(rt.info()["ready_tasks"]) == rt.tasks


def test_callers_are_served_in_the_order_they_came_so_none_waits_for_ever(bundle4):
    """One buffer set, four threads each calling its own task in a loop: a caller that has just run goes behind
    the ones waiting, so the tasks take turns (before, the thread that ran kept taking the set back, and the
    others waited until it had made all its calls)."""
    rt = Runtime(bundle4, device="cpu", ready=1, threads=1)
    rec = _Recorder(rt._impl._session)
    order: list[int] = []
    real_run = rec.run_with_iobinding

    def recording(binding, options=None):
        order.append(next(s.task for s in rt._impl._slots if s.binding is binding))
        real_run(binding, options)

    rec.run_with_iobinding = recording
    rt._impl._session = rec
    x = _images(1, seed=7)[0]
    barrier = threading.Barrier(4)

    def work(t):
        barrier.wait()
        for _ in range(8):
            rt.run(t, x)

    _in_threads(work, rt.tasks)
    assert sorted(order) == sorted(rt.tasks * 8)
    first_done = min(max(i for i, t in enumerate(order) if t == task) for task in rt.tasks)
    turns = order[: first_done + 1]
    assert all(a != b for a, b in zip(turns, turns[1:])), order  # nobody twice in a row while others wait
    assert rt.switches >= len(turns)


def test_a_caller_waits_for_the_task_another_caller_is_writing_and_does_not_write_it_again(bundle4, monkeypatch):
    """Two threads ask for the same task no buffer set holds, at once: one writes it, the other waits for
    that write and runs on it (one switch, not two), even with a free buffer set beside it."""
    import nwsconvert.export.switchmode as switchmode

    rt = Runtime(bundle4, device="cpu", ready=2, threads=1)
    real = switchmode.iter_dense_tensors

    def slow(*args):
        time.sleep(0.2)  # the second caller arrives while the first writes
        yield from real(*args)

    monkeypatch.setattr(switchmode, "iter_dense_tensors", slow)
    x = _images(1, seed=2)[0]
    out: list = []
    _in_threads(lambda _: out.append(rt.run(2, x)), range(2))
    assert len(out) == 2 and np.array_equal(out[0], out[1]) and rt.switches == 1
    assert rt.info()["ready_tasks"] == [2]


def test_session_mode_builds_a_session_while_cached_tasks_run_and_builds_it_once(bundle4):
    """Session mode: while one caller builds a task's session (held here until then), a caller of a cached task is
    served; three callers of the task being built wait for that one build (one session built, not three)."""
    rt = Runtime(bundle4, device="cpu", mode="session")
    x = _images(1, seed=8)[0]
    want0 = rt.run(0, x)
    real = rt._impl.setup.open_graph
    started, proceed, waited = threading.Event(), threading.Event(), []

    def slow(name, sha, what):
        started.set()
        waited.append(proceed.wait(timeout=20))  # held until the cached task has run
        return real(name, sha, what)

    rt._impl.setup.open_graph = slow
    out: list = []
    builders = [threading.Thread(target=lambda: out.append(rt.run(2, x))) for _ in range(3)]
    for th in builders:
        th.start()
    started.wait()
    assert np.array_equal(rt.run(0, x), want0)  # served while the build waits: it holds no lock
    proceed.set()
    for th in builders:
        th.join()
    assert waited == [True] and len(out) == 3 and all(np.array_equal(y, out[0]) for y in out)
    assert rt.switches == 2 and rt.info()["cached_tasks"] == [0, 2]


def test_a_failed_write_under_threads_frees_its_buffer_set_for_the_others(bundle4, monkeypatch):
    """A write that fails (memory, say) in one thread leaves its buffer set free: the other threads go on
    and get their logits; the failing task raises in its own thread only."""
    import nwsconvert.export.switchmode as switchmode

    rt = Runtime(bundle4, device="cpu", ready=1, threads=1)
    single = Runtime(bundle4, device="cpu", threads=1)
    real = switchmode.iter_dense_tensors
    x = _images(1, seed=3)[0]
    want = {t: single.run(t, x) for t in rt.tasks}

    def failing(recipe, pools, values):
        if values is rt._impl._values(3):
            raise MemoryError("stand-in for a failure while writing task 3")
        yield from real(recipe, pools, values)

    monkeypatch.setattr(switchmode, "iter_dense_tensors", failing)
    errors, wrong = [], []

    def work(t):
        for _ in range(10):
            try:
                if not np.array_equal(rt.run(t, x), want[t]):
                    wrong.append(t)
            except MemoryError:
                errors.append(t)

    _in_threads(work, rt.tasks)
    assert wrong == [] and errors == [3] * 10


# --------------------------------------------------------------------------- frames at the door
@pytest.mark.parametrize("mode", ["switch", "session"])
def test_frames_the_bundle_does_not_take_are_refused_in_one_line_naming_the_expected_shape(bundle4, mode):
    """A wrong channel count, spatial size or rank raises one UsageError line naming the images' shape and
    the ``(B, C, H, W)`` the bundle takes; integer pixels are refused with the normalisation to apply (they
    were answered unnormalised before); float64 images give the float32 logits; a batch of 0 gives no
    logits and NaN pixels NaN logits, as onnxruntime answers them; images in another memory order the
    logits of the same images in C order."""
    rt = Runtime(bundle4, device="cpu", mode=mode)
    bad = {
        (1, 3, 16, 16): "channels",
        (1, 1, 32, 32): "size",
        (1, 16, 16): "rank",
        (2, 1, 1, 16, 16): "rank",
    }
    for shape in bad:
        with pytest.raises(UsageError) as e:
            rt.run(1, np.zeros(shape, np.float32))
        got = "(" + ", ".join(map(str, shape)) + ")"
        assert str(e.value) == f"images of shape {got}: task 1 of bundle {bundle4} takes (B, 1, 16, 16)"
    with pytest.raises(UsageError, match=r"^images are uint8: .* not raw pixels; .*\(mean \[0\.5\], std \[0\.25\]\)$"):
        rt.run(1, np.zeros((1, 1, 16, 16), np.uint8))
    with pytest.raises(UsageError, match="^images are bool"):
        rt.predict(0, np.zeros((1, 1, 16, 16), bool))
    x = _images(1, seed=4)[0]
    assert np.array_equal(rt.run(1, x.astype(np.float64)), rt.run(1, x))
    assert np.array_equal(rt.run(1, np.asfortranarray(np.repeat(x, 3, 0))), rt.run(1, np.repeat(x, 3, 0)))  # strided
    assert rt.run(1, np.zeros((0, 1, 16, 16), np.float32)).shape == (0, TASKS[1])
    nan = np.full((1, 1, 16, 16), np.nan, np.float32)
    assert np.isnan(rt.run(1, nan)).all()


def test_an_ortvalue_of_another_shape_or_type_is_refused_at_the_door(bundle4):
    import onnxruntime as ort

    rt = Runtime(bundle4, device="cpu")
    with pytest.raises(UsageError, match=r"^images of shape \(1, 1, 8, 8\): .* takes \(B, 1, 16, 16\)$"):
        rt.run(0, ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, 8, 8), np.float32)))
    with pytest.raises(UsageError, match=r"^images: an OrtValue of tensor\(double\)"):
        rt.run(0, ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, 16, 16), np.float64)))


# --------------------------------------------------------------------------- files outside the bundle
def _resign(bundle: Path, graph: str, data: bytes) -> None:
    """Write ``graph`` with ``data`` and record its hash and size in bundle.json, as a sender would."""
    import hashlib

    (bundle / graph).write_bytes(data)
    desc = json.loads((bundle / "bundle.json").read_text())
    rows = (
        [desc["switch"]]
        if graph == desc["switch"]["onnx"]
        else [r for r in desc["tasks"].values() if r.get("onnx") == graph]
    )
    for row in rows:
        row["onnx_sha256"] = hashlib.sha256(data).hexdigest()
        row["onnx_bytes"] = len(data)
    (bundle / "bundle.json").write_text(json.dumps(desc))


def _point_outside(bundle: Path, graph: str, location: str) -> str:
    """Re-point the external data of ``graph``'s first external tensor at ``location``; its name."""
    proto = onnx.load(str(bundle / graph), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    _resign(bundle, graph, proto.SerializeToString())
    return tensor.name


@pytest.fixture
def copy4(bundle4, tmp_path):
    import shutil

    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(bundle4 / "pools.safetensors", outside / "pools.safetensors")
    return Path(shutil.copytree(bundle4, tmp_path / "b")), outside


@pytest.mark.parametrize("how", ["absolute", "dotdot", "link"])
def test_a_task_graph_that_reads_a_file_outside_the_bundle_is_refused_before_anything_opens_it(copy4, monkeypatch, how):
    """A task graph whose external data is at an absolute path, climbs with ``..``, or is a link in the bundle
    to a file outside, with bundle.json re-signed as a sender would: refused in one line naming the graph, the
    tensor and the location, before onnxruntime builds a session over it (before, the session mode opened it
    and ran on the outside file)."""
    import onnxruntime as ort

    bundle, outside = copy4
    location = {
        "absolute": str(outside / "pools.safetensors"),
        "dotdot": "../outside/pools.safetensors",
        "link": "linked.safetensors",
    }[how]
    if how == "link":
        os.symlink(outside / "pools.safetensors", bundle / "linked.safetensors")
    name = _point_outside(bundle, "task_1.onnx", location)
    rt = Runtime(bundle, device="cpu", mode="session")
    x = _images(1, seed=5)[0]
    rt.run(0, x)  # the other tasks run
    built: list = []
    real = ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: built.append(a) or real(*a, **k))
    with pytest.raises(nwsconvert.FormatError) as e:
        rt.run(1, x)
    message = str(e.value)
    assert "\n" not in message and built == []
    assert message.startswith(f"{bundle / 'task_1.onnx'}: tensor {name!r} (the graph) keeps its data at {location!r}")
    want = "a link that leaves the bundle folder" if how == "link" else "not a plain file name in the bundle folder"
    assert want in message


def test_the_switch_template_and_linked_graphs_outside_the_bundle_are_refused(copy4):
    """``switch.onnx`` may name only its placeholder or the bundle's files; a graph file that is itself a link
    out of the folder is refused, in both modes, naming the link and where it leads."""
    import shutil

    bundle, outside = copy4
    _point_outside(bundle, "switch.onnx", "/etc/hostname")
    with pytest.raises(nwsconvert.FormatError, match=r"switch\.onnx: tensor .* keeps its data at '/etc/hostname'"):
        Runtime(bundle, device="cpu", mode="switch")
    shutil.move(bundle / "task_2.onnx", outside / "task_2.onnx")
    os.symlink(outside / "task_2.onnx", bundle / "task_2.onnx")
    rt = Runtime(bundle, device="cpu", mode="session")
    with pytest.raises(
        nwsconvert.FormatError,
        match=r"task_2\.onnx: task 2's graph is a link to .*/outside/task_2\.onnx, outside the bundle folder",
    ):
        rt.run(2, _images(1, seed=6)[0])
    # A link inside the folder is the bundle's own file: it runs.
    os.rename(bundle / "task_3.onnx", bundle / "real_3.onnx")
    os.symlink("real_3.onnx", bundle / "task_3.onnx")
    assert rt.run(3, _images(1, seed=6)[0]).shape == (2, TASKS[3])


# --------------------------------------------------------------------------- what nws-infer --bench says
class _Clock:
    """A clock that only the fake runtimes move: the timings come out exact."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeRuntime:
    """Runs that take ``run`` seconds, plus ``switch`` seconds when the task differs from the last one's."""

    def __init__(self, clock: _Clock, mode: str, run: float, switch: float, tasks=(0, 1, 2)):
        self.clock, self.mode, self.cost, self.switch = clock, mode, run, switch
        self.tasks, self.ready, self.max_sessions, self.last = list(tasks), 1, 4, None
        self.precision = "float32"

    def run(self, task, images):
        self.clock.now += self.cost + (self.switch if task != self.last else 0.0)
        self.last = task

    def session(self, task):
        class _Input:
            shape = ["batch", 1, 16, 16]

        class _Session:
            def get_inputs(self):
                return [_Input()]

        return _Session()

    def info(self):
        return {"layout": "plain", "layout_note": "stand-in reason"}


def test_nws_infer_bench_reports_the_latency_the_mode_ratio_and_the_switch_it_measured(monkeypatch, capsys):
    """``--bench``'s figures are what was measured: with runs of 2 ms, switches of 30 ms, and the other mode's
    runs of 1 ms (a clock the runs move), it prints a 2.00 ms latency, 2.00x against the other mode (which
    it names as faster, with the switch mode's layout), and 30.00 ms a switch; a switch mode at the session
    mode's speed is said to be so."""
    import nwsconvert.export.timing as timing
    from nwsconvert.export.cli import _bench

    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    rt, other = _FakeRuntime(clock, "switch", 0.002, 0.030), _FakeRuntime(clock, "session", 0.001, 0.050)
    _bench(rt, 1, other)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "latency (batch 1): median 2.00 ms (IQR 2.00-2.00) over 50 runs"
    assert out[1] == (
        "switch mode against session mode (batch 1, 50 runs each, interleaved): median 2.00 ms against 1.00 ms "
        "(2.00x): the session mode is faster here (--mode session); the switch mode's layout: plain (stand-in reason)"
    )
    assert out[2] == (
        "task switch (first run after it minus a steady run, 3 tasks in turn; buffers rewritten, 1 task(s) held "
        "ready): median 30.00 ms (IQR 30.00-30.00) over 15 switches"
    )
    _bench(_FakeRuntime(clock, "switch", 0.00102, 0.03), 1, _FakeRuntime(clock, "session", 0.001, 0.05))
    assert "(1.02x): the switch mode runs at the session mode's speed\n" in capsys.readouterr().out
    half, full = _FakeRuntime(clock, "switch", 0.003, 0.03), _FakeRuntime(clock, "switch", 0.001, 0.03)
    half.precision = "float16"
    _bench(half, 1, full)  # --precision float16 --bench: against the float32 switch mode
    assert (
        "switch mode in float16 against switch mode in float32 (batch 1, 50 runs each, interleaved): median 3.00 ms "
        "against 1.00 ms (3.00x): the switch mode in float32 is faster here (--precision float32)"
    ) in capsys.readouterr().out


def test_a_switch_mode_without_the_blocked_layout_says_so_at_start_up(bundle4, monkeypatch):
    """Where the machine graph cannot be used at all on a CPU (the template runs as it is), the Runtime warns at
    start-up in one line with the reason and how to measure both modes; asking for ``layout="plain"`` does not."""
    import nwsconvert.export.switchmode as switchmode
    from nwsconvert.export.layout import plain_graph

    real = switchmode.prepare

    def refused(template, rows, *, layout, **kwargs):
        if layout == "plain":
            return real(template, rows, layout=layout, **kwargs)
        return plain_graph(template, rows, "stand-in: onnxruntime optimised it otherwise"), None

    monkeypatch.setattr(switchmode, "prepare", refused)
    with pytest.warns(UserWarning) as caught:
        rt = Runtime(bundle4, device="cpu")
    (w,) = caught
    assert str(w.message) == (
        f"{bundle4 / 'switch.onnx'}: the switch mode runs this template without this CPU's blocked layout "
        "(stand-in: onnxruntime optimised it otherwise); its runs may be 1.1-3x slower than mode='session' here: "
        "nws-infer --bench measures both"
    )
    assert w.filename == __file__ and rt.info()["layout"] == "plain"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Runtime(bundle4, device="cpu", layout="plain")


# --------------------------------------------------------------------------- half precision
def test_the_float16_switch_mode_halves_the_buffers_and_agrees_with_float32(bundle4):
    """``precision="float16"``: the switch graph's weight inputs are float16 (images in and logits out stay
    float32), its buffers take half the bytes of the float32 plain layout's, and its logits stay within 1 % of
    the largest float32 logit (float16 rounds each weight and activation to 11 significant bits, 4.9e-4
    relative; a few layers' worth stays well under 1 %): every row whose float32 top two classes differ by
    more than twice that bound keeps its class. Filling the buffers with NumPy gives the same float16 buffers
    as with onnxruntime (float16's default: both round to nearest even), so the same logits bit for bit; so
    does decoding the packs at each switch (``keep="pack"``)."""
    full = Runtime(bundle4, device="cpu", threads=1, layout="plain")
    half = Runtime(bundle4, device="cpu", threads=1, precision="float16")
    assert half.precision == "float16" and half.info()["precision"] == "float16" and half.info()["layout"] == "plain"
    assert half.info()["weight_buffer_bytes"] * 2 == full.info()["weight_buffer_bytes"]
    inputs = {i.name: i.type for i in half.session(0).get_inputs()}
    image = full.session(0).get_inputs()[0].name
    assert inputs.pop(image) == "tensor(float)" and set(inputs.values()) == {"tensor(float16)"}
    assert half.session(0).get_outputs()[0].type == "tensor(float)"
    x = np.random.default_rng(5).standard_normal((64, 1, 16, 16)).astype(np.float32)
    by_numpy = Runtime(bundle4, device="cpu", threads=1, precision="float16", fill="numpy")
    by_pack = Runtime(bundle4, device="cpu", threads=1, precision="float16", keep="pack")
    for t in half.tasks:
        want, got = full.run(t, x), half.run(t, x)
        assert got.dtype == np.float32 and got.shape == want.shape == (64, TASKS[t])
        bound = 0.01 * np.abs(want).max()
        assert np.abs(got - want).max() <= bound
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * bound
        assert clear.sum() >= 32 and np.array_equal(got.argmax(1)[clear], want.argmax(1)[clear])
        assert np.array_equal(by_numpy.run(t, x), got) and np.array_equal(by_pack.run(t, x), got)


def test_float16_is_the_switch_modes_and_named_when_misused(bundle4, capsys):
    from nwsconvert.export.cli import infer_main
    from nwsconvert.export.ortsetup import session_providers

    with pytest.raises(ValueError, match="precision='float16' runs the switch mode's one session"):
        Runtime(bundle4, device="cpu", mode="session", precision="float16")
    with pytest.raises(ValueError, match="precision must be float32 or float16, got 'bfloat16'"):
        Runtime(bundle4, device="cpu", precision="bfloat16")
    assert infer_main(["--bundle", str(bundle4), "--task", "0", "--mode", "session", "--precision", "float16"]) == 2
    assert capsys.readouterr().err == (
        "nws-infer: --precision float16 runs the switch mode's session; --mode session runs float32\n"
    )
    assert infer_main(["--bundle", str(bundle4), "--task", "0", "--device", "cpu", "--precision", "float16"]) == 0
    assert "mode: switch; providers: ['CPUExecutionProvider'], layout plain, float16" in capsys.readouterr().out
    assert session_providers(True, nhwc=True)[0] == ("CUDAExecutionProvider", {"use_tf32": "0", "prefer_nhwc": "1"})
    assert "prefer_nhwc" not in session_providers(True)[0][1]


def test_a_kept_switch_graph_checks_the_files_its_template_names_again(copy4):
    """The template's external-data check runs in the layout child (the Runtime's process never imports onnx);
    the graph it prepared is kept for the process. Handing the kept graph out again checks again, without onnx,
    the bundle files the template names: one swapped meanwhile for a link out of the folder is refused."""
    import onnx.helper

    from nwsconvert.export.bundlefile import check_external_data
    from nwsconvert.export.densify import PLACEHOLDER
    from nwsconvert.export.layout import prepare

    bundle, outside = copy4
    proto = onnx.load(str(bundle / "switch.onnx"), load_external_data=False)
    extra = onnx.helper.make_tensor("extra", onnx.TensorProto.FLOAT, [1], [0.0])
    extra.ClearField("float_data")
    extra.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "extra.bin"), ("offset", "0"), ("length", "4")):
        extra.external_data.add(key=key, value=value)
    proto.graph.initializer.append(extra)
    template = proto.SerializeToString()
    (bundle / "extra.bin").write_bytes(b"\0" * 4)
    assert check_external_data(template, bundle / "switch.onnx", bundle, placeholder=PLACEHOLDER) == ["extra.bin"]
    rows = [(t.name, tuple(t.dims)) for t in proto.graph.initializer if t.name != "extra" and t.external_data]
    args = dict(layout="plain", external=(str(bundle / "switch.onnx"), str(bundle), PLACEHOLDER))
    graph, _ = prepare(template, rows, **args)
    assert graph.external == ["extra.bin"] and prepare(template, rows, **args)[0] is graph  # kept
    (bundle / "extra.bin").unlink()
    os.symlink(outside / "pools.safetensors", bundle / "extra.bin")
    with pytest.raises(nwsconvert.FormatError, match=r"external data is a link to .*outside/pools\.safetensors"):
        prepare(template, rows, **args)
