"""The baselines NWS is compared with (benchmarks/baselines.py): what each stores is what it evaluates.

For every method, on a small timm model and separable tasks: the accuracy of a task
re-loaded from the stored files equals the accuracy of the model that was trained
(exactly: the same tensors); the memory it reports is the bytes of its files, and its
paper accounting is the floats it stored at 32 bits (plus PackNet's owner map);
PackNet's earlier tasks score exactly the same after later tasks were learnt.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from baselines import FREE, BNHead, DenseFinetune, LoRA4, PackNet, Piggyback  # noqa: E402
from trainer_utils import blobs, tiny_config  # noqa: E402

from nwsconvert import evaluate  # noqa: E402


class _Task:
    def __init__(self, classes: int, seed: int):
        self.num_classes = classes
        self.train = blobs(48, classes, seed)
        self.test = blobs(24, classes, seed + 100)


@pytest.fixture(scope="module")
def pretrained():
    torch.manual_seed(0)
    return timm.create_model("test_resnet", num_classes=3, in_chans=1)


TASKS = [_Task(3, 1), _Task(2, 2), _Task(4, 3)]


@pytest.mark.parametrize("cls", [DenseFinetune, BNHead, PackNet, Piggyback, LoRA4])
def test_a_stored_task_scores_what_was_trained(cls, pretrained, tmp_path):
    method = cls(pretrained, tmp_path, tiny_config(epochs=2), seed=1993)
    for t, task in enumerate(TASKS):
        acc = method.learn(t, task)
        trained = evaluate(method.model, task.test)["acc"]
        assert acc == trained  # re-loaded from the files: the same tensors, the same predictions
        # The reloaded model's logits are the trained model's, bit for bit.
        x = task.test.tensors[0][:8]
        method.model.eval()
        with torch.no_grad():
            assert torch.equal(method.load(t)(x), method.model(x))
    memory = method.memory()
    assert memory["disk_bytes"] == sum(f.stat().st_size for f in tmp_path.iterdir() if f.suffix == ".safetensors")
    # What the paper counts is what the files hold, less their headers and the slack of byte-wide masks
    # (measured: 84 % of the bytes for PackNet's, 98-99 % for the others); the exact counts per method
    # are checked in test_memory_accounting_counts_what_is_stored and test_piggyback_and_lora_store_bits_and_adapters.
    assert 0.8 * memory["disk_bytes"] <= memory["paper_bits"] / 8 <= memory["disk_bytes"]


@pytest.mark.parametrize("cls", [DenseFinetune, BNHead, PackNet, Piggyback, LoRA4])
def test_head_lr_scale_reaches_every_baseline(cls, pretrained, tmp_path, monkeypatch):
    """``head_lr_scale`` as in the NWS trainer: each method's head and BatchNorm parameters train at
    ``lr * head_lr_scale``, its weights of two or more dimensions outside the head (kernels, PackNet's
    free weights, Piggyback's mask scores, LoRA's factors) at ``lr``."""
    import baselines

    from nwsconvert.train.heads import find_head

    seen = []

    def spy(model, params, cfg):
        groups = param_groups(model, params, cfg)
        seen.append((model, groups))
        return groups

    param_groups = baselines.param_groups
    monkeypatch.setattr(baselines, "param_groups", spy)
    cls(pretrained, tmp_path, tiny_config(epochs=1, head_lr_scale=4.0), seed=1993).learn(0, TASKS[0])
    model, groups = seen[-1]
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    head = [p for p in find_head(model)[1].parameters() if p.requires_grad]
    norms = [p for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()]
    assert head and all(scale[id(p)] == 4.0 for p in head + norms)
    others = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2 and id(p) not in map(id, head)]
    assert all(scale[id(p)] == 1.0 for p in others) and (others or cls is BNHead)


@pytest.mark.parametrize("cls", [DenseFinetune, BNHead, PackNet, Piggyback, LoRA4])
def test_recalibrated_statistics_are_the_final_weights_and_are_stored(cls, pretrained, tmp_path):
    """``recalibrate_bn``, as in the NWS trainer: after a task the first BatchNorm holds the mean and
    unbiased variance of its input over the training data (one batch here), and the stored task
    reloads to the same logits."""
    method = cls(pretrained, tmp_path, tiny_config(epochs=2, batch_size=64, recalibrate_bn=True), seed=1993)
    for t, task in enumerate(TASKS[:2]):
        assert method.learn(t, task) == evaluate(method.model, task.test)["acc"]
        model = method.model.eval()
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        seen: list[torch.Tensor] = []
        hook = bn.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0].detach()))
        with torch.no_grad():
            logits = model(task.train.tensors[0])
        hook.remove()
        a = seen[0]
        mean, var = a.mean((0, 2, 3)), a.transpose(0, 1).reshape(a.shape[1], -1).var(1, unbiased=True)
        # float32 sums over 48 x 16 x 16 values in two orders (BatchNorm's kernel, the reference): 1e-5.
        assert torch.allclose(bn.running_mean, mean, atol=1e-5)
        assert torch.allclose(bn.running_var, var, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            assert torch.equal(method.load(t)(task.train.tensors[0]), logits)


def test_memory_accounting_counts_what_is_stored(pretrained, tmp_path):
    """Paper accounting: 32 bits per stored float (counters excluded), PackNet's owner map at ceil(log2(T + 1)) bits."""
    params = sum(p.numel() for p in pretrained.parameters())
    bn = sum(
        m.weight.numel() * 4 for m in pretrained.modules() if isinstance(m, torch.nn.BatchNorm2d)
    )  # weight, bias, mean, var
    head_in = pretrained.get_classifier().in_features
    heads = [head_in * task.num_classes + task.num_classes for task in TASKS]
    backbone = params - (head_in * 3 + 3)

    dense = DenseFinetune(pretrained, tmp_path / "dense", tiny_config(epochs=1), seed=1)
    bnhead = BNHead(pretrained, tmp_path / "bn", tiny_config(epochs=1), seed=1)
    packnet = PackNet(pretrained, tmp_path / "pn", tiny_config(epochs=1), seed=1)
    for t, task in enumerate(TASKS):
        for m in (dense, bnhead, packnet):
            m.learn(t, task)
    running = sum(m.running_mean.numel() * 2 for m in pretrained.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert dense.memory()["paper_bits"] == 32 * sum(backbone + running + h for h in heads)
    affine = bn - running
    assert bnhead.memory()["paper_bits"] == 32 * (backbone - affine) + 32 * sum(bn + h for h in heads)
    weights = sum(packnet.owner[n].numel() for n in packnet.prunable)
    others = backbone + running - weights  # BatchNorm, biases: per task
    assert packnet.memory()["paper_bits"] == (32 + math.ceil(math.log2(len(TASKS) + 1))) * weights + 32 * sum(
        others + h for h in heads
    )


def test_piggyback_and_lora_store_bits_and_adapters(pretrained, tmp_path):
    """Piggyback: one bit per backbone weight per task; LoRA r=4: r * (fan-in + fan-out) per adapted layer."""
    head = pretrained.get_classifier()
    heads = [head.in_features * task.num_classes + task.num_classes for task in TASKS]
    convs = [m for m in pretrained.modules() if isinstance(m, torch.nn.Conv2d)]
    weights = sum(m.weight.numel() for m in convs)
    small = sum(p.numel() for n, p in pretrained.named_parameters() if p.dim() < 2 and not n.startswith("fc."))
    running = sum(m.running_mean.numel() * 2 for m in pretrained.modules() if isinstance(m, torch.nn.BatchNorm2d))
    piggy = Piggyback(pretrained, tmp_path / "pb", tiny_config(epochs=1), seed=1)
    lora = LoRA4(pretrained, tmp_path / "lora", tiny_config(epochs=1), seed=1)
    for t, task in enumerate(TASKS):
        piggy.learn(t, task)
        lora.learn(t, task)
    assert piggy.memory()["paper_bits"] == 32 * weights + sum(weights + 32 * (small + running + h) for h in heads)
    adapters = sum(4 * (m.in_channels * m.kernel_size[0] * m.kernel_size[1] + m.out_channels) for m in convs)
    bn = running + sum(m.weight.numel() * 2 for m in pretrained.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert lora.memory()["paper_bits"] == 32 * (weights + small + running) + sum(
        32 * (adapters + bn + h) for h in heads
    )


def test_fit_does_not_depend_on_the_global_generator_it_finds():
    """A model with dropout trains to the same weights whatever ran before it in the process
    (EfficientNet-Lite0 has dropout and drop connect: without this a baseline's row changed with
    the methods run before it)."""
    from baselines import fit

    torch.manual_seed(0)
    start = timm.create_model("test_resnet", num_classes=3, in_chans=1, drop_rate=0.5)
    task = TASKS[0]
    trained = []
    for noise in (1, 2):
        model = copy.deepcopy(start)
        torch.manual_seed(noise)  # what an earlier method would leave behind
        fit(model, task.train, tiny_config(), 2, 0.05, seed=11)
        trained.append(model.state_dict())
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    torch.manual_seed(1)
    other = copy.deepcopy(start)
    fit(other, task.train, tiny_config(), 2, 0.05, seed=12)  # the seed, not the ambient state, decides
    assert not all(torch.equal(trained[0][k], v) for k, v in other.state_dict().items())


def test_packnet_never_changes_an_earlier_task(pretrained, tmp_path):
    method = PackNet(pretrained, tmp_path, tiny_config(epochs=2), seed=7)
    scores, logits = [], []
    for t, task in enumerate(TASKS):
        scores.append(method.learn(t, task))
        with torch.no_grad():
            logits.append(method.load(t)(task.test.tensors[0]))
    for t, task in enumerate(TASKS):  # after every later task: the same accuracy and the same logits
        assert method.evaluate(t, task.test) == scores[t]
        with torch.no_grad():
            assert torch.equal(method.load(t)(task.test.tensors[0]), logits[t])
    # Each task kept 40 % of the weights still free when it came; the rest stays free.
    for n in method.prunable:
        owner = method.owner[n]
        left = owner.numel()
        for t in range(len(TASKS)):
            kept = int((owner == t).sum())
            assert kept == round(0.4 * left)
            left -= kept
        assert int((owner == FREE).sum()) == left
    with pytest.raises(ValueError, match="prune"):
        PackNet(pretrained, tmp_path / "x", tiny_config(), seed=1, prune=1.0)


def test_split_cifar100_benchmark_runs_every_method_on_a_fake_archive(tmp_path, capsys):
    """``accuracy.py --suite split-cifar100 suite.path=... --methods all``: the paper's recipe unless told
    otherwise, every method, the paper's table printed beside ours (shortened: 2 tasks, 2 epochs, one of
    pretraining)."""
    import json

    import accuracy
    from fake_cifar import write_fake_cifar100

    archive = write_fake_cifar100(tmp_path / "cifar-100-python.tar.gz", per_class=6)
    out = tmp_path / "acc.json"
    argv = [
        f"suite.path={archive}",
        "tasks=2",
        "epochs=2",
        "pool_epochs=1",
        "pool_size=16",
        "batch_size=8",
        "model=timm:test_resnet",
        "--suite",
        "split-cifar100",
        "--seeds",
        "1993",
        "--json",
        str(out),
        "--methods",
        "all",
        "--nws-variants",
        "task_init=original,beta=0.1",
    ]
    assert accuracy.main(argv) == 0
    result = json.loads(out.read_text())
    variant = "nws[task_init=original,beta=0.1]"
    assert result["methods"] == ["nws", variant, "dense", "bn_head", "packnet", "piggyback", "lora4", "lora16"]
    assert result["job"]["recipe"] == "split-cifar100" and result["job"]["epochs"] == 2
    assert result["variants"] == {variant: "task_init=original,beta=0.1"}
    for m in result["methods"]:
        row = result["rows"][0][m]
        # The fake archive's classes are told apart by a square's place: every method learns its 5-way
        # tasks (chance: 20 %) from 6 images a class in 2 epochs. On the CPU the lowest task is 30 %
        # (Piggyback's first) and the lowest mean 40 %; on 30 test images a task, 25 % / 35 % floors
        # fail a method that learns nothing or is scored on another task's images.
        assert len(row["accs"]) == 2 and min(row["accs"]) >= 0.25 and sum(row["accs"]) / 2 >= 0.35, (m, row["accs"])
        assert row["disk_bytes"] > 0
        # Per-task curves: bytes on disk after each task, growing; a baseline's accuracy right after
        # each task equals its final re-evaluation (no method changes a stored task).
        curve = row["curve"]
        assert len(curve["disk_bytes"]) == len(curve["task_seconds"]) == 2
        assert 0 < curve["disk_bytes"][0] < curve["disk_bytes"][1] == row["disk_bytes"]  # files, every method
        if not m.startswith("nws"):
            assert curve["learned_accs"] == row["accs"] and row["pretrain_seconds"] > 0
    free = result["rows"][0]["packnet"]["curve"]["free_fraction"]
    assert free[0] == pytest.approx(0.6, abs=1e-3) and free[1] == pytest.approx(0.36, abs=1e-3)  # prune 0.6
    # Every method stores its two tasks in less than dense finetune's two models, and NWS in less than any peer.
    disk = {m: result["rows"][0][m]["disk_bytes"] for m in result["methods"]}
    assert max(v for m, v in disk.items() if m != "dense") < disk["dense"]
    assert disk["nws"] < min(v for m, v in disk.items() if not m.startswith("nws"))
    printed = capsys.readouterr().out
    assert "paper (Jiang & Celiktutan" in printed
    assert [ln.split()[:3] for ln in printed.splitlines() if ln.strip().startswith("KSM")] == [["KSM", "71.5", "192.5"]]
    nws_line = next(ln.split() for ln in printed.splitlines() if ln.strip().startswith("nws ") and "73.4" in ln)
    assert nws_line[3] == f"{result['mean']['nws']:.2f}"


def _stand_in_runs(monkeypatch, accuracy, figures) -> None:
    """``accuracy.py``'s runs replaced by ``figures(method, seed)`` (NWS as ``"nws"``), and no pretraining."""
    monkeypatch.setattr(accuracy, "nws_run", lambda job, seed, folder, peers_start: figures("nws", seed))
    monkeypatch.setattr(accuracy, "method_run", lambda name, pre, job, seed, folder: figures(name, seed))
    monkeypatch.setattr(accuracy, "pretrained_model", lambda job, seed: None)


def test_one_seed_methods_and_the_curves_plot(tmp_path, capsys, monkeypatch):
    """``--one-seed``: a method run on the first seed only, its mean over that seed; the per-task
    curves plot from the JSON (running means over the seeds that ran), and a JSON without curves is
    a one-line error. The runs are stand-ins: every method's real curves are checked above."""
    import json

    import accuracy
    import plot_curves

    def fake(name, seed):
        accs = [1.0, 0.9 if seed == 3 else 0.8]
        curve = {"learned_accs": accs, "disk_bytes": [10, 20], "task_seconds": [1.0, 1.0]}
        if name == "packnet":
            curve["free_fraction"] = [0.6, 0.36]
        return {
            "accs": accs,
            "avg": sum(accs) / 2,
            "seconds": 2.0,
            "disk_bytes": 20,
            "paper_bits": None,
            "curve": curve,
        }

    _stand_in_runs(monkeypatch, accuracy, fake)
    out = tmp_path / "r.json"
    argv = [
        "tasks=2",
        "--seeds",
        "3",
        "4",
        "--methods",
        "dense",
        "packnet",
        "--one-seed",
        "packnet",
        "--json",
        str(out),
    ]
    assert accuracy.main(argv) == 0
    result = json.loads(out.read_text())
    assert [sorted(r) for r in result["rows"]] == [["dense", "nws", "packnet", "seed"], ["dense", "nws", "seed"]]
    assert result["mean"]["packnet"] == 95.0 and result["mean"]["dense"] == 92.5 and result["one_seed"] == ["packnet"]
    curves = plot_curves.method_curves(result)
    assert curves["packnet"]["seeds"] == 1 and curves["nws"]["seeds"] == 2
    assert curves["nws"]["acc"][0] == pytest.approx([100.0, 92.5])  # running means of (100, 90) and (100, 80)
    assert curves["packnet"]["free"] == pytest.approx([60.0, 36.0])
    assert plot_curves.main([str(out), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    result["rows"][0]["dense"]["accs"] = [1.0, 0.5]  # a stored task that changed after it was learned
    with pytest.raises(ValueError, match=r"tasks \[1\] score otherwise at the end"):
        plot_curves.method_curves(result)
    for row in result["rows"]:
        for figures in row.values():
            if isinstance(figures, dict):
                figures.pop("curve")
    (tmp_path / "old.json").write_text(json.dumps(result))
    with pytest.raises(SystemExit):
        plot_curves.main([str(tmp_path / "old.json"), "--out", str(tmp_path / "d.png")])
    assert "no per-task curves" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        accuracy.main(["--methods", "dense", "--one-seed", "packnet"])
    assert "--one-seed packnet: not in --methods" in capsys.readouterr().err


def test_a_variant_with_weights_pretrained_starts_nws_from_the_baselines_model(tmp_path, monkeypatch):
    """``--nws-variants weights=pretrained,learn_pools=false``: the variant's nws-train job gets, as
    its ``weights=`` file, exactly the pretrained model the baselines start from."""
    import json

    import accuracy
    from safetensors.torch import load_file

    given = []
    real = accuracy.run_job

    def spy(job, **kwargs):
        if job.get("weights"):
            given.append((job, load_file(job["weights"])))
        return real(job, **kwargs)

    monkeypatch.setattr(accuracy, "run_job", spy)
    out = tmp_path / "acc.json"
    keys = ["model=timm:test_resnet", "pool_size=16", "epochs=1", "pool_epochs=1", "tasks=1", "batch_size=64"]
    argv = [*keys, "--seeds", "7", "--json", str(out), "--methods"]
    assert accuracy.main([*argv, "--nws-variants", "weights=pretrained,learn_pools=false"]) == 0
    result = json.loads(out.read_text())
    assert result["methods"] == ["nws", "nws[weights=pretrained,learn_pools=false]"]
    ((job, weights),) = given
    assert job["learn_pools"] is False
    start = accuracy.pretrained_model(accuracy.resolve_job(["suite=split-mnist", "progress=false", *keys]), 7)
    state = start.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)


def test_accuracy_plot_has_one_point_per_method(tmp_path, capsys):
    """plot_accuracy.py: mean and std over seeds per method, a PNG written; a missing file is a one-line error."""
    import json

    import plot_accuracy

    rows = [
        {"seed": s, "nws": {"avg": a, "disk_bytes": 3e6}, "dense": {"avg": b, "disk_bytes": 2e8}}
        for s, a, b in ((1, 0.80, 0.90), (2, 0.84, 0.90))
    ]
    result = {
        "suite": "split-mnist",
        "job": {"suite_options": {}, "recipe": "demo"},
        "methods": ["nws", "dense"],
        "rows": rows,
    }
    pts = {p["method"]: p for p in plot_accuracy.points(result)}
    assert pts["nws"]["acc"] == pytest.approx(82.0) and pts["nws"]["std"] == pytest.approx(math.sqrt(8.0))
    assert pts["dense"]["std"] == 0.0 and pts["dense"]["bytes"] == 2e8
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert plot_accuracy.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        plot_accuracy.main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "b.png")])
    (tmp_path / "no_recipe.json").write_text(json.dumps({**result, "job": {"suite_options": {}}}))
    with pytest.raises(SystemExit):
        plot_accuracy.main([str(tmp_path / "no_recipe.json"), "--out", str(tmp_path / "c.png")])
    assert "no_recipe.json: not an accuracy.py JSON (field job.recipe missing)" in capsys.readouterr().err


