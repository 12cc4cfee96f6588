# Sourced by the one-call GPU scripts (run_experts_gpu.sh, run_wide_gpu.sh): environment for the device
# machine and `stage`. Needs OUT set; defines LOG and t0.
mkdir -p "$OUT" /tmp/home /tmp/inductor /tmp/triton_cache /tmp/jax_cache
export HOME=/tmp/home TORCHINDUCTOR_CACHE_DIR=/tmp/inductor MHL_TRITON_CACHE=/tmp/triton_cache \
    TRITON_CACHE_DIR=/tmp/triton_cache XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 MHL_TEST_GPU=1 \
    JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
unset TRITON_INTERPRET
LOG="$OUT/run.log"
t0=$(date +%s)
stage() {  # stage NAME LIMIT CMD...: run under timeout, log, never abort the script
    local name=$1 limit=$2; shift 2
    echo "=== [$(( $(date +%s) - t0 )) s] $name (limit $limit s): $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && echo "{\"stage\": \"$name\", \"error\": \"timed out after $limit s\"}" | tee -a "$LOG"
    echo "=== $name rc=$rc" | tee -a "$LOG"
}
