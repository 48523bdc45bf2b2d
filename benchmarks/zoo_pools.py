"""Zoo pools from real ImageNet weights: EfficientNet-Lite0 converted with k-means pools.

For pool sizes n and 1x1 / linear group sizes g (and optional presets), in one
process on CPU:

* bytes: the pool set (float32), one task's indices at ceil(log2 n) bits per
  kernel, one task's other state (BatchNorm, biases), beside the dense model;
* agreement of the NWS model (k-means pools over the real kernels, no
  training) with the dense model on the photos shipped inside scikit-image
  (centre crop + its mirror image, EfficientNet-Lite preprocessing): top-1
  agreement (all inputs, and inputs where the dense top-1 probability is at
  least 0.3: many sample images are textures or micrographs whose dense
  prediction is a near-tie), top-5 overlap, dense top-1 within NWS top-5, mean KL(dense || NWS),
  mean logit cosine, and the relative weight error ||W - K|| / ||W||;
* optionally, accuracy after task training on the embedded split-mnist suite
  (5 tasks x 2 digits, recipe ``demo``, pools = the k-means pools of the
  ImageNet kernels, no pool learning; grayscale stem = the RGB kernels summed,
  "SAME" padding computed for 28 x 28 inputs)
  beside dense finetune of the same pretrained model with the same recipe.

    python benchmarks/zoo_pools.py --json zoo.json                  # the grid (no training)
    python benchmarks/zoo_pools.py --train preset:inverted-residual:512x1 preset:inverted-residual:512x4   # + training
    python benchmarks/zoo_pools.py --pool-sizes 512 --group-sizes 1 --presets --train 512x1 --train-tasks 2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nwsconvert as nc
from nwsconvert.zoo import get_preset, get_pretrained

#: scikit-image sample images shipped in its wheel (no pooch download). Others
#: (brain, eagle, lily, ...) need a download and are never loaded.
PHOTOS = [
    "astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
    "colorwheel", "logo", "motorcycle_left", "motorcycle_right", "camera", "brick", "grass", "gravel",
    "moon", "coins", "clock", "page", "text", "cell", "microaneurysms", "checkerboard", "horse",
]  # fmt: skip

ENTRY = "efficientnet_lite0"


def load_photos(names=PHOTOS) -> tuple[list[str], list]:
    """The shipped photos that load offline, as numpy arrays (missing ones are left out)."""
    import skimage.data as data

    used, images = [], []
    for name in names:
        try:
            if name.startswith("motorcycle_"):
                left, right, _ = data.stereo_motorcycle()
                img = left if name.endswith("left") else right
            else:
                img = getattr(data, name)()
        except (ModuleNotFoundError, ImportError, OSError, ValueError) as e:  # would need pooch
            print(f"  photo {name}: not available offline ({type(e).__name__})", file=sys.stderr)
            continue
        used.append(name)
        images.append(img)
    return used, images


def photo_batch(images) -> torch.Tensor:
    """``(2 * len(images), 3, 224, 224)``: every photo's centre crop and its mirror image."""
    entry = get_pretrained(ENTRY)
    xs = [entry.preprocess(img) for img in images]
    return torch.stack(xs + [x.flip(-1) for x in xs])


#: "confident" inputs: the dense model's top-1 probability is at least this.
CONFIDENT = 0.3


def agreement(dense: torch.Tensor, nws: torch.Tensor) -> dict:
    """Prediction agreement of two ``(B, 1000)`` logit tensors."""
    top5_d, top5_n = dense.topk(5, 1).indices, nws.topk(5, 1).indices
    same = dense.argmax(1) == nws.argmax(1)
    confident = dense.softmax(1).max(1).values >= CONFIDENT
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 5 for a, b in zip(top5_d, top5_n)])
    logp_d, logp_n = dense.log_softmax(1), nws.log_softmax(1)
    return {
        "top1_agree": float(same.float().mean()),
        "top1_agree_confident": float(same[confident].float().mean()),
        "top5_overlap": float(overlap.mean()),
        "dense_top1_in_nws_top5": float((top5_n == dense.argmax(1, keepdim=True)).any(1).float().mean()),
        "kl": float((logp_d.exp() * (logp_d - logp_n)).sum(1).mean()),
        "logit_cos": float(F.cosine_similarity(dense, nws, dim=1).mean()),
    }


