"""The Gluon expert forward (`kernels/gluon_experts.py`) against the Triton one (`expert_fwd_kernel`, default
tile) on the same packed inputs, one process, each kernel alone (CUDA events via do_bench, 3 rotating input
sets). Hopper only.

    python bench/gluon_fwd.py [--shapes 81920/384/4/256 ...] [--tiles 128,32,8,3 ...] [--out FILE]

One JSON line per (shape, kernel, tile): ms (median), TFLOP/s of the two matmuls, rel: relative difference of
the output rows to the Triton kernel's (bf16 rounding of the same function: ~1e-3 expected).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.kernel_tiles import expert_weights, input_set  # noqa: E402
from bench.timing import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["81920/384/4/256", "81920/768/8/128", "8192/384/4/256"],
                    help="tokens/Ne/k/de")
    ap.add_argument("--tiles", nargs="+", default=["128,32,8,4", "r,32,8", "r,64,8"],
                    help="block_m,block_e,num_warps,num_stages of the Gluon kernel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from triton.testing import do_bench

    from kernels.experts import default_config
    from kernels.gluon_experts import gluon_experts_fwd, gluon_experts_fwd_resident, gluon_experts_fwd_ws
    from kernels.torch_experts import experts_fwd

    nh, dh = 8, 128
    date, device = datetime.date.today().isoformat(), torch.cuda.get_device_name()
    outf = open(args.out, "a") if args.out else None
    rows = []
    for shape in args.shapes:
        tokens, ne, k, de = (int(v) for v in shape.split("/"))
        g = torch.Generator(device="cuda").manual_seed(0)
        cfg = default_config(tokens * nh * k, nh * ne, dh, de)
        sets = [input_set(tokens, ne, k, cfg.pack_block, g, nh, dh) for _ in range(3)]
        w1, w2 = expert_weights(ne, de, g, nh, dh)
        flops = 2 * 2 * tokens * nh * k * dh * de

        def triton_fwd(s):
            return experts_fwd(s[0], s[3].row_slot, s[3].block_group, w1, w2, k, cfg)

        t = cfg.fwd
        variants = [("triton", [t.block_m, t.block_e, t.num_warps, t.num_stages], triton_fwd)]
        for spec in args.tiles:
            if spec.startswith("ws,"):  # warp-specialised: ws,block_e,ns[,consumer_regs,producer_regs,maxnreg]
                vals = [int(v) for v in spec.split(",")[1:]]
                variants.append(("gluon_ws", vals, lambda s, v=tuple(vals): gluon_experts_fwd_ws(
                    s[0], s[3], w1, w2, k, cfg.pack_block, *v)))
                continue
            if spec.startswith("r,"):  # the weight-stationary persistent kernel: r,block_e,num_warps
                be, nw = (int(v) for v in spec.split(",")[1:])
                variants.append(("gluon_r", [cfg.pack_block, be, nw], lambda s, t=(be, nw): gluon_experts_fwd_resident(
                    s[0], s[3], w1, w2, k, cfg.pack_block, *t)))
                continue
            bm, be, nw, ns = (int(v) for v in spec.split(","))
            variants.append(("gluon", [bm, be, nw, ns], lambda s, t=(bm, be, nw, ns): gluon_experts_fwd(
                s[0], s[3].row_slot, s[3].block_group, w1, w2, k, cfg.pack_block, *t)))
        ref = triton_fwd(sets[0]).double()
        for name, tile, fn in variants:
            rec = dict(bench="gluon_fwd", kernel=name, device=device, date=date,
                       params=dict(tokens=tokens, nh=nh, dh=dh, k=k, ne=ne, de=de, pack_block=cfg.pack_block,
                                   tile=tile))
            try:
                out = fn(sets[0]).double()
                rec["rel"] = float((out - ref).norm() / ref.norm())
                rec["max_abs"] = float((out - ref).abs().max())
                state = {"i": 0}

                def step():
                    state["i"] += 1
                    fn(sets[state["i"] % len(sets)])

                rec["ms"] = float(do_bench(step, warmup=25, rep=200, return_mode="median"))
                rec["tflops"] = flops / rec["ms"] / 1e9
            except Exception as e:  # a tile that does not compile or launch is reported, the sweep goes on
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            emit(rec, outf)
            rows.append(rec)
    print(f"\n{'shape':>16} {'kernel':>8} {'tile':>16} {'ms':>7} {'TF/s':>6} rel")
    for r in rows:
        p = r["params"]
        shape = f"{p['tokens']}/{p['ne']}/{p['k']}/{p['de']}"
        if "ms" in r:
            print(f"{shape:>16} {r['kernel']:>8} {str(r['params']['tile']):>16} {r['ms']:7.3f} {r['tflops']:6.1f} "
                  f"{r['rel']:.1e}")
        else:
            print(f"{shape:>16} {r['kernel']:>8} {str(r['params']['tile']):>16} error {r['error'][:80]}")


if __name__ == "__main__":
    main()
