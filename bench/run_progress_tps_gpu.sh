#!/bin/bash
# The progress line's throughput around drained steps (evaluation, checkpoint, the last), session 37 (2026-11-27):
# README's built-in-corpus 2.2B command for 9 steps with a line per step, evaluation at 5 and 9 (then at every second
# step: finishes alternate ahead / drained), and the metrics file's per-step tokens_per_s. Before StepClock the lines
# at 5 and 9 read ~2078k tok/s (MFU 239%) and the one after the evaluation ~139k, around ~262k.
set -o pipefail
OUT=${OUT:-/tmp/progress_tps_out}
source "$(dirname "$0")/gpu_stage.sh"
for every in 5 2; do  # evaluation at 5 and 9; at every second step (finishes alternate ahead / drained)
  rm -rf /tmp/run_tps
  stage "tps_eval$every" 200 python3 train.py --config configs/mh_latent_moe_hp_2.2b.yaml --set data.source=builtin \
      --set data.path= --set data.val_path= --set data.tokenizer=byte --set train.micro_batch=16 \
      --set data.val_fraction=0.1 --set data.val_sequences=16 \
      --set schedule.total_steps=9 --set schedule.warmup_steps=1 --set schedule.decay_steps=1 \
      --set data.eval_every=$every --set logging.log_every=1 --set checkpoint.every=0 --set logging.run_dir=/tmp/run_tps \
      --set logging.progress_bar=false
  cp /tmp/run_tps/metrics.jsonl "$OUT/progress_tps-eval$every-metrics.jsonl"
  python3 -c "
import json
for line in open('/tmp/run_tps/metrics.jsonl'):
    m = json.loads(line)
    print('step', m['step'], 'tokens_per_s', round(m['tokens_per_s']), 'mfu', m.get('mfu'), 'val_loss', m.get('val_loss'))
" | tee -a "$LOG"
done
