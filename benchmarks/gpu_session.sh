#!/usr/bin/env bash
# One GPU lease, planned as a few back-to-back device calls (each call carries .dev/base and one .dev/ortK
# part of onnxruntime-gpu; ../shared/gpu/README.md). Every call:  . .dev/base/device.sh && PHASE=... bash benchmarks/gpu_session.sh
#   PHASE=steps    the step rows (gpu_checks.sh STAGE=rows; ROWS and MODES pick them) on a quiet GPU, then starts,
#                  detached (setsid), the suite, make demo's job and dense finetuning (STAGE=rest) into
#                  /tmp/gpu_bg (TESTS="tests/x.py ...": only those tests); the rows come
#                  back as $OUT/steps.tar.gz
#   PHASE=suite    only starts the detached work (STAGE=rest), at once
#   PHASE=poll     shows how far the detached work is (the calls that only bring an onnxruntime-gpu part)
#   PHASE=runtime  once onnxruntime-gpu is installed: the runtime's tests on CUDA beside the detached work, then
#                  waits for it, then deploy_modes.py on CUDA (gpu_runtime.sh, the demo's run that the
#                  detached make demo trained; RT_PARTS picks the parts, each bounded by PART_CAP), (PROFILE="model
#                  size batch") a profile and (ROWS) step rows on the quiet GPU; all as $OUT/*.tar.gz
# BUDGET (s, default 400) bounds a phase: every step's own timeout is cut to what is left, so the phase packs
# its results and returns before the device call's limit (give the call BUDGET + 30 s). Failures of the
# tests are printed (the call returns only the output's last 12,000 characters and at most 8 files).
# Measured on an H100 (2026-11-27): a machine's start and install ~30 s; the five step rows eager and four
# graphed ~300 s; the whole suite with -n 14 250 s; make demo's job 26 s; dense finetuning beside NWS 45 s;
# the runtime's tests 110 s (beside the suite).
#
# Staging (here, before the lease): bash ../shared/gpu/stage.sh --ort, then cut the wheel into five parts of
# 51 MiB instead of six (one call less; a part, .dev/base and the tree stay under 64 MiB):
#   cat .dev/ort*/part* > /tmp/ort.whl && rm -rf .dev/ort* && split -b 51M -d -a 1 /tmp/ort.whl /tmp/ortpart &&
#   i=0; for f in /tmp/ortpart*; do mkdir -p .dev/ort$i && mv $f .dev/ort$i/part$i; i=$((i+1)); done; echo $i > .dev/base/ort_parts
# The calls, back to back (a machine is given back after 30 s idle), each `. .dev/base/device.sh && ...`:
#   1. carry .dev/base .dev/ort0: PHASE=steps BUDGET=... (the rows still to time; the suite detached)
#   2-4. carry .dev/base .dev/ortK: PHASE=poll
#   5. carry .dev/base .dev/ort4: PHASE=runtime BUDGET=... PROFILE="resnet18 32 64"
set -u
PHASE=${PHASE:-poll}
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
case $PHASE in
steps)
    OUT=/tmp/gpu_steps STAGE=rows ROUNDS=${ROUNDS:-20} ROW_TIMEOUT=${ROW_TIMEOUT:-90} LAYER_ROW=${LAYER_ROW:-0} \
        bounded "$BUDGET" bash benchmarks/gpu_checks.sh
    pack /tmp/gpu_steps steps
    mkdir -p /tmp/gpu_bg
    setsid nohup bash -c 'OUT=/tmp/gpu_bg STAGE=rest bash benchmarks/gpu_checks.sh; touch /tmp/gpu_bg/DONE' \
        > /tmp/gpu_bg/driver.log 2>&1 < /dev/null &
    echo "detached: suite, demo, dense finetuning -> /tmp/gpu_bg" ;;
poll)
    ls /tmp/gpu_bg 2>/dev/null | tr '\n' ' '; echo
    tail -c 300 /tmp/gpu_bg/pytest_all.log 2>/dev/null; echo ;;
suite)  # the detached work alone, at once (no step rows first): the suite overlaps the onnxruntime-gpu transfers
    mkdir -p /tmp/gpu_bg
    setsid nohup bash -c 'OUT=/tmp/gpu_bg STAGE=rest bash benchmarks/gpu_checks.sh; touch /tmp/gpu_bg/DONE' \
        > /tmp/gpu_bg/driver.log 2>&1 < /dev/null &
    echo "detached: suite, demo, dense finetuning -> /tmp/gpu_bg" ;;
runtime)  # RT_TESTS=0 skips the runtime's tests, WAIT=0 the wait for the detached work (a second runtime call)
    mkdir -p /tmp/gpu_rt
    if [ "${RT_TESTS:-1}" = 1 ]; then
        OUT=/tmp/gpu_rt PARTS=tests bounded "${TESTS_TIMEOUT:-150}" bash benchmarks/gpu_runtime.sh
        failures /tmp/gpu_rt/pytest_runtime.log
        pack /tmp/gpu_rt runtime
    fi
    if [ "${WAIT:-1}" = 1 ]; then
        while [ ! -f /tmp/gpu_bg/DONE ] && [ $((BUDGET - (SECONDS - start))) -gt "${KEEP:-150}" ]; do sleep 1; done
        [ -f /tmp/gpu_bg/DONE ] || echo "detached work not finished; packed as it is"
        failures /tmp/gpu_bg/pytest_all.log; grep -E "finished|accuracy" /tmp/gpu_bg/demo.log 2>/dev/null | tail -2
        pack /tmp/gpu_bg bg
    fi
    # each deploy_modes.py part bounded on its own (PART_CAP s) and packed when it ends: a part cut short
    # leaves the others their time and what came before comes back
    for part in ${RT_PARTS:-demo models}; do
        DEMO_RUN=$PWD/runs/demo OUT=/tmp/gpu_rt PARTS=$part bounded "${PART_CAP:-200}" bash benchmarks/gpu_runtime.sh
        echo "== $part (rc $?)"; tail -n 22 "$(ls -t /tmp/gpu_rt/deploy_cuda_*.log 2>/dev/null | head -1)" 2>/dev/null
        pack /tmp/gpu_rt runtime
    done
    if [ -n "${PROFILE:-}" ]; then
        set -- $PROFILE
        bounded 90 $PY benchmarks/gpu_profile.py --model "$1" --size "$2" --batch "$3" --out /tmp/gpu_prof
        [ "${PROFILE_DENSE:-1}" = 1 ] && bounded 60 $PY benchmarks/gpu_profile.py --model "$1" --size "$2" --batch "$3" --dense --out /tmp/gpu_prof
        pack /tmp/gpu_prof profile
    fi
    if [ -n "${ROWS:-}" ]; then  # step rows last, on a quiet GPU (ROWS and MODES as gpu_checks.sh reads them)
        OUT=/tmp/gpu_rows STAGE=rows ROUNDS=${ROUNDS:-20} ROW_TIMEOUT=${ROW_TIMEOUT:-90} LAYER_ROW=0 \
            bounded "$BUDGET" bash benchmarks/gpu_checks.sh
        pack /tmp/gpu_rows rows
    fi ;;
esac
ls -la "$OUT"
