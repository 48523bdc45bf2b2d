"""Deployment side by side: NWS ONNX (Gather from the shared pool file) vs dense ONNX, same model, same run.

python benchmarks/deploy.py --models resnet18 mobilenetv2_100 --threads 2 --rounds 30
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import timm
import torch

import nwsconvert
from nwsconvert.export.onnx_graph import export_onnx


def converted_model(name: str) -> torch.nn.Module:
    """timm ``name`` (5 classes, seed 0) with non-zero BatchNorm scales, converted as ``convert(model)`` does by
    default (k-means pools of 512 entries), eval mode. (A trained run's bundle: ``deploy_modes.py``.)

    timm zero-initialises the last BatchNorm scale of each block; the exporter folds it into
    the conv weight, gets all-zero weights and deduplicates them, understating the dense
    file. Trained models have non-zero scales: give the BatchNorms such values.
    """
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    return nwsconvert.convert(model).eval()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["resnet18", "mobilenetv2_100"])
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    for name in args.models:
        model = converted_model(name)
        dense = nwsconvert.materialize(model).eval()
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            nwsconvert.pool_set(model).save(d / "pools.safetensors")
            nwsconvert.extract_task(model).save(d / "task.nwspack")
            export_onnx(
                model, d / "nws.onnx", d / "pools.safetensors", input_shape=(3, args.size, args.size), metadata={}
            )
            torch.onnx.export(
                dense,
                (torch.zeros(1, 3, args.size, args.size),),
                str(d / "dense.onnx"),
                dynamo=False,
                input_names=["input"],
                output_names=["logits"],
                opset_version=17,
            )
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = args.threads
            create = {"nws": [], "dense": []}
            sess = {}
            for _ in range(5):
                for k in ("nws", "dense"):
                    tic = time.perf_counter()
                    sess[k] = ort.InferenceSession(str(d / f"{k}.onnx"), opts, providers=["CPUExecutionProvider"])
                    create[k].append(time.perf_counter() - tic)
            x = np.random.default_rng(0).standard_normal((1, 3, args.size, args.size)).astype(np.float32)
            lat = {"nws": [], "dense": []}
            for k in ("nws", "dense"):
                sess[k].run(None, {"input": x})
            for _ in range(args.rounds):  # interleaved
                for k in ("nws", "dense"):
                    tic = time.perf_counter()
                    sess[k].run(None, {"input": x})
                    lat[k].append(time.perf_counter() - tic)
            diff = np.abs(sess["nws"].run(None, {"input": x})[0] - sess["dense"].run(None, {"input": x})[0]).max()
            sizes = {
                k: (d / f).stat().st_size
                for k, f in (
                    ("nws", "nws.onnx"),
                    ("dense", "dense.onnx"),
                    ("pools", "pools.safetensors"),
                    ("pack", "task.nwspack"),
                )
            }
        med = {k: float(np.median(v)) for k, v in lat.items()}
        print(f"{name} {args.size}x{args.size}, {args.threads} threads, CPU provider")
        print(
            f"  files per task: NWS .onnx {sizes['nws'] / 1e6:.2f} MB (+ shared pools {sizes['pools'] / 1e6:.2f} MB; pack {sizes['pack'] / 1e6:.2f} MB) vs dense .onnx {sizes['dense'] / 1e6:.2f} MB"
        )
        print(
            f"  session creation (= task switch): NWS {1e3 * np.median(create['nws']):.0f} ms, dense {1e3 * np.median(create['dense']):.0f} ms"
        )
        print(
            f"  latency batch 1: NWS {1e3 * med['nws']:.2f} ms, dense {1e3 * med['dense']:.2f} ms, ratio {med['nws'] / med['dense']:.3f} (median of {args.rounds} interleaved)"
        )
        print(f"  max |NWS - dense| logits: {diff:.2e}")


if __name__ == "__main__":
    main()
