#!/usr/bin/env bash
# Everything issue 14 measures on a GPU, in one call (the device tool runs it in the repository root):
#   bash benchmarks/gpu_checks.sh            # results under ${OUT:-/tmp/gpu_checks}
# 1. the GPU-only tests (fused search without host syncs, engine exactness) and the suite's device tests;
# 2. benchmarks/train_step.py on the five rows of issue 14, engine and per-layer search side by side.
# The device image has torch, Triton and timm; nwsconvert's other dependencies (safetensors, onnx,
# constriction, mlxtend, ...) travel as wheels (the device tool's README), installed before this runs.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
PY=${PY:-python}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
$PY -c "import torch, triton, timm; print(torch.__version__, torch.version.cuda, triton.__version__, timm.__version__)" > "$OUT/versions.txt" 2>&1
$PY -m pytest -q tests/test_fused_search.py tests/test_engine.py tests/test_compile.py \
    tests/test_trainer.py tests/test_cli.py -x > "$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.log"
for row in "resnet18 32 64" "resnet18 224 32" "resnet50 224 32" "mobilenetv2_100 224 32" "efficientnet_b0 224 32"; do
    set -- $row
    for search in engine layer; do
        $PY benchmarks/train_step.py --model "$1" --size "$2" --batch "$3" --rounds 30 --search "$search" \
            --json "$OUT/train_step_$1_$2_$search.json" > "$OUT/train_step_$1_$2_$search.log" 2>&1
    done
done
