"""Total memory in the paper's accounting: pool set + per-task packs, beside one dense model per task.

For each architecture and task sequence the model is converted (512-entry
pools, the paper's setting), every task's head is resized to its class count,
and the task's pack is measured: indices (fixed 9 bits per kernel: sizes need
no data) plus every tensor no pool owns (BatchNorm weights, biases and running
statistics, the head's bias). Dense finetune keeps one float32 model per task.
The paper's reported totals are printed beside ours.

``--run RUN`` adds a trained run's real packs: their bytes as stored (the
smallest index coding per layer, see ``nwsconvert.formats.indexcode``) beside the same
packs at 9 bits, and the order-0 entropy of their indices.

    python benchmarks/memory.py --run runs/demo --json memory.json
    python benchmarks/memory.py --archs resnet18 --run runs/demo --layers   # + every layer of every pack
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torchvision
from torch import nn

import nwsconvert as nc
from nwsconvert.analysis.summary import shared_base_bytes
from nwsconvert.conversion.report import format_bytes
from nwsconvert.formats.bitpack import packed_size
from nwsconvert.formats.entropy import entropy_bits

MB = 1e6  # the paper's MB

SEQUENCES = {
    "split-cifar100": [5] * 20,  # 20 tasks x 5 classes, 32x32
    "cub-to-sketches": [200, 196, 102, 195, 250],  # CUB, Cars, Flowers, WikiArt, Sketch
}

# Paper, Tables 1-3 (total MB). Finetune is one full model per task.
PAPER = {
    ("resnet18", "split-cifar100"): {"NWS": 33.9, "Finetune": 892.0, "KSM": 192.5, "PackNet": 55.2, "AQD": 52.7},
    ("resnet18", "cub-to-sketches"): {"NWS": 9.9, "Finetune": 223.0, "KSM": 76.9, "PackNet": 56.0, "AQD": 13.7},
    ("resnet34", "split-cifar100"): {"NWS": 59.6, "Finetune": 1628.0},
    ("vgg16", "split-cifar100"): {"NWS": 28.0, "Finetune": 1124.0},
    ("mobilenet_v2", "split-cifar100"): {"NWS": 52.6, "Finetune": 272.0},
}


def cifar_vgg16(num_classes: int) -> nn.Module:
    """VGG-16 (BN) as used on 32x32 inputs: the 13 convolutions, then one 512 -> classes layer.

    The paper's Finetune-VGG16 figure (1,124 MB / 20 tasks = 56 MB, 14.7M weights)
    matches this shape, not ImageNet VGG-16's 4096-wide classifier (138M weights).
    """
    vgg = torchvision.models.vgg16_bn(num_classes=num_classes)
    return nn.Sequential(vgg.features, nn.Flatten(), nn.Linear(512, num_classes))


ARCHS = {
    "resnet18": (lambda c: torchvision.models.resnet18(num_classes=c), {}),
    "resnet34": (lambda c: torchvision.models.resnet34(num_classes=c), {}),
    "mobilenet_v2": (lambda c: torchvision.models.mobilenet_v2(num_classes=c), {}),
    "mobilenet_v2 (1x1 groups of 4)": (lambda c: torchvision.models.mobilenet_v2(num_classes=c), {"group_size": 4}),
    "vgg16": (cifar_vgg16, {}),
}


def dense_bytes(model: nn.Module) -> int:
    """float32 bytes of every parameter and floating-point buffer (one finetuned model)."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    return 4 * sum(t.numel() for t in tensors)


@torch.no_grad()
def measure(arch: str, classes: list[int], pool_size: int = 512) -> dict:
    build, options = ARCHS[arch]
    torch.manual_seed(0)
    model = nc.convert(build(classes[0]), pool_size=pool_size, init="random", **options)
    pools = nc.pool_set(model).nbytes
    tasks = []
    for c in classes:
        nc.resize_head(model, c)
        pack = nc.extract_task(model)
        index = sum(packed_size(r["count"], r["bits"]) for r in pack.layers)
        dense = dense_bytes(nc.materialize(model))
        tasks.append(
            {"classes": c, "indices": index, "state": pack.state_bytes, "nws": index + pack.state_bytes, "dense": dense}
        )
    nws = pools + sum(t["nws"] for t in tasks)
    dense = sum(t["dense"] for t in tasks)
    return {
        "arch": arch,
        "options": options,
        "pool_bytes": pools,
        "tasks": tasks,
        "nws_total": nws,
        "dense_total": dense,
        "per_task_mean": (nws - pools) / len(tasks),
    }


def _limit_bits(pack, layer: dict, coding: str) -> float:
    """Order-0 entropy (bits) of the stream the layer's coding family models.

    Fixed width / rANS: the indices. Delta codings: the indices with every position
    that kept the base's choice replaced by one extra symbol (the stream a static
    code over "same as base" + the n indices would see).
    """
    idx = pack.indices[layer["name"]].numpy()
    if coding.startswith("delta"):
        base = pack.base.indices[layer["name"]].numpy()
        idx = np.where(idx == base, layer["pool_size"], idx)
    return entropy_bits(idx)


