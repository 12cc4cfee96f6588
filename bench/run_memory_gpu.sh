#!/bin/bash
# Device memory (session 39, 2026-11-27): the GPU tests of tests/unit/test_memory.py, the allocator's limit under JAX's
# defaults, and bench/memory.py: which paper configs fit one GPU (train.py's memory line, its refusal or the
# measured peak) and, on 2 GPUs, the state created eagerly vs in its shardings (4.2B at hp = 2) and that run's
# steps. Argument: one (1 GPU: tests, limits, the 2.2B at micro-batch 16 and 32), one42 (1 GPU: the 4.2B configs),
# two (2 GPUs), two_so (2 GPUs: parallel.shard_optimizer, data-parallel 2.2B off / on and the 4.2B on), remat (1 GPU:
# model.remat=block against none), moments (1 GPU: the 4.2B with bf16 AdamW moments).
set -o pipefail
OUT=${OUT:-/tmp/memory_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
R="$OUT/memory.jsonl"
U="env -u XLA_PYTHON_CLIENT_PREALLOCATE"  # JAX's default allocator settings, as a user runs train.py
LIMIT_PY="import jax, json, os; d = jax.local_devices()[0]; s = d.memory_stats(); print(json.dumps({'bench': \
'memory_limit', 'preallocate': os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', 'default'), 'jax': jax.__version__, \
'device': d.device_kind, 'bytes_limit_gib': s['bytes_limit'] / 2**30, 'bytes_in_use_gib': s['bytes_in_use'] / 2**30}))"
limits() {
  $U python3 -c "$LIMIT_PY" | tee -a "$R"
  python3 -c "$LIMIT_PY" | tee -a "$R"
}
bench() {  # bench NAME LIMIT init|fit --config FILE [--set ...]: bench/memory.py under JAX's default allocator
  local name=$1 limit=$2; shift 2
  stage "$name" "$limit" $U python3 bench/memory.py "$@" --out "$R"
}
tests() {
  stage tests 300 python3 -m pytest -q -rs tests/unit/test_memory.py -m gpu
}
case "${1:-one}" in
one)
  limits
  tests
  bench check-2.2b 200 fit --check --config configs/mh_latent_moe_hp_2.2b.yaml --set train.micro_batch=16
  bench check-4.2b 200 fit --check --config configs/mh_latent_moe_hp_4.2b.yaml
  bench fit-2.2b-mb16 200 fit --config configs/mh_latent_moe_hp_2.2b.yaml --set train.micro_batch=16
  bench fit-2.2b-mb32 200 fit --config configs/mh_latent_moe_hp_2.2b.yaml --set train.micro_batch=32 \
      --set train.global_batch=64
  ;;
one42)
  bench fit-4.2b 200 fit --config configs/mh_latent_moe_hp_4.2b.yaml
  bench fit-4.2b-moe 200 fit --config configs/moe_ep_4.2b.yaml
  ;;
two)
  limits
  tests
  bench init-4.2b-hp2 300 init --config configs/mh_latent_moe_hp_4.2b.yaml --set parallel.hp=2
  bench fit-4.2b-hp2 240 fit --config configs/mh_latent_moe_hp_4.2b.yaml --set parallel.hp=2 --steps 6
  ;;
two_so)  # parallel.shard_optimizer (session 40; CPU-counted state per GPU 24.68 -> 16.45 GiB at data 2)
  stage tests-so 300 python3 -m pytest -q -rs tests/parallel/test_shard_optimizer.py tests/unit/test_memory.py -m gpu
  bench fit-2.2b-data2 240 fit --config configs/mh_latent_moe_hp_2.2b.yaml --set parallel.hp=1 --steps 8
  bench fit-2.2b-data2-so 240 fit --config configs/mh_latent_moe_hp_2.2b.yaml --set parallel.hp=1 --steps 8 \
      --set parallel.shard_optimizer=true
  bench fit-4.2b-data2-so 240 fit --config configs/mh_latent_moe_hp_4.2b.yaml --set parallel.hp=1 --steps 8 \
      --set parallel.shard_optimizer=true
  ;;
remat)  # model.remat=block (session 41, not yet measured): tests, the 2.2B at micro-batch 16 none / block (the
  # baseline rerun in this call), micro-batch 32 block, the 4.2B --check with block
  stage tests-remat 300 python3 -m pytest -q -rs tests/unit/test_remat.py -m gpu
  bench fit-2.2b-mb16 200 fit --config configs/mh_latent_moe_hp_2.2b.yaml --set train.micro_batch=16
  bench fit-2.2b-mb16-remat 200 fit --config configs/mh_latent_moe_hp_2.2b.yaml --set train.micro_batch=16 \
      --set model.remat=block
  bench fit-2.2b-mb32-remat 200 fit --config configs/mh_latent_moe_hp_2.2b.yaml --set train.micro_batch=32 \
      --set train.global_batch=64 --set model.remat=block
  bench check-4.2b-remat 200 fit --check --config configs/mh_latent_moe_hp_4.2b.yaml --set model.remat=block
  ;;
moments)  # optimizer.moment_dtype=bfloat16 (session 41, not yet measured; counted state 47.22 -> 31.48 GiB): the
  # 4.2B configs on one GPU (predicted 74.49 -> ~58.8 GiB for MH-LatentMoE, 75.44 -> ~59.8 for MoE), with remat too
  bench check-4.2b-bf16m 200 fit --check --config configs/mh_latent_moe_hp_4.2b.yaml \
      --set optimizer.moment_dtype=bfloat16
  bench fit-4.2b-bf16m 300 fit --config configs/mh_latent_moe_hp_4.2b.yaml --set optimizer.moment_dtype=bfloat16
  bench fit-4.2b-bf16m-remat 300 fit --config configs/mh_latent_moe_hp_4.2b.yaml \
      --set optimizer.moment_dtype=bfloat16 --set model.remat=block
  bench check-4.2b-moe-bf16m-remat 200 fit --check --config configs/moe_ep_4.2b.yaml \
      --set optimizer.moment_dtype=bfloat16 --set model.remat=block
  ;;
esac
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
