"""Trainer: pool learning, task learning, run directory, rebuild from files, resume."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_utils import KWARGS, SPEC, blobs, tiny_config, tiny_model, train_run

import nwsconvert
from nwsconvert import RunDir, TaskPack, TrainConfig, Trainer, evaluate, nws_layers
from nwsconvert.errors import FormatError, UsageError
from nwsconvert.formats.packfile import PACK_FORMAT, PACK_VERSION
from nwsconvert.formats.stfile import read_arrays
from nwsconvert.train import stage as stage_module
from nwsconvert.train.checkpoint import load_checkpoint
from nwsconvert.train.heads import head_classes
from nwsconvert.train.manifest import model_sha256
from nwsconvert.train.stage import StageContext, run_stage


def _correct(model, data, trainer) -> int:
    """Images ``model`` gets right, evaluated as ``trainer`` evaluated its tasks: on its device, under its
    autocast (on a GPU machine: CUDA and bfloat16 by default) and in its batches; like with like."""
    cfg = trainer.config
    return evaluate(model.to(trainer.device), data, device=trainer.device, amp=cfg.amp, batch_size=cfg.batch_size)[
        "correct"
    ]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """Pools + 2 tasks (3 and 2 classes) of the tiny model; returns (run dir, trainer, datasets)."""
    out = tmp_path_factory.mktemp("run") / "r"
    model = tiny_model(num_classes=4)
    trainer = Trainer(model, out, tiny_config(), model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    pre = blobs(64, 4, seed=1)
    pool_metrics = trainer.fit_pools(pre, blobs(32, 4, seed=2), num_classes=4)
    tasks = [(blobs(48, 3, seed=3), blobs(24, 3, seed=4)), (blobs(48, 2, seed=5), blobs(24, 2, seed=6))]
    metrics = [
        trainer.fit_task(t, tr, te, tr.tensors[1].max().item() + 1, name=f"t{t}") for t, (tr, te) in enumerate(tasks)
    ]
    return out, trainer, tasks, metrics, pool_metrics


def test_run_directory_layout_and_manifest(finished_run):
    out, trainer, tasks, metrics, pool_metrics = finished_run
    run = RunDir(out)
    raw = json.loads(run.manifest_path.read_text())
    assert raw["format"] == "nwsconvert.run" and raw["version"] == 3
    assert raw["model_sha256"] == model_sha256(raw["model"])
    m = run.read()
    assert m.to_dict() == raw  # what is written is exactly the typed manifest
    assert m.model.spec == SPEC and m.model.kwargs == KWARGS
    assert m.model.convert["pool_size"] == 32 and m.model.convert["version"] == 1  # the whole NWSConfig
    assert m.model.config().pool_size == 32
    assert m.pools.sha256 == nwsconvert.PoolSet.load(run.pool_path).sha256
    assert m.pools.learned is True and "val_acc" in pool_metrics
    assert m.finished == [0, 1]
    assert [t.num_classes for t in m.tasks] == [3, 2]
    assert m.config["epochs"] == 2 and "torch" in m.versions
    for entry in m.tasks:
        pack = TaskPack.load(out / entry.file)
        assert pack.pool_sha256 == m.pools.sha256
        assert pack.num_classes == entry.num_classes
        # state_dtype=float16 (the default): the float32 state is stored in float16, and the bytes recorded say so
        assert {v.dtype for v in pack.state.values() if v.is_floating_point()} == {torch.float16}
        # the float16 entries are stored as changes against the base pack's where that is smaller: the bytes
        # recorded are the file's state tensors, coded or raw, and at most the raw entries
        header, arrays = read_arrays(out / entry.file, PACK_FORMAT, PACK_VERSION)
        stored = sum(a.nbytes for k, a in arrays.items() if k.startswith(("state/", "state_delta/")))
        raw = sum(v.numel() * v.element_size() for v in pack.state.values())
        assert entry.bytes["state"] == pack.state_bytes == stored < raw and header["state_delta"]
    # The stage checkpoint is removed once its stage is recorded.
    assert not run.checkpoint_path.exists()
    log = run.read_log()
    epochs = [r for r in log if r.get("stage") == "task:1" and "epoch" in r and "train_loss" in r and "event" not in r]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert all(0 <= r["searched"] <= 1 and 0 < r["pool_usage"] <= 1 for r in epochs)
    assert epochs[0]["lr"] == pytest.approx(0.05) and epochs[1]["lr"] == pytest.approx(0.005)  # milestone 1, gamma 0.1


def test_rebuilt_model_scores_exactly_the_training_time_accuracy(finished_run):
    out, trainer, tasks, metrics, _ = finished_run
    for t, (m, (_, test)) in enumerate(zip(metrics, tasks)):
        assert m["rebuilt_acc"] == m["val_acc"]
        loaded = nwsconvert.load(out, task=t)
        assert _correct(loaded, test, trainer) == m["val_correct"]


def test_a_pack_that_does_not_rebuild_the_task_fails_it(tmp_path, monkeypatch):
    """The rebuild check: a model rebuilt from the pack that scores otherwise than the trained one
    stops the task with one message naming the pack, and the task is not committed."""
    from nwsconvert.train.store import RunStore

    real = RunStore.rebuild

    def wrong(self, *args, **kwargs):
        model = real(self, *args, **kwargs)
        _, head = nwsconvert.find_head(model)
        with torch.no_grad():
            head.bias.copy_(torch.tensor([1e6] + [0.0] * (head.bias.numel() - 1)))  # always class 0
        return model

    monkeypatch.setattr(RunStore, "rebuild", wrong)
    trainer = Trainer(
        tiny_model(), tmp_path / "r", tiny_config(epochs=1), model_spec=SPEC, model_kwargs=KWARGS, progress=False
    )
    x, y = blobs(32, 2, 2).tensors
    ones = torch.utils.data.TensorDataset(x[y == 1], y[y == 1])  # class 1 only: the broken model scores 0
    with pytest.raises(
        RuntimeError,
        match=r"task 0: the model rebuilt from .*task_0\.nwspack scores 0/16, .* the pack does not reproduce",
    ):
        trainer.fit_task(0, blobs(32, 2, 1), ones, 2)
    trainer.close()
    assert RunDir(tmp_path / "r").read().finished == []


def test_loading_a_task_runs_no_search_and_training_mode_keeps_its_kernels(finished_run, monkeypatch):
    """A task's model is rebuilt without a search: the pack sets every index, the head resized to the
    task's classes included, so loading is a gather, yet scores what the trained model did. Put in
    training mode, its first forward searches each layer once, to set up the lazy search, and finds
    the pack's own indices (the temporary weights are the chosen kernels); the next finds nothing to do."""
    from nwsconvert.core.layers import NWSWeight

    out, trainer, tasks, metrics, _ = finished_run
    searched = []
    full_search = NWSWeight.full_search
    monkeypatch.setattr(NWSWeight, "full_search", lambda self, w: (searched.append(self), full_search(self, w))[1])
    for t, (m, (_, test)) in enumerate(zip(metrics, tasks)):
        loaded = nwsconvert.load(out, task=t)
        assert _correct(loaded, test, trainer) == m["val_correct"]
        assert searched == [], f"task {t}: loading or evaluating searched {len(searched)} layer(s)"
    layers = nws_layers(loaded)
    indices = {l.name: l.nws.indices.clone() for l in layers}
    x = tasks[1][1].tensors[0][:8].to(trainer.device)
    loaded.train()
    loaded(x)
    assert sorted(id(s) for s in searched) == sorted(id(l.nws) for l in layers)  # each layer once
    assert all(torch.equal(l.nws.indices, indices[l.name]) for l in layers)
    searched.clear()
    loaded(x)
    assert searched == [] and nwsconvert.search_stats(loaded)["searched"] == 0


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_under_autocast_the_rebuilt_model_scores_the_training_time_accuracy(tmp_path, amp):
    """The AMP path (on CUDA by default; here on the CPU, where ``amp`` given explicitly runs it):
    convolutions run in the low precision during training and evaluation, indices stay exact in
    float32, and the model rebuilt from each pack scores what the trained model scored, image for image."""
    seen = set()
    model = tiny_model()
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    # 32 x 32 images: at 16 x 16 the test ResNet's layer4.0.conv1 (3 x 3, stride 2) sees 1 x 1 maps, where
    # torch 2.14's CPU bfloat16 convolution returns garbage weight gradients from its second call on
    # (up to inf, run to run; float32 and 2 x 2 maps are right: RESULTS, "bfloat16 on CPU").
    trainer = train_run(tmp_path / "r", model, amp=amp, size=32)
    assert (torch.bfloat16 if amp == "bf16" else torch.float16) in seen  # (BatchNorm recalibration runs in float32)
    manifest = RunDir(tmp_path / "r").read()
    assert trainer.config.amp == amp and len(manifest.tasks) == 2
    for entry in manifest.tasks:
        assert entry.metrics["rebuilt_acc"] == entry.metrics["val_acc"]
        # Loaded afresh and evaluated under the same autocast: the same images right (train_run's validation sets).
        val = blobs(16, entry.num_classes, 20 + entry.id, 32)
        assert _correct(nwsconvert.load(tmp_path / "r", task=entry.id), val, trainer) == entry.metrics["val_correct"]


