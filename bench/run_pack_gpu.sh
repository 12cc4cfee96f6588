#!/bin/bash
# One H100 device call (~7 min) for what 2026-11-23's last changes left unmeasured (bench/NOTES.md,
# "Next device session"): the Triton packing kernels and the router's flat-sort metadata.
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_pack_gpu.sh
# Stages (each under `timeout`; limits T_TESTS T_LAYER T_ROUTER in s):
#   tests   tests/kernels/test_packing.py whole (torch-launcher cases on CUDA + the jax-triton binding test) and the
#           router's GPU tests (its backward metadata changed to one flat sort)
#   layer   bench/layer.py at 8192 and 81920 tokens, 384/4/256, Triton router, variants default and tpack
#           (the Triton packing), with --breakdown (pack_argsort / pack_count / pack_triton side by side)
#   router  bench/router.py --meta at Ne 384 (flat vs per-head vs argsort metadata; router fwd+bwd)
# Files in $OUT: run.log, tests.log, layer.jsonl, router.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/pack_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage tests "${T_TESTS:-200}" bash -c "python3 -m pytest -q -p no:cacheprovider -rA tests/kernels/test_packing.py \
    tests/kernels/test_router_kernel.py > $OUT/tests.log 2>&1; rc=\$?; grep -E 'PASS|FAIL|ERROR|passed|failed' \
    $OUT/tests.log | tail -n 40; exit \$rc"
stage layer "${T_LAYER:-150}" bash -c "python3 bench/layer.py --tokens 8192 81920 --configs 384/4/256 --router triton \
    --variants default tpack --breakdown --out $OUT/layer.jsonl"
stage router "${T_ROUTER:-120}" python3 bench/router.py --ne 384 --impls ours --meta --tag v4 --out "$OUT/router.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
