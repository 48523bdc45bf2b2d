"""``cuda_graph=true``: a task's training step captured once and replayed (nwsconvert/train/graphs.py).

On a GPU: replayed training ends with the eager run's weights, indices and packs, bit for bit, and
replays carry the steps. Everywhere: every condition it needs is refused in one line naming the option,
before a run directory is made.
"""

import pytest
import torch

from nwsconvert import TrainConfig, Trainer
from nwsconvert.core import fused_search
from nwsconvert.errors import UsageError
from nwsconvert.train.graphs import check_graphable

CUDA = torch.device("cuda")


@pytest.mark.parametrize("key", ["cuda_graph", "engine_graph"])
def test_the_option_is_a_recorded_boolean_off_by_default(key):
    assert getattr(TrainConfig(), key) is False
    assert getattr(TrainConfig.from_recorded({}), key) is False  # runs recorded before the option: eager
    with pytest.raises(UsageError, match=f"{key}='yes': expected true or false"):
        TrainConfig(**{key: "yes"})


@pytest.mark.parametrize(
    ("changes", "device", "message"),
    [
        ({}, "cpu", "engine_graph=true captures the search engine's Triton update on CUDA \\(device cpu"),
        ({"search": "layer"}, "cuda", "on CUDA \\(device cuda, search=layer"),
        ({"cuda_graph": True}, "cuda", "engine_graph=true and cuda_graph=true: the whole step's graph already holds"),
    ],
)
def test_what_the_engine_graph_cannot_capture_is_refused_in_one_line(changes, device, message):
    cfg = TrainConfig(engine_graph=True, **changes)
    with pytest.raises(UsageError, match=message) as info:
        check_graphable(cfg, torch.device(device), False)
    assert "\n" not in str(info.value)
    if device == "cuda" and fused_search.available(CUDA):
        check_graphable(TrainConfig(engine_graph=True), CUDA, True)  # what it needs: CUDA and the engine (torchrun too)


def test_a_cpu_run_asking_for_cuda_graphs_is_refused_before_its_directory_is_made(tmp_path):
    from trainer_utils import KWARGS, SPEC, tiny_config, tiny_model

    with pytest.raises(UsageError, match="cuda_graph=true needs a CUDA device; this run trains on cpu"):
        Trainer(tiny_model(), tmp_path / "run", tiny_config(cuda_graph=True), model_spec=SPEC, model_kwargs=KWARGS,
                device="cpu", progress=False)  # fmt: skip
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("changes", "distributed", "message"),
    [
        ({"search": "layer"}, False, "needs the search engine's Triton kernels \\(search=layer"),
        ({"amp": "fp16"}, False, "cannot capture float16 autocast \\(amp=fp16"),
        ({}, True, "runs in one process; under torchrun set cuda_graph=false"),
    ],
)
def test_what_a_graph_cannot_capture_is_refused_in_one_line(changes, distributed, message):
    if not fused_search.available(CUDA):
        pytest.skip("needs Triton (the engine's kernels), which this torch wheel lacks")
    cfg = TrainConfig(cuda_graph=True, **changes)
    with pytest.raises(UsageError, match=message) as info:
        check_graphable(cfg, CUDA, distributed)
    assert "\n" not in str(info.value)
    check_graphable(TrainConfig(cuda_graph=False, **changes), CUDA, distributed)  # off: nothing to check


