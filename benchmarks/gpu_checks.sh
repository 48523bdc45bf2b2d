#!/usr/bin/env bash
# Everything issue 38 measures on a GPU, in one call (the device tool runs it in the repository root):
#   . .dev/base/device.sh && bash benchmarks/gpu_checks.sh          # results under ${OUT:-/tmp/gpu_checks}
# 1. the GPU-marked tests and the engine's, the graphs', the compile and the trainer tests on CUDA;
# 2. benchmarks/train_step.py on issue 38's five rows: the engine eager, the engine with --cuda-graph
#    (both sides captured), and the per-layer search on one row;
# 3. (STAGE=all) the whole suite and make demo's job with dense finetuning beside it.
# STAGE picks: steps (1 and 2, the default), rows (2 only), rest (3 only), all (1, 2 and 3).
# Each benchmark invocation is bounded by ROW_TIMEOUT seconds (default 120), so that a slow row
# leaves the others their time.
# The device image has torch, Triton and timm; nwsconvert's other dependencies travel as wheels
# (../shared/gpu/README.md), installed by device.sh before this runs.
set -u
OUT=${OUT:-/tmp/gpu_checks}
STAGE=${STAGE:-steps}
mkdir -p "$OUT"
PY=${PY:-$(command -v python || command -v python3)}
ROW_TIMEOUT=${ROW_TIMEOUT:-120}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
$PY -c "import torch, triton, timm; print(torch.__version__, torch.version.cuda, triton.__version__, timm.__version__)" > "$OUT/versions.txt" 2>&1
git rev-parse HEAD >> "$OUT/versions.txt" 2>/dev/null
if [ "$STAGE" = steps ] || [ "$STAGE" = all ]; then
    $PY -m pytest -q -x tests/test_fused_search.py tests/test_engine.py tests/test_engine_kernels.py tests/test_graphs.py \
        tests/test_compile.py > "$OUT/pytest_gpu.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest_gpu.log"
fi
# ROWS="model size batch;..." picks rows (a call has at most 10 minutes: split the rows over two calls
# if one does not finish); MODES="eager graph" picks the step modes: eager (the engine's update eager),
# enginegraph (eager steps, the engine's update replayed from a CUDA graph: --engine-graph), graph (the
# whole step of both models captured: --cuda-graph).
ROWS=${ROWS:-"resnet18 32 64;resnet18 224 32;resnet50 224 32;mobilenetv2_100 224 32;efficientnet_b0 224 32"}
IFS=';' read -ra ROW_LIST <<< "$ROWS"
[ "$STAGE" = rest ] && ROW_LIST=()
for mode in ${MODES:-eager graph}; do  # every row eager first, then every row graphed
    for row in "${ROW_LIST[@]}"; do
        set -- $row
        extra=""
        [ "$mode" = graph ] && extra="--cuda-graph --no-memory"
        [ "$mode" = enginegraph ] && extra="--engine-graph"
        timeout "$ROW_TIMEOUT" $PY benchmarks/train_step.py --model "$1" --size "$2" --batch "$3" --rounds "${ROUNDS:-30}" --search engine $extra \
            --json "$OUT/train_step_$1_$2_$mode.json" > "$OUT/train_step_$1_$2_$mode.log" 2>&1
        echo "$1 $2 $mode: $(grep -E '^(step time|CUDA peak|per |kernels)' "$OUT/train_step_$1_$2_$mode.log" | tr '\n' ' ')"
    done
done
if [ "${LAYER_ROW:-1}" = 1 ] && [ "$STAGE" != rest ]; then
    timeout "$ROW_TIMEOUT" $PY benchmarks/train_step.py --model resnet18 --size 224 --batch 32 --rounds "${ROUNDS:-30}" --search layer \
        --json "$OUT/train_step_resnet18_224_layer.json" > "$OUT/train_step_resnet18_224_layer.log" 2>&1
fi
if [ "$STAGE" = all ] || [ "$STAGE" = rest ]; then
    $PY -m pytest -q -n 14 ${TESTS:-tests} > "$OUT/pytest_all.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest_all.log"
    TIMEV=""; [ -x /usr/bin/time ] && TIMEV="/usr/bin/time -v"
    $TIMEV $PY -m nwsconvert.cli.demo > "$OUT/demo.log" 2>&1
    [ "${DENSE:-1}" = 1 ] && $PY benchmarks/accuracy.py --suite split-mnist --methods dense --json "$OUT/accuracy_dense.json" \
        > "$OUT/accuracy_dense.log" 2>&1  # DENSE=0 leaves dense finetuning out
fi
