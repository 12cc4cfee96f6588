#!/bin/bash
# One H100 call (~7 min): first the one measurement session 34 (2026-11-27) could not make (its device time ran out),
# then its checks, all passed then (bench/NOTES.md, "Next device session"):
#   pack     the loop with the step's metrics packed into one vector (loop.PACK_METRICS, on since session 34) vs a dict
#            of scalars fetched one by one, fetch-ahead on, the d-512 bf16 run of bench/loop_overlap.py with the host's
#            time per call of the loop's parts (--host-split), off / on / off / on in one process: predicted ~-1 ms of
#            ~7.2 per step (session 34 measured the fetch at 1.37 ms per step with 13 scalars); if it is not faster,
#            set PACK_METRICS False (or take PackedMetrics out)
#   test     tests/test_combine.py's GPU test of the packing metadata on Triton and the converting forward against the
#            XLA paths, every gradient bitwise, also at 64-row packing blocks and de 256 where the converting forward
#            runs 32-wide de chunks and the plain one 64 (session 33's tile; written after that session's device time
#            ran out)
#   train    the train loop's GPU tests with session 34's fetch-ahead loop: train steps bitwise repeatable, exact
#            resume across processes (tests/test_gpu_train.py, tests/test_resume.py -m gpu)
#   loop     bench/loop_overlap.py: the loop's step period with fetch-ahead off / on, same process, losses bitwise
# (Session 33's trace over 30 calls and layer --inner 3 30 are in bench/NOTES.md, Layer, Session 33.)
# From the repo root on the device machine, after installing the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; bash bench/run_next_gpu.sh
# Stage limits T_PACK T_TEST T_TRAIN T_LOOP (s). Files in $OUT: run.log, pack.jsonl, test.log, train.log, loop.jsonl.
set -o pipefail
export OUT=${OUT:-/tmp/next_out}
source "$(dirname "$0")/gpu_stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$LOG"
stage pack "${T_PACK:-150}" python3 -c "
import json, os, tempfile
from pathlib import Path
from bench import loop_overlap as lo
from mhl_jax.train import loop
for pack in (False, True, False, True):
    loop.PACK_METRICS = pack
    r = lo.run_once('configs/tiny_mh_latent_moe.yaml', lo.DEFAULT_RUNS[1][2], 40, True, Path(tempfile.mkdtemp()),
                    host_split=True)
    line = json.dumps({'bench': 'loop_pack_metrics', 'pack_metrics': pack, 'fetch_ahead': True, 'ms': r['step_ms'],
                       'loss_last': r['losses'][-1], **r['trace']})
    print(line, flush=True)
    open(os.environ['OUT'] + '/pack.jsonl', 'a').write(line + '\\n')
"
stage test "${T_TEST:-150}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_combine.py \
    -k metadata_and_converting > $OUT/test.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR)|passed|failed|Error' \
    $OUT/test.log | tail -n 20; exit \$rc"
stage train "${T_TRAIN:-400}" bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_gpu_train.py \
    tests/test_resume.py > $OUT/train.log 2>&1; rc=\$?; grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error' \
    $OUT/train.log | tail -n 20; exit \$rc"
stage loop "${T_LOOP:-180}" python3 bench/loop_overlap.py --steps 60 --rounds ${ROUNDS:-2} ${TRACE:+--trace} \
    --out "$OUT/loop.jsonl"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
