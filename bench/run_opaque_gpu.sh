#!/bin/bash
# One H100 call (~6 min): jax-triton launches with slim opaques (mhl_jax.ops.gluon_bridge.SLIM_OPAQUE) on the GPU.
#   tests   GPU tests that launch every Triton / Gluon kernel of the layer through jax-triton (jaxlib assembles the
#           slim PTX): test_combine's GPU tests, the router's one-packing test
#   layer   the 8192-token layer with the host's enqueue time per fwd+bwd call (dispatch_ms), slim / full / slim
#           (MHL_SLIM_OPAQUE=0: jax-triton's own opaque), three processes in a row
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_opaque_gpu.sh
# Files in $OUT: run.log, tests.log, layer-{slim,full,slim2}.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/opaque_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage tests "${T_TESTS:-200}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_combine.py \
    tests/test_router_kernel.py -k 'test_combine or moe_heads' > $OUT/tests.log 2>&1; rc=\$?; \
    grep -E '^(PASSED|FAILED|ERROR)|passed|failed' $OUT/tests.log | tail -n 30; exit \$rc"
for v in slim full slim2; do
    slim=1; [ "$v" = full ] && slim=0
    stage "layer-$v" "${T_LAYER:-130}" env MHL_SLIM_OPAQUE=$slim python3 bench/layer.py --tokens 8192 --inner 3 30 \
        --out "$OUT/layer-$v.jsonl"
done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