def test_accuracy_plot_tells_nws_variants_apart_and_labels_a_narrow_axis():
    """Two NWS variants in one panel get different markers and colours; a panel narrower than a
    decade labels its 2x and 5x minor ticks in bytes, not in matplotlib's ``3x10^6`` notation."""
    import plot_accuracy

    rows = [
        {
            "seed": 1,
            "nws": {"avg": 0.89, "disk_bytes": 2.0e7},
            "nws[group_size=4]": {"avg": 0.88, "disk_bytes": 3.5e6},
            "nws[learn_pools=false]": {"avg": 0.84, "disk_bytes": 1.9e7},
            "dense": {"avg": 0.88, "disk_bytes": 6.8e7},
        }
    ]
    methods = ["nws", "nws[group_size=4]", "nws[learn_pools=false]", "dense"]
    result = {"suite": "s", "job": {"suite_options": {}, "recipe": "demo"}, "methods": methods, "rows": rows}
    fig = plot_accuracy.figure([(Path("r.json"), result)])
    ax = fig.axes[0]
    styles = {c.get_label(): (c.lines[0].get_marker(), c.lines[0].get_color()) for c in ax.containers}
    assert styles["NWS group_size=4"] != styles["NWS learn_pools=false"]
    fig.canvas.draw()
    minor = {t.get_text() for t in ax.xaxis.get_minorticklabels() if t.get_text()}
    assert {"5 MB", "20 MB", "50 MB"} <= minor and not any("10^" in t or "times" in t for t in minor)


