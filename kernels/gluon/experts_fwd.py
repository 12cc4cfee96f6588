"""The expert FFN forward of `kernels/triton/experts.py`, warp-specialised, in Gluon (Triton's explicit-layout
dialect, `triton.experimental.gluon`, Triton >= 3.6), Hopper only: the same function over the same packed layout
(bitwise the same output rows as `expert_fwd_kernel`), with the schedule written by hand:

    out = gelu(X W1[g]) W2[g]          X: (BLOCK_M, DH) gathered rows, W1[g]: (DH, DE), W2[g]: (DE, DH)

- Persistent: program i of n takes the used row blocks [i U / n, (i + 1) U / n) (U from the packing's
  group_block_start / group_nblocks), in packed order, so consecutive blocks mostly share a group; with HEADS > 1
  it takes that share of each head's blocks, head after head, so that all programs gather one head's rows at a
  time (from L2; `kernels.tuning.FWD_HEAD_MAJOR_MIN_K`).
- One producer warp group loads everything by cp.async (gathered X rows need no TMA descriptor): the next
  block's X rows into the other of two X buffers (padding rows zero-filled, so their output rows come out 0
  without a mask), the W1 / W2 chunks (BLOCK_E wide) into a ring of NS slots. With NS == DE / BLOCK_E each slot
  always holds the same chunk, and a block of the same group as the one before reuses the slots without loading
  them again.
- Two consumer warp groups (the default partition and one worker) compute the two 64-row halves of every
  block from the shared buffers in 128-de chunks: per chunk S_j = X W1_j (async m64n128 wgmma), gelu, then
  A_j W2_j, which runs under the next chunk's S and the other consumer's gelu (S_j's wait retires it); output
  rows go out as whole 32-byte sectors. A second half made only of padding (a group's last block, about every
  other group) is skipped: neither computed nor written (nothing reads padding rows).
- mbarriers hand each buffer over (ready: one cp.async arrival per producer thread; empty: one arrival per
  consumer). Registers per partition and maxnreg: `kernels.tuning.GLUON_FWD_REGS`, `GLUON_MAXNREG` (three warp
  groups in one 64K-register SM).

Faster than the Triton forward at every shape it takes (`kernels.tuning.gluon_fwd_supported`). Parameters in
jax-triton's binding order (inputs, the output, constexprs).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.gluon.common import _copy_layout, _gelu, _store_rows, _wgmma_layout, _ws_barriers, _ws_copy_rows
from kernels.tuning import GLUON_FWD_BLOCK_E, GLUON_FWD_REGS, GLUON_MAXNREG, gluon_fwd_supported


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
def _ws_half(a, xb, q0, rows, DH: gl.constexpr, BLOCK_E: gl.constexpr, NS: gl.constexpr, N: gl.constexpr,
             FAST_TANH: gl.constexpr, C: gl.constexpr, HALF: gl.constexpr):
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
        a_prev = gl.convert_layout(_gelu(s, FAST_TANH).to(cdt), a_layout)
        acc = warpgroup_mma(a_prev, w2_smem.index(q % NS), acc, is_async=True)
    acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
    mbarrier.arrive(w_empty.index((q0 + N - 1) % NS))
    mbarrier.arrive(x_empty.index(xb))
    _store_rows(out_ptr, rows, acc.to(out_ptr.dtype.element_ty), DH, NW)


@gluon.jit
def _ws_consumer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 NS: gl.constexpr, FAST_TANH: gl.constexpr, C: gl.constexpr, G: gl.constexpr = 1,
                 HEADS: gl.constexpr = 1):
    """Consumer C (one warp group) computes rows [C * BLOCK_M / 2, (C + 1) * BLOCK_M / 2) of every block, from the
    shared X buffer and weight ring, chunk by chunk (`_ws_half`): S_j = X W1_j, gelu, A_j W2_j. A_j W2_j runs under
    the next chunk's S_{j+1} and this consumer's wait for it (the wait retires both), so each consumer alternates its
    MMAs with its gelu and the two consumers' interleave. (Issuing S_{j+1} before gelu of S_j with 64-de chunks, two
    S tiles in registers, measured 1-4% slower: the m64n64 products read twice the X per product.)
    Consumer 1: a second half made only of padding (its first row a padding row: a group's padding
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
            if C == 1:
                half_slot = gl.load(row_slot_ptr + b.to(gl.int64) * BLOCK_M + HALF)
                mbarrier.wait(x_ready.index(xb), (t // 2) & 1)
                if half_slot < 0:  # padding only: free the block's weight chunks and X rows unused
                    for j in gl.static_range(N):
                        mbarrier.wait(w_ready.index((t * N + j) % NS), ((t * N + j) // NS) & 1)
                        mbarrier.arrive(w_empty.index((t * N + j) % NS))
                    mbarrier.arrive(x_empty.index(xb))
                else:
                    _ws_half(a, xb, t * N, b.to(gl.int64) * BLOCK_M + C * HALF + om, DH, BLOCK_E, NS, N, FAST_TANH,
                             C, HALF)
            else:
                mbarrier.wait(x_ready.index(xb), (t // 2) & 1)
                _ws_half(a, xb, t * N, b.to(gl.int64) * BLOCK_M + C * HALF + om, DH, BLOCK_E, NS, N, FAST_TANH, C,
                         HALF)
            t += 1


@gluon.jit
def gluon_expert_fwd_ws_kernel(
    x_ptr, row_slot_ptr, block_group_ptr, group_block_start_ptr, group_nblocks_ptr, w1_ptr, w2_ptr,  # inputs
    out_ptr,  # output (P, DH)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, G: gl.constexpr, NUM_BLOCKS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr, NS: gl.constexpr, FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, HEADS: gl.constexpr,
):
    """Warp-specialised persistent forward: one producer warp group loads (X rows gathered by cp.async, W1 / W2
    chunks into a ring of NS slots), two consumer warp groups (the default partition and one worker) each
    compute half of every row block from the shared buffers; mbarriers hand the buffers over. Program i takes
    its share [i B / n, (i + 1) B / n) of each head's B used row blocks, head after head (`_ws_share`; HEADS 1: of
    all U used blocks at once); blocks made only of padding get zero rows; a block's second half made only of padding
    is left unwritten (`_ws_consumer`; nothing reads padding rows)."""
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
    gl.warp_specialize([(_ws_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 0, G, HEADS)),
                        (_ws_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 1, G, HEADS)),
                        (_ws_producer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 0, G, HEADS))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    _zero_blocks(out_ptr, used, NUM_BLOCKS, BLOCK_M, DH, NW)


# jax-triton compiles with its own options: mhl_jax.moe.gpu.gluon adds these
gluon_expert_fwd_ws_kernel.mhl_compile_options = {"maxnreg": GLUON_MAXNREG}


def fwd_constexprs(k: int, dh: int, de: int, num_groups: int, num_blocks: int, pack_block: int, heads: int = 1) -> dict:
    """The kernel's constexpr arguments (torch and JAX launchers alike); raises on unsupported shapes. heads: the
    heads the groups split into (the programs take each head's blocks in turn; 1: all at once)."""
    if not gluon_fwd_supported(dh, de, pack_block):
        raise ValueError(f"warp-specialised expert forward: dh={dh}, de={de}, pack_block={pack_block}; expected "
                         "dh 128, de 128 or 256 and packing blocks of 128 rows")
    if heads < 1 or num_groups % heads:
        raise ValueError(f"warp-specialised expert forward: heads={heads} for {num_groups} groups; expected the "
                         "groups to split into equal heads")
    return dict(K=k, DH=dh, DE=de, G=num_groups, NUM_BLOCKS=num_blocks, BLOCK_M=pack_block,
                BLOCK_E=GLUON_FWD_BLOCK_E, NS=de // GLUON_FWD_BLOCK_E, FAST_TANH=True,
                CONSUMER_REGS=GLUON_FWD_REGS[0], PRODUCER_REGS=GLUON_FWD_REGS[1], HEADS=heads)