def weight_error(model) -> float:
    """``||W - K|| / ||W||`` over every converted layer (W: the real kernels, K: the chosen pool kernels)."""
    num = den = 0.0
    for layer in nc.nws_layers(model):
        w = layer.weight.detach().double()
        k = layer.nws.gather().reshape(w.shape).double()
        num += float((w - k).pow(2).sum())
        den += float(w.pow(2).sum())
    return math.sqrt(num / den)


def state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def parse_config(text: str) -> dict:
    """``512x4`` (plain convert) or ``preset:NAME:512x4``."""
    preset = None
    if text.startswith("preset:"):
        _, preset, text = text.split(":", 2)
    n, _, g = text.partition("x")
    return {"preset": preset, "pool_size": int(n), "group_size": int(g or 1)}


def label(cfg: dict) -> str:
    base = f"n={cfg['pool_size']} g={cfg['group_size']}"
    return f"{cfg['preset']} ({base})" if cfg["preset"] else base


def conversion_config(model, cfg: dict, kmeans_iters: int | None, seed: int) -> nc.NWSConfig:
    """The NWSConfig of one grid row: a preset's (it edits the planner's plans) or plain sizes."""
    extra = {} if kmeans_iters is None else {"kmeans_iters": kmeans_iters}
    if cfg["preset"]:
        return get_preset(cfg["preset"]).config(
            model, pool_size=cfg["pool_size"], group_size=cfg["group_size"], init="kmeans", seed=seed, **extra
        )
    return nc.NWSConfig(pool_size=cfg["pool_size"], group_size=cfg["group_size"], init="kmeans", seed=seed, **extra)


# ------------------------------------------------------------------ grid
def grid(configs: list[dict], x: torch.Tensor, kmeans_iters: int | None) -> tuple[dict, list[dict]]:
    entry = get_pretrained(ENTRY)
    dense = entry.build().eval()
    with torch.no_grad():
        ref = dense(x)
    conf = ref.softmax(1).max(1).values
    dense_info = {
        "bytes": state_bytes(dense),
        "top1_confidence": float(conf.mean()),
        "confident_inputs": int((conf >= CONFIDENT).sum()),
    }
    rows = []
    for cfg in configs:
        model = copy.deepcopy(dense)
        tic = time.perf_counter()
        nc.convert(model, conversion_config(model, cfg, kmeans_iters, seed=0))
        seconds = time.perf_counter() - tic
        model.eval()
        with torch.no_grad():
            out = model(x)
        rep = model.nws_report
        row = {
            **cfg,
            "label": label(cfg),
            "convert_seconds": seconds,
            "pool_bytes": rep.pool_bytes,
            "index_bytes": rep.index_bytes,
            "state_bytes": dense_info["bytes"] - rep.dense_bytes,
            "converted_dense_bytes": rep.dense_bytes,
            "dense_bytes": dense_info["bytes"],
            "weight_error": weight_error(model),
            **agreement(ref, out),
        }
        rows.append(row)
        print(
            f"  {row['label']:<34} top-1 {100 * row['top1_agree']:5.1f}%  top-5 overlap {100 * row['top5_overlap']:5.1f}%  "
            f"KL {row['kl']:.3f}  cos {row['logit_cos']:.3f}  ||W-K||/||W|| {row['weight_error']:.3f}  "
            f"pools {row['pool_bytes'] / 1e6:.2f} MB  indices {row['index_bytes'] / 1e6:.3f} MB  ({seconds:.0f}s)",
            flush=True,
        )
        del model
    return dense_info, rows


# -------------------------------------------------------------- training
def _task_kwargs(suite) -> dict:
    """Factory kwargs for the suite's images: its channels, and static padding computed for its input size."""
    return {"in_chans": suite.channels, "image_size": suite.input_size[0]}


