#!/bin/bash
# Router GPU check + benchmark in one device call (issue 5). Run from the repo root on the device
# machine after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_router_gpu.sh [bench args]
# Writes $OUT/router_gpu_tests.log, $OUT/router_bench.log and $OUT/router.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/router_out}
mkdir -p "$OUT" /tmp/home /tmp/inductor /tmp/triton_cache
export HOME=/tmp/home TORCHINDUCTOR_CACHE_DIR=/tmp/inductor MHL_TRITON_CACHE=/tmp/triton_cache \
    TRITON_CACHE_DIR=/tmp/triton_cache XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 MHL_TEST_GPU=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
t0=$(date +%s)
if python3 -c "import pytest" 2>/dev/null; then
    # ROUTER_TEST_K: optional pytest -k expression to run a subset
    python3 -m pytest -q -m gpu -p no:cacheprovider -s ${ROUTER_TEST_K:+-k "$ROUTER_TEST_K"} \
        tests/kernels/test_router_kernel.py 2>&1 | tee "$OUT/router_gpu_tests.log"
else
    echo "pytest is not installed here: GPU tests skipped" | tee "$OUT/router_gpu_tests.log"
fi
echo "tests took $(( $(date +%s) - t0 )) s"
python3 bench/router.py --out "$OUT/router.jsonl" "$@" 2>&1 | tee "$OUT/router_bench.log"
echo "total $(( $(date +%s) - t0 )) s"
