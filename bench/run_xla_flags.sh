#!/bin/bash
# The layer (bench/layer.py, Triton router and experts) at 8192 tokens under XLA flag sets, one process each (own
# compilation cache): where the launch gaps between kernels go (bench/NOTES.md, Layer, session 19). From the repo root
# on the device machine, after installing the carried wheels. Files in $OUT: run.log, layer_flags.jsonl (a `flags`
# field per record).
OUT=${OUT:-/tmp/flags_out}
source "$(dirname "$0")/gpu_stage.sh"
TOKENS=${TOKENS:-8192}
i=0
for flags in "" "--xla_gpu_graph_min_graph_size=1" \
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" \
    "--xla_gpu_enable_command_buffer="; do
    i=$((i + 1))
    stage "flags$i" "${T_FLAGS:-150}" env XLA_FLAGS="$flags" JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache_$i \
        python3 bench/layer.py --tokens $TOKENS --router triton --variants default --out "$OUT/layer_$i.jsonl"
    python3 -c "import json,sys; [print(json.dumps(dict(json.loads(l), flags=sys.argv[1]))) for l in open(sys.argv[2])]" \
        "$flags" "$OUT/layer_$i.jsonl" >> "$OUT/layer_flags.jsonl" 2>/dev/null
done
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
