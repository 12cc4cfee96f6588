#!/bin/bash
# One H100 call (~8-9 min) for what the evening of 2026-11-23 left unmeasured (bench/NOTES.md, "Next device
# session"), after the dW blocks of the shared packing were re-cut:
#   tests    the shared-packing GPU test (now bitwise in every gradient) and the router's GPU tests
#   layer    bench/layer.py, the whole table (8 rows) with the current defaults, breakdown at 384/4/256
#            (moe_fwd_bwd = router + experts as the layer runs them)
#   flex     the FlexAttention oracle at the 2048-token sweep shapes (torch.compile's recompile limit raised)
# From the repo root on the device machine, after installing the carried wheels (see run_pack_gpu.sh).
# Stage limits T_TESTS T_LAYER T_FLEX (s). Files in $OUT: run.log, tests.log, layer.jsonl, experts.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/next_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage tests "${T_TESTS:-150}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
    tests/test_router_kernel.py > $OUT/tests.log 2>&1; rc=\$?; \
    grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' $OUT/tests.log | tail -n 30; exit \$rc"
stage layer "${T_LAYER:-220}" bash -c "python3 bench/layer.py --tokens 8192 81920 --configs 384/4/256 --router triton \
    --variants default --breakdown --out $OUT/layer.jsonl; python3 bench/layer.py --tokens 8192 81920 \
    --configs 768/8/128 768/4/256 1536/8/128 --router triton --variants default --out $OUT/layer.jsonl"
stage flex "${T_FLEX:-150}" python3 bench/experts.py --tokens 2048 --ne 64 256 1024 1536 --de 128 256 512 \
    --impls flex --flex-max-compiles 12 --variants default --out "$OUT/experts.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