def test_accuracy_plot_merges_another_files_nws_rows_into_a_panel():
    """``A.json+B.json``: B's variants join A's panel under their own names (B's plain NWS left out
    when B ran A's job); a B of another job names the keys it changed; only seeds both hold remain."""
    import plot_accuracy

    def row(seed, nws, dense):
        return {"seed": seed, "nws": {"avg": nws, "disk_bytes": 3e6}, "dense": {"avg": dense, "disk_bytes": 2e8}}

    job = {"suite_options": {}, "recipe": "demo"}
    a = {"suite": "s", "job": job, "methods": ["nws", "dense"], "rows": [row(1, 0.8, 0.9), row(2, 0.7, 0.8)]}
    v = "nws[weights=pretrained]"
    b = {"suite": "s", "job": job, "methods": ["nws", v], "rows": [{"seed": 1, "nws": {"avg": 0.8}, v: {"avg": 0.85}}]}
    merged = plot_accuracy.merge(a, b)
    assert merged["methods"] == ["nws", v, "dense"]
    assert [r["seed"] for r in merged["rows"]] == [1] and merged["rows"][0][v] == {"avg": 0.85}
    c = {**b, "job": {**job, "epochs": 15}}
    merged = plot_accuracy.merge(a, c)
    assert merged["methods"] == ["nws", "nws[epochs=15]", "nws[epochs=15,weights=pretrained]", "dense"]
    assert merged["rows"][0]["nws[epochs=15,weights=pretrained]"] == {"avg": 0.85}


