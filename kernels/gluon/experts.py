"""The expert FFN forward (and weight gradients, below) of `kernels/triton/experts.py`, warp-specialised, in Gluon
(Triton's explicit-layout dialect, `triton.experimental.gluon`, Triton >= 3.6), Hopper only: the same function
over the same packed layout (bitwise the same output rows as `expert_fwd_kernel` in every run so far), with the
schedule written by hand:

    out = gelu(X W1[g]) W2[g]          X: (BLOCK_M, DH) gathered rows, W1[g]: (DH, DE), W2[g]: (DE, DH)

- Persistent: program i of n takes the used row blocks [i U / n, (i + 1) U / n) (U from the packing's
  group_block_start / group_nblocks), in packed order, so consecutive blocks mostly share a group; with HEADS > 1
  it takes that share of each head's blocks, head after head, so that all programs gather one head's rows at a
  time (from L2; the JAX binding's launch from k 8 on: `experts_triton.FWD_HEAD_MAJOR_MIN_K`).
- One producer warp group loads everything by cp.async (gathered X rows need no TMA descriptor): the next
  block's X rows into the other of two X buffers (padding rows zero-filled, so their output rows come out 0
  without a mask), the W1 / W2 chunks (BLOCK_E wide) into a ring of NS
  slots. With NS == DE / BLOCK_E each slot always holds the same chunk, and a block of the same group as
  the one before reuses the slots without loading them again.
- Two consumer warp groups (the default partition and one worker) compute the two 64-row halves of every
  block from the shared buffers in 128-de chunks: per chunk S_j = X W1_j (async m64n128 wgmma), gelu, then
  A_j W2_j, which runs under the next chunk's S and the other consumer's gelu (S_j's wait retires it); output
  rows go out as whole 32-byte sectors. A second half made only of padding (a group's last block, about every
  other group) is skipped: neither computed nor written (SKIP_PAD; nothing reads padding rows).
- mbarriers hand each buffer over (ready: one cp.async arrival per producer thread; empty: one arrival per
  consumer). Registers: consumers WS_CONSUMER_REGS, producer WS_PRODUCER_REGS, launched with maxnreg
  WS_MAXNREG (three warp groups in one 64K-register SM).

Measured on H100 (bench/gluon_kernels.py --routing layer, kernel alone, 81920 tokens, 2026-11-25): 0.77 vs 1.05 ms
(Ne 384, de 256), 1.14 vs 1.53 (Ne 768, de 128, k 8), 1.34 vs 1.65 (Ne 1536), 0.88 vs 1.18 (Ne 768, de 256).
Supported shapes: `ws_supported`. Parameters in jax-triton's binding order (inputs, the output, constexprs).

`gluon_expert_dw_ws_kernel`: the weight gradients of `expert_dwt_kernel` (without fused dX) in the same structure:
persistent over (group, 128 de) tiles taken from a static schedule (`deal_schedule`: head by head, each head's
groups largest first, dealt so that every program gets about the same rows), two consumer warp groups each holding
both gradients of 64 de (128 fp32 accumulator registers: the consumers run at setmaxnreg 232 / 240, which ptxas
honours per partition), 32-row blocks of gathered X / dy rows (and their gates) through a cp.async ring, the next
tile's weights in a second buffer. H100, kernel alone: 0.50 vs 0.70 ms (8192 tokens, Ne 384, de 256), 0.95 vs 1.19
(Ne 768, packing block 32), 1.97 vs 2.05 at 81920 tokens; the split backward takes it at packing blocks <= 64 where
the Gluon backward is off (`kernels.triton.experts.default_config`; at 128 the layer measured it slower). Supported shapes:
`dw_ws_supported`.

`gluon_expert_bwd_ws_kernel`: the whole backward (dW1, dW2, dX rows, gate gradients; `expert_dwt_kernel` with
FUSE_DX and DGATES at de = 128) in the dW kernel's structure: the two consumers exchange their dH^T halves through
shared memory and each makes 64 dh columns of every block's dX rows (`_dw_consumer`, FUSE); each warp leaves its
part of the gate gradient as a partial in shared memory, consumer 0 adds the eight. At de > 128 each 128-de tile
writes a partial dX row / gate gradient (the caller sums them). The default backward at de 128 and 256
(`kernels.triton.experts.default_config`). H100 2026-11-25, kernel alone on the layer's routing (`bench/gluon_kernels.py
--routing layer`): 2.98 vs 3.93 ms (81920 tokens, Ne 384, de 256, k 4; the split Triton backward), 0.73 vs 0.88
(8192 tokens, Ne 768, de 128, k 8; the fused Triton kernel). Supported shapes: `bwd_ws_supported`.

`gluon_expert_bwd_xw_kernel`: the same backward with a fourth warp group (`_dx_worker`) for the dX rows and gate
gradients: the consumers run the dW kernel's loop and hand their dH^T halves and gate-gradient partials over through
a shared-memory ring, so neither the dX products nor the other consumer sit on a consumer's per-block chain (16
warps, launched at 128 registers, consumers at 208). The default from `kernels.triton.experts.BWD_XW_MIN_SLOTS` routed slots
on. Until 2026-11-25 ptxas serialised all of its wgmma (C7512: the dX warp group at 56 registers, and dW2's product
in flight across the block loop); since then, alone, 2.61 vs 2.98 ms for the fused kernel (81920 tokens, 384/4/256),
2.65 vs 3.04 (768/8/128), level at 8192 tokens.
"""

from __future__ import annotations

import functools

import numpy as np
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


@gluon.jit
def _tanh(u, FAST_TANH: gl.constexpr):
    """tanh of fp32 u: the single `tanh.approx.f32` instruction, or the sigmoid form (`kernels.triton.experts._tanh`)."""
    if FAST_TANH:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=gl.float32, is_pure=True,
                                      pack=1)
    else:
        t = 2.0 / (1.0 + gl.exp(-2.0 * u)) - 1.0
    return t


@gluon.jit
def _gelu(h, FAST_TANH: gl.constexpr):
    """tanh-approximate gelu of fp32 h, the arithmetic of `kernels.triton.experts._gelu`."""
    t = _tanh(h * gl.fma(h * h, 0.7978845608028654 * 0.044715, 0.7978845608028654), FAST_TANH)
    hh = 0.5 * h
    return gl.fma(hh, t, hh)


@gluon.jit
def _gelu_and_grad(h, FAST_TANH: gl.constexpr):
    """(gelu(h), gelu'(h)) of fp32 h: the arithmetic of `kernels.triton.experts._gelu_and_grad`."""
    h2 = h * h
    t = _tanh(h * gl.fma(h2, 0.7978845608028654 * 0.044715, 0.7978845608028654), FAST_TANH)
    hh = 0.5 * h
    act = gl.fma(hh, t, hh)
    du = gl.fma(h2, 3.0 * 0.7978845608028654 * 0.044715, 0.7978845608028654)
    grad = gl.fma(hh * gl.fma(-t, t, 1.0), du, gl.fma(t, 0.5, 0.5))
    return act, grad


@gluon.constexpr_function
def _wgmma_layout(n, num_warps):
    """Accumulator layout of (rows, n) wgmma products of one warp group's warps (m16 x n x k16 instructions)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _copy_layout(cols, num_warps):
    """A blocked register layout for cp.async of a row-major (rows, cols) 16-bit tile: 16-byte vectors."""
    tpc = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [num_warps, 1], [1, 0])


@gluon.jit
def _ws_copy_rows(smem, base, ROWS: gl.constexpr, COLS: gl.constexpr, STRIDE: gl.constexpr, PASS: gl.constexpr,
                  num_warps: gl.constexpr):
    """cp.async the rows base + r * STRIDE + [0, COLS), r < ROWS, into smem (ROWS, COLS), PASS rows at a time
    (bounds the producer's address registers)."""
    l: gl.constexpr = _copy_layout(COLS, num_warps)
    r = gl.arange(0, PASS, layout=gl.SliceLayout(1, l))
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, l))
    for r0 in gl.static_range(0, ROWS, PASS):
        async_copy.async_copy_global_to_shared(smem.slice(r0, PASS, dim=0),
                                               base + (r0 + r)[:, None] * STRIDE + c[None, :])