def train_nws(cfg: dict, suite, recipe: str, seed: int, kmeans_iters: int | None) -> dict:
    from nwsconvert.analysis.summary import run_summary
    from nwsconvert.zoo import get_recipe

    entry = get_pretrained(ENTRY)
    config = get_recipe(recipe, seed=seed)
    torch.manual_seed(seed)
    # The ImageNet classifier is kept so that the head's pool is clustered from
    # real weights too; fit_task resizes it to each task (keeping rows, as always).
    model = entry.build(**_task_kwargs(suite))
    tic = time.perf_counter()
    nc.convert(model, conversion_config(model, cfg, kmeans_iters, seed=seed))
    accs, rebuilt = [], []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = nc.Trainer(
            model,
            f"{tmp}/run",
            config,
            model_spec=entry.spec,
            model_kwargs=_task_kwargs(suite),
            data_info=suite.info(),
            device="cpu",
            progress=False,
        )
        for t, task in enumerate(suite.tasks):
            m = trainer.fit_task(
                t, task.train, task.test, task.num_classes, name=task.name, class_names=task.class_names
            )
            accs.append(m["val_acc"])
            rebuilt.append(m["rebuilt_acc"])
        seconds = time.perf_counter() - tic
        try:
            total = run_summary(f"{tmp}/run")["total"]
        except Exception as e:  # noqa: BLE001 - the figures above stand without the byte summary
            total = {"error": f"{type(e).__name__}: {e}"}
    return {
        **cfg,
        "label": label(cfg),
        "accs": accs,
        "rebuilt": rebuilt,
        "avg": sum(accs) / len(accs),
        "seconds": seconds,
        "summary": total,
    }


def train_dense(suite, recipe: str, seed: int, tasks: int | None = None) -> dict:
    """Dense finetune of the same pretrained model, as ``benchmarks/accuracy.py`` runs it."""
    sys.path.insert(0, str(Path(__file__).parent))
    import tempfile

    from accuracy import method_run, pretrained_model

    from nwsconvert.train.job import resolve_job

    entry = get_pretrained(ENTRY)
    items = [
        f"suite={suite.name}",
        f"model={entry.spec}",
        f"recipe={recipe}",
        "learn_pools=false",
        f"tasks={tasks or 'null'}",
    ]
    job = resolve_job(items + [f"model.{k}={v}" for k, v in _task_kwargs(suite).items()])
    tic = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        accs = method_run("dense", pretrained_model(job, seed), job, seed, tmp)["accs"]
    return {"label": "dense finetune", "accs": accs, "avg": sum(accs) / len(accs), "seconds": time.perf_counter() - tic}