def test_accuracy_plot_names_the_task_init_of_an_older_nws_row():
    """The plain NWS point is labelled ``NWS`` when it ran today's default task initialisation and
    names ``task_init=previous`` when its JSON predates ``nws_config`` (it ran the old default) or
    recorded previous; a job that set task_init says which."""
    import plot_accuracy

    rows = [{"seed": 1, "nws": {"avg": 0.85, "disk_bytes": 3e6}}]
    old = {"suite": "s", "job": {"suite_options": {}, "recipe": "demo"}, "methods": ["nws"], "rows": rows}
    new = {**old, "nws_config": {"task_init": "original"}}
    set_in_job = {**old, "job": {"suite_options": {}, "recipe": "demo", "task_init": "random"}}
    labels = []
    for result in (old, new, set_in_job):
        ax = plot_accuracy.figure([(Path("r.json"), result)]).axes[0]
        labels.append(ax.containers[0].get_label())
    assert labels == ["NWS task_init=previous", "NWS", "NWS task_init=random"]


def test_accuracy_table_rows_and_gap_to_dense():
    """accuracy_table.py: one Markdown row per method, mean ± std, per-task means, the gap to dense."""
    import accuracy_table

    rows = [
        {
            "seed": s,
            "nws": {"accs": [a, 1.0], "avg": (a + 1.0) / 2, "seconds": 10, "disk_bytes": 3e6, "paper_bits": None},
            "dense": {"accs": [0.9, 0.9], "avg": 0.9, "seconds": 2, "disk_bytes": 2e8, "paper_bits": 1.6e9},
        }
        for s, a in ((1, 0.6), (2, 0.8))
    ]
    text = accuracy_table.table({"methods": ["nws", "dense"], "rows": rows})
    lines = text.splitlines()
    assert lines[2] == "| **NWS** | 85.00 ± 7.07 % | 70.0 / 100.0 | 3.00 MB (nws-info) | 3.00 MB | 10 s | -5.00 |"
    assert lines[3] == "| dense finetune | 90.00 ± 0.00 % | 90.0 / 90.0 | 200.00 MB | 200.00 MB | 2 s | +0.00 |"
    # Beside another run of the same seeds that holds NWS only: its mean and the change, "–" for dense.
    other = {"methods": ["nws"], "rows": [{**r, "nws": {**r["nws"], "avg": 0.75}} for r in rows]}
    lines = accuracy_table.table({"methods": ["nws", "dense"], "rows": rows}, other, "before").splitlines()
    assert lines[0].endswith("| method − dense, points | before |")
    assert lines[2].endswith("| -5.00 | 75.00 (+10.00) |") and lines[3].endswith("| +0.00 | – |")
    with pytest.raises(ValueError, match="different seeds"):
        accuracy_table.table({"methods": ["nws"], "rows": rows}, {"methods": ["nws"], "rows": rows[:1]})


