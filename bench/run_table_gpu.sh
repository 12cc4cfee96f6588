#!/bin/bash
# One single-GPU call (~4 min on an H100: 233 s on 2026-11-26) for the README's figures with the code as it is: the layer table
# (bench/layer.py, default variant, 8192 and 81920 tokens) and the 1-GPU training step of the 2.2B MH-LatentMoE and
# MoE configs (bench/train_scale.py --devices 1 --profile: step time, tokens/s, MFU, memory, the ops with the most
# time in one traced step). From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_table_gpu.sh
# Files in $OUT: run.log, layer.jsonl, train_scale.jsonl.
set -o pipefail
OUT=${OUT:-/tmp/table_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage layer "${T_LAYER:-240}" python3 bench/layer.py --tokens 8192 81920 --out "$OUT/layer.jsonl"
for c in ${TRAIN_CONFIGS:-mh_latent_moe_hp_2.2b moe_ep_2.2b}; do
    stage "train_$c" "${T_TRAIN:-170}" python3 bench/train_scale.py --config "configs/$c.yaml" --devices 1 --steps 4 \
        --profile --out "$OUT/train_scale.jsonl" ${TRAIN_SETS:-}  # train_scale's micro-batch 4 unless e.g.
    # TRAIN_SETS="--set train.micro_batch=8" (the 2.2B configs' own default)
done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
