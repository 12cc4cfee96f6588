#!/bin/bash
# One nvidia-h100-x2 call (~8 min) that verifies and measures the fused MoE core (moe_core.FUSE_ROUTER_DX: router,
# gates and experts under one custom_vjp whose dx and the router's dvalues come out of one combine kernel), with the
# two GPUs used side by side so the whole check fits one call:
#   GPU 0: the GPU tests of the fused core and the combine kernel (test_combine.py), the shared-packing test with the
#          switch off, the Triton train-step test (bitwise repeatable); then bench/combine.py (the kernel alone, at
#          its TILES); then the layer at 8192 tokens, VARIANTS (default: "default apart_dx") in one process
#   GPU 1: the layer at 81920 tokens (CONFIGS80K), VARIANTS in one process
# Falls back to one GPU (everything in turn) when only one is visible: then ~11 min with the defaults, over one call's
# 10-minute limit, so pass e.g. CONFIGS80K="768/8/128 1536/8/128" there. From the repo root on the device machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_fused_dx_gpu.sh
# Files in $OUT: run.log, gpu0.log, gpu1.log, tests.log, combine.jsonl, layer8k.jsonl, layer80k.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/fused_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
NGPU=$(nvidia-smi -L | wc -l)
VARIANTS=${VARIANTS:-default apart_dx}  # bench/layer.py variants, each row in one process
CONFIGS80K=${CONFIGS80K:-384/4/256 768/8/128 768/4/256 1536/8/128}

gpu0() {
    export CUDA_VISIBLE_DEVICES=0
    stage tests "${T_TESTS:-230}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/kernels/test_combine.py \
        'tests/kernels/test_router_kernel.py::test_gpu_moe_heads_one_packing_vs_separate_ops' \
        'tests/e2e/test_gpu_train.py::test_train_steps_bitwise_repeatable_on_one_gpu[triton-cudnn-bfloat16]' \
        > $OUT/tests.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error' $OUT/tests.log \
        | tail -n 40; exit \$rc"
    stage combine "${T_COMBINE:-120}" python3 bench/combine.py --out "$OUT/combine.jsonl"
    stage layer8k "${T_LAYER8K:-200}" python3 bench/layer.py --tokens 8192 --variants $VARIANTS \
        --out "$OUT/layer8k.jsonl"
}

gpu1() {
    export CUDA_VISIBLE_DEVICES=$1
    stage layer80k "${T_LAYER80K:-480}" python3 bench/layer.py --tokens 81920 --configs $CONFIGS80K \
        --variants $VARIANTS --out "$OUT/layer80k.jsonl"
}

if [ "$NGPU" -ge 2 ]; then
    gpu0 > "$OUT/gpu0.log" 2>&1 &
    p0=$!
    gpu1 1 > "$OUT/gpu1.log" 2>&1
    wait $p0
else
    gpu0 > "$OUT/gpu0.log" 2>&1
    gpu1 0 > "$OUT/gpu1.log" 2>&1
fi
cat "$OUT/gpu0.log" "$OUT/gpu1.log" | grep -E '^===|passed|failed|"ms"|tokens|^ *[0-9]+ ' | tail -n 60
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
