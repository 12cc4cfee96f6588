#!/bin/bash
# One single-GPU call (~6 min on an H100): the LM head's loss in chunks (`mhl_jax.model.gpt.HEAD_LOSS_CHUNK`, the
# default) against the whole fp32 logits (HEAD_LOSS_CHUNK=0), each in its own process on the same machine
# (bench/train_scale.py: the 1-GPU 2.2B MH-LatentMoE step, global batch 32): micro-batch 8 new / baseline / new, then
# micro-batch 16 new / baseline (the baseline ran out of memory there on 2026-11-26), then the GPU train tests.
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_head_loss_gpu.sh
set -o pipefail
OUT=${OUT:-/tmp/head_loss_out}
source "$(dirname "$0")/gpu_stage.sh"
CFG=${CONFIG:-configs/mh_latent_moe_hp_2.2b.yaml}
run() {  # run NAME MICRO CHUNK: one train_scale process with HEAD_LOSS_CHUNK=CHUNK
    stage "$1" 150 python3 -c "
import runpy, sys
import mhl_jax.model.gpt as g
g.HEAD_LOSS_CHUNK = int(sys.argv[1])
sys.argv = ['bench/train_scale.py'] + sys.argv[2:]
runpy.run_path('bench/train_scale.py', run_name='__main__')" "$3" --config "$CFG" --devices 1 --steps ${STEPS:-5} \
        --set train.micro_batch="$2" --out "$OUT/train_scale-$1.jsonl"
}
run mb8-chunk 8 4096
run mb8-whole 8 0
run mb8-chunk2 8 4096
run mb16-chunk 16 4096
run mb16-whole 16 0
stage tests 200 python3 -m pytest -q -x tests/e2e/test_gpu_train.py tests/unit/test_params.py
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
