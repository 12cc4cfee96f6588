#!/bin/bash
# One single-GPU call (~9 min on an H100): the Gluon backward skipping a group's 32-row blocks made only of padding
# (experts_triton.SKIP_PADDING_BLOCKS, session 21). First the layer, new vs old in one process per row (bench/layer.py
# variants default / no_padding_skip, 8192 and 81920 tokens), then the GPU tests of the kernels it changes (the Gluon
# dW and fused backward against float64 and the Triton kernels, the fused core vs the ops apart, the layer against
# the FlexAttention oracle). From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_padskip_gpu.sh
# Files in $OUT: run.log, layer.jsonl, tests.log.
set -o pipefail
OUT=${OUT:-/tmp/padskip_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage layer "${T_LAYER:-270}" python3 bench/layer.py --tokens ${TOKENS:-81920 8192} --variants default no_padding_skip \
    --out "$OUT/layer.jsonl"
stage tests "${T_TESTS:-290}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
    tests/test_experts_kernel.py tests/test_combine.py -k 'ws_fused_bwd or ws_dw or fused_core or oracle' \
    > $OUT/tests.log 2>&1; rc=\$?; grep -E '^(FAILED|ERROR)|passed|failed|Error' $OUT/tests.log | tail -n 30; exit \$rc"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
