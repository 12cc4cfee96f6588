#!/bin/bash
# One H100 device call (issues 6 and 7): experts wider than dh = 128 and the wide-expert models in a
# training step. From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_wide_gpu.sh
# Stages (each under `timeout`; limits T_LAYER T_WIDE T_TESTS T_SCALE in s):
#   layer  bench/layer.py with --breakdown at 8192 and 81920 tokens (the packing without cumsum / searchsorted)
#   wide   bench/wide_experts.py: fused kernels (dh = 128 tiles / wide tiles) vs grouped at dh 256 (+ dh 128)
#   tests  tests/e2e/test_gpu_train.py: bitwise-repeatable train steps, incl. the d = 256 MoE on Triton kernels
#   scale  bench/train_scale.py: MoE and LatentMoE 2.2B on one GPU with ffn.kernels=auto (grouped experts)
# Files in $OUT: run.log, layer.jsonl, wide.jsonl, tests.log, train_scale.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/wide_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage layer "${T_LAYER:-120}" bash -c "python3 bench/layer.py --tokens 8192 --configs 384/4/256 1536/8/128 --router triton \
    --variants default --breakdown --out $OUT/layer.jsonl; python3 bench/layer.py --tokens 81920 --configs 384/4/256 \
    --router triton --variants default --breakdown --out $OUT/layer.jsonl"
stage wide "${T_WIDE:-170}" python3 bench/wide_experts.py --child-timeout 40 --out "$OUT/wide.jsonl"
stage tests "${T_TESTS:-120}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/e2e/test_gpu_train.py \
    > $OUT/tests.log 2>&1; rc=\$?; tail -n 20 $OUT/tests.log; exit \$rc"
for cfg in moe_ep_2.2b latent_moe_ep_2.2b; do
    stage "scale_$cfg" "${T_SCALE:-90}" python3 bench/train_scale.py --config configs/$cfg.yaml --devices 1 \
        --steps 3 --set train.global_batch=32 --set train.micro_batch=4 --set schedule.warmup_steps=1 \
        --out "$OUT/train_scale.jsonl"
done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