def test_accuracy_resume_runs_only_what_the_json_lacks(tmp_path, monkeypatch):
    """accuracy.py writes after every method; ``--resume`` keeps those figures and runs the rest, refuses a
    JSON of another job (naming the key) and a command that would drop a method the JSON holds."""
    import json

    import accuracy

    calls, kill = [], [("bn_head", 1994)]

    class Killed(Exception):
        """Stands for the run being killed (SIGKILL cannot be caught in-process)."""

    def fake(name, seed):
        calls.append((name, seed))
        if (name, seed) in kill:
            kill.clear()
            raise Killed  # the run killed inside its second seed's last method
        return {
            "accs": [0.5, 0.7],
            "avg": 0.6 + seed % 10 / 100,
            "seconds": 1.0,
            "disk_bytes": 10,
            "paper_bits": None,
        }

    _stand_in_runs(monkeypatch, accuracy, fake)
    out = tmp_path / "acc.json"
    argv = [
        "epochs=1",
        "--suite",
        "split-mnist",
        "--json",
        str(out),
        "--seeds",
        "1993",
        "1994",
        "--methods",
        "dense",
        "bn_head",
    ]
    with pytest.raises(Killed):
        accuracy.main(argv)
    kept = json.loads(out.read_text())
    assert [r["seed"] for r in kept["rows"]] == [1993]
    assert sorted(kept["partial"]) == ["dense", "nws", "seed"] and kept["partial"]["seed"] == 1994
    calls.clear()
    assert accuracy.main([*argv, "--resume"]) == 0
    assert calls == [("bn_head", 1994)]  # nothing finished is run again
    result = json.loads(out.read_text())
    assert [r["seed"] for r in result["rows"]] == [1993, 1994] and "partial" not in result
    assert result["rows"][1]["nws"] == kept["partial"]["nws"]
    assert result["mean"]["bn_head"] == pytest.approx(100 * (0.63 + 0.64) / 2)

    calls.clear()  # more seeds later: the file's seeds are kept, only the new one runs
    assert (
        accuracy.main(
            [
                "epochs=1",
                "--suite",
                "split-mnist",
                "--json",
                str(out),
                "--seeds",
                "1995",
                "--methods",
                "dense",
                "bn_head",
                "--resume",
            ]
        )
        == 0
    )
    assert sorted(calls) == [("bn_head", 1995), ("dense", 1995), ("nws", 1995)]
    assert [r["seed"] for r in json.loads(out.read_text())["rows"]] == [1993, 1994, 1995]

    with pytest.raises(SystemExit, match="epochs"):
        accuracy.main(["epochs=2", *argv[1:], "--resume"])
    with pytest.raises(SystemExit):
        accuracy.main([*argv[:-1], "--resume"])  # would drop bn_head's figures
    assert calls == [("nws", 1995), ("dense", 1995), ("bn_head", 1995)]

    # A file written before the NWS options were recorded ran the default of its time, task_init=previous:
    # resuming it under today's default (original) is refused naming task_init; saying previous resumes it.
    old = json.loads(out.read_text())
    assert old["nws_config"]["task_init"] == "original" and old["nws_config"]["epochs"] == 1
    del old["nws_config"]
    out.write_text(json.dumps(old))
    # (nor recalibrate_bn, on since: off then, and named too).
    with pytest.raises(SystemExit, match=r"\(recalibrate_bn, task_init differ\)"):
        accuracy.main([*argv, "--resume"])
    assert accuracy.main(["task_init=previous", "recalibrate_bn=false", *argv, "--resume"]) == 0
    assert calls == [("nws", 1995), ("dense", 1995), ("bn_head", 1995)]  # every figure was there already
    # A file from before recalibrate_bn ran without it (today's default is on): refused, naming it.
    old = json.loads(out.read_text())
    old["nws_config"]["task_init"] = "original"
    del old["nws_config"]["recalibrate_bn"]
    out.write_text(json.dumps(old))
    with pytest.raises(SystemExit, match=r"\(recalibrate_bn differ\)"):
        accuracy.main([*argv, "--resume"])


