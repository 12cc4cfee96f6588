#!/bin/bash
# One H100 call (~7 min): the converting forward's (expert_fwd_cast_kernel) one-block tiles at the 8192-token rows.
#   tiles   the kernel alone (bench/kernel_tiles.py --fwd_cast) at each row
#   layer   the 8192-token layer with the default and candidate forward tiles (variants fwd_tile:M,E,W,S), one process
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_fwd_cast_tiles_gpu.sh
# Files in $OUT: run.log, tiles.jsonl, layer.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/fwd_cast_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
for row in "384 4 256" "768 8 128" "768 4 256" "1536 8 128"; do
    set -- $row
    stage "tiles-$1-$2-$3" "${T_TILES:-60}" python3 bench/kernel_tiles.py --tokens 8192 --ne $1 --k $2 --de $3 \
        --fwd --dx --dwt --fwd_cast 64,64,4,3 64,128,4,2 64,64,4,2 64,32,4,3 64,32,4,4 64,32,4,2 64,64,8,3 \
        64,128,8,2 64,32,8,3 32,64,4,3 32,128,4,2 --out "$OUT/tiles.jsonl"
done
stage layer "${T_LAYER:-330}" python3 bench/layer.py --tokens 8192 --variants default fwd_tile:64,32,4,3 \
    fwd_tile:64,32,4,4 fwd_tile:64,64,4,2 fwd_tile:64,64,8,3 fwd_tile:64,128,8,2 default --out "$OUT/layer.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
