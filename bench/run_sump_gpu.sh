source bench/gpu_stage.sh
stage tests 230 bash -c "python3 -m pytest -q -p no:cacheprovider -rA tests/test_experts_kernel.py -k 'test_gpu_ws_fused_bwd_vs_f64_and_triton and xw and 256' > $OUT/tests.log 2>&1; rc=\$?; grep -E '^(FAILED|ERROR)|passed|failed' $OUT/tests.log | tail -n 6; exit \$rc"
stage bench 150 python3 bench/gluon_kernels.py --kinds bwd --shapes 81920/384/4/256 81920/768/4/256 --routing layer --out $OUT/bwd.jsonl
stage layer 150 python3 bench/layer.py --tokens 81920 --configs 384/4/256 768/4/256 --router triton --variants default --out $OUT/layer.jsonl
