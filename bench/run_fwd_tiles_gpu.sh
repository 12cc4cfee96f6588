#!/bin/bash
# One single-GPU call (~3 min on an H100): the Triton expert forward (packing block 64, the 8192-token rows) alone
# over launch tiles, at the four 8192-token rows of DESIGN section 7 (bench/kernel_tiles.py, uniform routing, 3 input
# sets). The default tile first (rel_vs_first compares each tile's output with it).
# Files in $OUT: run.log, fwd_tiles.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/fwd_tiles_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
TILES=${FWD_TILES:-"64,64,4,3 64,32,4,3 64,32,4,4 64,64,4,4 64,64,4,2 64,128,4,2 64,64,8,3 64,128,8,2 32,64,4,3 32,128,4,3"}
for row in "384 4 256" "768 8 128" "768 4 256" "1536 8 128"; do
    set -- $row
    stage "fwd_$1_$2_$3" "${T_ROW:-120}" python3 bench/kernel_tiles.py --tokens 8192 --ne "$1" --k "$2" --de "$3" \
        --fwd $TILES --dx --dwt --out "$OUT/fwd_tiles.jsonl"
done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
