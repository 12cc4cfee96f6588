#!/bin/bash
# One short H100 call (~4 min) for the shared packing (the Triton router packs its indices for the expert
# op and takes its dW_r blocks from that packing, moe_heads_triton) and the Triton packing under jax.grad:
#   tests   the GPU test of the shared path against the separate ops (tests/kernels/test_router_kernel.py) and the
#           jax-triton packing binding (tests/kernels/test_packing.py)
#   layer   bench/layer.py at 8192 and 81920 tokens, 384/4/256, variants default (JAX packing) and tpack
#           (Triton packing), both on the model's path (moe_heads)
# From the repo root on the device machine, after installing the carried wheels (see run_pack_gpu.sh).
#   sweep_cell  bench/experts.py at 2048 tokens, Ne 1536, de 512 (ours, grouped_mm)
# Stage limits T_TESTS T_LAYER T_CELL (s). Files in $OUT: run.log, tests.log, layer.jsonl, experts.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/share_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage tests "${T_TESTS:-100}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
    tests/kernels/test_router_kernel.py::test_gpu_moe_heads_one_packing_vs_separate_ops \
    tests/kernels/test_packing.py::test_gpu_triton_pack_binding_equals_jax_pack > $OUT/tests.log 2>&1; rc=\$?; \
    grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' $OUT/tests.log | tail -n 30; exit \$rc"
stage layer "${T_LAYER:-130}" python3 bench/layer.py --tokens 8192 81920 --configs 384/4/256 --router triton \
    --variants default tpack --out "$OUT/layer.jsonl"
# the one sweep cell lost to the FlexAttention oracle's leaked memory in run_sweep_gpu.sh (2026-11-23)
stage sweep_cell "${T_CELL:-60}" python3 bench/experts.py --tokens 2048 --ne 1536 --de 512 --impls ours grouped_mm \
    --variants default --out "$OUT/experts.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
