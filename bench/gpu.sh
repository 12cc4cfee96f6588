#!/usr/bin/env bash
# Runs test and benchmark suites on a GPU machine, from the repo root there:
#     bash bench/gpu.sh SUITE...      e.g.  bash bench/gpu.sh tests-1      bash bench/gpu.sh layer train
# Suites:
#   tests-1 .. tests-5  the GPU tests (`pytest -m gpu`), split into five sets of test files that each finish in under
#                       ~8 minutes on one H200; together they are the whole GPU suite. tests-5 is tests/parallel,
#                       whose GPU tests need 2 GPUs (~6.5 minutes on two H200s) and skip on one. `tests` runs all
#                       five, one after the other.
#   tests-at-once       tests-1, tests-2 and tests-3 as three processes at once (they share the GPU; tests-4, whose
#                       memory tests fill the GPU, runs on its own)
#   layer               bench.layer at 8192 and 81920 tokens (the layer table)
#   layer-collapsed     bench.layer at 16384 tokens (the 2.2B step's micro-batch) with every token on the same k
#                       experts of each head, as the step's routing is after its first steps (the expert backward's
#                       chunks of long tiles)
#   train               bench.train_scale on 1 GPU: the dense MLP 0.2B and the 2.2B MH-LatentMoE, MoE and LatentMoE
#                       configs in one process (the step table of docs/performance.md), micro-batch 8, global batch
#                       32 x 2048
#   profile             bench.step_profile of the same four, XLA's command buffers off (every kernel names its op),
#                       and its picture (bench.step_plot)
#   attention           bench.tools.attention_tiles: the Triton flash attention's tile sweep beside cuDNN (the
#                       attention table of docs/performance.md)
#   loss                bench.loss --sweep: the LM head loss's kernel and its tiles against XLA's form
#   a2a                 bench.a2a over every visible GPU
#   chunks              bench.a2a --layer: the 2.2B layer's executor at parallel.hp_chunks 1, 2, 4 on one GPU (their
#                       overhead) and, with more GPUs, on data 1 x hp (all of them, up to 8) x ep 1 (their overlap)
# Wheels carried in .whl/ (bench/tools/fetch_gpu_wheels.sh) are installed first. Every stage runs under `timeout`
# (T_LIMIT seconds, default 570) and a failed or timed-out stage does not stop the next. Logs and JSON lines go to
# ${OUT:-/tmp/bench_out}; the exit status is 1 when any stage failed.
set -uo pipefail

if [ $# -eq 0 ]; then
    sed -n '2,25p' "$0"
    exit 2
fi
OUT=${OUT:-/tmp/bench_out}
LIMIT=${T_LIMIT:-570}
mkdir -p "$OUT" /tmp/home /tmp/triton_cache /tmp/inductor /tmp/jax_cache
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export HOME=/tmp/home TRITON_CACHE_DIR=/tmp/triton_cache MHL_TRITON_CACHE=/tmp/triton_cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache \
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

TESTS_1="tests/kernels/test_experts_gpu.py tests/kernels/test_experts_kernel.py tests/kernels/test_experts_binding.py"
TESTS_2="tests/kernels/test_router_kernel.py tests/kernels/test_router_gpu.py tests/kernels/test_router_binding.py
         tests/kernels/test_packing.py tests/kernels/test_combine.py tests/kernels/test_experts_grouped.py
         tests/kernels/test_kernels_in_model.py"
TESTS_3="tests/e2e/test_gpu_train.py tests/e2e/test_infer.py tests/e2e/test_resume.py tests/unit/test_remat.py
         tests/unit/test_wide_router.py"
TESTS_5="tests/parallel/test_multiprocess.py tests/parallel/test_shard_optimizer.py"
# tests-4: every other file with GPU tests, so that the five suites are always the whole GPU suite
TESTS_4=$(grep -rl --include='test_*.py' 'mark.gpu' tests | sort | while read -r f; do
    case " $(echo $TESTS_1 $TESTS_2 $TESTS_3 $TESTS_5) " in *" $f "*) ;; *) echo "$f" ;; esac
