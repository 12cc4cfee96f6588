"""The warp-specialised Gluon expert forward (`kernels/gluon_experts.py`) against the Triton one
(`expert_fwd_kernel`, default tile) on the same packed inputs, in one process, each kernel alone (do_bench, CUDA
events, 3 rotating input sets, uniform random top-k routing). Hopper only.

    python bench/gluon_fwd.py [--shapes 81920/384/4/256 ...] [--out FILE]

One JSON line per (shape, kernel): ms (median), TFLOP/s of the two matmuls, and rel / max_abs: the difference of
the output rows to the Triton kernel's (0 when bitwise equal).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.kernel_tiles import expert_weights, input_set, rotating  # noqa: E402
from bench.timing import emit  # noqa: E402

SHAPES = ["81920/384/4/256", "81920/768/8/128", "81920/768/4/256", "81920/1536/8/128"]


def run_shape(tokens: int, ne: int, k: int, de: int, date: str, device: str, outf, nh: int = 8,
              dh: int = 128) -> list[dict]:
    """Both forward kernels at one shape (the Gluon one where `ws_supported`): one record per kernel."""
    import torch
    from triton.testing import do_bench

    from kernels.experts import default_config
    from kernels.gluon_experts import gluon_experts_fwd_ws, ws_supported
    from kernels.torch_experts import experts_fwd

    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = default_config(tokens * nh * k, nh * ne, dh, de)
    sets = [input_set(tokens, ne, k, cfg.pack_block, g, nh, dh) for _ in range(3)]
    w1, w2 = expert_weights(ne, de, g, nh, dh)
    flops = 2 * 2 * tokens * nh * k * dh * de
    kernels = {"triton": lambda s: experts_fwd(s[0], s[3].row_slot, s[3].block_group, w1, w2, k, cfg)}
    if ws_supported(dh, de, cfg.pack_block):
        kernels["gluon_ws"] = lambda s: gluon_experts_fwd_ws(s[0], s[3], w1, w2, k, cfg.pack_block)
    ref = kernels["triton"](sets[0]).double()
    recs = []
    for name, fn in kernels.items():
        rec = dict(bench="gluon_fwd", kernel=name, device=device, date=date,
                   params=dict(tokens=tokens, nh=nh, dh=dh, k=k, ne=ne, de=de, pack_block=cfg.pack_block))
        out = fn(sets[0]).double()
        rec["rel"] = float((out - ref).norm() / ref.norm())
        rec["max_abs"] = float((out - ref).abs().max())
        rec["ms"] = float(do_bench(rotating(fn, sets), warmup=25, rep=200, return_mode="median"))
        rec["tflops"] = flops / rec["ms"] / 1e9
        emit(rec, outf)
        recs.append(rec)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="tokens/Ne/k/de (Nh 8, dh 128)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = []
    for spec in args.shapes:
        try:
            shapes.append(tuple(int(v) for v in spec.split("/")))
        except ValueError:
            shapes.append(())
        if len(shapes[-1]) != 4:
            ap.error(f"--shapes {spec!r}: expected tokens/Ne/k/de, e.g. 81920/384/4/256")

    import torch

    date, device = datetime.date.today().isoformat(), torch.cuda.get_device_name()
    outf = open(args.out, "a") if args.out else None
    rows = []
    for shape in shapes:
        rows += run_shape(*shape, date=date, device=device, outf=outf)
    print(f"\n{'shape':>17} {'kernel':>8} {'ms':>7} {'TF/s':>6} rel")
    for r in rows:
        p = r["params"]
        print(f"{p['tokens']:>6}/{p['ne']}/{p['k']}/{p['de']:<4} {r['kernel']:>8} {r['ms']:7.3f} {r['tflops']:6.1f} "
              f"{r['rel']:.1e}")


if __name__ == "__main__":
    main()
