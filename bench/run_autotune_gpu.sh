#!/bin/bash
# One single-GPU call (~5 min on an H100): train.xla_autotune_file across fresh processes.
#   tests: tests/e2e/test_resume.py's GPU case (train.py stopped and resumed in fresh processes, bitwise)
#   a:     the 2.2B MH-LatentMoE step (bench/train_scale.py), writing XLA's autotuning results to $OUT/tuned.txt
#   b:     the same in a fresh process, loading them -> losses bitwise a's?
#   c:     the same in a fresh process without them (the control: does a fresh tune differ here?)
# Each process has its own empty JAX compilation cache. Files in $OUT: run.log, autotune.jsonl, tuned.txt.
set -o pipefail
OUT=${OUT:-/tmp/autotune_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage tests "${T_TESTS:-200}" env -u JAX_COMPILATION_CACHE_DIR python3 -m pytest -q -rA tests/e2e/test_resume.py -k gpu \
    -p no:cacheprovider
run() {  # run NAME [--set ...]
    local name=$1; shift
    stage "$name" "${T_RUN:-140}" env JAX_COMPILATION_CACHE_DIR="/tmp/jc_$name" python3 bench/train_scale.py \
        --config configs/mh_latent_moe_hp_2.2b.yaml --devices 1 --steps 3 --set train.micro_batch=8 \
        --out "$OUT/autotune.jsonl" "$@"
}
run a --set "train.xla_autotune_file=$OUT/tuned.txt"
run b --set "train.xla_autotune_file=$OUT/tuned.txt"
run c
python3 - "$OUT/autotune.jsonl" <<'PY' | tee -a "$LOG"
import json, struct, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
hexs = lambda r: [struct.pack(">f", x).hex() for x in r.get("losses", [])]
for n, r in zip("abc", rows):
    print(n, "step_s", r.get("step_s"), "compile_s", r.get("compile_s"), "losses", r.get("losses"), hexs(r))
if len(rows) >= 2:
    print("b (loaded) == a bitwise:", hexs(rows[0]) == hexs(rows[1]))
if len(rows) >= 3:
    print("c (fresh) == a bitwise:", hexs(rows[0]) == hexs(rows[2]))
PY
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
