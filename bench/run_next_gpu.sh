#!/bin/bash
# One H100 call (~5 min): the checks sessions 34-35 (2026-11-27) ran after changing the train loop, all passed then
# (bench/NOTES.md, "Train loop"):
#   test     tests/kernels/test_combine.py's GPU test of the packing metadata on Triton and the converting forward against the
#            XLA paths, every gradient bitwise, also at 64-row packing blocks and de 256 (session 33's tile)
#   train    the train loop's GPU tests: train steps bitwise repeatable, exact resume across processes
#            (tests/e2e/test_gpu_train.py, tests/e2e/test_resume.py -m gpu)
#   loop     bench/loop_overlap.py: the loop's step period with fetch-ahead off / on, same process, losses bitwise
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_next_gpu.sh
# Stage limits T_TEST T_TRAIN T_LOOP (s). Files in $OUT: run.log, test.log, train.log, loop.jsonl.
set -o pipefail
export OUT=${OUT:-/tmp/next_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage test "${T_TEST:-150}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/kernels/test_combine.py \
    -k metadata_and_converting > $OUT/test.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' \
    $OUT/test.log | tail -n 20; exit \$rc"
stage train "${T_TRAIN:-400}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/e2e/test_gpu_train.py \
    tests/e2e/test_resume.py > $OUT/train.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error' \
    $OUT/train.log | tail -n 20; exit \$rc"
stage loop "${T_LOOP:-180}" python3 bench/loop_overlap.py --steps 60 --rounds ${ROUNDS:-2} ${TRACE:+--trace} \
    --out "$OUT/loop.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