@gluon.jit
def _ws_range(group_block_start_ptr, group_nblocks_ptr, G: gl.constexpr):
    """(U, start, end): the row blocks in use (after the last group's) and this program's share of them."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    used = gl.load(group_block_start_ptr + (G - 1)) + gl.load(group_nblocks_ptr + (G - 1))
    return used, pid * used // nprog, (pid + 1) * used // nprog


@gluon.jit
def _ws_share(group_block_start_ptr, group_nblocks_ptr, G: gl.constexpr, HEADS: gl.constexpr, hh):
    """This program's share [s0, s1) of head hh's row blocks (the groups of a head are consecutive, G / HEADS of
    them, their blocks in packed order): programs split every head in turn, so at any time they all gather the rows
    of one head (one head's x stays in L2). HEADS 1: a share of all the blocks in use."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    NEH: gl.constexpr = G // HEADS
    hs = gl.load(group_block_start_ptr + hh * NEH)
    last = hh * NEH + NEH - 1
    n = gl.load(group_block_start_ptr + last) + gl.load(group_nblocks_ptr + last) - hs
    return hs + pid * n // nprog, hs + (pid + 1) * n // nprog


@gluon.jit
def _zero_blocks(ptr, used, NUM_BLOCKS: gl.constexpr, BLOCK_M: gl.constexpr, DH: gl.constexpr, NW: gl.constexpr):
    """Zero rows (BLOCK_M, DH) of the blocks made only of padding (after the U in use), strided over programs."""
    lz: gl.constexpr = _copy_layout(DH, NW)
    zr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lz))
    zc = gl.arange(0, DH, layout=gl.SliceLayout(0, lz))
    for b in range(used + gl.program_id(0), NUM_BLOCKS, gl.num_programs(0)):
        rows = b.to(gl.int64) * BLOCK_M + zr
        gl.store(ptr + rows[:, None] * DH + zc[None, :], gl.zeros((BLOCK_M, DH), ptr.dtype.element_ty, lz))


