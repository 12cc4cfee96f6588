"""Probe: does Triton's automatic Hopper warp specialization help an expert-FFN forward?

A stand-alone forward over *packed* rows (contiguous per (head, expert) group, no gather) with every tile
moved by TMA tensor descriptors: H = X W1 chunk by chunk, A = gelu(H) in bf16, O += A W2. With
`tl.range(..., warp_specialize=True)` Triton 3.6 emits `ttg.warp_specialize` and `setmaxnreg` for sm_90
at 4 warps (not at 8): the producer / consumer split the model's kernels (pointer loads of gathered rows)
never get. Times it with and without, checks two row blocks against torch in fp32.

    python bench/ws_probe.py [--out FILE]          # GPU: one JSON line per tile (`bench: ws_probe`)
    python bench/ws_probe.py --compile-only        # CPU: is warp specialization emitted? (sm_90 target)

Measured (H100, 2026-11-24, 2.62M packed rows, Ne 384 x 8 heads, de 256, results/ws_probe-h100-2026-11-24.jsonl):
1.34-2.03 ms without, 1.69-3.35 ms with warp specialization, against 1.04 ms for the model's gathered-row
forward (bench/NOTES.md, Layer, session 8).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

P, G, DH, DE = 2621440, 3072, 128, 256  # 81920 tokens x 8 heads x k 4 packed rows; Ne 384 x 8 heads
TILES = ((128, 32, 4, 3), (128, 32, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3), (64, 64, 4, 3))


@triton.jit
def _gelu_tanh(h):
    u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    return 0.5 * h * (2.0 / (1.0 + tl.exp(-2.0 * u)))  # 0.5 h (1 + tanh u)


@triton.jit
def ffn_fwd_desc(x_ptr, w1_ptr, w2_ptr, o_ptr, bg_ptr, P: tl.constexpr, G: tl.constexpr, DH: tl.constexpr,
                 DE: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.load(bg_ptr + pid)  # the row block's (head, expert) group
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[P, DH], strides=[DH, 1], block_shape=[BM, DH])
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[P, DH], strides=[DH, 1], block_shape=[BM, DH])
    w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[G * DH, DE], strides=[DE, 1], block_shape=[DH, BE])
    w2_desc = tl.make_tensor_descriptor(w2_ptr, shape=[G * DE, DH], strides=[DH, 1], block_shape=[BE, DH])
    x = x_desc.load([pid * BM, 0])
    acc = tl.zeros((BM, DH), tl.float32)
    for e in tl.range(0, DE, BE, warp_specialize=WS):
        h = tl.dot(x, w1_desc.load([g * DH, e]))
        acc = tl.dot(_gelu_tanh(h).to(tl.bfloat16), w2_desc.load([g * DE + e, 0]), acc)
    o_desc.store([pid * BM, 0], acc.to(tl.bfloat16))


def compile_only() -> None:
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for ws in (False, True):
        for warps in (4, 8):
            consts = dict(P=P, G=G, DH=DH, DE=DE, BM=128, BE=32, WS=ws)
            sig = dict(x_ptr="*bf16", w1_ptr="*bf16", w2_ptr="*bf16", o_ptr="*bf16", bg_ptr="*i32")
            sig.update({k: "constexpr" for k in consts})
            src = ASTSource(fn=ffn_fwd_desc, signature=sig, constexprs=consts,
                            attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
            print(json.dumps(dict(bench="ws_probe_compile", triton=triton.__version__, warp_specialize=ws,
                                  warps=warps, ttg_warp_specialize="ttg.warp_specialize" in c.asm["ttgir"],
                                  setmaxnreg="setmaxnreg" in c.asm["ptx"],
                                  wgmma=len(re.findall(r"wgmma\.mma_async", c.asm["ptx"])))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    import torch
    from triton.testing import do_bench

    from bench.timing import emit

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(P, DH, device="cuda", generator=gen).bfloat16()
    w1 = (torch.randn(G * DH, DE, device="cuda", generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(G * DE, DH, device="cuda", generator=gen) * 0.05).bfloat16()
    outf = open(args.out, "a") if args.out else None
    for ws in (False, True):
        for bm, be, warps, stages in TILES:
            o = torch.empty(P, DH, device="cuda", dtype=torch.bfloat16)
            nb = P // bm
            bg = (torch.arange(nb, device="cuda") * G // nb).int()  # uniform groups, in order

            f = functools.partial(ffn_fwd_desc[(nb,)], x, w1, w2, o, bg, P=P, G=G, DH=DH, DE=DE, BM=bm, BE=be,
                                  WS=ws, num_warps=warps, num_stages=stages)

            rec = dict(bench="ws_probe", device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                       warp_specialize=ws, tile=[bm, be, warps, stages], params=dict(rows=P, groups=G, dh=DH, de=DE))
            try:
                f()
                errs = []
                for b in (0, nb - 1):
                    gg, xs = int(bg[b]), x[b * bm:(b + 1) * bm].float()
                    a = torch.nn.functional.gelu(xs @ w1[gg * DH:(gg + 1) * DH].float(), approximate="tanh")
                    ref = a.bfloat16().float() @ w2[gg * DE:(gg + 1) * DE].float()
                    errs.append(float((o[b * bm:(b + 1) * bm].float() - ref).abs().max() / ref.abs().max()))
                rec["rel_err"] = max(errs)
                rec["ms"] = float(do_bench(f, warmup=25, rep=200, return_mode="median"))
            except Exception as e:  # a tile that does not compile or run is reported, not fatal
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            emit(rec, outf)


if __name__ == "__main__":
    main()