def test_probe_reports_each_phase_and_the_stored_model_scores_the_last(pretrained):
    """benchmarks/probes/probe_baselines.py: PackNet's phases are measured on the model it then stores (its
    files score the stored accuracy exactly), BatchNorm re-estimation leaves the weights as they
    were, and Piggyback's per-layer report covers every masked layer with fractions in [0, 1]."""
    from probes import probe_baselines

    task, cfg = TASKS[0], tiny_config(epochs=2)
    rows = [probe_baselines.probe_packnet(pretrained, cfg, 1993, task, retrain) for retrain in (1, 2)]
    for retrain, row in zip((1, 2), rows):
        assert row["retrain_epochs"] == retrain and row["from_files"] == row["stored"]
        assert {"trained", "pruned", "pruned_bn_reestimated"} <= set(row)
    assert rows[0]["trained"] == rows[1]["trained"]  # the same seed and data order before pruning
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2))
    before = [p.clone() for p in model.parameters()]
    data = torch.utils.data.TensorDataset(torch.randn(100, 1, 3, 3) * 3 + 5, torch.zeros(100))
    probe_baselines._reestimate_bn(model, data)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with torch.no_grad():  # the running mean is the average of the 2 batches' means (64 + 36 images)
        z = model[0](data.tensors[0])
    expected = (z[:64].mean((0, 2, 3)) + z[64:].mean((0, 2, 3))) / 2
    torch.testing.assert_close(model[1].running_mean, expected)  # float sums in another order: a tolerance
    assert model[1].momentum == 0.1 and int(model[1].num_batches_tracked) == 2
    pig = probe_baselines.probe_piggyback(pretrained, cfg, 1993, task)
    assert set(pig["layers"]) == {n for n, p in pretrained.named_parameters() if p.dim() >= 2} - {"fc.weight"}
    assert all(0 <= r["off"] <= 1 and r["mean_abs_w"] > 0 for r in pig["layers"].values())
    assert 0 <= pig["from_files"] <= 1


