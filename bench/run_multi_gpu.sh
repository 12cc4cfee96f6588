#!/bin/bash
# Multi-GPU device calls (issues 4 and 7), one phase per call, on nvidia-h200-x4 (or -x2 for p2).
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_multi_gpu.sh p2|p4|scale|scale4
# p2|p2check: GPUs 0,1: bench/a2a.py at P=2 (+ EP layer check, 1-vs-2-GPU training losses, in-layer HP cost);
#        meanwhile GPUs 2,3: the tiny MH-LatentMoE trained with Triton kernels under Head Parallel (hp=2).
# p2train: GPUs 0,1 (nvidia-h200-x2 is enough, ~4 min): bench/train_2gpu.py with each set of XLA options
#        (OPTS, default "none det nopass default"), then with WITH_TEST=1 the GPU pytest tests/e2e/test_gpu_train.py.
# p4:    all 4 GPUs: bench/a2a.py at P=4 with the in-layer HP cost.
# scale: bench/train_scale.py, the 2.2B configs on 1, 2 and 4 GPUs (loss check, tokens/s, memory, comm split).
#        MoE / LatentMoE with the grouped-GEMM experts: ... scale --config configs/moe_ep_2.2b.yaml \
#        --set ffn.kernels=triton --set parallel.ep=4 --devices 1 4
# scale4: all 4 GPUs (~6 of the call's 10 min): bench/train_scale.py on 4 and 1 GPU(s), one process per config
#        (exact memory peaks), each under its own limit: MH-LatentMoE 2.2B hp=4 (T_HP, default 220 s), then
#        MoE 2.2B ep=4 (the rest of BUDGET, default 540 s from the start). Balancing gamma 0 (the loss check
#        compares the sharding only), no XLA deterministic-ops flag (it aborted jax-triton multi-GPU runs).
#        Expected ~150 s + ~180 s. CPU check of the EP step's memory first: bench/step_memory.py.
# Writes JSON lines and logs under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/multi_out}
DATE=${DATE:-$(date +%F)}
mkdir -p "$OUT" /tmp/home /tmp/triton_cache
export HOME=/tmp/home TRITON_CACHE_DIR=/tmp/triton_cache MHL_TRITON_CACHE=/tmp/triton_cache \
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 XLA_FLAGS=--xla_gpu_deterministic_ops=true
unset TRITON_INTERPRET
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -6
NGPU=$(nvidia-smi -L | wc -l)
t0=$(date +%s)
case "$1" in
p2|p2check)
    # p2check: only the checks and the in-layer HP cost (no Figure 3 sweep)
    CUDA_VISIBLE_DEVICES=0,1 timeout ${T_A2A:-420} python3 bench/a2a.py --train-check --hp-layer --repeats 10 \
        --ep-impls padded ragged --date "$DATE" $([ "$1" = p2check ] && echo --skip-bench) \
        --out "$OUT/a2a-$1.jsonl" > "$OUT/a2a_$1.log" 2>&1 &
    A2A=$!
    if [ "$NGPU" -ge 4 ]; then
        CUDA_VISIBLE_DEVICES=2,3 timeout ${T_A2A:-400} python3 train.py --config configs/tiny_mh_latent_moe.yaml \
            --set ffn.kernels=triton --set model.compute_dtype=bfloat16 --set parallel.hp=2 \
            --set parallel.devices=2 --set train.micro_batch=8 --set logging.run_dir=/tmp/run_triton_hp2 \
            > "$OUT/train_triton_hp2.log" 2>&1
        echo "train_triton_hp2 exit $? after $(( $(date +%s) - t0 )) s"
        grep -a "step 300/300" "$OUT/train_triton_hp2.log" | tr '\r' '\n' | grep -a "^step 300"
    fi
    wait $A2A
    echo "a2a $1 exit $? after $(( $(date +%s) - t0 )) s"
    grep -v '"impl": "ep_' "$OUT/a2a_$1.log" | tail -25 | cut -c1-600
    ;;
p2train)
    export XLA_FLAGS=  # as train.py runs: no deterministic-ops flag (it aborted jax-triton multi-GPU runs)
    CUDA_VISIBLE_DEVICES=0,1 timeout ${T_TRAIN:-400} python3 bench/train_2gpu.py --steps 5 \
        --options ${OPTS:-none det nopass default} 2>&1 | tee -a "$OUT/train_2gpu.log" | grep -a '^{' >> "$OUT/train_2gpu.jsonl"
    echo "train_2gpu exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
    cut -c1-900 "$OUT/train_2gpu.jsonl"
    [ -n "$WITH_TEST" ] && CUDA_VISIBLE_DEVICES=0,1 timeout ${T_TEST:-150} python3 -m pytest -q -m gpu \
        -p no:cacheprovider -rA tests/e2e/test_gpu_train.py 2>&1 | tail -5
    ;;
p4)
    timeout 540 python3 bench/a2a.py --hp-layer --repeats 10 --ep-impls padded ragged --date "$DATE" \
        --out "$OUT/a2a-p4.jsonl" > "$OUT/a2a_p4.log" 2>&1
    echo "a2a p4 exit $? after $(( $(date +%s) - t0 )) s"
    tail -25 "$OUT/a2a_p4.log"
    ;;
scale)
    shift
    timeout ${T_SCALE:-560} python3 bench/train_scale.py --date "$DATE" --out "$OUT/train-scale.jsonl" "$@" \
        2>&1 | tee "$OUT/train_scale.log"
    echo "train_scale exit $? after $(( $(date +%s) - t0 )) s"
    ;;
scale4)
    export XLA_FLAGS=
    S=(--date "$DATE" --steps "${STEPS:-4}" --warmup 1 --devices 4 1 --set ffn.balance_gamma=0
       --out "$OUT/train-scale4.jsonl" ${SCALE_SETS:-})  # e.g. SCALE_SETS="--set train.micro_batch=8"
    timeout -k 10 "${T_HP:-220}" python3 bench/train_scale.py --config configs/mh_latent_moe_hp_2.2b.yaml "${S[@]}" \
        > "$OUT/scale4_hp.log" 2>&1
    echo "mh_latent_moe_hp_2.2b: exit $? after $(( $(date +%s) - t0 )) s"
    left=$(( ${BUDGET:-540} - ($(date +%s) - t0) ))
    [ "$left" -lt 120 ] && left=120
    timeout -k 10 "$left" python3 bench/train_scale.py --config configs/moe_ep_2.2b.yaml "${S[@]}" \
        > "$OUT/scale4_ep.log" 2>&1
    echo "moe_ep_2.2b (limit $left s): exit $? after $(( $(date +%s) - t0 )) s"
    for f in "$OUT/scale4_hp.log" "$OUT/scale4_ep.log"; do
        echo "== $f"
        grep -a -E '^# |^\||Error|error:' "$f" | grep -av '^  File' | tail -14 | cut -c1-700
    done
    ;;
*)
    echo "usage: bash bench/run_multi_gpu.sh p2|p2check|p2train|p4|scale|scale4 [train_scale args]"; exit 2 ;;
esac
