#!/bin/bash
# The layer with jax-triton's kernels recorded into XLA's command buffers (CUDA graphs) or not (bench/NOTES.md, Layer,
# Session 35). Per XLA flag set, one process each (own compilation cache): bench/cmdbuf_probe.py (which kernels the
# compiled fwd+bwd records into command buffers), then bench/layer.py at 8192 tokens (inner 3 and 30), then 81920 at
# one row. From the repo root on the device machine, after installing the carried wheels. Files in $OUT: run.log,
# probe.jsonl, layer_flags.jsonl (a `flags` field per record).
OUT=${OUT:-/tmp/cmdbuf_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
CC="--xla_gpu_enable_command_buffer=+CUSTOM_CALL"
LEGACY="--legacy_command_buffer_custom_call_targets=triton_kernel_call"
i=0
for flags in "" "$CC" "$CC $LEGACY" "" "$CC $LEGACY"; do
    i=$((i + 1))
    export XLA_FLAGS="$flags" JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache_$i
    stage "probe$i" "${T_PROBE:-90}" python3 bench/cmdbuf_probe.py --tokens 8192 --configs ${CONFIGS:-384/4/256 768/8/128} \
        --out "$OUT/probe.jsonl"
    stage "layer$i" "${T_LAYER:-150}" python3 bench/layer.py --tokens 8192 --configs ${CONFIGS:-384/4/256 768/8/128} \
        --router triton --inner 3 30 --out "$OUT/layer_$i.jsonl"
    python3 -c "import json,sys; [print(json.dumps(dict(json.loads(l), flags=sys.argv[1]))) for l in open(sys.argv[2])]" \
        "$flags" "$OUT/layer_$i.jsonl" >> "$OUT/layer_flags.jsonl" 2>/dev/null
done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