@pytest.mark.parametrize("start, loaded", [("previous", [None, "the model task 0 ended as"]), ("base", [None, None])])
def test_probe_task_state_starts_each_task_from_where_it_says(tmp_path, monkeypatch, start, loaded):
    """benchmarks/probes/probe_task_state.py: task t's BatchNorm and head come from task t-1 (nws-train's
    rule: the model that just finished it, whose state its pack holds) or from the base pack for every
    task; afterwards nws-train is as it was."""
    from probes import probe_task_state

    from nwsconvert.train.store import RunStore
    from nwsconvert.train.trainer import Trainer

    calls: list[int | str | None] = []
    real, reenter = RunStore.enter_task_state, RunStore.reenter
    monkeypatch.setattr(
        RunStore, "enter_task_state", lambda self, model, task: (calls.append(task), real(self, model, task))[1]
    )
    # nws-train keeps the state task t-1 ended in from the model that just finished it (its pack's state)
    monkeypatch.setattr(
        RunStore, "reenter", lambda self, model: (calls.append("the model task 0 ended as"), reenter(self, model))[1]
    )
    fit_task = Trainer.fit_task
    argv = ["model=timm:test_resnet", "pool_size=32", "pool_epochs=1", "epochs=1", "tasks=2", "progress=false"]
    assert probe_task_state.main([f"--start={start}", *argv, f"out={tmp_path / 'run'}"]) == 0
    assert calls == loaded
    assert Trainer.fit_task is fit_task