done)

LOG="$OUT/run.log"
t0=$(date +%s)
failed=()

stage() {  # stage NAME CMD...: run CMD under the time limit into $OUT/NAME.log, record its failure, go on
    local name=$1
    shift
    echo "=== [$(( $(date +%s) - t0 )) s] $name (limit $LIMIT s): $*" | tee -a "$LOG"
    timeout -k 10 "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$rc" > "$OUT/$name.rc"
    tail -n 25 "$OUT/$name.log" | tee -a "$LOG"
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && echo "=== $name timed out after $LIMIT s" | tee -a "$LOG"
    echo "=== $name rc=$rc" | tee -a "$LOG"
    [ "$rc" = 0 ] || failed+=("$name")
}

tests() {  # tests NAME FILES...
    local name=$1
    shift
    stage "$name" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=20 "$@"
}

nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
for suite in "$@"; do
    case "$suite" in
        tests-1) tests tests-1 $TESTS_1 ;;
        tests-2) tests tests-2 $TESTS_2 ;;
        tests-3) tests tests-3 $TESTS_3 ;;
        tests-4) tests tests-4 $TESTS_4 ;;
        tests-5) tests tests-5 $TESTS_5 ;;
        tests) for i in 1 2 3 4 5; do v="TESTS_$i"; tests "tests-$i" ${!v}; done ;;
        tests-at-once)
            # each in a subshell of its own (its `failed` is lost there: read back from its .rc file)
            for i in 1 2 3; do v="TESTS_$i"; tests "tests-$i" ${!v} & done
            wait
            for i in 1 2 3; do [ "$(cat "$OUT/tests-$i.rc" 2>/dev/null)" = 0 ] || failed+=("tests-$i"); done ;;
        layer) stage layer python3 -m bench.layer --tokens 8192 81920 --out "$OUT/layer.jsonl" ;;
        layer-collapsed)
            stage layer-collapsed python3 -m bench.layer --tokens 16384 --routing collapsed \
                --out "$OUT/layer_collapsed.jsonl" ;;
        train)
            stage train python3 -m bench.train_scale --devices 1 --steps 5 --warmup 1 --set train.micro_batch=8 \
                --config configs/mlp_0.2b.yaml --config configs/mh_latent_moe_hp_2.2b.yaml \
                --config configs/moe_ep_2.2b.yaml --config configs/latent_moe_ep_2.2b.yaml \
                --out "$OUT/train_scale.jsonl" ;;
        profile)
            stage profile env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 -m bench.step_profile \
                --out "$OUT/step_profile.jsonl"
            stage profile-plot python3 -m bench.step_plot "$OUT/step_profile.jsonl" --out "$OUT/step_profile.png" ;;
        attention) stage attention python3 -m bench.tools.attention_tiles --out "$OUT/attention.jsonl" ;;
        loss) stage loss python3 -m bench.loss --sweep --out "$OUT/loss.jsonl" ;;
        a2a) stage a2a python3 -m bench.a2a --out "$OUT/a2a.jsonl" ;;
        chunks)
            stage chunks-1 python3 -m bench.a2a --layer --mesh 1 1 1 --chunks 1 2 4 --out "$OUT/chunks.jsonl"
            n=$(nvidia-smi -L | wc -l); [ "$n" -gt 8 ] && n=8
            [ "$n" -gt 1 ] && stage "chunks-$n" python3 -m bench.a2a --layer --mesh 1 "$n" 1 --chunks 1 2 4 \
                --out "$OUT/chunks.jsonl" ;;
        *) echo "unknown suite '$suite' (see: bash bench/gpu.sh)" | tee -a "$LOG"; failed+=("$suite") ;;
    esac
done
echo "total $(( $(date +%s) - t0 )) s; failed: ${failed[*]:-none}" | tee -a "$LOG"
[ ${#failed[@]} -eq 0 ]
