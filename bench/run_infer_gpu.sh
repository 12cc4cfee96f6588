#!/bin/bash
# mhl_jax.infer on one GPU (session 41, 2026-11-28; run in session 42, when the KV cache's parts were added, not yet
# run): its GPU test (the evaluation bitwise the run's own val_loss with the run's autotuning results; padded windows'
# and the KV cache's logits against the unpadded forward, bf16), then the 2.2B MH-LatentMoE: 4 steps on the built-in
# corpus with a checkpoint (~25 GiB on disk), `evaluate` against the run's record at step 4, `generate` of 4 x 128
# tokens with and without the KV cache, each timed, and bench/generate.py (per-token times, compiles left out).
set -o pipefail
OUT=${OUT:-/tmp/infer_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
RUN=/tmp/infer_run_2.2b
stage tests 300 python3 -m pytest -q -rs -p no:cacheprovider tests/e2e/test_infer.py -m gpu
stage train-2.2b 400 python3 train.py --config configs/mh_latent_moe_hp_2.2b.yaml --set data.source=builtin \
    --set data.path= --set data.val_path= --set data.tokenizer=byte --set data.val_fraction=0.1 \
    --set data.val_sequences=16 --set train.micro_batch=16 --set schedule.total_steps=4 --set schedule.warmup_steps=1 \
    --set schedule.decay_steps=1 --set data.eval_every=4 --set checkpoint.every=4 --set logging.progress_bar=false \
    --set logging.run_dir=$RUN
grep '"step": 4' $RUN/metrics.jsonl | python3 -c "import json, sys; r = json.loads(sys.stdin.read()); \
print('record val_loss', repr(r.get('val_loss')))" | tee -a "$LOG"
stage evaluate-2.2b 300 bash -c "time python3 -m mhl_jax.infer evaluate $RUN --json"
stage generate-2.2b 300 bash -c "time python3 -m mhl_jax.infer generate $RUN --prompt 'The ' --num-samples 4 \
    --max-new-tokens 128 --json"
stage generate-2.2b-no-cache 300 bash -c "time python3 -m mhl_jax.infer generate $RUN --prompt 'The ' --num-samples 4 \
    --max-new-tokens 128 --json --no-kv-cache"
stage generate-2.2b-timed 300 python3 bench/generate.py $RUN --rows 1 4 16 --tokens 128
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