def test_probe_base_starts_a_peer_from_the_base_pack_kernels(tmp_path, capsys):
    """benchmarks/probes/probe_base.py: the dense model it starts from holds, layer by layer, exactly the
    pool kernels the run's base pack names (and pool learning's BatchNorm); it trains the peer from
    there and from dense pretraining, leaves the run as it was, and writes what it printed."""
    import json

    from probes import probe_base

    from nwsconvert.cli.train import train_main
    from nwsconvert.core.nwsmodel import nws_layers
    from nwsconvert.formats.packs import TaskPack
    from nwsconvert.train.loading import load_run_pools
    from nwsconvert.train.rundir import RunDir

    run_dir = tmp_path / "run"
    argv = ["model=timm:test_resnet", "pool_size=32", "pool_epochs=1", "epochs=1", "tasks=2", "progress=false"]
    assert train_main([*argv, f"out={run_dir}"]) == 0
    job = probe_base.recorded_job(run_dir)[0]
    dense = probe_base.base_model(run_dir, job)
    assert dense.training and not nws_layers(dense)
    run = RunDir(run_dir)
    manifest = run.read()
    pools = load_run_pools(run, manifest)
    base = TaskPack.load(run.base_path, sha256=manifest.base.sha256, pool_sha256=pools.sha256, run_id=manifest.run_id)
    params, state = dict(dense.named_parameters()), dense.state_dict()
    assert set(base.indices) == {n.removesuffix(".weight") for n, p in params.items() if p.dim() >= 2}
    for name, idx in base.indices.items():  # every kernel: the pool entry the base pack names, bit for bit
        weight = params[f"{name}.weight"]
        assert torch.equal(weight, pools[name][idx].reshape(weight.shape)), name
    assert base.state and all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in base.state.items())

    out = tmp_path / "probe.json"
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert probe_base.main([str(run_dir), "--json", str(out)]) == 0
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files  # the run is only read
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["tasks"] == 2 and len(figures["nws"]["accs"]) == 2
    for start in ("nws_base", "dense_pretrained"):
        r = figures["bn_head"][start]
        assert len(r["accs"]) == 2 and all(0 <= a <= 1 for a in r["accs"])
        assert f"{100 * r['avg']:6.2f} %" in printed
    assert f"{100 * figures['nws']['avg']:6.2f} %" in printed


def test_accuracy_plot_title_names_the_training_options_every_method_shared():
    """A panel whose job overrode the recipe for every method (``pool_epochs=12``) says so in its
    title; a job at the recipe names only the suite, its options and the seeds."""
    import plot_accuracy

    job = {"suite_options": {"pairs": "hard", "path": "/x"}, "recipe": "demo", "model": "timm:resnet18"}
    today = {"nws_config": {"recalibrate_bn": True}}
    result = {"suite": "s", "job": job, "rows": [{}, {}, {}], **today}
    assert plot_accuracy.title_of(result, Path("r.json")) == "s: r\npairs=hard\n3 seed(s)"
    result["job"] = {**job, "pool_epochs": 12, "epochs": 15}
    assert plot_accuracy.title_of(result, Path("r.json")) == "s: r\npairs=hard\n3 seed(s), epochs=15, pool_epochs=12"
    # A file from before recalibrate_bn ran every method without it: the title says so.
    older = {"suite": "s", "job": job, "rows": [{}], "nws_config": {"task_init": "original"}}
    assert plot_accuracy.title_of(older, Path("r.json")) == "s: r\npairs=hard\n1 seed(s), recalibrate_bn=False"


def test_task_time_phases_count_nested_time_once():
    """``task_time.Phases``: a phase called inside another counts in the inner one only, and the
    shared names take the stage they run in."""
    import time

    import task_time

    phases = task_time.Phases()

    class Owner:
        @staticmethod
        def outer():
            time.sleep(0.01)
            Owner.inner()

        @staticmethod
        def inner():
            time.sleep(0.2)

    patches: list = []
    phases.wrap(Owner, "outer", "pool learning", patches)
    phases.wrap(Owner, "inner", "*training steps", patches)
    Owner.outer()
    Owner.inner()
    for owner, attr, real in patches:
        setattr(owner, attr, real)
    got = dict(phases.seconds)
    assert set(got) == {"pool learning", "pool learning: training steps", "task: training steps"}
    assert 0.01 <= got["pool learning"] < 0.15  # its own sleep, not the inner one's 0.2 s
    assert got["pool learning: training steps"] >= 0.2 and got["task: training steps"] >= 0.2