def measure_run(run: str) -> dict:
    """Real packs of a trained run: stored bytes, 9-bit bytes, order-0 entropy of the indices."""
    r = nc.RunDir(run)
    manifest = r.read()
    rows, packs = [], []
    for entry in sorted(manifest.tasks, key=lambda e: e.id):
        pack = nc.TaskPack.load(r.path / entry.file)  # also decodes (and caches) the base once
        packs.append(pack)
        times = []
        for _ in range(5):
            tic = time.perf_counter()
            nc.TaskPack.load(r.path / entry.file)
            times.append(time.perf_counter() - tic)
        nine = sum(packed_size(l["count"], l["bits"]) for l in pack.layers)
        h0 = sum(entropy_bits(pack.indices[l["name"]].numpy()) for l in pack.layers) / 8
        stored = pack.layer_index_bytes()
        layers = []
        for l, c in zip(pack.layers, pack.layer_codings().values()):
            changed = (
                int((pack.indices[l["name"]] != pack.base.indices[l["name"]]).sum()) if c.startswith("delta") else None
            )
            layers.append(
                {
                    "name": l["name"],
                    "kernels": l["count"],
                    "coding": c,
                    "changed": changed,
                    "stored": stored[l["name"]],
                    "limit": _limit_bits(pack, l, c) / 8,
                }
            )
        limit = sum(l["limit"] for l in layers)
        codings: dict[str, int] = {}
        for c in pack.layer_codings().values():
            codings[c] = codings.get(c, 0) + 1
        rows.append(
            {
                "task": entry.id,
                "classes": entry.num_classes,
                "kernels": sum(l["count"] for l in pack.layers),
                "stored_indices": pack.index_bytes,
                "nine_bit_indices": nine,
                "order0_entropy": h0,
                "order0_limit": limit,
                "state": pack.state_bytes,
                "file": (r.path / entry.file).stat().st_size,
                "codings": codings,
                "load_ms": 1e3 * min(times),
                "acc": entry.metrics["val_acc"],
                "layers": layers,
            }
        )
    base = shared_base_bytes(manifest, packs)
    total = manifest.pools.bytes + base + sum(t["stored_indices"] + t["state"] for t in rows)
    return {
        "run": run,
        "model": manifest.model.spec,
        "suite": manifest.data.get("suite"),
        "pool_bytes": manifest.pools.bytes,
        "base_bytes": base,
        "total": total,
        "tasks": rows,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="*", default=list(ARCHS), help=f"default: all of {list(ARCHS)}")
    p.add_argument("--run", help="a trained run directory: add its real packs")
    p.add_argument("--layers", action="store_true", help="with --run: also print every layer of every pack")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    out = {"sequences": SEQUENCES, "results": []}
    print(
        "| model | tasks | pool set | per task (mean) | NWS total | dense finetune total | ratio | paper NWS | paper others |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in a.archs:
        for seq, classes in SEQUENCES.items():
            if seq == "cub-to-sketches" and arch not in ("resnet18",):
                continue  # the paper reports the other architectures on Split-CIFAR-100 only
            m = measure(arch, classes)
            m["sequence"] = seq
            paper = PAPER.get((arch, seq), {})
            m["paper_mb"] = paper
            out["results"].append(m)
            others = ", ".join(f"{k} {v:g}" for k, v in paper.items() if k != "NWS")
            print(
                f"| {arch} | {seq} ({len(classes)}) | {m['pool_bytes'] / MB:.2f} MB | {m['per_task_mean'] / MB:.2f} MB | "
                f"{m['nws_total'] / MB:.1f} MB | {m['dense_total'] / MB:.1f} MB | {m['dense_total'] / m['nws_total']:.1f}x | "
                f"{paper.get('NWS', '-')} | {others or '-'} |",
                flush=True,
            )
    if a.run:
        run = measure_run(a.run)
        out["run"] = run
        print(
            f"\nreal packs of {a.run} ({run['model']}, {run['suite']}), pools {format_bytes(run['pool_bytes'])}, "
            f"shared base pack {format_bytes(run['base_bytes'])}, total {format_bytes(run['total'])}:"
        )
        print(f"(load = TaskPack.load: read, hash check and decode, best of 5, {torch.get_num_threads()} threads)")
        print("(order-0 entropy: of the indices; limit: of the streams the chosen codings model, see _limit_bits)")
        print(
            "| task | classes | kernels | indices stored | at 9 bits | order-0 entropy | limit | stored / limit | BN/state | file | load | codings |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for t in run["tasks"]:
            print(
                f"| {t['task']} | {t['classes']} | {t['kernels']:,} | {format_bytes(t['stored_indices'])} | {format_bytes(t['nine_bit_indices'])} | "
                f"{format_bytes(t['order0_entropy'])} | {format_bytes(t['order0_limit'])} | {t['stored_indices'] / t['order0_limit']:.3f} | {format_bytes(t['state'])} | {format_bytes(t['file'])} | {t['load_ms']:.0f} ms | {t['codings']} |"
            )
        if a.layers:
            for t in run["tasks"]:
                print(
                    f"\ntask {t['task']}, per layer (changed: positions that differ from the base, delta codings only):"
                )
                print("| layer | kernels | coding | changed | stored | limit | stored / limit |")
                print("|---|---|---|---|---|---|---|")
                for l in t["layers"]:
                    ratio = f"{l['stored'] / l['limit']:.3f}" if l["limit"] > 0 else "–"
                    changed = "–" if l["changed"] is None else f"{l['changed']:,}"
                    print(
                        f"| {l['name']} | {l['kernels']:,} | {l['coding']} | {changed} | {l['stored']:,} B | {l['limit'] + 0.0:,.0f} B | {ratio} |"
                    )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
