"""Experts wider than dh = 128 on Triton: the fused IO-aware kernels (with the dh = 128 tiles, and with
the wide tiles `kernels.triton.experts.default_config` now picks above 128) against the grouped-GEMM kernels.
Decides which path `ffn.kernels=triton` takes for 128 < dh <= 256 (`kernels_select.MAX_TRITON_EXPERT_WIDTH`).

    python bench/wide_experts.py [--out FILE] [--child-timeout 90]

Each (shape, path) runs in a child process under a timeout, so a kernel that spills so badly that it
never finishes costs one line, not the run. Per line: compile + first call seconds, forward and
forward+backward ms (bench/timing.time_jax), TFLOP/s of the expert matmuls, and the largest |difference|
of y against the grouped path (the first that finished) as a sanity check.
Shapes (x bf16, weights bf16, uniform routing with k = 4 distinct experts): the small d = 256 MoE of
bench/train_2gpu.py (1 head, Ne 16, de 128), a wider one (Ne 64, de 256), and dh = 128 as a control.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [  # (tokens, heads, dh, ne, de)
    (16384, 1, 256, 16, 128),
    (32768, 1, 256, 64, 256),
    (32768, 2, 128, 64, 256),
]
PATHS = ("grouped", "fused_wide", "fused_dh128_tiles")
K = 4


def child(path: str, tokens: int, heads: int, dh: int, ne: int, de: int) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.experts import make_inputs
    from bench.timing import time_jax
    from kernels.triton.experts import default_config
    from mhl_jax.moe.gpu.experts import expert_ffn_triton
    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    x, idx, gates, w1, w2, wy = make_inputs(0, tokens, ne, de, nh=heads, dh=dh, k=K)
    slots, groups = tokens * heads * K, heads * ne
    if path == "grouped":
        def op(x, g, w1, w2, i):
            return expert_ffn_grouped(x, i, g, w1, w2)[0]
    else:  # fused_wide: the default for this dh; fused_dh128_tiles: what default_config gave before
        cfg = default_config(slots, groups, dh if path == "fused_wide" else 128, de)

        def op(x, g, w1, w2, i):
            return expert_ffn_triton(x, i, g, w1, w2, cfg=cfg)[0]

    def loss(x, g, w1, w2, i):
        return jnp.sum(op(x, g, w1, w2, i).astype(jnp.float32) * wy.astype(jnp.float32))

    fwd = jax.jit(op)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    args = (x, gates, w1, w2, idx)
    t0 = time.perf_counter()
    y = jax.block_until_ready(fwd(*args))
    jax.block_until_ready(bwd(*args))
    compile_s = time.perf_counter() - t0
    ms_fwd = time_jax(fwd, [args])
    ms = time_jax(bwd, [args])
    flops = slots * 4.0 * dh * de
    ynp = jax.device_get(y.astype(jnp.float32))
    import numpy as np

    np.save(f"/tmp/wide_y_{tokens}_{heads}_{dh}_{ne}_{de}_{path}.npy", ynp)
    return dict(compile_s=compile_s, ms_fwd=ms_fwd, ms=ms, tflops_fwd=flops / ms_fwd / 1e9,
                tflops=3 * flops / ms / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-timeout", type=float, default=90.0)
    ap.add_argument("--child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        path, *dims = args.child
        print("RESULT " + json.dumps(child(path, *map(int, dims))), flush=True)
        return
    import numpy as np

    from bench.timing import emit

    outf = open(args.out, "a") if args.out else None
    device = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"],
                            capture_output=True, text=True).stdout.strip()
    for tokens, heads, dh, ne, de in SHAPES:
        first = None
        for path in PATHS:
            if path == "fused_dh128_tiles" and dh <= 128:
                continue
            rec = dict(bench="wide_experts", path=path, device=device, date=str(datetime.date.today()),
                       params=dict(tokens=tokens, heads=heads, dh=dh, ne=ne, de=de, k=K))
            cmd = [sys.executable, os.path.abspath(__file__), "--child", path, *map(str, (tokens, heads, dh, ne, de))]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if line:
                    rec.update(json.loads(line[-1][len("RESULT "):]))
                    y = np.load(f"/tmp/wide_y_{tokens}_{heads}_{dh}_{ne}_{de}_{path}.npy")
                    if first is None:
                        first = (path, y)
                    else:
                        rec["max_abs_diff_vs_" + first[0]] = float(np.max(np.abs(y - first[1])))
                        rec["max_abs_y"] = float(np.max(np.abs(first[1])))
                else:
                    rec["error"] = f"rc={proc.returncode}: " + (proc.stderr or proc.stdout)[-600:]
            except subprocess.TimeoutExpired:
                rec["error"] = f"timed out after {args.child_timeout} s"
            rec["wall_s"] = time.perf_counter() - t0
            emit(rec, outf)


if __name__ == "__main__":
    main()
