#!/bin/bash
# The GPU-marked kernel and training tests alone in one H100 call (~8 min: the layer-vs-oracle and variant
# tests compile many shapes). From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_tests_gpu.sh [test files]
# Default files: test_experts_kernel, test_experts_grouped, test_gpu_train (test_packing and test_router_kernel
# run in bench/run_pack_gpu.sh). Limit T_TESTS s (default 540). Files in $OUT: run.log, tests.log.
set -o pipefail
OUT=${OUT:-/tmp/tests_out}
source "$(dirname "$0")/gpu_stage.sh"
FILES=${*:-tests/kernels/test_experts_kernel.py tests/kernels/test_experts_grouped.py tests/e2e/test_gpu_train.py}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage tests "${T_TESTS:-540}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA --durations=15 $FILES \
    > $OUT/tests.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|slowest|s call' \
    $OUT/tests.log | tail -n 80; exit \$rc"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
