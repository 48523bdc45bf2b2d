#!/usr/bin/env bash
# One GPU lease, planned as a few back-to-back device calls (../shared/gpu/README.md). Every call:
#   . .dev/base/device.sh && PHASE=... bash benchmarks/gpu_session.sh
#   PHASE=parts    nothing beyond device.sh: the calls that bring onnxruntime-gpu's parts (.dev/ortK), one a call
#   PHASE=suite    on the machine once every part is there: the whole suite (python3 -m pytest -n 14), the
#                  runtime's tests with onnxruntime-gpu's CUDA provider, then make demo's job (runs/demo)
#   PHASE=rows     (TESTS_FIRST=1) the engine's and the graphs' tests on CUDA, (FUZZ=s) search_fuzz.py's engine
#                  and fused cases on CUDA (the GPU's tiles and FMA), step
#                  rows (ROWS, MODES; default: the five rows, eager then graphed) and (PROFILE) a profile:
#                  needs no onnxruntime-gpu, so it can run in the call that brings the first part
#   PHASE=runtime  deploy_modes.py on CUDA (gpu_runtime.sh; RT_PARTS picks the parts: gputests (the runtime's GPU
#                  tests), demo (the run PHASE=suite trained), long20 (LONG20_RUN: a carried run), models (three
#                  short runs at 224x224; ARENA and GRAPH as gpu_runtime.sh reads them), each
#                  bounded by PART_CAP), then (PROFILE="model size batch") a profile and (ROWS="model size
#                  batch;...", MODES) step rows on the quiet GPU
# Everything runs in the foreground: the device tool replaces the working tree at every call, so work left
# running across calls reads a tree being replaced (a detached suite still collecting when the next call came
# failed with 43 import errors, 2026-11-27). Results come back as $OUT/*.tar.gz, packed as each part ends.
# BUDGET (s, default 400) bounds a phase: every step's own timeout is cut to what is left, so the phase packs
# its results and returns before the device call's limit (give the call BUDGET + 30 s). Failures of the
# tests are printed (the call returns only the output's last 12,000 characters and at most 8 files).
# Measured on an H100 (2026-11-27): a machine's start and install ~50 s; a part's call ~12 s; the five step
# rows eager and four graphed ~300 s; the whole suite with -n 14 262 s; the runtime's tests with -n 4 75 s;
# make demo's job 26 s; deploy_modes.py on the demo's run ~70 s, on long-mixed-20's ~90 s, on one 224x224
# model ~90 s; a profile ~40 s.
#
# Staging (here, before the lease): bash ../shared/gpu/stage.sh --ort, then cut the wheel into five parts of
# 51 MiB instead of six (one call less; a part, .dev/base and the tree stay under 64 MiB):
#   cat .dev/ort*/part* > /tmp/ort.whl && rm -rf .dev/ort* && split -b 51M -d -a 1 /tmp/ort.whl /tmp/ortpart &&
#   i=0; for f in /tmp/ortpart*; do mkdir -p .dev/ort$i && mv $f .dev/ort$i/part$i; i=$((i+1)); done; echo $i > .dev/base/ort_parts
# and a trained long-mixed-20 run without its checkpoints (5.4 MB) in .dev/long20:
#   mkdir -p .dev/long20 && cp -r runs/long20/{base.nwspack,job.json,manifest.json,pools.safetensors,tasks} .dev/long20/
# The calls, back to back (a machine is given back after 30 s idle), each `. .dev/base/device.sh && ...`.
# The next lease (after 51a292a: the suite and the runtime's tests passed on the H100; what is left is the step
# rows with the persistent search, the wide-D kernels, W read in place, the commitment term added into the
# layers' own gradients (no backward cat: the 32^2 peak) and the graphed engine update (engine_graph=true,
# built after 741e7b3 for the eager rows' host time), the runtime on MobileNetV2 and EfficientNet-B0 and
# with onnxruntime's CUDA graph (cuda_graph=True), and a profile to compare with 51a292a's), about 15 minutes:
#   1. carry .dev/base .dev/ort0: PHASE=rows BUDGET=420 FUZZ=30 ROUNDS=15 MODES="eager enginegraph" TESTS_FIRST=1
#      ROW_TIMEOUT=50 (timeout_s 450): the engine's and the graphs' GPU tests first (the graphed update's
#      included), the CUDA fuzz (its engine cases run a graphed copy too), then the five rows eager and with
#      the graphed update, side by side (about 60 + 40 + 10 x 30 s)
#   2-5. carry .dev/base .dev/ortK: PHASE=parts (timeout_s 60 each)
#   6. carry .dev/base .dev/long20, with what is left (budget_left_s less 40 s): PHASE=runtime
#      LONG20_RUN=.dev/long20 ARENA=shared GRAPH=1 RT_PARTS="gputests long20" PART_CAP=130 (the runtime's GPU
#      tests, the cuda_graph one included; the shared CUDA arena against 51a292a's own-arena figures, and
#      onnxruntime's CUDA graph, switch mode against the dense model, both graphed), then in the same call
#      ARENA=own MODELS="mobilenetv2_100 efficientnet_b0" RT_PARTS=models PART_CAP=150 (converted with their
#      family's preset, gpu_runtime.sh's PRESET=auto: the scalar-pool bundles users train), chained with &&; if
#      time is left, ROWS="resnet18 32 64;resnet18 224 32" MODES=graph PROFILE="resnet18 32 64" (the graphed
#      rows and the profile are the first to go). Issue 65's load test on CUDA (4 threads x 4 tasks, 10,000
#      runs, NumPy and device OrtValue images; ~2 min) rides on the same call: add `threads` to RT_PARTS of the
#      first gpu_runtime.sh call (RT_PARTS="gputests threads long20"; PART_CAP bounds each part on its own)
#   7. half precision (issue 64; built on CPU at the fourth session of 2026-11-29): PHASE=runtime
#      LONG20_RUN=.dev/long20 PRECISION=float16 RT_PARTS="fp16parity long20 demo" PART_CAP=150 (the float16 switch
#      mode beside float32's: latency at batch 1 and 32, device memory, switch cost; top-1 agreement on the
#      demo's and long-mixed-20's test sets); MODELS="mobilenetv2_100 efficientnet_b0" RT_PARTS=models next
# A lease that has to check the suite again: PHASE=suite BUDGET=400 before 6.
set -u
PHASE=${PHASE:-parts}
OUT=${OUT:-/tmp/gpu_session}
PY=${PY:-$(command -v python || command -v python3)}
export PY
mkdir -p "$OUT"
start=$SECONDS
BUDGET=${BUDGET:-400}
# bounded CAP CMD...: CMD with a timeout of CAP seconds or what is left of BUDGET, whichever is less.
bounded() {
    local cap=$1 left=$((BUDGET - (SECONDS - start))); shift
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -le 5 ]; then echo "skipped, budget spent: $*"; return 124; fi
    timeout "$cap" "$@"
}
pack() { tar -C "$(dirname "$1")" -czf "$OUT/$2.tar.gz" "$(basename "$1")" 2>/dev/null; }
failures() { [ -f "$1" ] && { grep -E "^(FAILED|ERROR) |^E  " "$1" | cut -c1-300 | head -${2:-40}; tail -2 "$1"; }; }
# step_rows CAP: gpu_checks.sh's step rows (ROWS, MODES) within CAP seconds, packed as rows.tar.gz
step_rows() {
    OUT=/tmp/gpu_rows STAGE=rows ROUNDS=${ROUNDS:-20} ROW_TIMEOUT=${ROW_TIMEOUT:-70} LAYER_ROW=0 \
        bounded "$1" bash benchmarks/gpu_checks.sh
    pack /tmp/gpu_rows rows
}
# profiles "model size batch": NWS's step profiled, then (PROFILE_DENSE=1, the default) dense's, packed as profile.tar.gz
profiles() {
    set -- $1
    bounded 60 $PY benchmarks/gpu_profile.py --model "$1" --size "$2" --batch "$3" --out /tmp/gpu_prof
    [ "${PROFILE_DENSE:-1}" = 1 ] && bounded 40 $PY benchmarks/gpu_profile.py --model "$1" --size "$2" --batch "$3" --dense --out /tmp/gpu_prof
    pack /tmp/gpu_prof profile
}
case $PHASE in
parts) ;;
suite)
    mkdir -p /tmp/gpu_suite
    bounded "${SUITE_TIMEOUT:-300}" $PY -m pytest -q -n 14 ${TESTS:-tests} > /tmp/gpu_suite/pytest_all.log 2>&1
    echo "pytest rc=$?" >> /tmp/gpu_suite/pytest_all.log
    failures /tmp/gpu_suite/pytest_all.log
    pack /tmp/gpu_suite suite
    OUT=/tmp/gpu_suite PARTS=tests RT_N=${RT_N:-4} bounded "${TESTS_TIMEOUT:-120}" bash benchmarks/gpu_runtime.sh
    failures /tmp/gpu_suite/pytest_runtime.log
    TIMEV=""; [ -x /usr/bin/time ] && TIMEV="/usr/bin/time -v"
    bounded 120 $TIMEV $PY -m nwsconvert.cli.demo progress=false > /tmp/gpu_suite/demo.log 2>&1
    grep -E "smaller|finished|Maximum resident" /tmp/gpu_suite/demo.log
    pack /tmp/gpu_suite suite ;;
