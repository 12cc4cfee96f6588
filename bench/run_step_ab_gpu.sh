#!/bin/bash
# One single-GPU call (~2-3 min on an H100): the 1-GPU 2.2B MH-LatentMoE train step at micro-batch 8 with the code as
# it is, then with one module attribute set for the baseline (A_B="module.attribute=python value", required), each in
# its own process on the same machine (bench/train_scale.py). Session 21's head A/B was this with the plain einsum as
# `mhl_jax.model.gpt.head_logits` (the command in bench/NOTES.md), followed by tests/e2e/test_gpu_train.py.
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_step_ab_gpu.sh
set -o pipefail
OUT=${OUT:-/tmp/step_ab_out}
source "$(dirname "$0")/gpu_stage.sh"
export A_B=${A_B:?set A_B=module.attribute=value (the baseline)}  # read by the baseline from the environment
ARGS="--config ${CONFIG:-configs/mh_latent_moe_hp_2.2b.yaml} --devices 1 --steps 4 --set train.micro_batch=8"
stage new 150 python3 bench/train_scale.py $ARGS --out "$OUT/train_new.jsonl"
stage baseline 150 python3 -c "
import importlib, os, runpy, sys
key, value = os.environ['A_B'].split('=', 1)
mod, name = key.rsplit('.', 1)
setattr(importlib.import_module(mod), name, eval(value))
sys.argv = ['bench/train_scale.py'] + sys.argv[1:]
runpy.run_path('bench/train_scale.py', run_name='__main__')" $ARGS --out "$OUT/train_baseline.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
