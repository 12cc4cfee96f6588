"""The expert FFN weight gradients of `kernels/triton/experts.py`, warp-specialised, in Gluon (Hopper only), and the
pipeline the whole fused backward (kernels/gluon/experts_bwd_fused.py) shares with them.

`gluon_expert_dw_ws_kernel`: the weight gradients of `expert_dwt_kernel` (without fused dX): persistent over
(group, 128 de) tiles taken from a schedule (`kernels.gluon.schedule`: head by head, each head's groups largest
first, dealt so that every program gets about the same rows, a long tile's rows in chunks; read by
`kernels.gluon.work_items`), two consumer warp groups each
holding both gradients of 64 de (128 fp32 accumulator registers: the consumers run at setmaxnreg 232 / 240, which
ptxas honours per partition), 32-row blocks of gathered X / dy rows (and their gates) through a cp.async ring, the
next tile's weights in a second buffer. A split backward takes it where the whole Gluon backward does not run.

Supported shapes: `kernels.tuning.gluon_dw_supported`; launch tables (stages, buffers, registers): `kernels.tuning`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from kernels.gluon.common import _copy_layout, _gelu_and_grad, _wgmma_layout, _ws_barriers, _ws_copy_rows
from kernels.gluon.work_items import _items, _work
from kernels.tuning import (
    GLUON_DW_BLOCK_M,
    GLUON_DW_REGS,
    GLUON_DW_STAGES,
    GLUON_DW_WBUF,
    GLUON_MAXNREG,
    gluon_dw_supported,
)


@gluon.jit
def _dw_producer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr,
                 BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr, ACCUM: gl.constexpr):
    """Per item: W1 columns (DH, 64) and W2 rows (64, DH) of both consumers' de halves into weight buffer n % WB
    once both freed it, then every row block's gathered X and dy rows (zero on padding) into the NST-stage ring.
    ACCUM: an item without rows is skipped (its gradient, zero, is already summed), by every partition alike."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, part_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem) = a
    PW: gl.constexpr = gl.num_warps()
    lx: gl.constexpr = _copy_layout(DH, PW)
    rr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lx))
    cc = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    rg = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [PW], [0]))  # the gates' rows
    q = 0
    n = 0
    ni, items = _items(sched_ptr)
    for it in range(ni):
        g, e0, row0, nsub, _ = _work(items, it, DE)
        if nsub > 0 or not ACCUM:
            wb = n % WB
            mbarrier.wait(w_empty.index(wb), ((n // WB) & 1) ^ 1)
            fence_async_shared()
            for c in gl.static_range(2):
                e = e0 + c * 64
                _ws_copy_rows(w1_smem.index(wb * 2 + c), w1_ptr + g * (DH * DE) + e, DH, 64, DE, 32, PW)
                _ws_copy_rows(w2_smem.index(wb * 2 + c), w2_ptr + g * (DE * DH) + e * DH, 64, DH, DH, 32, PW)
            async_copy.mbarrier_arrive(w_ready.index(wb), increment_count=False)
            slot_next = gl.load(row_slot_ptr + row0 + rr, mask=nsub > 0, other=-1)
            gslot_next = gl.load(row_slot_ptr + row0 + rg, mask=nsub > 0, other=-1)
            for i in range(nsub):
                s = q % NST
                slot = slot_next
                gslot = gslot_next
                slot_next = gl.load(row_slot_ptr + row0 + (i + 1) * BLOCK_M + rr, mask=i + 1 < nsub, other=-1)
                gslot_next = gl.load(row_slot_ptr + row0 + (i + 1) * BLOCK_M + rg, mask=i + 1 < nsub, other=-1)
                valid = (slot >= 0)[:, None]
                gvalid = gslot >= 0
                src = gl.where(slot >= 0, slot // K, 0).to(gl.int64)[:, None] * DH + cc[None, :]
                mbarrier.wait(d_empty.index(s), ((q // NST) & 1) ^ 1)
                fence_async_shared()
                async_copy.async_copy_global_to_shared(x_smem.index(s), x_ptr + src, mask=valid)
                async_copy.async_copy_global_to_shared(dy_smem.index(s), dy_ptr + src, mask=valid)
                async_copy.async_copy_global_to_shared(g_smem.index(s), gates_ptr + gl.where(gslot >= 0, gslot, 0),
                                                       mask=gvalid)  # the rows' gates (padding: 0)
                async_copy.mbarrier_arrive(d_ready.index(s), increment_count=False)
                q += 1
            n += 1


@gluon.jit
def _wait_weights(w_ready, n, WB: gl.constexpr):
    """A weight-buffer user's wait for its n-th tile's buffer (n % WB) -> that buffer's index."""
    wb = n % WB
    mbarrier.wait(w_ready.index(wb), (n // WB) & 1)
    fence_async_shared()  # the cp.async writes (generic proxy) before the wgmma reads (async proxy)
    return wb


@gluon.constexpr_function
def _partials_layout(num_warps):
    """(num_warps, cols) per-warp partial sums, read so that one thread holds all of a column's partials."""
    return gl.BlockedLayout([num_warps, 1], [1, 32], [1, num_warps], [0, 1])


@gluon.jit
def _sum_partials(dg_smem, hb, BLOCK_M: gl.constexpr, NW: gl.constexpr):
    """The gate gradient of a block's BLOCK_M rows over the tile's 128 de: the two consumers' per-warp partials in
    slots 2 hb and 2 hb + 1 of dg_smem (2 x NW of them, 16 de each), added in a fixed order within each thread."""
    lg: gl.constexpr = _partials_layout(NW)
    return gl.sum(dg_smem.index(hb * 2).load(lg), axis=0) + gl.sum(dg_smem.index(hb * 2 + 1).load(lg), axis=0)


@gluon.jit
def _block_products(w1t, w2c, xs, ds, gate, s_zero, acc2, d_empty, q, i, NST: gl.constexpr,
                    FAST_TANH: gl.constexpr, FUSE: gl.constexpr, XW: gl.constexpr, BLOCK_M: gl.constexpr,
                    a_layout: gl.constexpr):
    """One row block's H^T and dA'^T, its gelu, the dW2 product (issued, in flight) and dH_c^T -> (dht, dg, op2,
    acc2); dg (FUSE, XW): this consumer's per-warp partials of <gelu(H) row, dA' row>, the activation rounded as the
    forward's (16 de each, no exchange between the warps: consumer 0 (FUSE) or the dX warp group (XW) adds them)."""
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = xs.dtype
    ht = warpgroup_mma(w1t, xs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dat = warpgroup_mma(w2c, ds.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if FUSE or XW:  # H^T and dA'^T together (the gate gradient takes both)
        ht, dat = warpgroup_mma_wait(num_outstanding=0, deps=(ht, dat))
        if XW and i > 0:  # this also retired the block before's dW1 product: its stage is free
            mbarrier.arrive(d_empty.index((q - 1) % NST))
        act, dgelu = _gelu_and_grad(ht, FAST_TANH)
        # first: the activation's registers are free once its A operand is made
        dg = gl.sum(gl.reshape(act.to(cdt).to(gl.float32) * dat, (NW, 64 // NW, BLOCK_M)), axis=1)
        op2 = gl.convert_layout((act * gate[None, :]).to(cdt), a_layout)
        acc2 = warpgroup_mma(op2, ds, acc2, is_async=True)
    else:  # H^T (the block before's products retired at its end)
        ht = warpgroup_mma_wait(num_outstanding=1, deps=(ht,))
        act, dgelu = _gelu_and_grad(ht, FAST_TANH)
        op2 = gl.convert_layout((act * gate[None, :]).to(cdt), a_layout)
        acc2 = warpgroup_mma(op2, ds, acc2, is_async=True)
        dat = warpgroup_mma_wait(num_outstanding=1, deps=(dat,))
        dg = dat  # no gate gradient here (unused)
    dht = (dat * gate[None, :] * dgelu).to(cdt)
    return dht, dg, op2, acc2


@gluon.jit
def _fused_dx(a, f, dht, dg, xs, s_zero, xr, xc, acc1, s, q, wb, row0, i, e0, DE: gl.constexpr, DH: gl.constexpr,
              BLOCK_M: gl.constexpr, C: gl.constexpr):
    """FUSE: hand dH_c^T and dg to the other consumer through shared memory, issue the dW1 product (A operand dH_c^T
    from there), then make this consumer's 64 dh columns of the block's dX rows from both halves (consumer 0 also
    the gate gradients) and free the block's stage. Every product of the block retires here (deferring the dX half
    by one block measured slower); acc1 stays a wgmma accumulator: the next wait names it."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, part_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem) = a
    (dx_ptr, dgate_ptr, dh_smem, dg_smem, h_ready, h_empty) = f
    NW: gl.constexpr = gl.num_warps()
    hb = q % 2
    mbarrier.wait(h_empty.index(hb), ((q // 2) & 1) ^ 1)
    dh_smem.index(hb * 2 + C).store(dht)
    dg_smem.index(hb * 2 + C).store(dg)
    fence_async_shared()  # the generic writes before the wgmma reads (the arrive syncs the warp group)
    mbarrier.arrive(h_ready.index(hb))
    acc1 = warpgroup_mma(dh_smem.index(hb * 2 + C), xs, acc1, is_async=True)  # dH_c^T from shared
    mbarrier.wait(h_ready.index(hb), (q // 2) & 1)
    w1a = w1_smem.index(wb * 2).slice(64 * C, 64, dim=0)  # (64, 64): W1[64 C:, :64]
    w1b = w1_smem.index(wb * 2 + 1).slice(64 * C, 64, dim=0)  # W1[64 C:, 64:]
    dxt = warpgroup_mma(w1a, dh_smem.index(hb * 2), s_zero, use_acc=False, is_async=True)
    dxt = warpgroup_mma(w1b, dh_smem.index(hb * 2 + 1), dxt, is_async=True)
    rows = row0 + i * BLOCK_M
    NP: gl.constexpr = DE // 128  # the tiles' partial dX / gate gradients of a row, side by side
    if C == 0:
        dg = _sum_partials(dg_smem, hb, BLOCK_M, NW)
        gl.store(dgate_ptr + (rows + gl.arange(0, BLOCK_M, layout=dg.type.layout)) * NP + e0 // 128, dg)
    dxt = warpgroup_mma_wait(num_outstanding=0, deps=(dxt,))
    mbarrier.arrive(d_empty.index(s))
    mbarrier.arrive(h_empty.index(hb))
    lxs: gl.constexpr = _copy_layout(64, NW)  # xr / xc's: 16-byte vectors of 8 dh
    dxv = gl.convert_layout(gl.permute(dxt.to(w1_ptr.dtype.element_ty), (1, 0)), lxs)  # (BLOCK_M, 64)
    dx_cols = (e0 // 128) * DH + 64 * C + xc  # this tile's partial, this consumer's dh half
    gl.store(dx_ptr + (rows + xr).to(gl.int64)[:, None] * (NP * DH) + dx_cols[None, :], dxv)
    return acc1


@gluon.jit
def _hand_over(f, dht, dg, xs, acc1, op2, q, HB: gl.constexpr, C: gl.constexpr):
    """XW: dH_c^T and the gate gradient's half to the dX warp group through the HB-deep ring, and the dW1 product
    (dH_c^T from shared memory: no A operand registers in flight; this consumer writes the slot again only after the
    next block's first wait retired the product, HB >= 2 is for overlap). dW2's product (A operand op2 in registers)
    retires here, dW1's at the next block's first wait: with dW2's in flight across the loop too, ptxas serialises
    every wgmma of the kernel (C7512 "insufficient register resources": each k-step waits for the one before)."""
    (dx_ptr, dgate_ptr, dh_smem, dg_smem, h_ready, h_empty) = f
    hb = q % HB
    mbarrier.wait(h_empty.index(hb), ((q // HB) & 1) ^ 1)
    dh_smem.index(hb * 2 + C).store(dht)
    dg_smem.index(hb * 2 + C).store(dg)
    fence_async_shared()  # the generic writes before the wgmma reads (the arrive syncs the warp group)
    mbarrier.arrive(h_ready.index(hb))
    acc1 = warpgroup_mma(dh_smem.index(hb * 2 + C), xs, acc1, is_async=True)
    op2 = warpgroup_mma_wait(num_outstanding=1, deps=(op2,))
    return acc1, op2


@gluon.jit
def _store_dw(a, acc1, acc2, op1, op2, er, dc, g, e0, q, wb, nsub, slot, DH: gl.constexpr, DE: gl.constexpr,
              NST: gl.constexpr, C: gl.constexpr, XW: gl.constexpr, ACCUM: gl.constexpr):
    """An item's end: its last products retire, the weight buffer is freed, and this consumer's dW1 / dW2 columns are
    stored (ACCUM: added in fp32 to the sum so far, what XLA's add of the two gives, bitwise); a split tile's chunk's
    (slot >= 0) go to its partial-sum slot instead (in dW's dtype: dW1's (DH, DE) block at the tile's 128 columns,
    then dW2's 128 rows (128, DH)).
    dW1's sum so far loads while the last products retire (dW2's after dW1's store: registers); with XW (at 208
    registers) after the wait: loaded before it, the consumer spilled 504 bytes (sm_90a compile)."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, part_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem) = a
    EARLY: gl.constexpr = ACCUM and not XW
    # one store for both destinations at the same constant strides (a second path, or runtime strides, spilled up to
    # ~1 KB a thread): a slot holds dW1's (DH, DE) at its tile's columns, then dW2's 128 rows; never read here
    part = slot >= 0
    base = part_ptr + slot.to(gl.int64) * (DH * DE + 128 * DH)
    e = e0 + C * 64 + er
    p1 = gl.where(part, base, dw1_ptr + g * (DH * DE)) + dc[None, :] * DE + e[:, None]
    keep = slot < 0  # the sum so far: dW's only (a uniform predicate: the loads stay vectorised)
    if EARLY:
        old1 = gl.load(p1, mask=keep, other=0.0)
    acc1, acc2, op1, op2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, acc2, op1, op2))
    if XW and nsub > 0:  # the last block's dW1 product retired just now
        mbarrier.arrive(d_empty.index((q - 1) % NST))
    mbarrier.arrive(w_empty.index(wb))
    # each store instruction of the wgmma layout covers 8 consecutive de x 4 dh: whole 32-byte sectors
    if EARLY:
        acc1 = old1 + acc1
    elif ACCUM:
        acc1 = gl.load(p1, mask=keep, other=0.0) + acc1
    gl.store(p1, acc1.to(dw1_ptr.dtype.element_ty))
    p2 = gl.where(part, base + DH * DE - e0 * DH, dw2_ptr + g * (DE * DH)) + e[:, None] * DH + dc[None, :]
    if ACCUM:
        acc2 = gl.load(p2, mask=keep, other=0.0) + acc2
    gl.store(p2, acc2.to(dw2_ptr.dtype.element_ty))


@gluon.jit
def _dw_consumer(a, f, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr,
                 BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr, FAST_TANH: gl.constexpr,
                 C: gl.constexpr, FUSE: gl.constexpr, XW: gl.constexpr = False, HB: gl.constexpr = 2,
                 ACCUM: gl.constexpr = False):
    """Consumer C (one warp group): de rows [e0 + 64 C, + 64) of every tile, both gradients. Per row block,
    transposed as in `expert_dwt_kernel`, with the dy rows as stored and the gate on the products' columns:
        H^T = W1_c^T X^T, dA'^T = W2_c dy^T              (64, BLOCK_M): async wgmma from shared memory
        dW2_c   += (gelu(H^T) diag(g)) dy                 (64, DH) fp32 accumulators in registers, A operands
        dW1_c^T += (dA'^T diag(g) gelu'(H^T)) X            from registers
    The accumulating products of each block retire at its end, which frees its stage (in flight across the block loop
    ptxas serialised every wgmma of the kernel: C7512).

    FUSE (`gluon_expert_bwd_ws_kernel`): also the block's dX rows and gate gradients (over the tile's 128 de: with
    DE > 128 each row gets DE / 128 partials, side by side: dX (P, DE / 128, DH), gate (P, DE / 128)). Each consumer
    writes its dH_c^T = dA'^T diag(g) gelu'(H^T) (64 de, BLOCK_M) to shared memory (one of two buffers, `f`'s
    h_ready / h_empty hand them over between the two consumers); consumer C then makes dh columns [64 C, + 64)
    of the block's dX: dX^T_C = W1[64 C:, :64] dH_0^T + W1[64 C:, 64:] dH_1^T (the W1 tile already in shared
    memory; dW1's product also takes its A operand dH_c^T from there), and consumer 0 adds the two consumers'
    per-warp partials of <gelu(H) row, dA' row> (2 x NW of 16 de each, through shared memory: `_sum_partials`): the
    gate gradient of every row, in a fixed order (`_fused_dx`). The gates of each block come from shared memory
    (`g_smem`, gathered by the producer).

    XW (`gluon_expert_bwd_xw_kernel`, not with FUSE): FUSE's order without the dX products: each block's dW2 product
    retires at the block's end, its dW1 product at the next block's first wait, and the block's dH_c^T and this
    consumer's half of the gate gradient go to an HB-deep ring in shared memory (`_hand_over`) for the dX warp group
    (`_dx_worker`), which makes the dX rows and gate gradients off the consumers' chain.

    ACCUM: dW1 / dW2 hold a gradient summed so far (the JAX binding aliases the accumulator to them): each tile in one
    chunk adds its own to it (`_store_dw`) instead of overwriting it; a split tile's chunks go to their slots, and
    items without rows are skipped (their zero gradient is summed already), as the producer skips them."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, part_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem) = a
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M, NW)
    o_layout: gl.constexpr = _wgmma_layout(DH, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    er = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    dc = gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    s_zero = gl.zeros((64, BLOCK_M), gl.float32, s_layout)
    lxs: gl.constexpr = _copy_layout(64, NW)  # FUSE's dX half's store: 16-byte vectors of 8 dh
    xr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lxs))
    xc = gl.arange(0, 64, layout=gl.SliceLayout(0, lxs))
    q = 0
    n = 0
    ni, items = _items(sched_ptr)
    for it in range(ni):
        g, e0, row0, nsub, slot = _work(items, it, DE)
        if nsub > 0 or not ACCUM:  # as the producer skips
            wb = _wait_weights(w_ready, n, WB)
            w1t = w1_smem.index(wb * 2 + C).permute((1, 0))  # (64, DH): W1[:, e:e + 64]^T
            w2c = w2_smem.index(wb * 2 + C)  # (64, DH): W2[e:e + 64, :]
            # in flight across iterations: carried as wgmma accumulators, with their register operands
            acc1 = warpgroup_mma_init(gl.zeros((64, DH), gl.float32, o_layout))  # dW1[:, e:e + 64]^T
            acc2 = warpgroup_mma_init(gl.zeros((64, DH), gl.float32, o_layout))  # dW2[e:e + 64, :]
            op1 = gl.zeros((64, BLOCK_M), cdt, a_layout)
            op2 = gl.zeros((64, BLOCK_M), cdt, a_layout)
            for i in range(nsub):
                s = q % NST
                mbarrier.wait(d_ready.index(s), (q // NST) & 1)
                fence_async_shared()  # the cp.async writes (generic proxy) before the wgmma reads (async proxy)
                gate = g_smem.index(s).load(cols.type.layout)  # the block's gates (gathered by the producer)
                xs = x_smem.index(s)
                dht, dg, op2, acc2 = _block_products(w1t, w2c, xs, dy_smem.index(s), gate, s_zero, acc2, d_empty, q,
                                                     i, NST, FAST_TANH, FUSE, XW, BLOCK_M, a_layout)
                if FUSE:
                    acc1 = _fused_dx(a, f, dht, dg, xs, s_zero, xr, xc, acc1, s, q, wb, row0, i, e0, DE, DH, BLOCK_M,
                                     C)
                elif XW:
                    acc1, op2 = _hand_over(f, dht, dg, xs, acc1, op2, q, HB, C)
                else:
                    op1 = gl.convert_layout(dht, a_layout)
                    acc1 = warpgroup_mma(op1, xs, acc1, is_async=True)
                    # the block's products retire here (its stage is then free): in flight across the block loop
                    # (register A operands op1, op2) ptxas serialised every wgmma of the kernel (C7512)
                    op1, op2 = warpgroup_mma_wait(num_outstanding=0, deps=(op1, op2))
                    mbarrier.arrive(d_empty.index(s))
                q += 1
            _store_dw(a, acc1, acc2, op1, op2, er, dc, g, e0, q, wb, nsub, slot, DH, DE, NST, C, XW, ACCUM)
            n += 1


@gluon.jit
def _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr,
                 w2_ptr, dw1_ptr, dw2_ptr, part_ptr, NST: gl.constexpr, WB: gl.constexpr, BLOCK_M: gl.constexpr,
                 DH: gl.constexpr, NW: gl.constexpr, W_USERS: gl.constexpr = 2):
    """The dW / backward kernels' shared operand tuple (`_dw_producer` / `_dw_consumer` / `_dx_worker` unpack it): the
    pointers, and the shared memory: an NST-stage ring of gathered X / dy rows and their gates, WB buffers of a
    tile's W1 columns / W2 rows (two 64-de halves each), and their (ready, empty) mbarriers."""
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    x_smem = gl.allocate_shared_memory(cdt, [NST, BLOCK_M, DH],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH], cdt))
    dy_smem = gl.allocate_shared_memory(cdt, [NST, BLOCK_M, DH],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH], cdt))
    g_smem = gl.allocate_shared_memory(gl.float32, [NST, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # gates
    w1_smem = gl.allocate_shared_memory(cdt, [WB * 2, DH, 64], gl.NVMMASharedLayout.get_default_for([DH, 64], cdt))
    w2_smem = gl.allocate_shared_memory(cdt, [WB * 2, 64, DH], gl.NVMMASharedLayout.get_default_for([64, DH], cdt))
    d_ready, d_empty = _ws_barriers(NST, NW * 32)
    w_ready, w_empty = _ws_barriers(WB, NW * 32, W_USERS)  # W_USERS partitions free a weight buffer
    return (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr,
            w2_ptr, dw1_ptr, dw2_ptr, part_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty,
            g_smem)


@gluon.jit
def gluon_expert_dw_ws_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr, w1_ptr,
    w2_ptr, acc1_ptr, acc2_ptr,  # inputs (acc1 / acc2: see ACCUM)
    dw1_ptr, dw2_ptr, part_ptr,  # outputs (G, DH, DE), (G, DE, DH), split tiles' partials (S, DH * DE + 128 * DH)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr,
    FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACCUM: gl.constexpr,
):
    """Warp-specialised persistent weight gradients (dW1, dW2 of `expert_dwt_kernel`): tiles (group, 128 de) as
    the schedule sched_ptr deals them (`kernels.gluon.schedule`: about the same rows for every program, largest
    groups first, one head at a time; the tiles of one group run side by side, so its gathered rows come from L2
    after the first), a long tile's rows in chunks (summed into part_ptr's slots, added into dW1 / dW2 afterwards by
    `kernels.triton.dw_chunks`); two consumer warp groups, each both gradients of 64 de in
    registers (128 accumulator registers: the worker consumer runs at CONSUMER_REGS after setmaxnreg, the producer at
    PRODUCER_REGS, the default partition at what is left of 512 per lane); one producer warp group (cp.async:
    the tile's weights into one of WB buffers, gathered X / dy rows of BLOCK_M into an NST-stage ring). Sums over
    a group's rows in packed order, no atomics. ACCUM: acc1 / acc2 are the accumulated gradients, the same buffers
    as dW1 / dW2 (the JAX binding's input_output_aliases; the torch launcher passes dW1 / dW2 for both), and every
    tile in one chunk adds its gradient to them (`_dw_consumer`; a split tile's by `kernels.triton.dw_chunks`);
    acc1 / acc2 are never read through their own pointers."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(DE % 128 == 0, "DE: tiles of 128 de (two consumers of 64)")
    gl.static_assert(NST >= 2 and WB >= 1, "NST: a consumer frees stage q - 1 only after it waited for stage q")
    args = _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, sched_ptr,
                        w1_ptr, w2_ptr, dw1_ptr, dw2_ptr, part_ptr, NST, WB, BLOCK_M, DH, NW)
    f = (0, 0, 0, 0, 0, 0)  # FUSE's operands (unused)
    gl.warp_specialize([(_dw_consumer, (args, f, K, DH, DE, BLOCK_M, NST, WB, FAST_TANH, 0, False, False,
                                        2, ACCUM)),
                        (_dw_consumer, (args, f, K, DH, DE, BLOCK_M, NST, WB, FAST_TANH, 1, False, False,
                                        2, ACCUM)),
                        (_dw_producer, (args, K, DH, DE, BLOCK_M, NST, WB, ACCUM))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


# jax-triton compiles with its own options: mhl_jax.moe.gpu.gluon adds these
gluon_expert_dw_ws_kernel.mhl_compile_options = {"maxnreg": GLUON_MAXNREG}


def dw_ws_constexprs(k: int, dh: int, de: int, pack_block: int, stages: int = GLUON_DW_STAGES,
                     wbuf: int = GLUON_DW_WBUF, regs: tuple[int, int] = GLUON_DW_REGS, block_m: int = GLUON_DW_BLOCK_M,
                     kernel: str = "expert dW", accum: bool = False) -> dict:
    """The dW kernel's constexpr arguments (torch and JAX launchers alike); raises on unsupported shapes, naming
    `kernel`. accum: the kernel adds its weight gradients to what dW1 / dW2 hold (ACCUM)."""
    if not gluon_dw_supported(dh, de, pack_block) or pack_block % block_m:
        raise ValueError(f"warp-specialised {kernel}: dh={dh}, de={de}, pack_block={pack_block}, block_m={block_m}; "
                         f"expected dh 128, de a multiple of 128 and packing blocks of at least {GLUON_DW_BLOCK_M} "
                         "rows, a multiple of block_m")
    return dict(K=k, DH=dh, DE=de, BLOCK_M=block_m, NST=stages, WB=wbuf,
                FAST_TANH=True, CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], ACCUM=bool(accum))
