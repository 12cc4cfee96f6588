#!/bin/bash
# One single-GPU call (~5 min on an H100): the LM head's custom VJP (bf16 backward matmuls, session 21) against plain
# autodiff of the einsum (fp32 x bf16 backward matmuls: TF32 GEMMs), the 1-GPU 2.2B MH-LatentMoE step at micro-batch 8
# (bench/train_scale.py; the plain head monkeypatched in for the baseline, same machine), then the GPU train tests.
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_head_gpu.sh
set -o pipefail
OUT=${OUT:-/tmp/head_out}
source "$(dirname "$0")/gpu_stage.sh"
ARGS="--config configs/mh_latent_moe_hp_2.2b.yaml --devices 1 --steps 4 --set train.micro_batch=8"
stage head_vjp 150 python3 bench/train_scale.py $ARGS --out "$OUT/train_head.jsonl"
stage head_plain 150 python3 -c "
import sys, runpy, jax.numpy as jnp
import mhl_jax.model.gpt as g
g.head_logits = lambda x, w: jnp.einsum('btd,dv->btv', x, w, preferred_element_type=jnp.float32)
sys.argv = ['bench/train_scale.py'] + sys.argv[1:]
runpy.run_path('bench/train_scale.py', run_name='__main__')" $ARGS --out "$OUT/train_head_plain.jsonl"
stage gpu_train "${T_TESTS:-200}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_gpu_train.py \
    > $OUT/tests.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed' $OUT/tests.log | tail; exit \$rc"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
