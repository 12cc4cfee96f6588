"""The backward's dX combine with the softmax's backward and the router's dX folded in (`kernels/triton/combine.py`), the
kernel alone, at each of TILES, beside its parts apart in one process: the same kernel without the router term (the
experts' combine) and the router's dX kernel (`router_bwd_dx_kernel`, its default tile). do_bench medians, 3
rotating input sets; packed rows in a random order (every gather row random), no slot empty (as in the layer).

    python bench/combine.py [--shapes 81920/768/8/1 81920/384/4/2 ...] [--out FILE]

A shape is tokens/Ne/k/parts (8 heads, dh 128; parts = de / 128 partial rows per packed row at de > 128).
One JSON line per (shape, kernel): ms, bytes (HBM: dX rows gathered, dx written, slot_row / idx / gates / gate
gradients read and dv written; the W_r^T rows come from L2 and are not counted), GB/s.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (rows per program, warps). The head-major program order (session 20, dropped in session 21) measured 0.73-0.94 ms vs
# 0.79 at Ne 768 / k 8 over four tiles (results/combine-h200-2026-11-26-s21-headmajor.jsonl).
TILES = [(16, 4), (32, 4), (8, 4), (16, 2)]
H, DH = 8, 128


def bench_shape(n: int, ne: int, k: int, parts: int, base: dict, outf) -> None:
    import torch
    from triton.testing import do_bench

    from bench.timing import emit
    from kernels.triton.combine import CombineTiles, dx_combine_torch
    from kernels.triton.router import router_bwd_dx_kernel, router_tiles

    dev = "cuda"
    r, m = n * H, n * H * k
    p = m + m // 8  # padding rows, as packing leaves them
    sets = []
    for s in range(3):
        g = torch.Generator(device=dev).manual_seed(s)
        rows = torch.randn((p, parts, DH), generator=g, device=dev).to(torch.bfloat16)
        dgr = torch.randn((p, parts), generator=g, device=dev)
        slot_row = torch.randperm(p, generator=g, device=dev)[:m].to(torch.int32)
        gates = torch.softmax(torch.randn((r, k), generator=g, device=dev), -1)
        idx = torch.randint(0, ne, (r, k), generator=g, device=dev, dtype=torch.int32)
        wt = torch.randn((H, ne, DH), generator=g, device=dev)
        sets.append((rows, slot_row, dgr, gates, idx, wt))
    it = [0]

    def timed(fn):
        def call():
            it[0] = (it[0] + 1) % len(sets)
            return fn(*sets[it[0]])
        return do_bench(call, warmup=25, rep=200, return_mode="median")

    idx_bytes = m * 4 * 5  # slot_row, idx, gates, dv (written), a gate gradient per slot (gathered)
    rows_bytes = m * parts * DH * 2 + r * DH * 2
    ref = dx_combine_torch(*sets[0], heads=H, k=k)
    for br, nw in TILES:
        t = CombineTiles(br, nw)
        ms = timed(lambda *a, t=t: dx_combine_torch(*a, heads=H, k=k, tiles=t))
        got = dx_combine_torch(*sets[0], heads=H, k=k, tiles=t)
        same = all(bool(torch.equal(a, b)) for a, b in zip(got, ref))  # per row the same sums in the same order
        emit(dict(base, kernel="combine_router", tile=list(t), ms=ms, bytes=rows_bytes + idx_bytes,
                  gbps=(rows_bytes + idx_bytes) / ms / 1e6, equal_to_default_tile=same), outf)
        ms = timed(lambda a, b, *_, t=t: dx_combine_torch(a, b, None, None, None, None, heads=H, k=k, tiles=t))
        emit(dict(base, kernel="combine_experts_only", tile=list(t), ms=ms, bytes=rows_bytes + m * 4,
                  gbps=(rows_bytes + m * 4) / ms / 1e6), outf)
    rt = router_tiles(ne, k)
    out = torch.empty((n, H, DH), dtype=torch.bfloat16, device=dev)

    dv = torch.randn((r, k), device=dev)

    def router_dx(rows, slot_row, dgr, gates, idx, wt):
        router_bwd_dx_kernel[(-(-n // rt.dx_block_n), H)](
            idx, dv, wt, out, N=n, H=H, DH=DH, DHP=DH, NE=ne, K=k, BLOCK_N=rt.dx_block_n, num_warps=rt.dx_warps)

    ms = timed(router_dx)
    emit(dict(base, kernel="router_bwd_dx", tile=[rt.dx_block_n, rt.dx_warps], ms=ms, bytes=r * DH * 2 + m * 8,
              gbps=(r * DH * 2 + m * 8) / ms / 1e6), outf)


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["81920/768/8/1", "81920/1536/8/1", "81920/384/4/2",
                                                    "8192/768/8/1"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    outf = open(args.out, "a") if args.out else None
    device, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    for shape in args.shapes:
        n, ne, k, parts = (int(v) for v in shape.split("/"))
        base = dict(bench="combine", device=device, date=date, params=dict(tokens=n, heads=H, dh=DH, ne=ne, k=k,
                                                                          parts=parts))
        bench_shape(n, ne, k, parts, base, outf)


if __name__ == "__main__":
    main()
