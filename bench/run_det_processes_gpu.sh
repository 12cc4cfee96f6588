#!/bin/bash
# One single-GPU call (~6 min on an H100): do fresh processes give the 2.2B MH-LatentMoE step the same losses?
# Four processes, each with its own empty JAX compilation cache (so none reuses another's compiled step):
#   a, b:  default XLA flags; each dumps XLA's autotuning results (a.txt, b.txt) -> losses a vs b, choices a vs b
#   load:  loads a.txt (--xla_gpu_load_autotune_results_from) -> losses vs a
#   lvl0:  --xla_gpu_autotune_level=0 (no autotuning) -> step time vs a
# From the repo root on the device machine, after installing the carried wheels (see run_table_gpu.sh).
# Files in $OUT: run.log, det.jsonl (one train_scale line per process, in the order above), a.txt, b.txt.
set -o pipefail
OUT=${OUT:-/tmp/det_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
CFG=${DET_CONFIG:-configs/mh_latent_moe_hp_2.2b.yaml}
run() {  # run NAME XLA_FLAGS
    stage "det_$1" "${T_DET:-150}" env XLA_FLAGS="$2" JAX_COMPILATION_CACHE_DIR="/tmp/jc_$1" \
        python3 bench/train_scale.py --config "$CFG" --devices 1 --steps "${DET_STEPS:-3}" \
        --set train.micro_batch=8 --out "$OUT/det.jsonl"
}
run a "--xla_gpu_dump_autotune_results_to=$OUT/a.txt"
run b "--xla_gpu_dump_autotune_results_to=$OUT/b.txt"
run load "--xla_gpu_load_autotune_results_from=$OUT/a.txt"
run lvl0 "--xla_gpu_autotune_level=0"
python3 - "$OUT/det.jsonl" <<'PY' | tee -a "$LOG"
import json, struct, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
names = ["a", "b", "load", "lvl0"]
hexs = lambda r: [struct.pack(">f", x).hex() for x in r["losses"]]
for n, r in zip(names, rows):
    print(n, "step_s %.4f" % r["step_s"], "losses", r["losses"], hexs(r))
if len(rows) >= 2:
    print("a == b bitwise:", hexs(rows[0]) == hexs(rows[1]))
if len(rows) >= 3:
    print("a == load bitwise:", hexs(rows[0]) == hexs(rows[2]))
PY
cmp -s "$OUT/a.txt" "$OUT/b.txt" && echo "autotune results a == b" | tee -a "$LOG" || echo "autotune results a != b" | tee -a "$LOG"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
