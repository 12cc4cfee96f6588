#!/bin/bash
# The third call of the head-loss session (2026-11-27, s36), after the loss made its gradients in the forward's
# chunk loop: the GPU tests it touches, the 2.2B MH-LatentMoE step at micro-batch 16 and 8, and README's command for
# a 2.2B config on the built-in corpus (3 steps, evaluation at the end; on 2026-11-27 with val_sequences 32 it
# stopped at the data check: 12 validation sequences at the default 5% hold-out, now 10%).
set -o pipefail
OUT=${OUT:-/tmp/head_loss_out}
source "$(dirname "$0")/gpu_stage.sh"
stage tests 330 python3 -m pytest -q -rs tests/unit/test_params.py tests/e2e/test_gpu_train.py tests/e2e/test_resume.py \
    -k "head_loss or loss_chunk or gpu"
for mb in 16 8; do
  stage "mb$mb" 100 python3 bench/train_scale.py --config configs/mh_latent_moe_hp_2.2b.yaml --devices 1 --steps 5 \
      --set train.micro_batch=$mb --out "$OUT/train_scale-mh_latent_moe_hp_2.2b-mb$mb.jsonl"
done
stage readme_cmd 120 python3 train.py --config configs/mh_latent_moe_hp_2.2b.yaml --set data.source=builtin \
    --set data.path= --set data.val_path= --set data.tokenizer=byte --set train.micro_batch=16 \
    --set data.val_fraction=0.1 --set data.val_sequences=16 \
    --set schedule.total_steps=3 --set schedule.warmup_steps=1 --set schedule.decay_steps=1 --set data.eval_every=3 \
    --set checkpoint.every=0 --set logging.run_dir=/tmp/run_readme \
    --set logging.progress_bar=false
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
