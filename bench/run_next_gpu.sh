#!/bin/bash
# One H100 call (~6 min) for what session 33 (2026-11-27) left unmeasured (bench/NOTES.md, "Next device session"):
#   test     tests/test_combine.py's GPU test of the packing metadata on Triton and the converting forward against the
#            XLA paths, every gradient bitwise, now also at 64-row packing blocks and de 256 where the converting forward
#            runs 32-wide de chunks and the plain one 64 (session 33's new tile; the case was written after that
#            session's device time ran out: the bitwise agreement there is inferred, not tested)
#   trace    the 8192-token rows traced over 30 back-to-back calls (bench/profile_layer.py --calls 30): busy time, span
#            per call and the timed figure with today's code
#   layer    the 8192-token layer table with more calls per timed batch (bench/layer.py --inner 3 30)
# (Session 18's caster / oracle checks that this script ran before are in bench/NOTES.md, Layer, Session 18.)
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_next_gpu.sh
# Stage limits T_TEST T_TRACE T_LAYER (s). Files in $OUT: run.log, test.log, trace.jsonl, layer.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/next_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage test "${T_TEST:-150}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_combine.py \
    -k metadata_and_converting > $OUT/test.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' \
    $OUT/test.log | tail -n 20; exit \$rc"
stage trace "${T_TRACE:-150}" python3 bench/profile_layer.py --tokens 8192 \
    --configs 384/4/256 768/8/128 768/4/256 1536/8/128 --calls 30 --out "$OUT/trace.jsonl"
stage layer "${T_LAYER:-150}" python3 bench/layer.py --tokens 8192 --inner 3 30 --out "$OUT/layer.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