@gluon.jit
def _ws_barriers(N: gl.constexpr, READY: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """N (ready, empty) mbarrier pairs: ready completes after READY arrivals (one per producer thread, by
    cp.async), empty after one arrival per consumer (CONSUMERS)."""
    ready = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def _ws_load_chunk(w1_smem, w2_smem, w_ready, w_empty, w1_ptr, w2_ptr, g, reuse, j: gl.constexpr, q,
                   DH: gl.constexpr, DE: gl.constexpr, BLOCK_E: gl.constexpr, NS: gl.constexpr, PW: gl.constexpr):
    """Producer: chunk j of group g (the q-th ring use) into slot q % NS once the consumers freed it. With
    NS == DE / BLOCK_E the slot already holds chunk j; when `reuse` (same group as the block before) it is
    handed over again without a copy."""
    s = q % NS
    mbarrier.wait(w_empty.index(s), ((q // NS) & 1) ^ 1)
    if NS == DE // BLOCK_E and reuse:
        mbarrier.arrive(w_ready.index(s), count=PW * 32)
    else:
        fence_async_shared()
        _ws_copy_rows(w1_smem.index(s), w1_ptr + g * (DH * DE) + j * BLOCK_E, DH, BLOCK_E, DE, 32, PW)
        _ws_copy_rows(w2_smem.index(s), w2_ptr + g * (DE * DH) + j * BLOCK_E * DH, BLOCK_E, DH, DH,
                      min(BLOCK_E, 32), PW)
        async_copy.mbarrier_arrive(w_ready.index(s), increment_count=False)


@gluon.jit
def _store_rows(ptr, rows, vals, DH: gl.constexpr, NW: gl.constexpr, live=None):
    """Store vals (rows, DH) at ptr + rows * DH as 16-byte vectors, whole 32-byte sectors (stored from the wgmma
    layout they go out as 4-byte pairs: half sectors, twice the L2 writes); live: a mask (a probe's)."""
    ls: gl.constexpr = _copy_layout(DH, NW)
    cols = gl.arange(0, DH, layout=gl.SliceLayout(0, ls))
    rows = gl.convert_layout(rows, gl.SliceLayout(1, ls))
    gl.store(ptr + rows[:, None] * DH + cols[None, :], gl.convert_layout(vals, ls), mask=live)


@gluon.jit
def _ws_producer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 NS: gl.constexpr, FAST_TANH: gl.constexpr, C: gl.constexpr, G: gl.constexpr = 1,
                 HEADS: gl.constexpr = 1):
    """Loads for both consumers: per block, its X rows (gathered) into one of two X buffers, then its W1 / W2
    chunks into the NS-slot ring; each buffer's `ready` barrier completes when this partition's copies land
    (cp.async arrive, one arrival per thread)."""
    (x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, x_smem, w1_smem, w2_smem, x_ready, x_empty,
     w_ready, w_empty, gbs_ptr, gnb_ptr) = a
    N: gl.constexpr = DE // BLOCK_E
    PW: gl.constexpr = gl.num_warps()
    lx: gl.constexpr = _copy_layout(DH, PW)
    rr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lx))
    cc = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    g_prev = gl.to_tensor(-1).to(gl.int64)
    t = 0
    for hh in range(HEADS):
        start, end = _ws_share(gbs_ptr, gnb_ptr, G, HEADS, hh)
        # the next block's row slots and group are loaded one block ahead: their latency hides under this block
        slot_next = gl.load(row_slot_ptr + start.to(gl.int64) * BLOCK_M + rr, mask=start < end, other=-1)
        g_next = gl.load(block_group_ptr + start, mask=start < end, other=0)
        for b in range(start, end):
            xb = t % 2
            slot = slot_next
            g = g_next.to(gl.int64)
            slot_next = gl.load(row_slot_ptr + (b + 1).to(gl.int64) * BLOCK_M + rr, mask=b + 1 < end, other=-1)
            g_next = gl.load(block_group_ptr + b + 1, mask=b + 1 < end, other=0)
            src = gl.where(slot >= 0, slot // K, 0).to(gl.int64)
            mbarrier.wait(x_empty.index(xb), ((t // 2) & 1) ^ 1)
            fence_async_shared()
            # padding rows zero-filled (cp.async of 0 bytes): their output rows come out exactly 0, as gelu(0) = 0,
            # so the consumers need no row-slot load (which every fence_async_shared's MEMBAR would wait for)
            async_copy.async_copy_global_to_shared(x_smem.index(xb), x_ptr + src[:, None] * DH + cc[None, :],
                                                   mask=(slot >= 0)[:, None])
            async_copy.mbarrier_arrive(x_ready.index(xb), increment_count=False)
            for j in gl.static_range(N):
                _ws_load_chunk(w1_smem, w2_smem, w_ready, w_empty, w1_ptr, w2_ptr, g, g == g_prev, j, t * N + j, DH,
                               DE, BLOCK_E, NS, PW)
            g_prev = g
            t += 1


@gluon.jit
def _ws_half(a, xb, q0, rows, b, DH: gl.constexpr, BLOCK_E: gl.constexpr, NS: gl.constexpr, N: gl.constexpr,
             FAST_TANH: gl.constexpr, C: gl.constexpr, PROBE: gl.constexpr, HALF: gl.constexpr):
    """One consumer's half of block b (X rows ready in buffer xb, ring uses q0 ..): the chunks' products, then its
    rows' store."""
    (x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, x_smem, w1_smem, w2_smem, x_ready, x_empty,
     w_ready, w_empty, gbs_ptr, gnb_ptr) = a
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_E, NW)
    o_layout: gl.constexpr = _wgmma_layout(DH, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros((HALF, BLOCK_E), gl.float32, s_layout)
    xs = x_smem.index(xb).slice(C * HALF, HALF, dim=0)
    acc = gl.zeros((HALF, DH), gl.float32, o_layout)
    a_prev = gl.zeros((HALF, BLOCK_E), cdt, a_layout)
    for j in gl.static_range(N):
        q = q0 + j
        mbarrier.wait(w_ready.index(q % NS), (q // NS) & 1)
        fence_async_shared()  # the cp.async writes (generic proxy) before the wgmma reads (async proxy)
        s = warpgroup_mma(xs, w1_smem.index(q % NS), s_zero, use_acc=False, is_async=True)
        # retires S_j and, before it, A_{j-1} W2_{j-1} (its chunk's slot is then free)
        s, acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc, a_prev))
        if j > 0:
            mbarrier.arrive(w_empty.index((q - 1) % NS))
        if PROBE & 2:  # a measurement: no gelu (A = S)
            a_prev = gl.convert_layout(s.to(cdt), a_layout)
        else:
            a_prev = gl.convert_layout(_gelu(s, FAST_TANH).to(cdt), a_layout)
        acc = warpgroup_mma(a_prev, w2_smem.index(q % NS), acc, is_async=True)
    acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
    mbarrier.arrive(w_empty.index((q0 + N - 1) % NS))
    mbarrier.arrive(x_empty.index(xb))
    live = None
    if PROBE & 1:  # a measurement: the output rows' stores masked off by a condition false at run time
        live = b < 0
    _store_rows(out_ptr, rows, acc.to(out_ptr.dtype.element_ty), DH, NW, live)


@gluon.jit
def _ws_consumer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 NS: gl.constexpr, FAST_TANH: gl.constexpr, C: gl.constexpr, PROBE: gl.constexpr = 0,
                 G: gl.constexpr = 1, HEADS: gl.constexpr = 1, SKIP_PAD: gl.constexpr = False):
    """Consumer C (one warp group) computes rows [C * BLOCK_M / 2, (C + 1) * BLOCK_M / 2) of every block, from the
    shared X buffer and weight ring, chunk by chunk (`_ws_half`): S_j = X W1_j, gelu, A_j W2_j. A_j W2_j runs under
    the next chunk's S_{j+1} and this consumer's wait for it (the wait retires both), so each consumer alternates its
    MMAs with its gelu and the two consumers' interleave. (Issuing S_{j+1} before gelu of S_j with 64-de chunks, two
    S tiles in registers, measured 1-4% slower: the m64n64 products read twice the X per product.)
    SKIP_PAD (consumer 1 only): a second half made only of padding (its first row a padding row: a group's padding
    is the end of its last block, so half 0 always holds a row) is neither computed nor stored; the consumer still
    waits for the block's buffers and frees them. The slot of its first row is loaded at the block's start (loaded
    one block ahead, it measured the same, and ptxas spilled setup values at de 256)."""
    (x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, x_smem, w1_smem, w2_smem, x_ready, x_empty,
     w_ready, w_empty, gbs_ptr, gnb_ptr) = a
    N: gl.constexpr = DE // BLOCK_E
    HALF: gl.constexpr = BLOCK_M // 2
    NW: gl.constexpr = gl.num_warps()
    o_layout: gl.constexpr = _wgmma_layout(DH, NW)
    om = gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
    t = 0
    for hh in range(HEADS):
        start, end = _ws_share(gbs_ptr, gnb_ptr, G, HEADS, hh)
        for b in range(start, end):
            xb = t % 2
            if SKIP_PAD and C == 1:
                half_slot = gl.load(row_slot_ptr + b.to(gl.int64) * BLOCK_M + HALF)
                mbarrier.wait(x_ready.index(xb), (t // 2) & 1)
                if half_slot < 0:  # padding only: free the block's weight chunks and X rows unused
                    for j in gl.static_range(N):
                        mbarrier.wait(w_ready.index((t * N + j) % NS), ((t * N + j) // NS) & 1)
                        mbarrier.arrive(w_empty.index((t * N + j) % NS))
                    mbarrier.arrive(x_empty.index(xb))
                else:
                    _ws_half(a, xb, t * N, b.to(gl.int64) * BLOCK_M + C * HALF + om, b, DH, BLOCK_E, NS, N, FAST_TANH,
                             C, PROBE, HALF)
            else:
                mbarrier.wait(x_ready.index(xb), (t // 2) & 1)
                _ws_half(a, xb, t * N, b.to(gl.int64) * BLOCK_M + C * HALF + om, b, DH, BLOCK_E, NS, N, FAST_TANH, C,
                         PROBE, HALF)
            t += 1


@gluon.jit
def gluon_expert_fwd_ws_kernel(
    x_ptr, row_slot_ptr, block_group_ptr, group_block_start_ptr, group_nblocks_ptr, w1_ptr, w2_ptr,  # inputs
    out_ptr,  # output (P, DH)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, G: gl.constexpr, NUM_BLOCKS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr, NS: gl.constexpr, FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PROBE: gl.constexpr, HEADS: gl.constexpr,
    SKIP_PAD: gl.constexpr = True,
):
    """Warp-specialised persistent forward: one producer warp group loads (X rows gathered by cp.async, W1 / W2
    chunks into a ring of NS slots), two consumer warp groups (the default partition and one worker) each
    compute half of every row block from the shared buffers; mbarriers hand the buffers over. Program i takes
    its share [i B / n, (i + 1) B / n) of each head's B used row blocks, head after head (`_ws_share`; HEADS 1: of
    all U used blocks at once); blocks made only of padding get zero rows. SKIP_PAD: a block's second half made only
    of padding is left unwritten (`_ws_consumer`; nothing reads padding rows); else padding rows are 0."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(NS >= 2 or NS == DE // BLOCK_E,
                     "NS: a consumer holds two ring slots (chunks j - 1, j) until S_j's wait retires chunk j - 1")
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    gl.static_assert(G % HEADS == 0, "HEADS: the groups split into equal heads")
    used, _, _ = _ws_range(group_block_start_ptr, group_nblocks_ptr, G)

    x_smem = gl.allocate_shared_memory(cdt, [2, BLOCK_M, DH], gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH],
                                                                                                  cdt))
    w1_smem = gl.allocate_shared_memory(cdt, [NS, DH, BLOCK_E], gl.NVMMASharedLayout.get_default_for([DH, BLOCK_E],
                                                                                                    cdt))
    w2_smem = gl.allocate_shared_memory(cdt, [NS, BLOCK_E, DH], gl.NVMMASharedLayout.get_default_for([BLOCK_E, DH],
                                                                                                    cdt))
    x_ready, x_empty = _ws_barriers(2, NW * 32)  # the producer warp group has NW warps too
    w_ready, w_empty = _ws_barriers(NS, NW * 32)
    args = (x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, x_smem, w1_smem, w2_smem, x_ready,
            x_empty, w_ready, w_empty, group_block_start_ptr, group_nblocks_ptr)
    gl.warp_specialize([(_ws_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 0, PROBE, G, HEADS)),
                        (_ws_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 1, PROBE, G, HEADS,
                                        SKIP_PAD)),
                        (_ws_producer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 0, G, HEADS))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    _zero_blocks(out_ptr, used, NUM_BLOCKS, BLOCK_M, DH, NW)


WS_BLOCK_E = 128  # de chunk; NS = DE / WS_BLOCK_E ring slots (1 or 2: every slot keeps its chunk)
WS_CONSUMER_REGS, WS_PRODUCER_REGS, WS_MAXNREG = 208, 88, 168
# jax-triton compiles with its own options: mhl_jax.moe.gpu.gluon adds these
gluon_expert_fwd_ws_kernel.mhl_compile_options = {"maxnreg": WS_MAXNREG}


def ws_supported(dh: int, de: int, pack_block: int) -> bool:
    """Shapes the warp-specialised forward takes (and was measured at): dh 128, 128-row packing blocks (two
    64-row consumer halves), de 128 or 256 (all chunks resident: 64 or 128 KB of the ring)."""
    return dh == 128 and pack_block == 128 and de in (128, 256)


def ws_constexprs(k: int, dh: int, de: int, num_groups: int, num_blocks: int, pack_block: int,
                  probe: int = 0, heads: int = 1, skip_padding: bool = True) -> dict:
    """The kernel's constexpr arguments (torch and JAX launchers alike); raises on unsupported shapes. probe: 0 (the
    kernel) or a measurement (bits: 1 the output rows' stores masked off, 2 no gelu): wrong outputs, bench only.
    heads: the heads the groups split into (the programs take each head's blocks in turn; 1: all at once).
    skip_padding: the second halves of blocks made only of padding are not computed and stay unwritten."""
    if not ws_supported(dh, de, pack_block):
        raise ValueError(f"warp-specialised expert forward: dh={dh}, de={de}, pack_block={pack_block}; expected "
                         "dh 128, de 128 or 256 and packing blocks of 128 rows")
    if heads < 1 or num_groups % heads:
        raise ValueError(f"warp-specialised expert forward: heads={heads} for {num_groups} groups; expected the "
                         "groups to split into equal heads")
    if not 0 <= probe < 4:
        raise ValueError(f"warp-specialised expert forward: probe={probe}, expected 0..3 (bits: 1 no output stores, "
                         "2 no gelu)")
    return dict(K=k, DH=dh, DE=de, G=num_groups, NUM_BLOCKS=num_blocks, BLOCK_M=pack_block, BLOCK_E=WS_BLOCK_E,
                NS=de // WS_BLOCK_E, FAST_TANH=True, CONSUMER_REGS=WS_CONSUMER_REGS, PRODUCER_REGS=WS_PRODUCER_REGS,
                PROBE=probe, HEADS=heads, SKIP_PAD=skip_padding)


def gluon_experts_fwd_ws(x, pk, w1, w2, k: int, pack_block: int, programs: int | None = None, out=None,
                         probe: int = 0, heads: int = 1, skip_padding: bool = True):
    """Torch launcher (CUDA, Hopper): x (S, dh), pk a `kernels.torch.experts.TorchPacking`, w1 (G, dh, de),
    w2 (G, de, dh) -> out rows (P, dh) in x.dtype (padding rows 0, but for the padding-only second halves of blocks
    with skip_padding: unwritten); `out`, if given, is written in place; probe: `ws_constexprs`' (bench only);
    heads, skip_padding: `ws_constexprs`'."""
    import torch

    p, (_, dh), (g_count, _, de) = pk.row_slot.shape[0], x.shape, w1.shape
    nb = p // pack_block
    consts = ws_constexprs(k, dh, de, g_count, nb, pack_block, probe, heads, skip_padding)
    out = torch.empty(p, dh, dtype=x.dtype, device=x.device) if out is None else out
    programs = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    gluon_expert_fwd_ws_kernel[(min(programs, nb),)](
        x.contiguous(), pk.row_slot, pk.block_group, pk.group_block_start, pk.group_nblocks, w1.contiguous(),
        w2.contiguous(), out, num_warps=4, maxnreg=WS_MAXNREG, **consts)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Weight gradients, warp-specialised (dW1, dW2 of `expert_dwt_kernel` without FUSE_DX / DGATES)
# ---------------------------------------------------------------------------------------------------------------


@gluon.jit
def _dw_tile(t, group_block_start_ptr, group_size_ptr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr,
             BLOCK_M: gl.constexpr):
    """Tile t = (group, 128 de): (group as int64, first de, first packed row, row blocks of BLOCK_M). The row blocks
    are those holding the group's rows (its size rounded up to BLOCK_M): blocks made only of the padding after them
    (up to PACK_BLOCK - BLOCK_M rows) are neither computed nor written."""
    gi = t // (DE // 128)
    start = gl.load(group_block_start_ptr + gi)
    size = gl.load(group_size_ptr + gi)
    return gi.to(gl.int64), (t % (DE // 128)) * 128, start.to(gl.int64) * PACK_BLOCK, (size + BLOCK_M - 1) // BLOCK_M


@gluon.jit
def _dw_producer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr,
                 BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr, FAST_TANH: gl.constexpr,
                 C: gl.constexpr, PROBE: gl.constexpr = 0):
    """Per tile: W1 columns (DH, 64) and W2 rows (64, DH) of both consumers' de halves into weight buffer n % WB
    once both freed it, then every row block's gathered X and dy rows (zero on padding) into the NST-stage ring.
    PROBE & 4 (a measurement, `bwd_xw_constexprs`' probe): the rows' gathers masked off by a condition false at run
    time (the ring's stages zero-filled, no global loads of X / dy / gates)."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem) = a
    PW: gl.constexpr = gl.num_warps()
    lx: gl.constexpr = _copy_layout(DH, PW)
    rr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lx))
    cc = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    rg = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [PW], [0]))  # the gates' rows
    q = 0
    n = 0
    # this program's tiles: sched[sched[pid]:sched[pid + 1]] (`tile_schedule`: the offsets count from sched_ptr)
    for j in range(gl.load(sched_ptr + gl.program_id(0)), gl.load(sched_ptr + gl.program_id(0) + 1)):
        g, e0, row0, nsub = _dw_tile(gl.load(sched_ptr + j), group_block_start_ptr, group_size_ptr, DE, PACK_BLOCK,
                                     BLOCK_M)
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
            if PROBE & 4:  # false at run time (the compiler cannot tell)
                valid = valid & (g < 0)
                gvalid = gvalid & (g < 0)
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
def _dw_consumer(a, f, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr,
                 BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr, FAST_TANH: gl.constexpr,
                 C: gl.constexpr, FUSE: gl.constexpr, XW: gl.constexpr = False, HB: gl.constexpr = 2,
                 ACCUM: gl.constexpr = False, PROBE: gl.constexpr = 0):
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
    gate gradient of every row, in a fixed order. The
    block's products all retire before the next block (deferring the dX half by one block measured slower, 2026-11-24).
    The gates of each block come from shared memory (`g_smem`, gathered by the producer).

    XW (`gluon_expert_bwd_xw_kernel`, not with FUSE): FUSE's order without the dX products: each block's dW2 product
    retires at the block's end, its dW1 product at the next block's first wait, and the block's dH_c^T and this
    consumer's half of the gate gradient go
    to an HB-deep ring in shared memory (`f`'s h_ready / h_empty) for the dX warp group (`_dx_worker`), which makes
    the dX rows and gate gradients off the consumers' chain. The gate gradient's half leaves as one partial per warp
    (its 16 de rows: no exchange between the warps; the dX warp group adds them).

    ACCUM: dW1 / dW2 hold a gradient summed so far (the JAX binding aliases the accumulator to them): each tile adds
    its own to it in fp32 (acc + dW, what XLA's add of the two gives, bitwise) instead of overwriting it.

    PROBE & 1 (a measurement, `bwd_xw_constexprs`' probe): dW's loads and stores masked off by a condition false at
    run time (the products still made; no dW traffic)."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem) = a
    (dx_ptr, dgate_ptr, dh_smem, dg_smem, h_ready, h_empty) = f
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M, NW)
    o_layout: gl.constexpr = _wgmma_layout(DH, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    er = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    dc = gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    s_zero = gl.zeros((64, BLOCK_M), gl.float32, s_layout)
    s_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)).to(gl.float32) * 0.001  # PROBE & 64 only
    lxs: gl.constexpr = _copy_layout(64, NW)  # the dX half's store: 16-byte vectors of 8 dh
    xr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lxs))
    xc = gl.arange(0, 64, layout=gl.SliceLayout(0, lxs))
    q = 0
    n = 0
    # this program's tiles: sched[sched[pid]:sched[pid + 1]] (`tile_schedule`: the offsets count from sched_ptr)
    for j in range(gl.load(sched_ptr + gl.program_id(0)), gl.load(sched_ptr + gl.program_id(0) + 1)):
        g, e0, row0, nsub = _dw_tile(gl.load(sched_ptr + j), group_block_start_ptr, group_size_ptr, DE, PACK_BLOCK,
                                     BLOCK_M)
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
            ds = dy_smem.index(s)
            if PROBE & 64:  # a measurement (XW only): no H^T / dA'^T products (a value per element, unknown to the
                # compiler: the math stays per element)
                ht = gate[None, :] + s_zero + s_rows[:, None]
                dat = gate[None, :] - s_zero - s_rows[:, None]
            else:
                ht = warpgroup_mma(w1t, xs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dat = warpgroup_mma(w2c, ds.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if FUSE or XW:  # H^T and dA'^T together (the gate gradient takes both)
                ht, dat = warpgroup_mma_wait(num_outstanding=0, deps=(ht, dat))
                if XW and i > 0:  # this also retired the block before's dW1 product: its stage is free
                    mbarrier.arrive(d_empty.index((q - 1) % NST))
                if PROBE & 16:  # a measurement (XW only): no gelu math (act = H, gelu' = dA')
                    act, dgelu = ht, dat
                else:
                    act, dgelu = _gelu_and_grad(ht, FAST_TANH)
                # this consumer's half of <gelu(H) row, dA' row> (the activation rounded as the forward's), first:
                # the activation's registers are free once its A operand is made
                # per warp (16 de each, no exchange between the warps): consumer 0 (FUSE) or the dX warp group (XW)
                # adds the eight partials
                if not PROBE & 8:  # PROBE & 8 (a measurement, XW only): no gate gradient (none handed over)
                    dg = gl.sum(gl.reshape(act.to(cdt).to(gl.float32) * dat, (NW, 64 // NW, BLOCK_M)), axis=1)
                op2 = gl.convert_layout((act * gate[None, :]).to(cdt), a_layout)
                acc2 = warpgroup_mma(op2, ds, acc2, is_async=True)
            else:  # H^T (the block before's products retired at its end)
                ht = warpgroup_mma_wait(num_outstanding=1, deps=(ht,))
                act, dgelu = _gelu_and_grad(ht, FAST_TANH)
                op2 = gl.convert_layout((act * gate[None, :]).to(cdt), a_layout)
                acc2 = warpgroup_mma(op2, ds, acc2, is_async=True)
                dat = warpgroup_mma_wait(num_outstanding=1, deps=(dat,))
            dht = (dat * gate[None, :] * dgelu).to(cdt)
            if FUSE:
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
                # retires the block's products (acc1 / acc2 stay wgmma accumulators: the next wait names them)
                dxt = warpgroup_mma_wait(num_outstanding=0, deps=(dxt,))
                mbarrier.arrive(d_empty.index(s))
                mbarrier.arrive(h_empty.index(hb))
                dxv = gl.convert_layout(gl.permute(dxt.to(cdt), (1, 0)), lxs)  # (BLOCK_M, 64)
                dx_cols = (e0 // 128) * DH + 64 * C + xc  # this tile's partial, this consumer's dh half
                gl.store(dx_ptr + (rows + xr).to(gl.int64)[:, None] * (NP * DH) + dx_cols[None, :], dxv)
            else:
                if XW:  # dH_c^T and the gate gradient's half to the dX warp group
                    hb = q % HB
                    mbarrier.wait(h_empty.index(hb), ((q // HB) & 1) ^ 1)
                    dh_smem.index(hb * 2 + C).store(dht)
                    if not PROBE & 8:
                        dg_smem.index(hb * 2 + C).store(dg)
                    fence_async_shared()  # the generic writes before the wgmma reads (the arrive syncs the warp group)
                    mbarrier.arrive(h_ready.index(hb))
                    # dH_c^T from shared memory: no A operand registers in flight (this consumer writes the slot again
                    # only after the next block's first wait retired this product; HB >= 2 is for overlap)
                    acc1 = warpgroup_mma(dh_smem.index(hb * 2 + C), xs, acc1, is_async=True)
                    # dW2's product (A operand op2 in registers) retires here, dW1's at the next block's first
                    # wait: with dW2's in flight across the loop too, ptxas serialises every wgmma of the kernel
                    # (C7512 "insufficient register resources": each k-step waits for the one before)
                    op2 = warpgroup_mma_wait(num_outstanding=1, deps=(op2,))
                else:
                    op1 = gl.convert_layout(dht, a_layout)
                    acc1 = warpgroup_mma(op1, xs, acc1, is_async=True)
                    # the block's products retire here (its stage is then free): in flight across the block loop
                    # (register A operands op1, op2) ptxas serialised every wgmma of the kernel (C7512)
                    op1, op2 = warpgroup_mma_wait(num_outstanding=0, deps=(op1, op2))
                    mbarrier.arrive(d_empty.index(s))
            q += 1
        # dW1's sum so far loads while the last products retire (dW2's after dW1's store: registers); with XW (at 208
        # registers) after the wait: loaded before it, the consumer spilled 504 bytes (sm_90a compile, 2026-11-26). The
        # address is spelled out here rather than p1 moved above the wait: that move changed the kernels' code without
        # ACCUM (the XW consumer's spills 104 -> 100 B), which the layer measurements were not re-run for
        EARLY: gl.constexpr = ACCUM and not XW
        live = None
        if PROBE & 1:  # false at run time (the compiler cannot tell)
            live = g < 0
        if EARLY:
            old1 = gl.load(dw1_ptr + g * (DH * DE) + dc[None, :] * DE + (e0 + C * 64 + er)[:, None])
        acc1, acc2, op1, op2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, acc2, op1, op2))
        if XW and nsub > 0:  # the last block's dW1 product retired just now
            mbarrier.arrive(d_empty.index((q - 1) % NST))
        mbarrier.arrive(w_empty.index(wb))
        e = e0 + C * 64 + er
        # each store instruction of the wgmma layout covers 8 consecutive de x 4 dh: whole 32-byte sectors
        p1 = dw1_ptr + g * (DH * DE) + dc[None, :] * DE + e[:, None]
        if EARLY:
            acc1 = old1 + acc1
        elif ACCUM:
            acc1 = gl.load(p1, mask=live) + acc1
        gl.store(p1, acc1.to(dw1_ptr.dtype.element_ty), mask=live)
        p2 = dw2_ptr + g * (DE * DH) + e[:, None] * DH + dc[None, :]
        if ACCUM:
            acc2 = gl.load(p2, mask=live) + acc2
        gl.store(p2, acc2.to(dw2_ptr.dtype.element_ty), mask=live)
        n += 1


@gluon.jit
def _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr,
                 w2_ptr, dw1_ptr, dw2_ptr, NST: gl.constexpr, WB: gl.constexpr, BLOCK_M: gl.constexpr,
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
    return (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr,
            w2_ptr, dw1_ptr, dw2_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem)


@gluon.jit
def gluon_expert_dw_ws_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr,
    w2_ptr, acc1_ptr, acc2_ptr,  # inputs (acc1 / acc2: see ACCUM)
    dw1_ptr, dw2_ptr,  # outputs (G, DH, DE), (G, DE, DH)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr,
    BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr, FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACCUM: gl.constexpr,
):
    """Warp-specialised persistent weight gradients (dW1, dW2 of `expert_dwt_kernel`): tiles (group, 128 de) as
    the schedule sched_ptr deals them (`deal_schedule`: offsets of each program's tiles, then the tiles; about the
    same rows for every program, largest groups first, one head at a time; the tiles of one group run side by side,
    so its gathered rows come from L2 after the first); two consumer warp groups, each both gradients of 64 de in
    registers (128 accumulator registers: the worker consumer runs at CONSUMER_REGS after setmaxnreg, the producer at
    PRODUCER_REGS, the default partition at what is left of 512 per lane); one producer warp group (cp.async:
    the tile's weights into one of WB buffers, gathered X / dy rows of BLOCK_M into an NST-stage ring). Sums over
    a group's rows in packed order, no atomics. ACCUM: acc1 / acc2 are the accumulated gradients, the same buffers
    as dW1 / dW2 (the JAX binding's input_output_aliases; the torch launcher passes dW1 / dW2 for both), and every
    tile adds its gradient to them (`_dw_consumer`); acc1 / acc2 are never read through their own pointers."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(DE % 128 == 0, "DE: tiles of 128 de (two consumers of 64)")
    gl.static_assert(NST >= 2 and WB >= 1, "NST: a consumer frees stage q - 1 only after it waited for stage q")
    args = _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr,
                        w1_ptr, w2_ptr, dw1_ptr, dw2_ptr, NST, WB, BLOCK_M, DH, NW)
    f = (0, 0, 0, 0, 0, 0)  # FUSE's operands (unused)
    gl.warp_specialize([(_dw_consumer, (args, f, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 0, False, False,
                                        2, ACCUM)),
                        (_dw_consumer, (args, f, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 1, False, False,
                                        2, ACCUM)),
                        (_dw_producer, (args, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 0))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


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
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr,
    w2_ptr, acc1_ptr, acc2_ptr,  # inputs (acc1 / acc2: as `gluon_expert_dw_ws_kernel`'s, ACCUM)
    dw1_ptr, dw2_ptr, dx_ptr, dgate_ptr,  # outputs (G, DH, DE), (G, DE, DH), (P, DE / 128, DH), (P, DE / 128) fp32
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr,
    BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr, FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, ACCUM: gl.constexpr,
):
    """The whole expert backward (`expert_dwt_kernel` with FUSE_DX and DGATES at DE == 128), warp-specialised:
    `gluon_expert_dw_ws_kernel`'s structure (tiles of (group, 128 de)), whose two consumers also exchange their
    halves of dH^T through shared memory for the block's dX rows and gate gradients (`_dw_consumer`, FUSE). With
    DE > 128 every tile writes its own partial dX row and gate gradient (over its 128 de; the caller sums the
    DE / 128 partials, in order). Rows of BLOCK_M-row blocks made only of padding are not written (`_dw_tile`)."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(DE % 128 == 0 and DH == 128, "the fused backward: DH == 128, tiles of 128 de (consumers of 64)")
    gl.static_assert(NST >= 2 and WB >= 1, "NST >= 2, WB >= 1")
    args = _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr,
                        w1_ptr, w2_ptr, dw1_ptr, dw2_ptr, NST, WB, BLOCK_M, DH, NW)
    f = _dh_ring(dx_ptr, dgate_ptr, 2, BLOCK_M, NW, 2)  # both consumers arrive on both
    gl.warp_specialize([(_dw_consumer, (args, f, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 0, True, False,
                                        2, ACCUM)),
                        (_dw_consumer, (args, f, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 1, True, False,
                                        2, ACCUM)),
                        (_dw_producer, (args, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 0))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _dx_worker(a, f, DE: gl.constexpr, DH: gl.constexpr, PACK_BLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
               WB: gl.constexpr, HB: gl.constexpr, PROBE: gl.constexpr = 0):
    """The dX warp group of `gluon_expert_bwd_xw_kernel`: per row block, once both consumers handed over their dH_c^T
    (h_ready), the block's dX rows over the tile's 128 de, dh half D: dX^T_D = W1[64 D:, :64] dH_0^T + W1[64 D:, 64:]
    dH_1^T (W1 from the tile's weight buffer), stored as (BLOCK_M, DH) rows of this tile's partial; and the gate
    gradient (the consumers' per-warp partials, 16 de each, added in a fixed order). Frees the ring slot (h_empty)
    once its products retired, the weight buffer (w_empty) after the tile's last block. PROBE & 2 (a measurement):
    the dX rows' and gate gradients' stores masked off by a condition false at run time."""
    (x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr, w2_ptr,
     dw1_ptr, dw2_ptr, x_smem, dy_smem, w1_smem, w2_smem, d_ready, d_empty, w_ready, w_empty, g_smem) = a
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
    for j in range(gl.load(sched_ptr + gl.program_id(0)), gl.load(sched_ptr + gl.program_id(0) + 1)):
        g, e0, row0, nsub = _dw_tile(gl.load(sched_ptr + j), group_block_start_ptr, group_size_ptr, DE, PACK_BLOCK,
                                     BLOCK_M)
        wb = _wait_weights(w_ready, n, WB)
        live = None
        if PROBE & 2:  # false at run time (the compiler cannot tell)
            live = g < 0
        for i in range(nsub):
            hb = q % HB
            mbarrier.wait(h_ready.index(hb), (q // HB) & 1)
            h0 = dh_smem.index(hb * 2)
            h1 = dh_smem.index(hb * 2 + 1)
            rows = row0 + i * BLOCK_M
            if PROBE & 32:  # a measurement: no dX products (the rows stored are a value the compiler cannot fold)
                d0 = s_zero + rows.to(gl.float32)
                d1 = s_zero - rows.to(gl.float32)
            else:
                d0 = warpgroup_mma(w1_smem.index(wb * 2).slice(0, 64, dim=0), h0, s_zero, use_acc=False,
                                   is_async=True)
                d0 = warpgroup_mma(w1_smem.index(wb * 2 + 1).slice(0, 64, dim=0), h1, d0, is_async=True)
                d1 = warpgroup_mma(w1_smem.index(wb * 2).slice(64, 64, dim=0), h0, s_zero, use_acc=False,
                                   is_async=True)
                d1 = warpgroup_mma(w1_smem.index(wb * 2 + 1).slice(64, 64, dim=0), h1, d1, is_async=True)
            dg = _sum_partials(dg_smem, hb, BLOCK_M, NW)
            gl.store(dgate_ptr + (rows + gcol) * NP + e0 // 128, dg, mask=live)
            d0, d1 = warpgroup_mma_wait(num_outstanding=0, deps=(d0, d1))
            mbarrier.arrive(h_empty.index(hb))
            base = dx_ptr + (rows + xr).to(gl.int64)[:, None] * (NP * DH) + (e0 // 128) * DH + xc[None, :]
            gl.store(base, gl.convert_layout(gl.permute(d0.to(cdt), (1, 0)), lxs), mask=live)
            gl.store(base + 64, gl.convert_layout(gl.permute(d1.to(cdt), (1, 0)), lxs), mask=live)
            q += 1
        mbarrier.arrive(w_empty.index(wb))
        n += 1


@gluon.jit
def gluon_expert_bwd_xw_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr, w1_ptr,
    w2_ptr, acc1_ptr, acc2_ptr,  # inputs (acc1 / acc2: as `gluon_expert_dw_ws_kernel`'s, ACCUM)
    dw1_ptr, dw2_ptr, dx_ptr, dgate_ptr,  # outputs (G, DH, DE), (G, DE, DH), (P, DE / 128, DH), (P, DE / 128) fp32
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr,
    BLOCK_M: gl.constexpr, NST: gl.constexpr, WB: gl.constexpr, FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DX_REGS: gl.constexpr, HB: gl.constexpr,
    ACCUM: gl.constexpr, PROBE: gl.constexpr,
):
    """The whole expert backward as `gluon_expert_bwd_ws_kernel` computes it (same outputs, same sums in the same
    order), with a fourth warp group for the dX rows (`_dx_worker`): the consumers run the dW kernel's pipeline and
    hand each block's dH^T halves and gate-gradient halves over through an HB-deep ring (`_dw_consumer`, XW), so
    neither the dX products nor the other consumer sit on a consumer's per-block chain. 16 warps: launched with
    maxnreg 128; worker registers (CONSUMER_REGS, PRODUCER_REGS, DX_REGS), the default consumer the rest. PROBE:
    0, or a measurement (`bwd_xw_constexprs`' probe bits)."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(DE % 128 == 0 and DH == 128, "the fused backward: DH == 128, tiles of 128 de (consumers of 64)")
    gl.static_assert(NST >= 2 and WB >= 1 and HB >= 2, "NST >= 2, WB >= 1, HB >= 2")
    args = _dw_operands(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_size_ptr, sched_ptr,
                        w1_ptr, w2_ptr, dw1_ptr, dw2_ptr, NST, WB, BLOCK_M, DH, NW, 3)
    f = _dh_ring(dx_ptr, dgate_ptr, HB, BLOCK_M, NW, 1)  # both consumers arrive on ready, the dX warp group on empty
    gl.warp_specialize([(_dw_consumer, (args, f, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 0, False, True,
                                        HB, ACCUM, PROBE)),
                        (_dw_consumer, (args, f, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 1, False, True,
                                        HB, ACCUM, PROBE)),
                        (_dw_producer, (args, K, DH, DE, PACK_BLOCK, BLOCK_M, NST, WB, FAST_TANH, 0, PROBE)),
                        (_dx_worker, (args, f, DE, DH, PACK_BLOCK, BLOCK_M, WB, HB, PROBE))],
                       [4, 4, 4], [CONSUMER_REGS, PRODUCER_REGS, DX_REGS])


# 32-row blocks (64-row ones need ~250 registers per consumer thread and spill), two weight buffers, six stages;
# worker registers (240, 32): the worker consumer runs at 240, the producer at 32 and Triton gives the default
# partition (the other consumer) the rest, 232 (H100 2026-11-24, kernel alone, bench/gluon_kernels.py --kinds
# dw_options)
DW_WS_BLOCK_M, DW_WS_STAGES, DW_WS_WBUF, DW_WS_REGS = 32, 6, 2, (240, 32)
gluon_expert_dw_ws_kernel.mhl_compile_options = {"maxnreg": WS_MAXNREG}


# the fused backward: two weight buffers, three stages (shared memory: 128 + 48 KB + 16 KB of dH^T halves), worker
# consumer / producer registers (232, 40) (H100 2026-11-24, kernel alone, results/gluon_kernels-h100-2026-11-24-bwd-
# dg-first.jsonl: 0.705 vs 0.735 ms for (4 stages, (240, 32)) at 8192 tokens 768/8/128, 1.088 vs 1.190 at 1536/8/128,
# level within 0.04 ms at 81920 tokens)
BWD_WS_STAGES, BWD_WS_WBUF, BWD_WS_REGS = 3, 2, (232, 40)
gluon_expert_bwd_ws_kernel.mhl_compile_options = {"maxnreg": WS_MAXNREG}


# the fused backward with the dX warp group: 16 warps, so launched at maxnreg 128; worker registers (consumer,
# producer, dX warp group), the default consumer gets 512 - their sum (208). At 56 registers for the dX warp group
# ptxas serialises every wgmma of the kernel (C7512; `tests/e2e/test_bench_scripts.py` guards it). H100 2026-11-25, kernel
# alone, 81920 tokens (results/gluon_kernels-h100-2026-11-25-s16-defer.jsonl): 2.61 / 2.65 / 3.03 / 3.11 ms at
# (384/4/256, 768/8/128, 768/4/256, 1536/8/128) with HB 3 vs 2.68 / 2.73 / 3.18 / 3.17 at HB 2
BWD_XW_STAGES, BWD_XW_WBUF, BWD_XW_HB, BWD_XW_REGS = 3, 2, 3, (208, 32, 64)
gluon_expert_bwd_xw_kernel.mhl_compile_options = {"maxnreg": 128}


def bwd_ws_supported(dh: int, de: int, pack_block: int) -> bool:
    """Shapes of the warp-specialised fused backward: the dW kernel's (`dw_ws_supported`; same tiles and ring)."""
    return dw_ws_supported(dh, de, pack_block)


def bwd_ws_constexprs(k: int, dh: int, de: int, pack_block: int, stages: int = BWD_WS_STAGES,
                      wbuf: int = BWD_WS_WBUF, regs: tuple[int, int] = BWD_WS_REGS, accum: bool = False) -> dict:
    """The fused backward's constexpr arguments (torch and JAX launchers alike): the dW kernel's (`dw_ws_constexprs`,
    32-row blocks) at the backward's defaults; raises on unsupported shapes."""
    return dw_ws_constexprs(k, dh, de, pack_block, stages, wbuf, regs, kernel="fused expert backward", accum=accum)


def bwd_xw_constexprs(k: int, dh: int, de: int, pack_block: int, stages: int = BWD_XW_STAGES,
                      wbuf: int = BWD_XW_WBUF, regs: tuple[int, int, int] = BWD_XW_REGS, hb: int = BWD_XW_HB,
                      accum: bool = False, probe: int = 0, block_m: int = DW_WS_BLOCK_M) -> dict:
    """`gluon_expert_bwd_xw_kernel`'s constexpr arguments: the fused backward's, the dX warp group's registers and
    the dH^T ring's depth; raises on unsupported shapes and on `regs` / `hb` the kernel cannot take. probe: 0 (the
    kernel), or a measurement that masks traffic off (bits 1 dW, 2 dX, 4 gathers), leaves consumer math out (8 the
    gate gradient, 16 the gelu and its derivative) or leaves products out (32 the dX warp group's, 64 the consumers'
    H^T / dA'^T): wrong outputs, bench only."""
    if not 0 <= probe < 128:
        raise ValueError(f"fused expert backward: probe={probe}, expected 0..127 (bits: 1 dW, 2 dX, 4 gathers, "
                         "8 no gate gradient, 16 no gelu math, 32 no dX products, 64 no H^T / dA'^T products)")
    if len(regs) != 3 or hb < 2:
        raise ValueError(f"fused expert backward with the dX warp group: regs={regs}, hb={hb}; expected three worker "
                         "register counts (consumer, producer, dX warp group) and hb >= 2")
    consts = dw_ws_constexprs(k, dh, de, pack_block, stages, wbuf, regs[:2], block_m, kernel="fused expert backward",
                              accum=accum)
    return dict(consts, DX_REGS=regs[2], HB=hb, PROBE=probe)


def bwd_kernel(xw: bool):
    """(kernel, constexpr function) of the Gluon backward: with the dX warp group (`gluon_expert_bwd_xw_kernel`,
    `bwd_xw_constexprs`) or without (`gluon_expert_bwd_ws_kernel`, `bwd_ws_constexprs`); torch and JAX launchers."""
    return (gluon_expert_bwd_xw_kernel, bwd_xw_constexprs) if xw else (gluon_expert_bwd_ws_kernel, bwd_ws_constexprs)


def gluon_experts_bwd_ws(x, dy, gates, pk, w1, w2, k: int, pack_block: int, programs: int | None = None,
                         dw_dtype=None, out=None, *, heads: int, deal: bool = True, xw: bool = False, **options):
    """Torch launcher (CUDA, Hopper) of the fused backward: as `gluon_experts_dw_ws`, plus dX rows (P, de / 128, dh)
    in x.dtype and each packed row's gate gradient (P, de / 128) fp32, one partial per 128 de (sum them; rows of
    the kernel's row blocks (block_m, 32) made only of padding unwritten): -> (dW1, dW2, dX, dgate), or written into
    `out` (the same four).
    xw: `gluon_expert_bwd_xw_kernel` (the dX rows by a fourth warp group; options: `bwd_xw_constexprs`')."""
    import torch

    p, (_, dh), (_, _, de) = pk.row_slot.shape[0], x.shape, w1.shape
    kernel, constexprs = bwd_kernel(xw)
    consts = constexprs(k, dh, de, pack_block, **options)
    dw_dtype = dw_dtype or torch.float32
    out = out or (torch.empty(w1.shape, dtype=dw_dtype, device=x.device),
                  torch.empty(w2.shape, dtype=dw_dtype, device=x.device),
                  torch.empty(p, de // 128, dh, dtype=x.dtype, device=x.device),
                  torch.empty(p, de // 128, dtype=torch.float32, device=x.device))
    _launch_tiled(kernel, x, dy, gates, pk, w1, w2, out, consts, programs, heads, deal)
    return out


def _launch_tiled(kernel, x, dy, gates, pk, w1, w2, outs, consts: dict, programs: int | None, heads: int,
                  deal: bool) -> None:
    """Launch a persistent dW / backward kernel from torch: one program per SM (or `programs`), at most one per
    (group, 128 de) tile, with `tile_schedule_torch`'s schedule for exactly that many programs."""
    import torch

    tiles_per_group = w1.shape[2] // 128
    programs = min(programs or torch.cuda.get_device_properties(x.device).multi_processor_count,
                   w1.shape[0] * tiles_per_group)
    sched = tile_schedule_torch(pk.group_nblocks, tiles_per_group, heads, programs, deal)
    kernel[(programs,)](x.contiguous(), dy.contiguous(), gates.contiguous(), pk.row_slot, pk.group_block_start,
                        pk.group_sizes, sched, w1.contiguous(), w2.contiguous(), outs[0], outs[1],  # acc1, acc2
                        *outs, num_warps=4,
                        maxnreg=kernel.mhl_compile_options["maxnreg"], **consts)


def check_schedule_args(num_groups: int, tiles_per_group: int, heads: int, programs: int) -> None:
    """Raise a ValueError naming the values unless the groups split into `heads` equal heads and 1 <= programs <=
    num_groups * tiles_per_group (the launch grid a schedule is dealt for)."""
    if heads < 1 or num_groups % heads or not 1 <= programs <= num_groups * tiles_per_group:
        raise ValueError(f"tile schedule: {num_groups} groups, heads={heads}, programs={programs}, tiles_per_group="
                         f"{tiles_per_group}; expected the groups to split into equal heads and 1 <= programs <= "
                         f"{num_groups * tiles_per_group} (the tiles)")


def deal_schedule(num_tiles: int, heads: int, programs: int, deal: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The persistent dW / backward kernels' static schedule. The tiles come in head-major order, each head's sorted by
    size, largest first (`tile_schedule`); position j of that sequence goes to one program. Within a head the positions
    are dealt like cards in rounds of alternating direction (program p gets the head's positions p, 2 P - 1 - p,
    2 P + p, ...), and each head's deal starts at another program (rotated by P / heads): the longest-first rule, so
    every program's sum of tile sizes comes out about even, while the programs stay in about the same head at a time
    (its gathered X / dy rows, 21 MB per head at 81920 tokens, stay in L2).
    Groups are as uneven as the router makes them: at 81920 tokens, Ne 384, the layer's first step has groups of 102
    to 2471 rows; strided in group order the busiest of 132 programs had 1544 row blocks against a mean of 1336,
    dealt like this 1356 (and 1360 dealt over all heads at once, which took the gathers out of L2: slower alone).
    -> (perm, starts): program p takes positions perm[starts[p]:starts[p + 1]], in order. deal=False: position j
    to program j % programs (strided in the given order: comparisons)."""
    if heads < 1 or num_tiles % heads or programs < 1:
        raise ValueError(f"deal_schedule: {num_tiles} tiles, heads={heads}, programs={programs}; expected the tiles to "
                         "split into equal heads and at least one program")
    j = np.arange(num_tiles)
    h, jh = j // (num_tiles // heads), j % (num_tiles // heads)
    r, i = jh // programs, jh % programs
    prog = (np.where(r % 2 == 1, programs - 1 - i, i) + h * programs // heads) % programs if deal else j % programs
    starts = np.concatenate([[0], np.cumsum(np.bincount(prog, minlength=programs))])
    return np.argsort(prog, kind="stable"), starts


@functools.lru_cache(maxsize=64)
def _deal_schedule_torch(num_tiles: int, heads: int, programs: int, device: str, deal: bool):
    import torch

    perm, starts = deal_schedule(num_tiles, heads, programs, deal)
    return (torch.as_tensor(perm, device=device),
            torch.as_tensor((starts + programs + 1).astype(np.int32), device=device))


def tile_schedule_torch(group_nblocks, tiles_per_group: int, heads: int, programs: int, deal: bool = True):
    """The schedule array the dW / backward kernels read (int32, torch): `deal_schedule`'s program offsets (counted
    from the array's start: program p's tiles are sched[sched[p]:sched[p + 1]]), then the (group, 128 de) tiles
    program by program. Groups are head-major (G = heads x experts); each head's sorted by row
    blocks, largest first (stable), a group's tiles side by side; deal=False: the tiles in group order, strided over the
    programs (comparisons)."""
    import torch

    check_schedule_args(group_nblocks.shape[0], tiles_per_group, heads, programs)
    nb = group_nblocks.long().reshape(heads, -1)
    go = torch.argsort(-nb, dim=1, stable=True) if deal else torch.arange(nb.shape[1], device=nb.device).expand_as(nb)
    go = go + torch.arange(heads, device=nb.device)[:, None] * nb.shape[1]
    tiles = (go.reshape(-1, 1) * tiles_per_group + torch.arange(tiles_per_group, device=nb.device)).reshape(-1)
    perm, starts = _deal_schedule_torch(tiles.numel(), heads, programs, str(nb.device), deal)
    return torch.cat([starts, tiles[perm].to(torch.int32)])


def dw_ws_supported(dh: int, de: int, pack_block: int) -> bool:
    """Shapes of the warp-specialised weight gradients: dh 128, de a multiple of 128, packing blocks of >= 32 rows."""
    return dh == 128 and de % 128 == 0 and pack_block >= DW_WS_BLOCK_M


def dw_ws_constexprs(k: int, dh: int, de: int, pack_block: int, stages: int = DW_WS_STAGES,
                     wbuf: int = DW_WS_WBUF, regs: tuple[int, int] = DW_WS_REGS, block_m: int = DW_WS_BLOCK_M,
                     kernel: str = "expert dW", accum: bool = False) -> dict:
    """The dW kernel's constexpr arguments (torch and JAX launchers alike); raises on unsupported shapes, naming
    `kernel`. accum: the kernel adds its weight gradients to what dW1 / dW2 hold (ACCUM)."""
    if not dw_ws_supported(dh, de, pack_block) or pack_block % block_m:
        raise ValueError(f"warp-specialised {kernel}: dh={dh}, de={de}, pack_block={pack_block}, block_m={block_m}; "
                         f"expected dh 128, de a multiple of 128 and packing blocks of at least {DW_WS_BLOCK_M} rows, "
                         "a multiple of block_m")
    return dict(K=k, DH=dh, DE=de, PACK_BLOCK=pack_block, BLOCK_M=block_m, NST=stages, WB=wbuf,
                FAST_TANH=True, CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], ACCUM=bool(accum))


def gluon_experts_dw_ws(x, dy, gates, pk, w1, w2, k: int, pack_block: int, programs: int | None = None,
                        dw_dtype=None, out=None, *, heads: int, deal: bool = True, **options):
    """Torch launcher (CUDA, Hopper): x, dy (S, dh) rows as stored, gates (S * k,) fp32, pk a
    `kernels.torch.experts.TorchPacking`, w1 (G, dh, de), w2 (G, de, dh) -> (dW1, dW2) in dw_dtype (fp32), or
    written into `out` = (dW1, dW2) if given; options: `dw_ws_constexprs`' stages / wbuf / regs / block_m (probes)."""
    import torch

    (_, dh), (_, _, de) = x.shape, w1.shape
    consts = dw_ws_constexprs(k, dh, de, pack_block, **options)
    dw_dtype = dw_dtype or torch.float32
    dw1, dw2 = out or (torch.empty(w1.shape, dtype=dw_dtype, device=x.device),
                       torch.empty(w2.shape, dtype=dw_dtype, device=x.device))
    _launch_tiled(gluon_expert_dw_ws_kernel, x, dy, gates, pk, w1, w2, (dw1, dw2), consts, programs, heads, deal)
    return dw1, dw2
