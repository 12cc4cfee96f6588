#!/bin/bash
# One H100 call (~5 min) for what session 18 (2026-11-25) left unmeasured (bench/NOTES.md, "Next device session"):
#   caster   the router kernel's caster warp group: its GPU test (top-k bitwise as without it, casts equal torch's and
#            XLA's) and bench/router_cast.py (every layer gradient bitwise with moe_core.ROUTER_CASTS_WEIGHTS on and
#            off, then both timed) at 81920 tokens, 1536/8/128 and 768/8/128
#   oracle   the layer against the FlexAttention oracle and the packing binding (the packing's histogram changed)
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_next_gpu.sh
# Stage limits T_CASTER T_BENCH T_ORACLE (s). Files in $OUT: run.log, caster.log, router_cast.jsonl, oracle.log.
set -o pipefail
OUT=${OUT:-/tmp/next_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage caster "${T_CASTER:-120}" bash -c "python3 -m pytest -q -p no:cacheprovider -rA tests/test_router_kernel.py \
    -k caster > $OUT/caster.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' $OUT/caster.log \
    | tail -n 20; exit \$rc"
stage bench "${T_BENCH:-200}" python3 bench/router_cast.py --configs 1536/8/128 768/8/128 \
    --out "$OUT/router_cast.jsonl"
stage oracle "${T_ORACLE:-150}" bash -c "python3 -m pytest -q -p no:cacheprovider -rA tests/test_experts_kernel.py \
    tests/test_packing.py -k 'layer_triton_vs_oracle or gpu_triton_pack' > $OUT/oracle.log 2>&1; rc=\$?; \
    grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' $OUT/oracle.log | tail -n 20; exit \$rc"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