def test_load_matches_the_trained_model_bitwise(finished_run):
    out, trainer, tasks, _, _ = finished_run
    # The trainer's model ends in the last task's state.
    device = next(trainer.model.parameters()).device  # the trainer's device: CUDA where there is one
    x = tasks[1][1].tensors[0].to(device)
    trainer.model.eval()
    with torch.no_grad():
        ref = trainer.model(x)
        nws = nwsconvert.load(out, task=1, device=device)(x)
        dense = nwsconvert.load(out, task=1, dense=True, device=device)
        assert not nwsconvert.is_converted(dense)
        assert torch.equal(nws, ref)
        assert torch.equal(dense(x), ref)


def test_task_heads_keep_rows_and_tasks_share_pools(finished_run):
    out, _, _, _, _ = finished_run
    m0, m1 = nwsconvert.load(out, task=0), nwsconvert.load(out, task=1)
    assert head_classes(m0) == 3 and head_classes(m1) == 2
    for a, b in zip(nws_layers(m0), nws_layers(m1)):
        assert torch.equal(a.nws.pool, b.nws.pool)


def test_next_task_starts_from_previous_chosen_kernels(tmp_path):
    model = tiny_model()
    config = tiny_config(epochs=1, task_init="previous")
    trainer = Trainer(model, tmp_path / "r", config, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    trainer.fit_task(0, blobs(32, 2, 1), blobs(16, 2, 2), 2)
    pack0 = TaskPack.load(tmp_path / "r" / "tasks" / "task_0.nwspack")
    # fit_task(1) with zero epochs of change would start from pack 0: check the start state directly.
    trainer.store.enter_task_state(trainer.model, 0)
    for layer in nws_layers(trainer.model):
        assert torch.equal(layer.weight, layer.nws.gather())  # W = D(C_{t-1}; M)
        assert torch.equal(layer.nws.indices.long().cpu(), pack0.indices[layer.name])


def test_without_pool_learning_the_converted_pools_are_the_run_pools(tmp_path):
    model = tiny_model()
    before = nwsconvert.pool_set(model).sha256
    trainer = Trainer(
        model, tmp_path / "r", tiny_config(epochs=1), model_spec=SPEC, model_kwargs=KWARGS, progress=False
    )
    trainer.fit_task(0, blobs(32, 2, 1), blobs(16, 2, 2), 2)
    m = RunDir(tmp_path / "r").read()
    assert m.pools.sha256 == before and m.pools.learned is False


def test_a_run_without_its_base_entry_names_the_field(tmp_path):
    """Task packs are stored against the base pack: a manifest whose base entry was removed is refused
    by name when the next task is written, not with a bare TypeError or assert."""
    t1 = Trainer(
        tiny_model(), tmp_path / "r", tiny_config(epochs=1), model_spec=SPEC, model_kwargs=KWARGS, progress=False
    )
    t1.fit_task(0, blobs(32, 2, 1), blobs(16, 2, 2), 2)
    t1.close()
    path = RunDir(tmp_path / "r").manifest_path
    raw = json.loads(path.read_text())
    raw["base"] = None
    path.write_text(json.dumps(raw))
    t2 = Trainer(tiny_model(), tmp_path / "r", resume=True, progress=False)
    with pytest.raises(FormatError, match=r"manifest.json: field base: the run records no base entry"):
        t2.fit_task(1, blobs(32, 2, 3), blobs(16, 2, 4), 2)


def test_tasks_in_order_and_existing_runs_are_protected(tmp_path):
    model = tiny_model()
    trainer = Trainer(
        model, tmp_path / "r", tiny_config(epochs=1), model_spec=SPEC, model_kwargs=KWARGS, progress=False
    )
    with pytest.raises(ValueError, match="next is 0, not 1"):
        trainer.fit_task(1, blobs(32, 2, 1), blobs(16, 2, 2), 2)
    with pytest.raises(FileExistsError, match="already holds a run"):
        Trainer(tiny_model(), tmp_path / "r", tiny_config(), model_spec=SPEC, progress=False)
    with pytest.raises(ValueError, match="no NWS layers"):
        Trainer(torch.nn.Linear(2, 2), tmp_path / "other")


def test_resume_skips_finished_tasks_and_continues_from_checkpoint(tmp_path):
    cfg = tiny_config(epochs=2)
    data = [(blobs(32, 2, 1), blobs(16, 2, 2)), (blobs(32, 2, 3), blobs(16, 2, 4))]
    t1 = Trainer(tiny_model(), tmp_path / "r", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    first = t1.fit_task(0, *data[0], 2)
    # Simulate a process killed after task 1's first epoch: run one epoch, keep its checkpoint.
    t1.config = cfg.replace(epochs=1)
    t1.store.enter_task_state(t1.model, 0)
    run_stage(t1.stages, "task:1", data[1][0], None, cfg.replace(epochs=1), pool=False, seed=cfg.seed + 2, ckpt=None)
    header, _, _ = load_checkpoint(RunDir(tmp_path / "r").checkpoint_path)
    assert header["stage"] == "task:1" and header["epoch"] == 1
    sha0 = RunDir(tmp_path / "r").read().tasks[0].sha256

    t2 = Trainer(tiny_model(seed=5), tmp_path / "r", resume=True, progress=False)
    assert t2.config.epochs == 2  # the run's own configuration
    assert t2.fit_task(0, *data[0], 2) == first  # finished: skipped, recorded metrics
    m = t2.fit_task(1, *data[1], 2)
    run = RunDir(tmp_path / "r")
    manifest = run.read()
    assert manifest.tasks[0].sha256 == sha0
    assert m["rebuilt_acc"] == m["val_acc"]
    resumed = [r for r in run.read_log() if r.get("event") == "resumed"]
    assert resumed and resumed[-1]["stage"] == "task:1" and resumed[-1]["epoch"] == 1
    epochs = [
        r["epoch"] for r in run.read_log() if r.get("stage") == "task:1" and "train_loss" in r and "event" not in r
    ]
    assert epochs == [1, 2]  # epoch 1 from the first process, epoch 2 after the resume


def _killed_when_epoch_2_is_logged(monkeypatch, out, cfg, train, val) -> None:
    """Task 0 of a new run in ``out``, its process killed as epoch 2's record is about to be logged
    (after that epoch's checkpoint, if one is written)."""

    class Killed(BaseException):
        pass

    real_log = StageContext.log

    def log(self, record):
        if record.get("stage") == "task:0" and record.get("epoch") == 2 and "train_loss" in record:
            raise Killed
        real_log(self, record)

    monkeypatch.setattr(StageContext, "log", log)
    t1 = Trainer(tiny_model(), out, cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    with pytest.raises(Killed):
        t1.fit_task(0, train, val, 2)
    t1.close()
    monkeypatch.setattr(StageContext, "log", real_log)


def test_a_stage_killed_after_its_last_checkpoint_keeps_its_metrics(tmp_path, monkeypatch):
    """A kill between a stage's last checkpoint and its pack: the resumed stage runs no epoch and must
    still report the trained epoch's metrics, equal to an uninterrupted run's. The killed process's
    validation counts are not reused (its settings may differ from this one's): the trainer evaluates the
    restored model itself, then the rebuilt one."""
    from nwsconvert.train import trainer as trainer_module

    cfg = tiny_config(epochs=2)
    train, val = blobs(32, 2, 1), blobs(16, 2, 2)
    ref = Trainer(tiny_model(), tmp_path / "ref", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False).fit_task(
        0, train, val, 2
    )

    _killed_when_epoch_2_is_logged(monkeypatch, tmp_path / "r", cfg, train, val)  # its checkpoint is on disk
    assert load_checkpoint(RunDir(tmp_path / "r").checkpoint_path)[0]["epoch"] == 2
    t2 = Trainer(tiny_model(seed=5), tmp_path / "r", resume=True, progress=False)
    evaluated = []
    real_evaluate = trainer_module.evaluate
    monkeypatch.setattr(trainer_module, "evaluate", lambda *a, **k: (evaluated.append(1), real_evaluate(*a, **k))[1])
    m = t2.fit_task(0, train, val, 2)
    assert len(evaluated) == 2  # the restored model, then the rebuilt one
    assert m["train_acc"] is not None
    for key in ("val_acc", "val_correct", "train_acc", "train_loss", "pool_usage"):
        assert m[key] == ref[key], key
    assert RunDir(tmp_path / "r").read().tasks[0].sha256 == RunDir(tmp_path / "ref").read().tasks[0].sha256


def test_checkpoint_interval_skips_short_epochs_and_a_kill_then_restarts_the_stage(tmp_path, monkeypatch):
    """``checkpoint_interval``: epochs shorter than it write no checkpoint; a run killed before its
    first one restarts the stage and packs what an uninterrupted run packs, bit for bit."""
    cfg = tiny_config(epochs=2, checkpoint_interval=1e9)
    train, val = blobs(32, 2, 1), blobs(16, 2, 2)
    ref = Trainer(tiny_model(), tmp_path / "ref", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    ref.fit_task(0, train, val, 2)
    written = []
    real_save = stage_module.save_checkpoint
    monkeypatch.setattr(
        stage_module, "save_checkpoint", lambda *a, **k: (written.append(k["epoch"]), real_save(*a, **k))
    )

    _killed_when_epoch_2_is_logged(monkeypatch, tmp_path / "r", cfg, train, val)  # no checkpoint written
    assert written == [] and not RunDir(tmp_path / "r").checkpoint_path.exists()
    t2 = Trainer(tiny_model(seed=5), tmp_path / "r", resume=True, progress=False)
    t2.fit_task(0, train, val, 2)
    assert not any(r.get("event") == "resumed" for r in RunDir(tmp_path / "r").read_log())  # restarted
    assert RunDir(tmp_path / "r").read().tasks[0].sha256 == RunDir(tmp_path / "ref").read().tasks[0].sha256
    # Interval 0: every epoch checkpoints (the pool-learning stage's and the task's).
    t3 = Trainer(tiny_model(), tmp_path / "r0", cfg.replace(checkpoint_interval=0), progress=False)
    t3.fit_task(0, train, val, 2)
    assert written == [1, 2]


@pytest.mark.parametrize("how", ["original", "random"])
def test_task_init_options(tmp_path, how):
    model = tiny_model()
    trainer = Trainer(
        model,
        tmp_path / "r",
        tiny_config(epochs=1, task_init=how),
        model_spec=SPEC,
        model_kwargs=KWARGS,
        progress=False,
    )
    trainer.fit_pools(blobs(32, 4, 1), num_classes=4)
    base = {l.name: l.weight.detach().clone() for l in nws_layers(trainer.model)}
    trainer.store.enter_task_state(trainer.model, None)
    trainer.store.init_weights(trainer.model, how, trainer.config.seed)
    changed = [not torch.equal(l.weight, base[l.name]) for l in nws_layers(trainer.model)]
    if how == "original":
        assert not any(changed)  # the weights right after pool learning
    else:
        assert all(changed)
    val = blobs(16, 2, 4)
    metrics = trainer.fit_task(0, blobs(32, 2, 3), val, 2)
    # The model rebuilt from the written pack scores what the trained model scored, image for image.
    assert metrics["val_total"] == 16 and metrics["val_acc"] == metrics["val_correct"] / 16
    assert metrics["rebuilt_acc"] == metrics["val_acc"]
    trainer.close()
    assert _correct(nwsconvert.load(tmp_path / "r", task=0), val, trainer) == metrics["val_correct"]


def test_ema_pool_update_moves_each_entry_toward_its_kernels_and_adam_steps(tmp_path, monkeypatch):
    """``pool_update=ema`` (paper Eq. 4): after every step, each layer's pools entries that kernels chose
    move toward the mean of those kernels, by a fraction in (0, 1], and the others stay; the pools take
    no gradient (buffers throughout). ``optimizer=adam`` steps with Adam, never SGD, at the cosine
    schedule's learning rate (2 epochs: 1x, then 0.5x)."""
    from nwsconvert.core.layers import NWSWeight

    moved, stayed, lrs = [], [], []
    ema_update = NWSWeight.ema_update

    def spy(self, weight, decay=0.99):
        assert self.mode == "task" and not isinstance(self.pool, torch.nn.Parameter)
        old = self.pool.detach().double().clone()
        vec = self._vectors(weight).detach().double()
        counts = torch.bincount(self.indices.long(), minlength=self.pool_size)
        mean = torch.zeros_like(old).index_add_(0, self.indices.long(), vec) / counts.clamp_min(1)[:, None]
        ema_update(self, weight, decay)
        step, toward = self.pool.detach().double() - old, mean - old
        chosen = counts > 0
        # Each chosen entry's step is a multiple t of (mean - old) with 0 < t <= 1: t from the projection,
        # and the step's component off that line within float32 rounding of the entry's size.
        t = (step * toward).sum(1) / toward.square().sum(1).clamp_min(1e-30)
        off = (step - t[:, None] * toward).norm(dim=1)
        tol = 1e-6 * (old.norm(dim=1) + mean.norm(dim=1)) + 1e-12
        keep = chosen & (toward.norm(dim=1) > 1e-6 * old.norm(dim=1).clamp_min(1e-3))  # entries far from their mean
        moved.append(bool((off[keep] <= tol[keep]).all() and (t[keep] > 0).all() and (t[keep] <= 1 + 1e-5).all()))
        stayed.append(bool((step[~chosen].norm(dim=1) <= tol[~chosen]).all()))

    sgd_steps = []
    monkeypatch.setattr(NWSWeight, "ema_update", spy)
    monkeypatch.setattr(torch.optim.SGD, "step", lambda *a, **k: sgd_steps.append(1))
    adam_step = torch.optim.Adam.step

    def adam_spy(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"] / self.param_groups[0]["lr_scale"])
        return adam_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", adam_spy)
    cfg = tiny_config(pool_update="ema", optimizer="adam", lr=0.001, schedule="cosine", pool_epochs=2)
    trainer = Trainer(tiny_model(), tmp_path / "r", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    trainer.fit_pools(blobs(32, 4, 1), num_classes=4)
    layers = len(nws_layers(trainer.model))
    assert sgd_steps == [] and lrs == [0.001, 0.001, 0.0005, 0.0005]  # 32 images, batches of 16, 2 epochs
    assert len(moved) == 4 * layers and all(moved) and all(stayed)
    assert RunDir(tmp_path / "r").read().pools.sha256 == nwsconvert.pool_set(trainer.model).sha256
    trainer.close()


def test_gradient_pool_learning_moves_pools_and_reseeds(tmp_path, monkeypatch):
    """Pools learn by gradient; after every epoch but the last, entries no kernel chose are reseeded, each
    onto a kernel of its layer, so that it is used again: at that moment it is the nearest pool vector
    (float64 brute force) of some kernel. The log counts them."""
    from nwsconvert.core.layers import NWSWeight

    reseeded, unused_after = [], []
    reseed = NWSWeight.reseed_unused

    def spy(self, weight, generator=None):
        dead = (torch.bincount(self.indices.long(), minlength=self.pool_size) == 0).nonzero().squeeze(1)
        n = reseed(self, weight, generator)
        vec, pool = self._vectors(weight).detach().double(), self.pool.detach().double()
        nearest = set(((vec[:, None, :] - pool[None]) ** 2).sum(-1).argmin(1).tolist())
        reseeded.append(n)
        unused_after.extend(int(e) for e in dead[:n] if int(e) not in nearest)
        return n

    monkeypatch.setattr(NWSWeight, "reseed_unused", spy)
    model = tiny_model()
    before = nwsconvert.pool_set(model).sha256
    trainer = Trainer(
        model, tmp_path / "r", tiny_config(pool_epochs=3), model_spec=SPEC, model_kwargs=KWARGS, progress=False
    )
    trainer.fit_pools(blobs(64, 4, 1), num_classes=4)
    assert RunDir(tmp_path / "r").read().pools.sha256 != before
    assert all(l.nws.mode == "task" for l in nws_layers(trainer.model))  # pools frozen again afterwards
    log = [
        r
        for r in RunDir(tmp_path / "r").read_log()
        if r.get("stage") == "pools" and "train_loss" in r and "event" not in r
    ]
    layers = len(nws_layers(trainer.model))
    assert len(log) == 3 and "reseeded" not in log[-1] and len(reseeded) == 2 * layers
    assert [r["reseeded"] for r in log[:-1]] == [sum(reseeded[:layers]), sum(reseeded[layers:])]
    assert sum(reseeded) > 0 and unused_after == []
    trainer.close()


def test_metrics_log_survives_a_cut_line(tmp_path):
    run = RunDir(tmp_path)
    run.log({"a": 1})
    with open(run.log_path, "a") as f:
        f.write('{"b": ')  # a kill in the middle of a line
    assert run.read_log() == [{"a": 1}]


def test_manifest_errors_name_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        nwsconvert.load(tmp_path / "missing", task=0)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        nwsconvert.load(tmp_path, task=0)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "nwsconvert.run", "version": 99}))
    with pytest.raises(nwsconvert.FormatError, match="newer"):
        nwsconvert.load(tmp_path, task=0)


@pytest.mark.parametrize("how", ["pools", "task0", "none"])
def test_pack_base_options(tmp_path, how):
    """``pack_base`` decides what the packs are delta-coded against; every choice decodes to the same
    indices as the trained model, and a task's base is never delta-coded itself."""
    trainer = Trainer(
        tiny_model(),
        tmp_path / "r",
        tiny_config(epochs=1, pack_base=how),
        model_spec=SPEC,
        model_kwargs=KWARGS,
        progress=False,
    )
    trained = []
    for t in range(2):
        trainer.fit_task(t, blobs(32, 2, 5 + t), blobs(16, 2, 7 + t), 2)
        trained.append(nwsconvert.extract_task(trainer.model, state_dtype=trainer.config.state_dtype).content_sha256())
    want = {"pools": ["base.nwspack", "base.nwspack"], "task0": [None, "task_0.nwspack"], "none": [None, None]}[how]
    for t in range(2):
        pack = TaskPack.load(tmp_path / "r" / "tasks" / f"task_{t}.nwspack")
        assert (pack.base.source.name if pack.base is not None else None) == want[t]
        assert pack.base is None or pack.base.base_sha256 is None
        assert pack.content_sha256() == trained[t]
    if how == "pools":  # task 0 keeps most of the choices made in pool learning: stored as changes
        assert any(
            c.startswith("delta")
            for c in TaskPack.load(tmp_path / "r" / "tasks" / "task_0.nwspack").layer_codings().values()
        )
    with pytest.raises(ValueError, match="pack_base"):
        tiny_config(pack_base="task1")


class DefaultNet(torch.nn.Sequential):
    """A user's own model class whose constructor needs no arguments."""

    def __init__(self, num_classes: int = 3):
        super().__init__(
            torch.nn.Conv2d(1, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, num_classes)
        )


def test_recorded_spec_of_a_plain_class_rebuilds_it_or_says_what_to_do():
    from nwsconvert.formats.packs import model_spec_of
    from nwsconvert.train.specs import build_model

    spec = model_spec_of(DefaultNet())
    assert spec == f"{__name__}:DefaultNet"
    with pytest.raises(nwsconvert.UntrustedCodeError, match="trust_code=True"):
        build_model(spec, num_classes=5)  # a spec from a file imports code only when the caller says so
    assert isinstance(build_model(spec, trust_code=True, num_classes=5), DefaultNet)
    import torchvision

    spec = model_spec_of(torchvision.models.resnet18())  # ResNet(block, layers, ...) needs arguments
    assert spec == "torchvision.models.resnet:ResNet"
    with pytest.raises(ValueError, match="model=") as e:
        build_model(spec, trust_code=True, num_classes=5)
    assert "torchvision.models.resnet:ResNet" in str(e.value)


def test_a_diverging_stage_stops_with_one_line(tmp_path):
    """The running loss is read back every few steps and at the end of each epoch: a NaN or inf stops the stage."""
    trainer = Trainer(
        tiny_model(),
        tmp_path / "r",
        tiny_config(epochs=2, lr=1e30),
        model_spec=SPEC,
        model_kwargs=KWARGS,
        progress=False,
    )
    with pytest.raises(FloatingPointError, match=r"task:0: loss is (nan|inf) at epoch 1: lower the learning rate"):
        trainer.fit_task(0, blobs(32, 2, 1), blobs(16, 2, 2), 2)


def _kernels(model) -> dict:
    """The temporary weights W of every NWS layer but the head."""
    return {l.name: l.weight.detach().clone() for l in nws_layers(model) if l.nws.role != "head"}


@pytest.mark.parametrize("search", ["layer", "engine"])
def test_head_epochs_train_the_head_and_batchnorm_first(tmp_path, search):
    """``head_epochs``: the first epochs of a task leave every temporary kernel where task_init put it
    (so its index, the nearest pool entry, stays too: linear probing) and train BatchNorm and the
    head; the epochs after train everything."""
    data = (blobs(48, 2, 3), blobs(16, 2, 4))
    runs = {}
    for head_epochs in (2, 1):
        trainer = Trainer(
            tiny_model(),
            tmp_path / f"h{head_epochs}",
            tiny_config(epochs=2, head_epochs=head_epochs, search=search),
            model_spec=SPEC,
            model_kwargs=KWARGS,
            progress=False,
        )
        trainer.fit_pools(blobs(64, 4, 1), num_classes=4)
        start = _kernels(trainer.model)
        bn = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "bn" in n}
        metrics = trainer.fit_task(0, *data, 2)
        assert metrics["rebuilt_acc"] == metrics["val_acc"]
        assert all(p.requires_grad for p in trainer.model.parameters())  # unfrozen after the stage
        end = _kernels(trainer.model)
        same = [torch.equal(start[n], end[n]) for n in start]
        runs[head_epochs] = same
        assert any(not torch.equal(p, bn[n]) for n, p in trainer.model.named_parameters() if n in bn)
        log = [r for r in trainer.run.read_log() if r.get("stage") == "task:0" and "head_only" in r]
        assert [r["head_only"] for r in log] == [True, head_epochs == 2]
    assert all(runs[2])  # two epochs of two head-only: no kernel moved
    assert not all(runs[1])  # one of two: the second epoch moved kernels


def test_a_run_killed_after_its_head_epochs_resumes_as_the_uninterrupted_run(tmp_path, monkeypatch):
    cfg = tiny_config(epochs=2, head_epochs=1)
    train, val = blobs(32, 2, 1), blobs(16, 2, 2)
    ref = Trainer(tiny_model(), tmp_path / "ref", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    ref.fit_task(0, train, val, 2)

    class Killed(BaseException):
        pass

    real_log = StageContext.log

    def log(self, record):
        if record.get("stage") == "task:0" and record.get("epoch") == 1 and "train_loss" in record:
            raise Killed  # epoch 1 (head only) checkpointed, nothing after it
        real_log(self, record)

    monkeypatch.setattr(StageContext, "log", log)
    t1 = Trainer(tiny_model(), tmp_path / "r", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    with pytest.raises(Killed):
        t1.fit_task(0, train, val, 2)
    assert all(p.requires_grad for p in t1.model.parameters())  # unfrozen on the way out too
    t1.close()
    monkeypatch.setattr(StageContext, "log", real_log)
    t2 = Trainer(tiny_model(seed=5), tmp_path / "r", resume=True, progress=False)
    t2.fit_task(0, train, val, 2)
    assert RunDir(tmp_path / "r").read().tasks[0].sha256 == RunDir(tmp_path / "ref").read().tasks[0].sha256


def test_head_epochs_at_most_epochs_and_not_in_pool_learning():
    with pytest.raises(UsageError, match="head_epochs=4 is more than epochs=3"):
        TrainConfig(epochs=3, head_epochs=4)
    assert TrainConfig(epochs=3, head_epochs=3, pool_epochs=1).for_pools().head_epochs == 0


@pytest.mark.parametrize("recalibrate", [True, False])
def test_recalibrate_bn_gives_the_statistics_of_the_final_kernels(tmp_path, recalibrate):
    """``recalibrate_bn``: after the last epoch the first BatchNorm holds the mean and unbiased
    variance of its input over the training data (one batch here), computed from the kernels the
    task ended with; without it, a moving average that still carries the starting statistics."""
    train = blobs(48, 2, 3)
    cfg = tiny_config(epochs=2, batch_size=64, recalibrate_bn=recalibrate, state_dtype="float32")
    trainer = Trainer(tiny_model(), tmp_path / "r", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    metrics = trainer.fit_task(0, train, blobs(16, 2, 4), 2)
    assert metrics["rebuilt_acc"] == metrics["val_acc"]
    model = trainer.model.eval()
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))  # the stem's first conv,
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))  # and the BatchNorm after it
    with torch.no_grad():
        a = conv(train.tensors[0].to(next(model.parameters()).device))
    mean, var = a.mean((0, 2, 3)), a.transpose(0, 1).reshape(a.shape[1], -1).var(1, unbiased=True)
    # float32 sums over 48 x 16 x 16 values in two orders (BatchNorm's kernel, the reference): 1e-5.
    close = torch.allclose(bn.running_mean, mean, atol=1e-5) and torch.allclose(
        bn.running_var, var, rtol=1e-5, atol=1e-5
    )
    assert close == recalibrate


def test_a_recorded_configuration_keeps_the_behaviour_of_options_it_predates():
    """A manifest written before ``recalibrate_bn`` ran without it; a new job gets today's default."""
    from nwsconvert.zoo import get_recipe

    assert TrainConfig.from_recorded({"epochs": 3}).recalibrate_bn is False
    assert TrainConfig.from_recorded({"epochs": 3, "recalibrate_bn": True}).recalibrate_bn is True
    assert TrainConfig.from_dict({"epochs": 3}).recalibrate_bn is True
    assert get_recipe("demo").recalibrate_bn is True


def test_head_lr_scale_gives_the_head_norms_and_biases_their_own_rate(tmp_path, monkeypatch):
    """``head_lr_scale``: a task's optimiser trains the temporary kernels at ``lr`` and the head,
    BatchNorm and biases at ``lr * head_lr_scale``; pool learning keeps one rate."""
    from nwsconvert.train import stage
    from nwsconvert.train.heads import feature_weights, find_head

    made = []

    def spy(model, cfg):
        made.append(opt := make_optimizer(model, cfg))
        return opt

    make_optimizer = stage.make_optimizer
    monkeypatch.setattr(stage, "make_optimizer", spy)
    trainer = train_run(tmp_path / "r", tasks=(3,), head_lr_scale=4.0)
    pools, task = made
    assert [g["lr_scale"] for g in pools.param_groups] == [1.0]
    kernels, rest = task.param_groups
    assert (kernels["lr_scale"], rest["lr_scale"]) == (1.0, 4.0)
    assert (kernels["lr"], rest["lr"]) == (0.05, 0.2)  # tiny_config's lr; epoch 0, before the milestone
    model = trainer.model
    assert {id(p) for p in kernels["params"]} == {id(p) for p in feature_weights(model)}
    head = {id(p) for p in find_head(model)[1].parameters()}
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    assert head | norms <= {id(p) for p in rest["params"]}


@pytest.mark.parametrize("older", [False, True])
def test_a_killed_task_with_head_lr_scale_resumes_to_the_uninterrupted_pack(tmp_path, monkeypatch, older):
    """A task killed after a checkpoint resumes with the run's ``head_lr_scale`` and packs what an
    uninterrupted run packs, bit for bit; also from a checkpoint written before the option, whose
    optimiser groups carry no ``lr_scale`` (torch's ``load_state_dict`` keeps only what the file holds)."""
    from nwsconvert.train import stage

    cfg = tiny_config(epochs=2, head_lr_scale=4.0)
    train, val = blobs(32, 2, 1), blobs(16, 2, 2)
    Trainer(tiny_model(), tmp_path / "ref", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False).fit_task(
        0, train, val, 2
    )

    class Killed(BaseException):
        pass

    real_log = StageContext.log

    def log(self, record):
        if record.get("stage") == "task:0" and record.get("epoch") == 1 and "train_loss" in record:
            raise Killed  # epoch 1's checkpoint is on disk
        real_log(self, record)

    monkeypatch.setattr(StageContext, "log", log)
    t1 = Trainer(tiny_model(), tmp_path / "r", cfg, model_spec=SPEC, model_kwargs=KWARGS, progress=False)
    with pytest.raises(Killed):
        t1.fit_task(0, train, val, 2)
    t1.close()
    monkeypatch.setattr(StageContext, "log", real_log)
    assert load_checkpoint(RunDir(tmp_path / "r").checkpoint_path)[0]["epoch"] == 1
    if older:

        def without_scales(path):
            header, model_state, opt_state = load_checkpoint(path)
            for group in opt_state["param_groups"]:
                del group["lr_scale"]
            return header, model_state, opt_state

        monkeypatch.setattr(stage, "load_checkpoint", without_scales)
    Trainer(tiny_model(seed=5), tmp_path / "r", resume=True, progress=False).fit_task(0, train, val, 2)
    assert RunDir(tmp_path / "r").read().tasks[0].sha256 == RunDir(tmp_path / "ref").read().tasks[0].sha256


def test_task_starts_reuse_the_first_search_and_write_the_same_packs(tmp_path, monkeypatch):
    """Under ``task_init=original`` every task starts from the weights pool learning ended with: the first
    task start searches them, later ones restore that search (and the base weights and base pack are read
    once, the rebuild check reuses the model it built, and the state the previous task ended in is the
    model's own, not read back from its pack). The packs are those of a run that searches and reads
    everything again at each task start, tensor for tensor."""
    from nwsconvert.core.layers import NWSWeight
    from nwsconvert.train.store import RunStore

    assert TrainConfig().task_init == "original"
    searched = []
    full_search = NWSWeight.full_search
    monkeypatch.setattr(NWSWeight, "full_search", lambda self, w: (searched.append(self), full_search(self, w))[1])
    cached = train_run(tmp_path / "cached", tasks=(3, 2, 3))
    per_run = len(searched)
    layers = len(nws_layers(cached.model))

    def again(self, layers, pools):  # every task start searches, as before the cache
        for layer in layers:
            layer.nws.full_search(layer.weight)

    monkeypatch.setattr(RunStore, "_start_search", again)
    monkeypatch.setattr(RunStore, "holds", lambda self, model, task: False)  # and reads the previous pack
    searched.clear()
    train_run(tmp_path / "fresh", tasks=(3, 2, 3))
    assert len(searched) - per_run == 2 * (layers - 1)  # tasks 1 and 2: every layer but the resized head
    packs = [[t.sha256 for t in RunDir(tmp_path / name).read().tasks] for name in ("cached", "fresh")]
    assert packs[0] == packs[1] and len(packs[0]) == 3


def test_pool_usage_is_the_mean_share_of_entries_some_kernel_selects():
    """``pool_usage``: per NWS layer, the distinct selected entries over the pool size, averaged; counted
    per entry (no sort), exactly what the distinct-values count gives, with indices set by hand."""
    from nwsconvert.train.evaluation import pool_usage

    model = tiny_model(pool_size=32)
    layers = nws_layers(model)
    want = []
    for i, layer in enumerate(layers):
        idx = layer.nws.indices
        idx.copy_(
            torch.arange(idx.numel(), dtype=idx.dtype) % (i + 1)
        )  # entries 0..i, when there are that many kernels
        want.append(torch.unique(idx).numel() / layer.nws.pool_size)
    assert pool_usage(model) == sum(want) / len(want)
    assert len(set(want)) > 1  # the layers differ: a mean, not one layer's figure


def test_a_tasks_last_validation_is_of_the_stored_state_and_the_check_evaluates_only_the_rebuilt_model(
    tmp_path, monkeypatch
):
    """A task's last epoch rounds its state to what the pack stores (float16 by default) before validating
    it, so that validation is the stored task's: the trainer's check then evaluates only the model rebuilt
    from the pack (one evaluation a task, not two), records the last epoch's figures as ``val_acc``, and
    the rebuilt model scores them exactly. The packs are those of evaluating again (every pack byte equal)."""
    from nwsconvert.train import stage as stage_mod
    from nwsconvert.train import trainer as trainer_mod

    calls = {"stage": [], "trainer": 0}
    real = stage_mod.evaluate

    def in_stage(model, *a, **k):
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        calls["stage"].append(bn.running_var.clone())  # the state this validation saw
        return real(model, *a, **k)

    def in_trainer(*a, **k):
        calls["trainer"] += 1
        return real(*a, **k)

    monkeypatch.setattr(stage_mod, "evaluate", in_stage)
    monkeypatch.setattr(trainer_mod, "evaluate", in_trainer)
    trainer = train_run(tmp_path / "run", tasks=(3, 2))  # one epoch a task: its last
    assert calls["trainer"] == 2  # the rebuilt model of each task, nothing else
    run = RunDir(tmp_path / "run")
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for t in (0, 1):
        last = [r for r in logged if r.get("stage") == f"task:{t}" and r.get("epoch") == 1]
        metrics = trainer.manifest.task(t).metrics
        assert last and metrics["val_acc"] == last[-1]["val_acc"] == metrics["rebuilt_acc"]
        assert metrics["val_correct"] == last[-1]["val_correct"]
    seen = calls["stage"][-1].cpu()  # task 1's last validation (on the trainer's device; packs load on the CPU)
    assert torch.equal(seen, seen.half().float())  # float16 values: the rounded state
    pack = TaskPack.load(run.task_path(run.read(), 1))
    key = next(k for k in pack.state if k.endswith("running_var"))
    assert torch.equal(pack.state[key].float(), seen)
    # Without the rounding before the last validation, and the reuse, the packs are the same bytes.
    monkeypatch.setattr(stage_mod, "round_state_", lambda model, dtype: model)
    real_finish = trainer_mod.Trainer._finish_task

    def finish_evaluating(self, task, val, num_classes, meta, record, seconds):
        record = {k: v for k, v in record.items() if k != "val_correct"}  # as a record written before the reuse
        return real_finish(self, task, val, num_classes, meta, record, seconds)

    monkeypatch.setattr(trainer_mod.Trainer, "_finish_task", finish_evaluating)
    other = train_run(tmp_path / "again", tasks=(3, 2))
    again = RunDir(tmp_path / "again")
    for t in (0, 1):
        a = TaskPack.load(run.task_path(run.read(), t))
        b = TaskPack.load(again.task_path(again.read(), t))
        assert a.content_sha256() == b.content_sha256()
    assert other.manifest.task(1).metrics["val_correct"] == trainer.manifest.task(1).metrics["val_correct"]
