#!/usr/bin/env bash
# The runtime on a GPU (issue 47's CUDA column), in one call once onnxruntime-gpu is installed there:
#   . .dev/base/device.sh && bash benchmarks/gpu_runtime.sh        # results under ${OUT:-/tmp/gpu_runtime}
# (every .dev/ortK part sent first, one per call: ../shared/gpu/README.md). It checks that onnxruntime
# offers the CUDA provider, runs the runtime's tests on CUDA, then benchmarks/deploy_modes.py --device cuda
# on ResNet-18, MobileNetV2 and EfficientNet-B0 at 224x224 (short runs trained there) and on the demo's
# and long-mixed-20's runs at 28x28 (trained there with nws-train's defaults). PARTS picks what runs
# (tests models demo long20) to split it over two calls; RT_N: pytest-xdist workers for the tests. The device image lacks Debian's Fashion-MNIST:
# copy /usr/share/datasets/fashion-mnist to .dev/fashion here and carry it for long20 (FASHION=.dev/fashion).
# MEMORY=core (default) measures deploy_modes.py's core memory rows only (three processes fewer a bundle);
# MEMORY=all adds what each further ready task, cached session and dense session costs. MODELS picks the
# models part's models, PRESET their conversion (default auto: MobileNets and EfficientNets with the scalar
# pools users get from nws-train preset=auto; none: convert(model)'s defaults); ARENA=shared builds every
# Runtime with cuda_arena='shared' (files *_shared.*).
# GRAPH=1 adds the switch mode and the dense model through onnxruntime's CUDA graph (deploy_modes.py
# --cuda-graph; files *_graph.*). The part gputests runs the runtime's GPU tests alone (pytest -m gpu, ~30 s);
# the part threads runs benchmarks/harnesses/runtime_load.py's load test on CUDA (issue 65; ~2 min).
# PRECISION=float16 adds the float16 switch mode to every deploy_modes.py call (latency beside float32's,
# switch cost, memory, agreement; files *_float16.*); the part fp16parity runs benchmarks/parity.py --precision
# float16 on CUDA over the demo's and long-mixed-20's test sets (top-1 agreement, largest logit difference).
set -u
OUT=${OUT:-/tmp/gpu_runtime}
PARTS=${PARTS:-"tests models demo long20"}
MEMORY=${MEMORY:-core}
MODELS=${MODELS:-"resnet18 mobilenetv2_100 efficientnet_b0"}  # the models part's models
PRESET=${PRESET:-auto}  # their conversion (deploy_modes.py --preset): the family's preset, as users train them
ARENA=${ARENA:-own}  # deploy_modes.py --cuda-arena: own or shared (its files then end in _shared)
TAG=""; [ "$ARENA" = own ] || TAG="_$ARENA"
GRAPH_FLAG=""; [ "${GRAPH:-0}" = 1 ] && { GRAPH_FLAG="--cuda-graph"; TAG="${TAG}_graph"; }
PRECISION=${PRECISION:-float32}
[ "$PRECISION" = float32 ] || { GRAPH_FLAG="$GRAPH_FLAG --precision $PRECISION"; TAG="${TAG}_$PRECISION"; }
PY=${PY:-$(command -v python || command -v python3)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv" 2>&1
$PY -c "import onnxruntime as o, torch; print(o.__version__, o.get_available_providers(), torch.__version__)" \
    > "$OUT/versions.txt" 2>&1
git rev-parse HEAD >> "$OUT/versions.txt" 2>/dev/null
if ! grep -q CUDAExecutionProvider "$OUT/versions.txt"; then
    echo "onnxruntime offers no CUDA provider: send every .dev/ortK part first" | tee "$OUT/FAILED"
    exit 1
fi
for part in $PARTS; do
    case $part in
    threads)  # issue 65's load test on CUDA: 4 threads x 4 tasks, 10,000 runs, images as NumPy and as device OrtValues
        for input in numpy ortvalue; do
            $PY benchmarks/harnesses/runtime_load.py threads --device cuda --input "$input" --configs switch:1,switch:4,session \
                --work /tmp/gpu_runtime_load --json "$OUT/runtime_load_cuda_$input.json" > "$OUT/runtime_load_cuda_$input.log" 2>&1
            $PY benchmarks/harnesses/runtime_load.py threads --device cuda --input "$input" --mixed --configs switch:2,session \
                --work /tmp/gpu_runtime_load --json "$OUT/runtime_load_cuda_${input}_mixed.json" > "$OUT/runtime_load_cuda_${input}_mixed.log" 2>&1
        done
        tail -8 "$OUT"/runtime_load_cuda_*.log ;;
    fp16parity)  # the demo's run (DEMO_RUN, trained here when missing) and long-mixed-20's (LONG20_RUN, carried)
        run=${DEMO_RUN:-/tmp/gpu_demo}
        [ -f "$run/manifest.json" ] || $PY -m nwsconvert.cli.demo out="$run" progress=false > "$OUT/demo_train.log" 2>&1
        $PY benchmarks/parity.py --run "$run" --precision float16 --device cuda --json "$OUT/parity_fp16_demo.json" \
            > "$OUT/parity_fp16_demo.log" 2>&1
        [ -f "${LONG20_RUN:-/tmp/gpu_long20}/manifest.json" ] && $PY benchmarks/parity.py --run "${LONG20_RUN:-/tmp/gpu_long20}" \
            --precision float16 --device cuda --json "$OUT/parity_fp16_long20.json" > "$OUT/parity_fp16_long20.log" 2>&1
        tail -n 1 "$OUT"/parity_fp16_*.log ;;
    gputests)
        $PY -m pytest -q -m gpu tests/test_export.py > "$OUT/pytest_runtime_gpu.log" 2>&1
        echo "pytest rc=$?" >> "$OUT/pytest_runtime_gpu.log"
        tail -3 "$OUT/pytest_runtime_gpu.log" ;;
    tests)
        $PY -m pytest -q -n "${RT_N:-1}" tests/test_export.py tests/test_layout.py tests/test_demo.py > "$OUT/pytest_runtime.log" 2>&1
        echo "pytest rc=$?" >> "$OUT/pytest_runtime.log" ;;
    models)
        $PY benchmarks/deploy_modes.py --device cuda --memory "$MEMORY" --cuda-arena "$ARENA" $GRAPH_FLAG --models $MODELS --size 224 \
            --preset "$PRESET" --tasks 6 --json "$OUT/deploy_cuda_224$TAG.json" > "$OUT/deploy_cuda_224$TAG.log" 2>&1 ;;
    demo)  # DEMO_RUN: a demo run already trained on this machine (gpu_checks.sh's make demo writes runs/demo)
        run=${DEMO_RUN:-/tmp/gpu_demo}
        [ -f "$run/manifest.json" ] || $PY -m nwsconvert.cli.demo out="$run" progress=false > "$OUT/demo_train.log" 2>&1
        $PY benchmarks/deploy_modes.py --device cuda --memory "$MEMORY" --cuda-arena "$ARENA" $GRAPH_FLAG --run "$run" \
            --json "$OUT/deploy_cuda_demo$TAG.json" > "$OUT/deploy_cuda_demo$TAG.log" 2>&1 ;;
    long20)  # LONG20_RUN: a long-mixed-20 run trained elsewhere and carried (its manifest, pools and packs suffice)
        run=${LONG20_RUN:-/tmp/gpu_long20}
        [ -f "$run/manifest.json" ] || $PY -m nwsconvert.cli.train suite=long-mixed-20 "suite.fashion_root=${FASHION:-.dev/fashion}" \
            out="$run" progress=false > "$OUT/long20_train.log" 2>&1
        $PY benchmarks/deploy_modes.py --device cuda --memory "$MEMORY" --cuda-arena "$ARENA" $GRAPH_FLAG --run "$run" \
            --json "$OUT/deploy_cuda_long20$TAG.json" > "$OUT/deploy_cuda_long20$TAG.log" 2>&1 ;;
    esac
done
