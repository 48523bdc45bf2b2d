#!/usr/bin/env bash
# One GPU lease, planned as a few back-to-back device calls (each call carries .dev/base and one .dev/ortK
# part of onnxruntime-gpu; ../shared/gpu/README.md). Every call:  . .dev/base/device.sh && PHASE=... bash benchmarks/gpu_session.sh
#   PHASE=steps    the step rows (gpu_checks.sh STAGE=rows) on a quiet GPU, then starts, detached (setsid), the
#                  suite, make demo's job and dense finetuning (STAGE=rest) into /tmp/gpu_bg; the rows come back
#                  as $OUT/steps.tar.gz
#   PHASE=poll     shows how far the detached work is (the calls that only bring an onnxruntime-gpu part)
#   PHASE=runtime  once onnxruntime-gpu is installed: the runtime's tests on CUDA beside the detached work, then
#                  waits for it (at most WAIT s), then deploy_modes.py on CUDA (gpu_runtime.sh, the demo's run that
#                  the detached make demo trained) and a profile of the worst step row; all as $OUT/*.tar.gz
# A call may return at most 8 files, so each phase packs its folder into one archive, also when a step fails
# or is cut by its own timeout.
set -u
PHASE=${PHASE:-poll}
OUT=${OUT:-/tmp/gpu_session}
PY=${PY:-$(command -v python || command -v python3)}
export PY
mkdir -p "$OUT"
pack() { tar -C "$(dirname "$1")" -czf "$OUT/$2.tar.gz" "$(basename "$1")" 2>/dev/null; }
case $PHASE in
steps)
    OUT=/tmp/gpu_steps STAGE=rows ROUNDS=${ROUNDS:-20} ROW_TIMEOUT=${ROW_TIMEOUT:-90} LAYER_ROW=${LAYER_ROW:-0} \
        timeout "${STEPS_BUDGET:-330}" bash benchmarks/gpu_checks.sh
    pack /tmp/gpu_steps steps
    mkdir -p /tmp/gpu_bg
    setsid nohup bash -c 'OUT=/tmp/gpu_bg STAGE=rest bash benchmarks/gpu_checks.sh; touch /tmp/gpu_bg/DONE' \
        > /tmp/gpu_bg/driver.log 2>&1 < /dev/null &
    echo "detached: suite, demo, dense finetuning -> /tmp/gpu_bg" ;;
poll)
    ls /tmp/gpu_bg 2>/dev/null | tr '\n' ' '; echo
    tail -c 300 /tmp/gpu_bg/pytest_all.log 2>/dev/null; echo ;;
runtime)
    mkdir -p /tmp/gpu_rt
    OUT=/tmp/gpu_rt PARTS=tests bash benchmarks/gpu_runtime.sh
    tail -3 /tmp/gpu_rt/pytest_runtime.log
    for _ in $(seq "${WAIT:-240}"); do [ -f /tmp/gpu_bg/DONE ] && break; sleep 1; done
    [ -f /tmp/gpu_bg/DONE ] || echo "detached work not finished after ${WAIT:-240} s"
    tail -3 /tmp/gpu_bg/pytest_all.log 2>/dev/null; grep -E "finished|acc" /tmp/gpu_bg/demo.log 2>/dev/null | tail -3
    pack /tmp/gpu_bg bg
    DEMO_RUN=$PWD/runs/demo OUT=/tmp/gpu_rt PARTS="${RT_PARTS:-demo models}" timeout "${RT_TIMEOUT:-200}" \
        bash benchmarks/gpu_runtime.sh
    tail -25 /tmp/gpu_rt/deploy_cuda_demo.log 2>/dev/null
    pack /tmp/gpu_rt runtime
    if [ -n "${PROFILE:-}" ]; then
        set -- $PROFILE
        timeout 90 $PY benchmarks/gpu_profile.py --model "$1" --size "$2" --batch "$3" --out /tmp/gpu_prof
        timeout 60 $PY benchmarks/gpu_profile.py --model "$1" --size "$2" --batch "$3" --dense --out /tmp/gpu_prof
        pack /tmp/gpu_prof profile
    fi ;;
esac
ls -la "$OUT"
