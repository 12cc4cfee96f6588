"""The tensor cores' rate for the wgmma shapes of the expert backward, from shared memory or registers: is the
backward's time in products and synchronisation bound by shared-memory reads?

    python -m bench.tools.wgmma_rates [--out FILE] [--iters 4000]      # on a Hopper GPU (torch launcher)
    python -m bench.tools.wgmma_rates --compile-only                    # CPU: compile for sm_90a, count the wgmma forms

One kernel, `wgmma_rate_kernel`: every program loads an A tile (M, K) and a B tile (K, N) into shared memory once,
then chains ITERS products acc += A B (each a group of K / 16 wgmma instructions, DEPTH groups in flight), A from
shared memory (SS) or held in registers (RS, A_REG). M = 64 per warp group: NW warps = NW / 4 warp groups issue
side by side on their own 64 rows of A and share B, as the backward's consumers do (1, 2 or 4: num_warps is a
power of 2). The B tile is stored (N, K)
and read transposed (K-major), as the backward's gathered rows are (`xs.permute((1, 0))`).

Floor first (H100 SXM: 4096 bf16 FLOP per clock per SM, 128 bytes of shared memory per clock per SM): an m64nNk16
instruction is 64 N 16 x 2 FLOP = N / 2 clocks of tensor work, and reads 2 KB of A (SS only) + N x 32 bytes of B.
At N 32 SS needs 3 KB in 16 clocks, 192 B/clock: if shared-memory bandwidth bounds it, SS runs at 2/3 of RS at N 32;
at N 64 SS needs exactly 128 B/clock; at N 128 96 B/clock. Output: one JSON line per (N, K, warp groups, form).
"""

from __future__ import annotations

import argparse
import json

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from bench.common import JsonLines, today
from kernels.gluon.common import _wgmma_layout


@gluon.jit
def wgmma_rate_kernel(a_ptr, b_ptr, out_ptr, ITERS: gl.constexpr, M: gl.constexpr, N: gl.constexpr,
                      K: gl.constexpr, A_REG: gl.constexpr, DEPTH: gl.constexpr):
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = a_ptr.dtype.element_ty
    la: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (K // 8) if K < 256 else 1, K // 8 if K < 256 else 32],
                                        [NW, 1], [1, 0])
    ar = gl.arange(0, M, layout=gl.SliceLayout(1, la))
    ac = gl.arange(0, K, layout=gl.SliceLayout(0, la))
    a_smem = gl.allocate_shared_memory(cdt, [M, K], gl.NVMMASharedLayout.get_default_for([M, K], cdt))
    a_smem.store(gl.load(a_ptr + ar[:, None] * K + ac[None, :]))
    br = gl.arange(0, N, layout=gl.SliceLayout(1, la))
    b_smem = gl.allocate_shared_memory(cdt, [N, K], gl.NVMMASharedLayout.get_default_for([N, K], cdt))
    b_smem.store(gl.load(b_ptr + br[:, None] * K + ac[None, :]))
    fence_async_shared()
    acc_layout: gl.constexpr = _wgmma_layout(N, NW)
    acc = gl.zeros((M, N), gl.float32, acc_layout)
    bt = b_smem.permute((1, 0))  # (K, N), K-major
    if A_REG:
        a_op = a_smem.load(gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
        for _ in range(ITERS):
            acc = warpgroup_mma(a_op, bt, acc, is_async=True)
            acc, a_op = warpgroup_mma_wait(num_outstanding=DEPTH, deps=(acc, a_op))
    else:
        for _ in range(ITERS):
            acc = warpgroup_mma(a_smem, bt, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=DEPTH, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    # one value per program (keeps the products alive)
    gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))


CASES = [(n, k, wg, a_reg) for n in (32, 64, 128) for k in (64, 128) for wg in (1, 2, 4) for a_reg in (0, 1)]


def consts(n, k, wg, a_reg, iters, depth=1):
    return dict(ITERS=iters, M=64 * wg, N=n, K=k, A_REG=a_reg, DEPTH=depth)


def compile_case(n: int, k: int, wg: int, a_reg: int) -> dict:
    """sm_90a compile of one case (no GPU): the SASS wgmma forms (operands as `_`: RS has one register operand more,
    A's), their count and the registers."""
    import re

    from bench.tools.kernel_report import ptxas_sass
    from mhl_jax.moe.gpu.gluon import compile_gluon

    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32"}
    c = consts(n, k, wg, a_reg, 16)
    r = compile_gluon(wgmma_rate_kernel, dict(sig, **{key: "constexpr" for key in c}), c, {}, num_warps=4 * wg)
    info, sass = ptxas_sass(r["ptx"])
    forms = sorted(set(re.sub(r"UR\d+|R\d+|gdesc\[[^]]*\]", "_", m).strip()
                       for m in re.findall(r"HGMMA\.[^;]*", sass)))
    regs = re.search(r"Used (\d+) registers", info)
    return dict(n=n, k=k, warp_groups=wg, a_reg=a_reg, hgmma=forms, hgmma_count=sass.count("HGMMA."),
                regs=int(regs.group(1)) if regs else None,
                spills=not re.search(r"0 bytes spill stores, 0 bytes spill loads", info))


def compile_only() -> None:
    """Every case compiled for sm_90a (no GPU), one JSON line each."""
    for case in CASES:
        print(json.dumps(compile_case(*case)), flush=True)


def run(iters: int, out: str | None) -> None:
    import torch

    dev = torch.cuda.get_device_properties(0)
    sms = dev.multi_processor_count
    date = today()
    emit = JsonLines(out)
    rows = []
    for n, k, wg, a_reg in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(64 * wg, k, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
        o = torch.empty(sms, device="cuda")
        c = consts(n, k, wg, a_reg, iters)
        def launch(a=a, b=b, o=o, wg=wg, c=c):
            return wgmma_rate_kernel[(sms,)](a, b, o, num_warps=4 * wg, **c)

        launch()
        torch.cuda.synchronize()
        # correctness: every program's sum = ITERS x sum(A B) (fp32 accumulation: relative 1e-3 of the magnitude)
        ref = float((a.float() @ b.float().T).sum()) * iters
        scale = float((a.float().abs() @ b.float().abs().T).sum()) * iters
        err = float((o - ref).abs().max()) / scale
        ts = []
        for _ in range(7):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            launch()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        ms = sorted(ts)[len(ts) // 2]
        flops = sms * iters * 2.0 * (64 * wg) * n * k
        rec = dict(bench="wgmma_rates", device=torch.cuda.get_device_name(0), date=date, n=n, k=k, warp_groups=wg,
                   form="RS" if a_reg else "SS", iters=iters, ms=ms, tflops=flops / ms / 1e9, rel_err=err)
        rows.append(emit(rec))
    print(f"\n{'N':>4} {'K':>4} {'WG':>3} {'SS TF/s':>8} {'RS TF/s':>8} {'SS/RS':>6}")
    for n, k, wg, a_reg in CASES:
        if a_reg:
            continue
        ss = next(r for r in rows if (r["n"], r["k"], r["warp_groups"], r["form"]) == (n, k, wg, "SS"))
        rs = next(r for r in rows if (r["n"], r["k"], r["warp_groups"], r["form"]) == (n, k, wg, "RS"))
        print(f"{n:>4} {k:>4} {wg:>3} {ss['tflops']:8.1f} {rs['tflops']:8.1f} {ss['tflops'] / rs['tflops']:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
    else:
        run(args.iters, args.out)


if __name__ == "__main__":
    main()
