#!/bin/bash
# Several processes in one run (session 38, 2026-11-27), on a machine with 2 GPUs (nvidia-h100-x2 / h200-x2):
# the GPU test (a process per GPU against one process of both: losses, exact resume, a checkpoint resumed by the
# other process count), then the 2.2B MH-LatentMoE on the built-in byte corpus at hp = 2, one process of both GPUs
# against one process per GPU (bench/multiprocess.py: tokens/s and the losses side by side), and the 2.2B MoE with
# ep = 2 the same way. Argument: all (default), tests, bench (the MH-LatentMoE), moe, tests+moe.
set -o pipefail
OUT=${OUT:-/tmp/multiprocess_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
if [ "${1:-all}" = "tests" ] || [ "${1:-all}" = "all" ] || [ "${1:-all}" = "tests+moe" ]; then
  stage tests 420 python3 -m pytest -q -rs tests/parallel/test_multiprocess.py tests/unit/test_autotune.py tests/e2e/test_resume.py -m gpu
fi
if [ "${1:-all}" = "bench" ] || [ "${1:-all}" = "all" ]; then
  stage tps 420 python3 bench/multiprocess.py --config configs/mh_latent_moe_hp_2.2b.yaml --processes 1 2 --steps 10 \
      --set data.source=builtin --set data.path= --set data.val_path= --set data.tokenizer=byte \
      --set data.val_fraction=0.1 --set parallel.hp=2 --set train.micro_batch=8 \
      --out "$OUT/multiprocess-2.2b-hp2.jsonl"
fi
if [ "${1:-all}" = "moe" ] || [ "${1:-all}" = "all" ] || [ "${1:-all}" = "tests+moe" ]; then
  stage tps_moe 420 python3 bench/multiprocess.py --config configs/moe_ep_2.2b.yaml --processes 1 2 --steps 10 \
      --set data.source=builtin --set data.path= --set data.val_path= --set data.tokenizer=byte \
      --set data.val_fraction=0.1 --set parallel.ep=2 --set train.micro_batch=4 \
      --out "$OUT/multiprocess-moe-2.2b-ep2.jsonl"
fi
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
