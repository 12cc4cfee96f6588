#!/bin/bash
# Issue 6 item 5 in one H100 call (~8 min): bench/experts.py over Nh=8, dh=128, k=4, de in {128, 256, 512},
# Ne in {64, 256, 1024, 1536}, at 2048 tokens (B=4 x T=512) and at 81920 tokens: ours (default variant),
# torch._grouped_mm and the FlexAttention oracle. The oracle takes ~0.6 s per fwd+bwd at 81920 tokens plus
# a compile per shape, so there it runs at Ne 1536 only (the three de); ragged_dot_mgpu is left out (its
# Mosaic-GPU compile never finished inside a 30-90 s child limit in three sessions).
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_sweep_gpu.sh
# Stage limits T_SMALL T_LARGE T_FLEX (s). Files in $OUT: run.log, experts.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/sweep_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
J="$OUT/experts.jsonl"
COMMON="--de 128 256 512 --variants default ${VARIANTS:-} --out $J"
stage small "${T_SMALL:-240}" python3 bench/experts.py --tokens 2048 --ne 64 256 1024 1536 $COMMON \
    --impls ours grouped_mm flex --flex-max-compiles 12
stage large "${T_LARGE:-170}" python3 bench/experts.py --tokens 81920 --ne 64 256 1024 1536 $COMMON \
    --impls ours grouped_mm
stage flex_large "${T_FLEX:-120}" python3 bench/experts.py --tokens 81920 --ne 1536 $COMMON --impls flex
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
