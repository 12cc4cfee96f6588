#!/bin/bash
# The last baseline of issue 6 item 5: JAX's Pallas Mosaic-GPU ragged_dot (`ragged_mgpu` in bench/experts.py),
# which never finished inside a 30-90 s child limit (2026-11-22/23). One H100 call (<= ~9 min): a child per
# shape with a long limit; its progress lines (compile, first call) are kept in the record if it times out,
# and slow calls are timed with fewer repeats (bench/timing.py). Smallest shape first.
# From the repo root on the device machine, after installing the carried wheels (see run_pack_gpu.sh).
# Stage limits T_SMALL T_LARGE (s). Files in $OUT: run.log, experts.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/ragged_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
J="$OUT/experts.jsonl"
stage small "${T_SMALL:-250}" python3 bench/experts.py --tokens 2048 --ne 64 --de 128 --impls ours ragged_mgpu \
    --variants default --child-timeout 230 --out "$J"
stage large "${T_LARGE:-280}" python3 bench/experts.py --tokens 81920 --ne 384 --de 256 --impls ours ragged_mgpu \
    --variants default --child-timeout 250 --out "$J"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