runtime)
    mkdir -p /tmp/gpu_rt
    # each part bounded on its own (PART_CAP s) and packed when it ends: a part cut short leaves the
    # others their time, and what came before comes back
    for part in ${RT_PARTS:-demo long20 models}; do
        DEMO_RUN=$PWD/runs/demo OUT=/tmp/gpu_rt PARTS=$part bounded "${PART_CAP:-200}" bash benchmarks/gpu_runtime.sh
        echo "== $part (rc $?)"; tail -n 30 "$(ls -t /tmp/gpu_rt/deploy_cuda_*.log 2>/dev/null | head -1)" 2>/dev/null
        pack /tmp/gpu_rt runtime
    done
    [ -n "${PROFILE:-}" ] && profiles "$PROFILE"
    [ -n "${ROWS:-}" ] && step_rows "$BUDGET"  # step rows last (ROWS and MODES as gpu_checks.sh reads them)
    ;;
rows)
    if [ "${TESTS_FIRST:-0}" = 1 ]; then  # the GPU tests of the engine and the graphs (a few seconds each)
        mkdir -p /tmp/gpu_rows
        xdist=""; $PY -c "import xdist" 2>/dev/null && xdist="-n 4"
        bounded 90 $PY -m pytest -q $xdist tests/test_engine.py tests/test_graphs.py tests/test_engine_kernels.py \
            > /tmp/gpu_rows/pytest_engine.log 2>&1
        echo "pytest rc=$?" >> /tmp/gpu_rows/pytest_engine.log
        failures /tmp/gpu_rows/pytest_engine.log
    fi
    if [ "${FUZZ:-0}" -gt 0 ]; then  # the engine's Triton kernels as the GPU compiles them, against brute force
        mkdir -p /tmp/gpu_rows
        bounded $((FUZZ + 30)) $PY benchmarks/harnesses/search_fuzz.py --seconds "$FUZZ" --seed 0 --kinds engine,fused \
            --out /tmp/gpu_rows/search_fuzz_cuda.json | tail -5
    fi
    keep=0; [ -n "${PROFILE:-}" ] && keep=100  # the profiles' time, kept from the rows'
    step_rows "$((BUDGET - (SECONDS - start) - keep))"
    [ -n "${PROFILE:-}" ] && profiles "$PROFILE"
    ;;
*) echo "PHASE: parts, suite, rows or runtime"; exit 2 ;;
esac
ls -la "$OUT"
