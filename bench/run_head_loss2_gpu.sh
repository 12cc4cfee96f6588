#!/bin/bash
# The second call of the head-loss session (2026-11-27, s36): the CPU-side loss tests and the exact-resume test on the
# GPU, then micro-batch 16 vs 8 again (MH-LatentMoE) and for the MoE 2.2B, chunked loss, one process each.
set -o pipefail
OUT=${OUT:-/tmp/head_loss_out}
source "$(dirname "$0")/gpu_stage.sh"
stage tests 240 python3 -m pytest -q tests/unit/test_params.py tests/e2e/test_resume.py -k "head_loss or loss_chunk or gpu"
for cfg in mh_latent_moe_hp_2.2b moe_ep_2.2b; do
  for mb in 16 8; do
    stage "$cfg-mb$mb" 150 python3 bench/train_scale.py --config configs/$cfg.yaml --devices 1 --steps 5 \
        --set train.micro_batch=$mb --out "$OUT/train_scale-$cfg-mb$mb.jsonl"
  done
done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