def test_nws_train_refuses_cuda_graphs_on_a_cpu_in_one_line(tmp_path):
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine can capture")
    done = subprocess.run(
        [sys.executable, "-m", "nwsconvert.cli.train", f"out={tmp_path / 'run'}", "cuda_graph=true", "tasks=1"],
        capture_output=True, text=True, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cuda_graph=true needs a CUDA device" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu  # CUDA graphs
@pytest.mark.parametrize("option", ["cuda_graph", "engine_graph"])
def test_replayed_task_training_equals_eager_training_bit_for_bit(tmp_path, option):
    """Two epochs of a task (a new learning rate in the second: a second capture), with the engine and
    commitment: the run with cuda_graph=true (the whole step replayed) or engine_graph=true (the engine's
    update replayed) ends with the eager run's weights, indices and packs. Both with deterministic=true:
    cuDNN's default backward kernels differ from run to run on CUDA (an H100 gave other weights after the
    first step, eager against eager on a side stream)."""
    from trainer_utils import KWARGS, SPEC, blobs, tiny_config, tiny_model

    from nwsconvert.core.nwsmodel import nws_layers
    from nwsconvert.formats.packs import TaskPack

    models, packs = {}, {}
    for graphed in (False, True):
        cfg = tiny_config(
            epochs=2, milestones=[1], amp="off", search="engine", batch_size=8, deterministic=True, **{option: graphed}
        )
        with Trainer(tiny_model(), tmp_path / str(graphed), cfg, model_spec=SPEC, model_kwargs=KWARGS,
                     device="cuda", progress=False) as trainer:  # fmt: skip
            trainer.fit_task(
                0, blobs(64, 2, 1), blobs(16, 2, 2), 2
            )  # 8 steps an epoch: 3 warm-up, 1 capture, 4 replays
            models[graphed] = trainer.model
        packs[graphed] = TaskPack.load(tmp_path / str(graphed) / "tasks" / "task_0.nwspack")
    for eager, replayed in zip(nws_layers(models[False]), nws_layers(models[True])):
        assert torch.equal(eager.nws.indices, replayed.nws.indices), eager.name
        assert torch.equal(eager.weight, replayed.weight), eager.name
    for name, idx in packs[False].indices.items():
        assert torch.equal(idx, packs[True].indices[name]), name


def test_adam_keeps_its_step_on_the_device_when_steps_are_captured():
    """A captured Adam step needs ``capturable`` (its step count on the device); eager runs keep the default."""
    from trainer_utils import tiny_config, tiny_model

    from nwsconvert.train.loop import make_optimizer

    model = tiny_model()
    for graphed in (False, True):
        opt = make_optimizer(model, tiny_config(optimizer="adam", cuda_graph=graphed))
        assert all(group["capturable"] is graphed for group in opt.param_groups)


def _walk(step, opt, x, y) -> list:
    """Drive a GraphedStep (warm-up 2) through its cases, checking its counts; the first five outputs.

    Two warm-up steps, a capture (replayed once) and two replays; a batch of another shape (eager, the
    graph kept); a replay; a new learning rate: two warm-up steps and a new capture."""
    outs = [step(x, y) for _ in range(5)]
    assert (step.captures, step.replays) == (1, 3)
    step(x[:4], y[:4])
    assert (step.captures, step.replays) == (1, 3)
    step(x, y)
    assert (step.captures, step.replays) == (1, 4)
    for group in opt.param_groups:
        group["lr"] *= 0.1
    for _ in range(3):
        step(x, y)
    assert (step.captures, step.replays) == (2, 5)
    return outs


def test_a_graphed_steps_bookkeeping_with_the_cuda_calls_stood_in_for(monkeypatch):
    """GraphedStep's own decisions on any machine, with torch.cuda's graph, stream and pool calls replaced
    by stand-ins that capture nothing (a stand-in capture runs the step once; a replay does nothing):
    warm-up steps, one capture, replays of the captured shapes, eager steps for another shape, a new
    capture for a new learning rate, and each capture asked in thread-local mode in a memory pool of its
    own (``pool=None``: a pool handle shared by successive captures stops the second capture at an
    allocator assert, seen on an H100 with torch 2.11). Whether a replay computes the eager step is the
    GPU test below."""
    import contextlib

    from trainer_utils import tiny_config, tiny_model

    from nwsconvert.train.graphs import GraphedStep
    from nwsconvert.train.loop import TrainStep, make_optimizer

    calls = []

    class Graph:
        def replay(self):
            calls.append("replay")

    @contextlib.contextmanager
    def capture(graph, pool=None, capture_error_mode="global"):
        calls.append(("capture", pool, capture_error_mode))
        yield

    class Stream:
        def wait_stream(self, other):
            pass

    for name, value in {"CUDAGraph": Graph, "graph": capture, "Stream": Stream, "graph_pool_handle": lambda: (0, 1),
                        "stream": lambda s: contextlib.nullcontext(), "current_stream": Stream}.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)
    model = tiny_model().train()
    cfg = tiny_config(amp="off")
    opt = make_optimizer(model, cfg)
    step = GraphedStep(TrainStep(model, model, opt, cfg, torch.device("cpu"), pool=False), warmup=2)
    outs = _walk(step, opt, torch.randn(8, 1, 16, 16), torch.randint(0, 4, (8,)))
    capture = ("capture", None, "thread_local")
    assert calls == [capture, "replay", "replay", "replay", "replay", capture, "replay"]
    assert outs[2][0] is outs[4][0] and outs[2][1] is outs[4][1]  # replays hand out the graph's output buffers
    assert outs[0][0] is not outs[1][0]
    assert step.model is model and step.device == torch.device("cpu")


@pytest.mark.gpu  # CUDA graphs
def test_a_graphed_step_computes_the_eager_step_through_replays_shapes_and_a_new_learning_rate():
    """A GraphedStep and an eager TrainStep on twin models, fed the same batches, step for step: the logits,
    the loss, every temporary weight and every index are equal bit for bit after each step, through the
    warm-up, the capture, the replays, an eager step for another batch shape, the replay after it, and
    the warm-up and new capture that a new learning rate makes (the counts of _walk). Under
    deterministic kernels (what ``deterministic=true`` sets): cuDNN's default backward kernels differ from
    run to run on CUDA."""
    from trainer_utils import tiny_config, tiny_model

    from nwsconvert.core.engine import SearchEngine
    from nwsconvert.core.nwsmodel import nws_layers
    from nwsconvert.train.graphs import GraphedStep
    from nwsconvert.train.loop import TrainStep, make_optimizer, use_deterministic

    cfg = tiny_config(amp="off", cuda_graph=True)
    restore = use_deterministic()
    twins = []
    for graphed in (False, True):
        model = tiny_model().to(CUDA).train()
        opt = make_optimizer(model, cfg)
        engine = SearchEngine(model)
        step = TrainStep(model, model, opt, cfg, CUDA, pool=False)
        twins.append((model, opt, engine, GraphedStep(step, warmup=2) if graphed else step))
    g = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(8, 1, 16, 16, device=CUDA, generator=g)
    y = torch.randint(0, 4, (8,), device=CUDA, generator=g)
    schedule = [(x, y)] * 5 + [(x[:4], y[:4]), (x, y), "new learning rate"] + [(x, y)] * 3
    try:
        for i, batch in enumerate(schedule):
            if batch == "new learning rate":
                for _, opt, _, _ in twins:
                    for group in opt.param_groups:
                        group["lr"] *= 0.1
                continue
            (eager_out, eager_loss), (out, loss) = (step(*batch) for *_, step in twins)
            assert torch.equal(eager_out, out) and torch.equal(eager_loss, loss), f"step {i}"
            for a, b in zip(nws_layers(twins[0][0]), nws_layers(twins[1][0])):
                assert torch.equal(a.weight, b.weight) and torch.equal(a.nws.indices, b.nws.indices), (i, a.name)
        assert (twins[1][3].captures, twins[1][3].replays) == (2, 5)
    finally:
        for _, _, engine, _ in twins:
            engine.close()
        restore()
