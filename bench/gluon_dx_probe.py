"""Probe (measured, not kept): the dX expert kernel (with the gate gradients) warp-specialised in Gluon, in
the structure of the kept forward (`kernels/gluon/experts.py`): a producer warp group gathers X and dy rows
of each 128-row block (XB buffers) and streams W1 / W2 chunks (32 wide) through an NS-slot ring (with
NS = de / 32 a block of the same group reuses them); two consumer warp groups take the 64-row halves. Per
chunk: H = X W1_j, dA' = dy W2_j^T, the gate gradient partial sum over de of A * dA', dH = g dA' gelu'(H),
dX += dH W1_j^T. The chunk loop is not unrolled (unrolled, ptxas spilled 2-3 KB: a warp-specialised kernel
of three warp groups compiles under .reqntid 384, i.e. at most 168 registers in every partition).

Measured (H100, 2026-11-24, `results/gluon_dx_probe-h100-2026-11-24.jsonl`, kernel alone, 81920 tokens, dX rows
bitwise equal to `expert_dx_kernel`'s, gate gradients within 1.2e-7): 384/4/256 Triton 1.83 ms, probe 1.96 (NS 8
reuse, one X/dy buffer), 1.83 (NS 4, two buffers, no reuse), 1.86 (NS 3); 768/8/128 (de 128, where the default
backward is the fused dW kernel, not this one) Triton 2.51, probe 2.55 (one buffer), **2.08** (NS 4 = reuse, two
buffers), 2.28 (NS 3). Reuse and double buffering together win; at de 256 they need 128 KB (all chunks) + 128
KB (two X / dy buffers) of shared memory, over the 227 KB an SM has.

    python bench/gluon_dx_probe.py 81920/384/4/256 81920/768/8/128     # Hopper GPU; one JSON line per variant
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.gluon.experts import (  # noqa: E402
    _copy_layout,
    _gelu_and_grad,
    _store_rows,
    _wgmma_layout,
    _ws_barriers,
    _ws_load_chunk,
    _ws_range,
    _zero_blocks,
)


@gluon.jit
def _dx_producer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_E: gl.constexpr, FAST_TANH: gl.constexpr, NS: gl.constexpr, XB: gl.constexpr,
                 C: gl.constexpr):
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, dx_ptr, dgate_ptr, x_smem, dy_smem,
     w1_smem, w2_smem, xd_ready, xd_empty, w_ready, w_empty, start, end) = a
    N: gl.constexpr = DE // BLOCK_E
    PW: gl.constexpr = gl.num_warps()
    XP: gl.constexpr = 32  # rows per gather pass (bounds the address registers)
    lx: gl.constexpr = _copy_layout(DH, PW)
    rr = gl.arange(0, XP, layout=gl.SliceLayout(1, lx))
    cc = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    g_next = gl.load(block_group_ptr + start, mask=start < end, other=0)
    g_prev = gl.to_tensor(-1).to(gl.int64)
    for t in range(end - start):
        b = start + t
        g = g_next.to(gl.int64)
        g_next = gl.load(block_group_ptr + b + 1, mask=b + 1 < end, other=0)
        xb = t % XB
        mbarrier.wait(xd_empty.index(xb), ((t // XB) & 1) ^ 1)
        fence_async_shared()
        for r0 in gl.static_range(0, BLOCK_M, XP):
            slot = gl.load(row_slot_ptr + b.to(gl.int64) * BLOCK_M + r0 + rr)
            src = gl.where(slot >= 0, slot // K, 0).to(gl.int64)
            async_copy.async_copy_global_to_shared(x_smem.index(xb).slice(r0, XP, dim=0),
                                                   x_ptr + src[:, None] * DH + cc[None, :])
            async_copy.async_copy_global_to_shared(dy_smem.index(xb).slice(r0, XP, dim=0),
                                                   dy_ptr + src[:, None] * DH + cc[None, :])
        async_copy.mbarrier_arrive(xd_ready.index(xb), increment_count=False)
        for j in gl.static_range(N):
            _ws_load_chunk(w1_smem, w2_smem, w_ready, w_empty, w1_ptr, w2_ptr, g, g == g_prev, j, t * N + j, DH, DE,
                           BLOCK_E, NS, PW)
        g_prev = g


@gluon.jit
def _dx_consumer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_E: gl.constexpr, FAST_TANH: gl.constexpr, NS: gl.constexpr, XB: gl.constexpr,
                 C: gl.constexpr):
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, dx_ptr, dgate_ptr, x_smem, dy_smem,
     w1_smem, w2_smem, xd_ready, xd_empty, w_ready, w_empty, start, end) = a
    N: gl.constexpr = DE // BLOCK_E
    HALF: gl.constexpr = BLOCK_M // 2
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_E, NW)
    o_layout: gl.constexpr = _wgmma_layout(DH, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    sm = gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros((HALF, BLOCK_E), gl.float32, s_layout)
    for t in range(end - start):
        b = start + t
        rows = b.to(gl.int64) * BLOCK_M + C * HALF + sm
        slot = gl.load(row_slot_ptr + rows)
        valid = slot >= 0
        gate = gl.load(gates_ptr + gl.where(valid, slot, 0), mask=valid, other=0.0)
        xb = t % XB
        mbarrier.wait(xd_ready.index(xb), (t // XB) & 1)
        xs = x_smem.index(xb).slice(C * HALF, HALF, dim=0)
        dys = dy_smem.index(xb).slice(C * HALF, HALF, dim=0)
        acc = gl.zeros((HALF, DH), gl.float32, o_layout)
        gsum = gl.zeros((HALF,), gl.float32, gl.SliceLayout(1, s_layout))
        dh_prev = gl.zeros((HALF, BLOCK_E), cdt, a_layout)
        for j in range(N):
            q = t * N + j
            sl = q % NS
            mbarrier.wait(w_ready.index(sl), (q // NS) & 1)
            h_tok = warpgroup_mma(xs, w1_smem.index(sl), s_zero, use_acc=False, is_async=True)
            d_tok = warpgroup_mma(dys, w2_smem.index(sl).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # retires the product of chunk j - 1 too (issued before): its slot is free
            h, da, acc, dh_prev = warpgroup_mma_wait(num_outstanding=0, deps=(h_tok, d_tok, acc, dh_prev))
            mbarrier.arrive(w_empty.index((q - 1) % NS), pred=j > 0)
            mbarrier.arrive(xd_empty.index(xb), pred=j + 1 == N)
            act, dgelu = _gelu_and_grad(h, FAST_TANH)
            gsum += gl.sum(act.to(cdt).to(gl.float32) * da, axis=1)
            da = da * gate[:, None]
            dh_prev = gl.convert_layout((da * dgelu).to(cdt), a_layout)
            acc = warpgroup_mma(dh_prev, w1_smem.index(sl).permute((1, 0)), acc, is_async=True)
            # still running: retired by the next chunk's wait (this only types acc for the loop)
            acc, dh_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, dh_prev))
        acc, dh_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, dh_prev))
        mbarrier.arrive(w_empty.index((t * N + N - 1) % NS))
        dgate = gl.where(valid, gsum, 0.0)
        gl.store(dgate_ptr + rows, dgate)
        validf = gl.convert_layout(valid, gl.SliceLayout(1, o_layout))
        _store_rows(dx_ptr, rows, gl.where(validf[:, None], acc, 0.0).to(dx_ptr.dtype.element_ty), DH, NW)


@gluon.jit
def gluon_expert_dx_ws_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, block_group_ptr, group_block_start_ptr, group_nblocks_ptr, w1_ptr,
    w2_ptr,  # inputs
    dx_ptr, dgate_ptr,  # outputs
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, G: gl.constexpr, NUM_BLOCKS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr, FAST_TANH: gl.constexpr, NS: gl.constexpr, XB: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    rows_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH], cdt)
    used, start, end = _ws_range(group_block_start_ptr, group_nblocks_ptr, G)
    x_smem = gl.allocate_shared_memory(cdt, [XB, BLOCK_M, DH], rows_layout)
    dy_smem = gl.allocate_shared_memory(cdt, [XB, BLOCK_M, DH], rows_layout)
    w1_smem = gl.allocate_shared_memory(cdt, [NS, DH, BLOCK_E],
                                        gl.NVMMASharedLayout.get_default_for([DH, BLOCK_E], cdt))
    w2_smem = gl.allocate_shared_memory(cdt, [NS, BLOCK_E, DH],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_E, DH], cdt))
    xd_ready, xd_empty = _ws_barriers(XB, NW * 32)
    w_ready, w_empty = _ws_barriers(NS, NW * 32)
    args = (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, dx_ptr, dgate_ptr, x_smem,
            dy_smem, w1_smem, w2_smem, xd_ready, xd_empty, w_ready, w_empty, start, end)
    gl.warp_specialize([(_dx_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, FAST_TANH, NS, XB, 0)),
                        (_dx_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, FAST_TANH, NS, XB, 1)),
                        (_dx_producer, (args, K, DH, DE, BLOCK_M, BLOCK_E, FAST_TANH, NS, XB, 0))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    _zero_blocks(dx_ptr, used, NUM_BLOCKS, BLOCK_M, DH, NW)
    zl: gl.constexpr = gl.SliceLayout(1, _copy_layout(DH, NW))
    zr = gl.arange(0, BLOCK_M, layout=zl)
    for b in range(used + gl.program_id(0), NUM_BLOCKS, gl.num_programs(0)):
        gl.store(dgate_ptr + b.to(gl.int64) * BLOCK_M + zr, gl.zeros((BLOCK_M,), gl.float32, zl))


gluon_expert_dx_ws_kernel.mhl_compile_options = {"maxnreg": 168}


def gluon_experts_dx_ws(x, dy, gates, pk, w1, w2, k, pack_block, block_e=32, ns=None, xb=1, programs=None):
    import torch
    p, (_, dh), (g_count, _, de) = pk.row_slot.shape[0], x.shape, w1.shape
    nb = p // pack_block
    dx = torch.empty(p, dh, dtype=x.dtype, device=x.device)
    dgate = torch.empty(p, dtype=torch.float32, device=x.device)
    programs = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    gluon_expert_dx_ws_kernel[(min(programs, nb),)](
        x, dy, gates, pk.row_slot, pk.block_group, pk.group_block_start, pk.group_nblocks, w1, w2, dx, dgate,
        K=k, DH=dh, DE=de, G=g_count, NUM_BLOCKS=nb, BLOCK_M=pack_block, BLOCK_E=block_e, FAST_TANH=True,
        NS=ns or de // block_e, XB=xb,
        CONSUMER_REGS=208, PRODUCER_REGS=88, num_warps=4, maxnreg=168)
    return dx, dgate


def probe_shape(tokens: int, ne: int, k: int, de: int, nh: int = 8, dh: int = 128) -> None:
    """The Triton dX kernel (default tile, gate gradients) and three probe variants on the same inputs."""
    import torch
    from triton.testing import do_bench

    from bench.kernel_tiles import expert_weights, input_set, rotating
    from kernels.torch.experts import experts_dx
    from kernels.triton.experts import default_config

    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = default_config(tokens * nh * k, nh * ne, dh, de, fuse_bwd=False)
    sets = [input_set(tokens, ne, k, cfg.pack_block, g, nh, dh) for _ in range(3)]
    w1, w2 = expert_weights(ne, de, g, nh, dh)
    x, dy, gates, pk = sets[0]
    rdx, rdg = experts_dx(x, dy, gates, pk, w1, w2, k, cfg)
    valid = pk.row_slot >= 0

    def triton_dx(s):
        return experts_dx(s[0], s[1], s[2], s[3], w1, w2, k, cfg)

    t_tr = do_bench(rotating(triton_dx, sets), warmup=25, rep=200, return_mode="median")
    for ns, xb in ((de // 32, 1), (4, 2), (3, 2)):
        def probe(s, ns=ns, xb=xb):
            return gluon_experts_dx_ws(s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, ns=ns, xb=xb)

        dx, dgt = probe(sets[0])
        rec = dict(bench="gluon_dx_probe", shape=f"{tokens}/{ne}/{k}/{de}", ns=ns, xb=xb, pack=cfg.pack_block,
                   rel_dx=float((dx.double() - rdx.double()).norm() / rdx.double().norm()),
                   rel_dgate=float((dgt[valid].double() - rdg[valid].double()).norm() / rdg[valid].double().norm()),
                   equal_dx=bool(torch.equal(dx, rdx)),
                   pad_zero=bool((dx[~valid] == 0).all()) and bool((dgt[~valid] == 0).all()), ms_triton=t_tr,
                   ms_ws=do_bench(rotating(probe, sets), warmup=25, rep=200, return_mode="median"),
                   device=torch.cuda.get_device_name())
        print(json.dumps(rec))


def main() -> None:
    for spec in sys.argv[1:]:
        probe_shape(*(int(v) for v in spec.split("/")))


if __name__ == "__main__":
    main()
