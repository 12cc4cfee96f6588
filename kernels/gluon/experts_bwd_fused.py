"""The whole expert FFN backward of `kernels/triton/experts.py` (dW1, dW2, dX rows, gate gradients; `expert_dwt_kernel`
with FUSE_DX and DGATES), warp-specialised, in Gluon (Hopper only), on the dW kernel's pipeline
(kernels/gluon/experts_bwd.py).

`gluon_expert_bwd_ws_kernel`: the two consumers exchange their dH^T halves through shared memory and each makes 64
dh columns of every block's dX rows (`_dw_consumer`, FUSE); each warp leaves its part of the gate gradient as a
partial in shared memory, consumer 0 adds the eight. At de > 128 each 128-de tile writes a partial dX row / gate
gradient (the combine sums them).

`gluon_expert_bwd_xw_kernel`: the same backward with a fourth warp group (`_dx_worker`) for the dX rows and gate
gradients: the consumers run the dW kernel's loop and hand their dH^T halves and gate-gradient partials over through
a shared-memory ring, so neither the dX products nor the other consumer sit on a consumer's per-block chain (16
warps). It pays from `kernels.tuning.BWD_XW_MIN_SLOTS` routed slots on.

Supported shapes: `kernels.tuning.gluon_bwd_supported`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from kernels.gluon.common import _copy_layout, _wgmma_layout, _ws_barriers
from kernels.gluon.experts_bwd import (
    _dw_consumer,
    _dw_operands,
    _dw_producer,
    _partials_layout,
    _sum_partials,
    _wait_weights,
    dw_ws_constexprs,
)
from kernels.gluon.work_items import _items, _work
from kernels.tuning import (
    GLUON_BWD_REGS,
    GLUON_BWD_STAGES,
    GLUON_BWD_WBUF,
    GLUON_DW_BLOCK_M,
    GLUON_MAXNREG,
    GLUON_XW_HB,
    GLUON_XW_MAXNREG,
    GLUON_XW_REGS,
    GLUON_XW_STAGES,
    GLUON_XW_WBUF,
)


@gluon.jit
def _dh_ring(dx_ptr, dgate_ptr, HB: gl.constexpr, BLOCK_M: gl.constexpr, NW: gl.constexpr, EMPTY: gl.constexpr):
    """The backward's dX operand tuple (`_dw_consumer`'s and `_dx_worker`'s `f`): the dX / gate-gradient outputs and
    the hand-over ring of HB slots: per slot both consumers' dH_c^T (64 de, BLOCK_M) and per-warp gate-gradient
    partials (NW, BLOCK_M), and its (ready, empty) mbarriers (ready after both consumers, empty after EMPTY
    arrivals)."""
    cdt: gl.constexpr = dx_ptr.dtype.element_ty
    dh_smem = gl.allocate_shared_memory(cdt, [2 * HB, 64, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], cdt))
    dg_smem = gl.allocate_shared_memory(gl.float32, [2 * HB, NW, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    h_ready, h_empty = _ws_barriers(HB, 2, EMPTY)
    return dx_ptr, dgate_ptr, dh_smem, dg_smem, h_ready, h_empty


@gluon.jit
def gluon_expert_bwd_ws_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr,
    w2_ptr, acc1_ptr, acc2_ptr,  # inputs (acc1 / acc2: as `gluon_expert_dw_ws_kernel`'s, ACCUM)
    dw1_ptr, dw2_ptr, dx_ptr, dgate_ptr,  # outputs (G, DH, DE), (G, DE, DH), (P, DE / 128, DH), (P, DE / 128) fp32,
    part_ptr,  # and the split tiles' partial sums (S, DH * DE + 128 * DH), dW's dtype (`kernels.gluon.schedule`)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr,
    FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACCUM: gl.constexpr,
):
    """The whole expert backward (`expert_dwt_kernel` with FUSE_DX and DGATES at DE == 128), warp-specialised:
    `gluon_expert_dw_ws_kernel`'s structure (tiles of (group, 128 de)), whose two consumers also exchange their
    halves of dH^T through shared memory for the block's dX rows and gate gradients (`_dw_consumer`, FUSE). With
    DE > 128 every tile writes its own partial dX row and gate gradient (over its 128 de; the caller sums the
    DE / 128 partials, in order). Rows of BLOCK_M-row blocks made only of padding are not written (`_work`)."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(DE % 128 == 0 and DH == 128, "the fused backward: DH == 128, tiles of 128 de (consumers of 64)")
    gl.static_assert(NST >= 2 and WB >= 1, "NST >= 2, WB >= 1")
    args = _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr,
                        w1_ptr, w2_ptr, dw1_ptr, dw2_ptr, part_ptr, NST, WB, BLOCK_M, DH, NW)
    f = _dh_ring(dx_ptr, dgate_ptr, 2, BLOCK_M, NW, 2)  # both consumers arrive on both
    gl.warp_specialize([(_dw_consumer, (args, f, K, DH, DE, BLOCK_M, NST, WB, FAST_TANH, 0, True, False,
                                        2, ACCUM)),
                        (_dw_consumer, (args, f, K, DH, DE, BLOCK_M, NST, WB, FAST_TANH, 1, True, False,
                                        2, ACCUM)),
                        (_dw_producer, (args, K, DH, DE, BLOCK_M, NST, WB, ACCUM))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _dx_worker(a, f, DE: gl.constexpr, DH: gl.constexpr, BLOCK_M: gl.constexpr,
               WB: gl.constexpr, HB: gl.constexpr, ACCUM: gl.constexpr):
    """The dX warp group of `gluon_expert_bwd_xw_kernel`: per row block, once both consumers handed over their dH_c^T
    (h_ready), the block's dX rows over the tile's 128 de, dh half D: dX^T_D = W1[64 D:, :64] dH_0^T + W1[64 D:, 64:]
    dH_1^T (W1 from the tile's weight buffer), stored as (BLOCK_M, DH) rows of this tile's partial; and the gate
    gradient (the consumers' per-warp partials, 16 de each, added in a fixed order). Frees the ring slot (h_empty)
    once its products retired, the weight buffer (w_empty) after the tile's last block."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, part_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty,
     g_smem) = a
    (dx_ptr, dgate_ptr, dh_smem, dg_smem, h_ready, h_empty) = f
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M, NW)
    s_zero = gl.zeros((64, BLOCK_M), gl.float32, s_layout)
    lxs: gl.constexpr = _copy_layout(64, NW)  # the dX half's store: 16-byte vectors of 8 dh
    xr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lxs))
    xc = gl.arange(0, 64, layout=gl.SliceLayout(0, lxs))
    NP: gl.constexpr = DE // 128  # the tiles' partial dX / gate gradients of a row, side by side
    gcol = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, _partials_layout(NW)))
    q = 0
    n = 0
    ni, items = _items(sched_ptr)
    for it in range(ni):
        g, e0, row0, nsub, _ = _work(items, it, DE)
        if nsub > 0 or not ACCUM:  # as the producer skips
            wb = _wait_weights(w_ready, n, WB)
            for i in range(nsub):
                hb = q % HB
                mbarrier.wait(h_ready.index(hb), (q // HB) & 1)
                h0 = dh_smem.index(hb * 2)
                h1 = dh_smem.index(hb * 2 + 1)
                rows = row0 + i * BLOCK_M
                d0 = warpgroup_mma(w1_smem.index(wb * 2).slice(0, 64, dim=0), h0, s_zero, use_acc=False, is_async=True)
                d0 = warpgroup_mma(w1_smem.index(wb * 2 + 1).slice(0, 64, dim=0), h1, d0, is_async=True)
                d1 = warpgroup_mma(w1_smem.index(wb * 2).slice(64, 64, dim=0), h0, s_zero, use_acc=False, is_async=True)
                d1 = warpgroup_mma(w1_smem.index(wb * 2 + 1).slice(64, 64, dim=0), h1, d1, is_async=True)
                dg = _sum_partials(dg_smem, hb, BLOCK_M, NW)
                gl.store(dgate_ptr + (rows + gcol) * NP + e0 // 128, dg)
                d0, d1 = warpgroup_mma_wait(num_outstanding=0, deps=(d0, d1))
                mbarrier.arrive(h_empty.index(hb))
                base = dx_ptr + (rows + xr).to(gl.int64)[:, None] * (NP * DH) + (e0 // 128) * DH + xc[None, :]
                gl.store(base, gl.convert_layout(gl.permute(d0.to(cdt), (1, 0)), lxs))
                gl.store(base + 64, gl.convert_layout(gl.permute(d1.to(cdt), (1, 0)), lxs))
                q += 1
            mbarrier.arrive(w_empty.index(wb))
            n += 1


@gluon.jit
def gluon_expert_bwd_xw_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr,
    w2_ptr, acc1_ptr, acc2_ptr,  # inputs (acc1 / acc2: as `gluon_expert_dw_ws_kernel`'s, ACCUM)
    dw1_ptr, dw2_ptr, dx_ptr, dgate_ptr,  # outputs (G, DH, DE), (G, DE, DH), (P, DE / 128, DH), (P, DE / 128) fp32,
    part_ptr,  # and the split tiles' partial sums (S, DH * DE + 128 * DH), dW's dtype (`kernels.gluon.schedule`)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr,
    FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DX_REGS: gl.constexpr, HB: gl.constexpr,
    ACCUM: gl.constexpr,
):
    """The whole expert backward as `gluon_expert_bwd_ws_kernel` computes it (same outputs, same sums in the same
    order), with a fourth warp group for the dX rows (`_dx_worker`): the consumers run the dW kernel's pipeline and
    hand each block's dH^T halves and gate-gradient halves over through an HB-deep ring (`_dw_consumer`, XW), so
    neither the dX products nor the other consumer sit on a consumer's per-block chain. 16 warps: launched with
    maxnreg 128; worker registers (CONSUMER_REGS, PRODUCER_REGS, DX_REGS), the default consumer the rest."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(DE % 128 == 0 and DH == 128, "the fused backward: DH == 128, tiles of 128 de (consumers of 64)")
    gl.static_assert(NST >= 2 and WB >= 1 and HB >= 2, "NST >= 2, WB >= 1, HB >= 2")
    args = _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr,
                        w1_ptr, w2_ptr, dw1_ptr, dw2_ptr, part_ptr, NST, WB, BLOCK_M, DH, NW, 3)
    f = _dh_ring(dx_ptr, dgate_ptr, HB, BLOCK_M, NW, 1)  # both consumers arrive on ready, the dX warp group on empty
    gl.warp_specialize([(_dw_consumer, (args, f, K, DH, DE, BLOCK_M, NST, WB, FAST_TANH, 0, False, True,
                                        HB, ACCUM)),
                        (_dw_consumer, (args, f, K, DH, DE, BLOCK_M, NST, WB, FAST_TANH, 1, False, True,
                                        HB, ACCUM)),
                        (_dw_producer, (args, K, DH, DE, BLOCK_M, NST, WB, ACCUM)),
                        (_dx_worker, (args, f, DE, DH, BLOCK_M, WB, HB, ACCUM))],
                       [4, 4, 4], [CONSUMER_REGS, PRODUCER_REGS, DX_REGS])



# jax-triton compiles with its own options: mhl_jax.moe.gpu.gluon adds these
gluon_expert_bwd_ws_kernel.mhl_compile_options = {"maxnreg": GLUON_MAXNREG}
gluon_expert_bwd_xw_kernel.mhl_compile_options = {"maxnreg": GLUON_XW_MAXNREG}


def bwd_ws_constexprs(k: int, dh: int, de: int, pack_block: int, stages: int = GLUON_BWD_STAGES,
                      wbuf: int = GLUON_BWD_WBUF, regs: tuple[int, int] = GLUON_BWD_REGS, accum: bool = False) -> dict:
    """The fused backward's constexpr arguments (torch and JAX launchers alike): the dW kernel's (`dw_ws_constexprs`,
    32-row blocks) at the backward's defaults; raises on unsupported shapes."""
    return dw_ws_constexprs(k, dh, de, pack_block, stages, wbuf, regs, kernel="fused expert backward", accum=accum)


def bwd_xw_constexprs(k: int, dh: int, de: int, pack_block: int, stages: int = GLUON_XW_STAGES,
                      wbuf: int = GLUON_XW_WBUF, regs: tuple[int, int, int] = GLUON_XW_REGS, hb: int = GLUON_XW_HB,
                      accum: bool = False, block_m: int = GLUON_DW_BLOCK_M) -> dict:
    """`gluon_expert_bwd_xw_kernel`'s constexpr arguments: the fused backward's, the dX warp group's registers and
    the dH^T ring's depth; raises on unsupported shapes and on `regs` / `hb` the kernel cannot take."""
    if len(regs) != 3 or hb < 2:
        raise ValueError(f"fused expert backward with the dX warp group: regs={regs}, hb={hb}; expected three worker "
                         "register counts (consumer, producer, dX warp group) and hb >= 2")
    consts = dw_ws_constexprs(k, dh, de, pack_block, stages, wbuf, regs[:2], block_m, kernel="fused expert backward",
                              accum=accum)
    return dict(consts, DX_REGS=regs[2], HB=hb)


def bwd_kernel(xw: bool):
    """(kernel, constexpr function) of the Gluon backward: with the dX warp group (`gluon_expert_bwd_xw_kernel`,
    `bwd_xw_constexprs`) or without (`gluon_expert_bwd_ws_kernel`, `bwd_ws_constexprs`); torch and JAX launchers."""
    return (gluon_expert_bwd_xw_kernel, bwd_xw_constexprs) if xw else (gluon_expert_bwd_ws_kernel, bwd_ws_constexprs)