# ---------------------------------------------------------------- output
def markdown(photos: list[str], n_images: int, dense_info: dict, rows: list[dict], train: list[dict], args) -> str:
    mb = lambda b: f"{b / 1e6:.3f}"  # noqa: E731
    out = [
        f"Photos: {len(photos)} scikit-image sample images ({', '.join(photos)}), centre crop + mirror = {n_images} inputs; "
        f"dense mean top-1 confidence {100 * dense_info['top1_confidence']:.1f} %, {dense_info['confident_inputs']} inputs with dense "
        f'top-1 ≥ {100 * CONFIDENT:.0f} % ("confident"). Dense model {mb(dense_info["bytes"])} MB (float32, all tensors). '
        "Indices at ceil(log2 n) bits per kernel; other state = BatchNorm tensors and biases; task / dense = (indices + other state) / dense model.",
        "",
        "| config | pools MB | indices / task MB | other state / task MB | task / dense | top-1 agree | top-1 agree, confident | top-5 overlap | dense top-1 in NWS top-5 | KL(dense‖NWS) | logit cos | ‖W−K‖/‖W‖ | convert s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_task = r["index_bytes"] + r["state_bytes"]
        out.append(
            f"| {r['label']} | {mb(r['pool_bytes'])} | {mb(r['index_bytes'])} | {mb(r['state_bytes'])} | "
            f"{100 * per_task / r['dense_bytes']:.1f} % | {100 * r['top1_agree']:.1f} % | {100 * r['top1_agree_confident']:.1f} % | {100 * r['top5_overlap']:.1f} % | "
            f"{100 * r['dense_top1_in_nws_top5']:.1f} % | {r['kl']:.3f} | {r['logit_cos']:.3f} | {r['weight_error']:.3f} | {r['convert_seconds']:.0f} |"
        )
    if train:
        out += [
            "",
            f"Task training: split-mnist ({len(train[0]['accs'])} tasks x 2 digits, 28x28 grayscale), recipe `{args.recipe}`, seed {args.seed}, "
            "pools = k-means of the ImageNet kernels (no pool learning), CPU.",
            "",
            "| run | avg acc | per task | rebuilt from pack = trained | stored (all tasks) | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for r in train:
            same = "—" if "rebuilt" not in r else ("yes" if r["rebuilt"] == r["accs"] else "NO")
            per = " / ".join(f"{100 * a:.1f}" for a in r["accs"])
            summ = r.get("summary") or {}
            if "nws_bytes" in summ:
                stored = f"{mb(summ['nws_bytes'])} MB (dense finetune {mb(summ['dense_finetune_bytes'])} MB)"
            else:
                stored = summ.get("error", "one dense model per task")
            out.append(f"| {r['label']} | {100 * r['avg']:.2f} % | {per} | {same} | {stored} | {r['seconds']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-sizes", type=int, nargs="*", default=[128, 256, 512, 1024])
    p.add_argument("--group-sizes", type=int, nargs="*", default=[1, 4, 8])
    p.add_argument("--presets", nargs="*", default=[f"preset:inverted-residual:{n}x1" for n in (128, 256, 512, 1024)] + ["preset:inverted-residual:512x4"],
                   help="extra grid rows: preset:NAME:NxG")  # fmt: skip
    p.add_argument("--train", nargs="*", default=[],
                   help="configs to train on split-mnist (NxG or preset:NAME:NxG), beside one dense finetune run; "
                        "about 2 min per task and config on 2 cores, so off by default")  # fmt: skip
    p.add_argument("--train-tasks", type=int, default=None, help="train only the first N split-mnist tasks")
    p.add_argument("--recipe", default="demo")
    p.add_argument("--seed", type=int, default=1993)
    p.add_argument(
        "--kmeans-iters", type=int, default=None, help="Lloyd iterations (default: the converter's / preset's)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tic = time.perf_counter()

    photos, images = load_photos()
    x = photo_batch(images)
    configs = [{"preset": None, "pool_size": n, "group_size": g} for g in args.group_sizes for n in args.pool_sizes]
    configs += [parse_config(c) for c in args.presets]
    print(
        f"EfficientNet-Lite0 (ImageNet weights), {len(photos)} photos -> {x.shape[0]} inputs, {len(configs)} configs",
        flush=True,
    )
    dense_info, rows = grid(configs, x, args.kmeans_iters)

    train = []
    train_cfgs = [parse_config(c) for c in args.train if c != "none"]
    if train_cfgs:
        from nwsconvert.zoo import get_suite

        suite = get_suite("split-mnist")
        suite.tasks = suite.tasks[: args.train_tasks] if args.train_tasks else suite.tasks
        dense = train_dense(suite, args.recipe, args.seed, args.train_tasks)
        print(f"  dense finetune: avg {100 * dense['avg']:.2f}% ({dense['seconds']:.0f}s)", flush=True)
        train.append(dense)
        for cfg in train_cfgs:
            r = train_nws(cfg, suite, args.recipe, args.seed, args.kmeans_iters)
            print(f"  NWS {r['label']}: avg {100 * r['avg']:.2f}% ({r['seconds']:.0f}s)", flush=True)
            train.append(r)

    table = markdown(photos, x.shape[0], dense_info, rows, train, args)
    print("\n" + table)
    print(f"\ntotal {time.perf_counter() - tic:.0f}s, torch {torch.__version__}, {args.threads} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"photos": photos, "inputs": x.shape[0], "dense": dense_info, "grid": rows, "train": train,
                       "args": vars(args)}, f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
