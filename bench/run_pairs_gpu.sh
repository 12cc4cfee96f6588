#!/bin/bash
# One H100 call (~7 min): the converting forward's pair tiles (kernels.experts.fwd_pairs) at the 8192-token rows.
#   test    tests/test_combine.py's GPU test of the pair tiles against the one-block tiles, bitwise (de 128, 256)
#   tiles   the converting forward alone (bench/kernel_tiles.py --fwd_cast) at each row: the one-block tiles and
#           pair tiles of 8 warps
#   layer   the 8192-token layer, default / fwd_pairs / default in one process
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_pairs_gpu.sh
# Files in $OUT: run.log, test.log, tiles.jsonl, layer.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/pairs_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage test "${T_TEST:-120}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_combine.py \
    -k pair_tiles > $OUT/test.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' \
    $OUT/test.log | tail -n 20; exit \$rc"
for row in "384 4 256" "768 8 128" "768 4 256" "1536 8 128"; do
    set -- $row
    stage "tiles-$1-$2-$3" "${T_TILES:-70}" python3 bench/kernel_tiles.py --tokens 8192 --ne $1 --k $2 --de $3 \
        --fwd --dx --dwt --fwd_cast 64,64,4,3 64,128,4,2 128,64,8,2 128,64,8,3 128,32,8,3 128,128,8,2 \
        --out "$OUT/tiles.jsonl"
done
stage layer "${T_LAYER:-170}" python3 bench/layer.py --tokens 8192 --variants default fwd_pairs default \
    --out "$OUT/layer.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
