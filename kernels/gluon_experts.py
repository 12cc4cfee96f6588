"""The expert FFN forward of `kernels/experts.py` written in Gluon (Triton's explicit-layout dialect,
`triton.experimental.gluon`), Hopper only: the same function over the same packed layout, with the
schedule written by hand instead of left to Triton's pipeliner.

    out = gelu(X W1[g]) W2[g]          X: (BLOCK_M, DH) gathered rows, W1[g]: (DH, DE), W2[g]: (DE, DH)

What the hand schedule changes against `expert_fwd_kernel` (where every `tl.dot` is issued and waited
for in turn, so the tensor cores idle while the warps compute gelu):
- the matmuls are asynchronous warpgroup MMAs: the product acc += A_j W2_j of chunk j runs on the tensor
  cores while the warps compute gelu of chunk j + 1, whose S_{j+1} = X W1_{j+1} was issued before it;
- X rows and W1 / W2 chunks arrive by cp.async (gathered rows need no TMA descriptor) into a ring of
  NUM_STAGES shared-memory stages, prefetched NUM_STAGES - 2 chunks ahead of their first use.

Parameters follow `expert_fwd_kernel` (jax-triton's binding order), plus NUM_STAGES (>= 3). Padding rows
are written as zeros; blocks made only of padding are skipped.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _gelu(h, FAST_TANH: gl.constexpr):
    """tanh-approximate gelu of fp32 h, the arithmetic of `kernels.experts._gelu`."""
    u = h * gl.fma(h * h, 0.7978845608028654 * 0.044715, 0.7978845608028654)
    if FAST_TANH:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=gl.float32, is_pure=True,
                                      pack=1)
    else:
        t = 2.0 / (1.0 + gl.exp(-2.0 * u)) - 1.0
    hh = 0.5 * h
    return gl.fma(hh, t, hh)


@gluon.constexpr_function
def _copy_layout(cols, num_warps):
    """A blocked register layout for cp.async of a row-major (rows, cols) 16-bit tile: 16-byte vectors."""
    tpc = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [num_warps, 1], [1, 0])


@gluon.jit
def _copy_chunk(w1_smem, w2_smem, w1_base, w2_base, e0, DH: gl.constexpr, DE: gl.constexpr,
                BLOCK_E: gl.constexpr, num_warps: gl.constexpr):
    """cp.async W1[:, e0:e0+BLOCK_E] (DH, BLOCK_E) and W2[e0:e0+BLOCK_E, :] (BLOCK_E, DH) into one stage."""
    l1: gl.constexpr = _copy_layout(BLOCK_E, num_warps)
    d1 = gl.arange(0, DH, layout=gl.SliceLayout(1, l1))
    c1 = gl.arange(0, BLOCK_E, layout=gl.SliceLayout(0, l1))
    async_copy.async_copy_global_to_shared(w1_smem, w1_base + d1[:, None] * DE + (e0 + c1)[None, :])
    l2: gl.constexpr = _copy_layout(DH, num_warps)
    r2 = gl.arange(0, BLOCK_E, layout=gl.SliceLayout(1, l2))
    d2 = gl.arange(0, DH, layout=gl.SliceLayout(0, l2))
    async_copy.async_copy_global_to_shared(w2_smem, w2_base + (e0 + r2)[:, None] * DH + d2[None, :])


@gluon.jit
def gluon_expert_fwd_kernel(
    x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr,  # inputs
    out_ptr,  # output (P, DH)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_E: gl.constexpr, FAST_TANH: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(NUM_STAGES >= 3, "NUM_STAGES: W1 of chunk j + 1 is read one chunk before W2 of chunk j")
    gl.static_assert(BLOCK_M >= 16 * num_warps, "BLOCK_M: every warp holds >= 16 rows of the MMA tiles")
    N_CHUNKS: gl.constexpr = DE // BLOCK_E
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    pid = gl.program_id(0)
    g = gl.load(block_group_ptr + pid // (PACK_BLOCK // BLOCK_M))

    lx: gl.constexpr = _copy_layout(DH, num_warps)
    rows = pid.to(gl.int64) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lx))
    offs_d = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    out_ptrs = out_ptr + rows[:, None] * DH + offs_d[None, :]
    if g < 0:  # block made only of padding
        gl.store(out_ptrs, gl.zeros((BLOCK_M, DH), out_ptr.dtype.element_ty, lx))
    else:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_E, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, DH, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        x_smem = gl.allocate_shared_memory(cdt, [BLOCK_M, DH], gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH],
                                                                                                   cdt))
        w1_smem = gl.allocate_shared_memory(cdt, [NUM_STAGES, DH, BLOCK_E],
                                            gl.NVMMASharedLayout.get_default_for([DH, BLOCK_E], cdt))
        w2_smem = gl.allocate_shared_memory(cdt, [NUM_STAGES, BLOCK_E, DH],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_E, DH], cdt))
        w1_base = w1_ptr + g.to(gl.int64) * (DH * DE)
        w2_base = w2_ptr + g.to(gl.int64) * (DE * DH)

        slot = gl.load(row_slot_ptr + rows)
        valid = slot >= 0
        src = gl.where(valid, slot // K, 0).to(gl.int64)  # padding rows read row 0; their output is zeroed
        async_copy.async_copy_global_to_shared(x_smem, x_ptr + src[:, None] * DH + offs_d[None, :])
        for c in gl.static_range(NUM_STAGES - 1):  # group c: chunk c (group 0 also carries X)
            if c < N_CHUNKS:
                _copy_chunk(w1_smem.index(c), w2_smem.index(c), w1_base, w2_base, c * BLOCK_E, DH, DE, BLOCK_E,
                            num_warps)
            async_copy.commit_group()
        async_copy.wait_group(NUM_STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()

        s_zero = gl.zeros((BLOCK_M, BLOCK_E), gl.float32, s_layout)
        s_tok = warpgroup_mma(x_smem, w1_smem.index(0), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        a = gl.convert_layout(_gelu(s, FAST_TANH).to(cdt), a_layout)
        acc = gl.zeros((BLOCK_M, DH), gl.float32, o_layout)
        for j in gl.static_range(N_CHUNKS):
            if j + 1 < N_CHUNKS:  # S_{j+1} = X W1_{j+1}, issued before the product of chunk j
                async_copy.wait_group(NUM_STAGES - 3)
                fence_async_shared()
                gl.thread_barrier()
                s_tok = warpgroup_mma(x_smem, w1_smem.index((j + 1) % NUM_STAGES), s_zero, use_acc=False,
                                      is_async=True)
            acc_tok = warpgroup_mma(a, w2_smem.index(j % NUM_STAGES), acc, is_async=True)
            if j + 1 < N_CHUNKS:
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # S_{j+1} done, A_j W2_j may still run
                gl.thread_barrier()  # every warpgroup is past the product of chunk j - 1: its stage is free
                if j + NUM_STAGES - 1 < N_CHUNKS:
                    c = j + NUM_STAGES - 1
                    _copy_chunk(w1_smem.index(c % NUM_STAGES), w2_smem.index(c % NUM_STAGES), w1_base, w2_base,
                                c * BLOCK_E, DH, DE, BLOCK_E, num_warps)
                async_copy.commit_group()
                a_next = gl.convert_layout(_gelu(s, FAST_TANH).to(cdt), a_layout)
                acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, a))
                a = a_next
            else:
                acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, a))
        out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), lx)
        gl.store(out_ptrs, gl.where(valid[:, None], out, gl.zeros_like(out)))


def gluon_experts_fwd(x, row_slot, block_group, w1, w2, k: int, pack_block: int, block_m: int = 128,
                      block_e: int = 32, num_warps: int = 8, num_stages: int = 3, out=None):
    """Torch launcher (CUDA, Hopper): the arguments of `kernels.torch_experts.experts_fwd`, tile given apart."""
    import torch

    p, (_, dh), de = row_slot.shape[0], x.shape, w1.shape[2]
    if pack_block % block_m or de % block_e:
        raise ValueError(f"tile (block_m={block_m}, block_e={block_e}): expected block_m to divide the packing "
                         f"block {pack_block} and block_e to divide de={de}")
    out = torch.empty(p, dh, dtype=x.dtype, device=x.device) if out is None else out
    gluon_expert_fwd_kernel[(p // block_m,)](
        x.contiguous(), row_slot, block_group, w1.contiguous(), w2.contiguous(), out,
        K=k, DH=dh, DE=de, PACK_BLOCK=pack_block, BLOCK_M=block_m, BLOCK_E=block_e, FAST_TANH=True,
        NUM_STAGES=num_stages, num_warps=num_warps)
    return out


@gluon.jit
def gluon_expert_fwd_resident_kernel(
    x_ptr, row_slot_ptr, block_group_ptr, group_block_start_ptr, group_nblocks_ptr, w1_ptr, w2_ptr,  # inputs
    out_ptr,  # output (P, DH)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, G: gl.constexpr, NUM_BLOCKS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr, FAST_TANH: gl.constexpr, num_warps: gl.constexpr,
):
    """Persistent, weight-stationary forward: program i computes the row blocks [i U / n, (i + 1) U / n) of the
    U blocks in use (n programs), in packed order, so consecutive blocks mostly share a group: W1[g] and W2[g]
    stay in shared memory and are loaded again only when the group changes. X rows of the next block are
    prefetched while this one computes. Blocks made only of padding (after U) get zero rows.
    BLOCK_M must equal the packing's row block."""
    N_CHUNKS: gl.constexpr = DE // BLOCK_E
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    used = gl.load(group_block_start_ptr + (G - 1)) + gl.load(group_nblocks_ptr + (G - 1))

    lx: gl.constexpr = _copy_layout(DH, num_warps)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_E, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, DH, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    x_smem = gl.allocate_shared_memory(cdt, [2, BLOCK_M, DH], gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH],
                                                                                                  cdt))
    w1_smem = gl.allocate_shared_memory(cdt, [N_CHUNKS, DH, BLOCK_E],
                                        gl.NVMMASharedLayout.get_default_for([DH, BLOCK_E], cdt))
    w2_smem = gl.allocate_shared_memory(cdt, [N_CHUNKS, BLOCK_E, DH],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_E, DH], cdt))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lx))
    offs_d = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    od = gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))

    start = pid * used // nprog
    end = (pid + 1) * used // nprog
    if start < end:  # prefetch X rows of the first block
        slot = gl.load(row_slot_ptr + start.to(gl.int64) * BLOCK_M + offs_m)
        src = gl.where(slot >= 0, slot // K, 0).to(gl.int64)
        async_copy.async_copy_global_to_shared(x_smem.index(0), x_ptr + src[:, None] * DH + offs_d[None, :])
    async_copy.commit_group()
    cur_g = -1
    s_zero = gl.zeros((BLOCK_M, BLOCK_E), gl.float32, s_layout)
    for b in range(start, end):
        buf = (b - start) % 2
        g = gl.load(block_group_ptr + b)
        gl.thread_barrier()  # every warp is done with the previous block's X buffer and with the weights
        if g != cur_g:
            w1_base = w1_ptr + g.to(gl.int64) * (DH * DE)
            w2_base = w2_ptr + g.to(gl.int64) * (DE * DH)
            for c in gl.static_range(N_CHUNKS):
                _copy_chunk(w1_smem.index(c), w2_smem.index(c), w1_base, w2_base, c * BLOCK_E, DH, DE, BLOCK_E,
                            num_warps)
            async_copy.commit_group()
            cur_g = g
        if b + 1 < end:  # X rows of the next block, into the other buffer
            slot = gl.load(row_slot_ptr + (b + 1).to(gl.int64) * BLOCK_M + offs_m)
            src = gl.where(slot >= 0, slot // K, 0).to(gl.int64)
            async_copy.async_copy_global_to_shared(x_smem.index(1 - buf),
                                                   x_ptr + src[:, None] * DH + offs_d[None, :])
        async_copy.commit_group()
        async_copy.wait_group(1)  # all but the newest group (the next block's X): this X and the weights
        fence_async_shared()
        gl.thread_barrier()

        xb = x_smem.index(buf)
        s_tok = warpgroup_mma(xb, w1_smem.index(0), s_zero, use_acc=False, is_async=True)
        if N_CHUNKS > 1:
            s_tok_next = warpgroup_mma(xb, w1_smem.index(1), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        else:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        a = gl.convert_layout(_gelu(s, FAST_TANH).to(cdt), a_layout)
        acc = gl.zeros((BLOCK_M, DH), gl.float32, o_layout)
        for j in gl.static_range(N_CHUNKS):
            # issued, in order: S_{j+1}, then A_j W2_j, then S_{j+2}; gelu of S_{j+1} runs under the last two
            acc = warpgroup_mma(a, w2_smem.index(j), acc, is_async=True)
            if j + 2 < N_CHUNKS:
                s_tok_after = warpgroup_mma(xb, w1_smem.index(j + 2), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok_next,))
                s_tok_next = s_tok_after
            elif j + 1 < N_CHUNKS:
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok_next,))
            if j + 1 < N_CHUNKS:
                a_next = gl.convert_layout(_gelu(s, FAST_TANH).to(cdt), a_layout)
                acc, a = warpgroup_mma_wait(num_outstanding=1 if j + 2 < N_CHUNKS else 0, deps=(acc, a))
                a = a_next
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        rows = b.to(gl.int64) * BLOCK_M + om
        valid = gl.load(row_slot_ptr + rows) >= 0
        out = gl.where(valid[:, None], acc, 0.0).to(out_ptr.dtype.element_ty)
        gl.store(out_ptr + rows[:, None] * DH + od[None, :], out)
    async_copy.wait_group(0)
    for b in range(used + pid, NUM_BLOCKS, nprog):  # blocks made only of padding
        rows = b.to(gl.int64) * BLOCK_M + om
        gl.store(out_ptr + rows[:, None] * DH + od[None, :], gl.zeros((BLOCK_M, DH), out_ptr.dtype.element_ty,
                                                                        o_layout))


def gluon_experts_fwd_resident(x, pk, w1, w2, k: int, pack_block: int, block_e: int = 32, num_warps: int = 8,
                               programs: int | None = None, out=None):
    """Torch launcher of the weight-stationary forward; pk: `kernels.torch_experts.TorchPacking`."""
    import torch

    p, (_, dh), (g_count, _, de) = pk.row_slot.shape[0], x.shape, w1.shape
    if de % block_e:
        raise ValueError(f"block_e={block_e}: expected a divisor of de={de}")
    out = torch.empty(p, dh, dtype=x.dtype, device=x.device) if out is None else out
    nb = p // pack_block
    num_warps = min(num_warps, pack_block // 16)  # every warp holds >= 16 rows of the MMA tiles
    programs = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    gluon_expert_fwd_resident_kernel[(min(programs, nb),)](
        x.contiguous(), pk.row_slot, pk.block_group, pk.group_block_start, pk.group_nblocks, w1.contiguous(),
        w2.contiguous(), out, K=k, DH=dh, DE=de, G=g_count, NUM_BLOCKS=nb, BLOCK_M=pack_block, BLOCK_E=block_e,
        FAST_TANH=True, num_warps=num_warps)
    return out


@gluon.jit
def _ws_copy_rows(smem, base, row_ids, ROWS: gl.constexpr, COLS: gl.constexpr, STRIDE: gl.constexpr,
                  PASS: gl.constexpr, num_warps: gl.constexpr):
    """cp.async rows base + row_ids[r] * STRIDE + [0, COLS) into smem (ROWS, COLS), PASS rows per instruction
    batch (bounds the producer's address registers). row_ids: a callable-free (ROWS,) int64 tensor is too many
    registers for one warp group, so the caller passes None and the rows are contiguous from base."""
    l: gl.constexpr = _copy_layout(COLS, num_warps)
    r = gl.arange(0, PASS, layout=gl.SliceLayout(1, l))
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, l))
    for r0 in gl.static_range(0, ROWS, PASS):
        async_copy.async_copy_global_to_shared(smem.slice(r0, PASS, dim=0),
                                               base + (r0 + r)[:, None] * STRIDE + c[None, :])


@gluon.jit
def _ws_producer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 NS: gl.constexpr, FAST_TANH: gl.constexpr, C: gl.constexpr):
    """Loads for both consumers: per block, its X rows (gathered) into one of two X buffers, then its W1 / W2
    chunks into the NS-slot ring; each buffer's `ready` barrier completes when this partition's copies land
    (cp.async arrive, one arrival per thread)."""
    (x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, x_smem, w1_smem, w2_smem, x_ready, x_empty,
     w_ready, w_empty, start, end) = a
    N: gl.constexpr = DE // BLOCK_E
    PW: gl.constexpr = gl.num_warps()
    lx: gl.constexpr = _copy_layout(DH, PW)
    rr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lx))
    cc = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    # the next block's row slots and group are loaded one block ahead: their latency hides under this block
    slot_next = gl.load(row_slot_ptr + start.to(gl.int64) * BLOCK_M + rr, mask=start < end, other=-1)
    g_next = gl.load(block_group_ptr + start, mask=start < end, other=0)
    g_prev = gl.to_tensor(-1).to(gl.int64)
    for t in range(end - start):
        b = start + t
        xb = t % 2
        slot = slot_next
        g = g_next.to(gl.int64)
        slot_next = gl.load(row_slot_ptr + (b + 1).to(gl.int64) * BLOCK_M + rr, mask=b + 1 < end, other=-1)
        g_next = gl.load(block_group_ptr + b + 1, mask=b + 1 < end, other=0)
        src = gl.where(slot >= 0, slot // K, 0).to(gl.int64)
        mbarrier.wait(x_empty.index(xb), ((t // 2) & 1) ^ 1)
        fence_async_shared()
        async_copy.async_copy_global_to_shared(x_smem.index(xb), x_ptr + src[:, None] * DH + cc[None, :])
        async_copy.mbarrier_arrive(x_ready.index(xb), increment_count=False)
        for j in gl.static_range(N):
            q = t * N + j
            s = q % NS
            mbarrier.wait(w_empty.index(s), ((q // NS) & 1) ^ 1)
            if NS == N and g == g_prev:  # slot j already holds chunk j of this group: hand it over again
                mbarrier.arrive(w_ready.index(s), count=PW * 32)
            else:
                fence_async_shared()
                _ws_copy_rows(w1_smem.index(s), w1_ptr + g * (DH * DE) + j * BLOCK_E, None, DH, BLOCK_E, DE, 32,
                              PW)
                _ws_copy_rows(w2_smem.index(s), w2_ptr + g * (DE * DH) + j * BLOCK_E * DH, None, BLOCK_E, DH, DH,
                              min(BLOCK_E, 32), PW)
                async_copy.mbarrier_arrive(w_ready.index(s), increment_count=False)
        g_prev = g


@gluon.jit
def _ws_consumer(a, K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 NS: gl.constexpr, FAST_TANH: gl.constexpr, C: gl.constexpr):
    """Consumer C (one warp group) computes rows [C * BLOCK_M / 2, (C + 1) * BLOCK_M / 2) of every block, from the
    shared X buffer and weight ring: S_{j+1} = X W1_{j+1} is issued before gelu of S_j, and A_j W2_j runs
    under the wait for S_{j+1} and the next gelu."""
    (x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, x_smem, w1_smem, w2_smem, x_ready, x_empty,
     w_ready, w_empty, start, end) = a
    N: gl.constexpr = DE // BLOCK_E
    HALF: gl.constexpr = BLOCK_M // 2
    NW: gl.constexpr = gl.num_warps()
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, BLOCK_E, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                       instr_shape=[16, DH, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    om = gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
    ls: gl.constexpr = _copy_layout(DH, NW)
    ds = gl.arange(0, DH, layout=gl.SliceLayout(0, ls))
    s_zero = gl.zeros((HALF, BLOCK_E), gl.float32, s_layout)
    for t in range(end - start):
        b = start + t
        xb = t % 2
        rows = b.to(gl.int64) * BLOCK_M + C * HALF + om
        valid = gl.load(row_slot_ptr + rows) >= 0  # used after the products: its latency hides under them
        mbarrier.wait(x_ready.index(xb), (t // 2) & 1)
        xs = x_smem.index(xb).slice(C * HALF, HALF, dim=0)
        q0 = t * N
        mbarrier.wait(w_ready.index(q0 % NS), (q0 // NS) & 1)
        s_tok = warpgroup_mma(xs, w1_smem.index(q0 % NS), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        acc = gl.zeros((HALF, DH), gl.float32, o_layout)
        a_prev = gl.zeros((HALF, BLOCK_E), cdt, a_layout)
        for j in gl.static_range(N):
            q = q0 + j
            if j + 1 < N:
                qn = q + 1
                mbarrier.wait(w_ready.index(qn % NS), (qn // NS) & 1)
                s_next = warpgroup_mma(xs, w1_smem.index(qn % NS), s_zero, use_acc=False, is_async=True)
            a_cur = gl.convert_layout(_gelu(s, FAST_TANH).to(cdt), a_layout)
            acc = warpgroup_mma(a_cur, w2_smem.index(q % NS), acc, is_async=True)
            if j + 1 < N:  # retires S_{j+1} and A_{j-1} W2_{j-1}; A_j W2_j keeps running
                s, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, a_prev))
                if j > 0:
                    mbarrier.arrive(w_empty.index((q - 1) % NS))
                a_prev = a_cur
        acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
        if N > 1:
            mbarrier.arrive(w_empty.index((q0 + N - 2) % NS))
        mbarrier.arrive(w_empty.index((q0 + N - 1) % NS))
        mbarrier.arrive(x_empty.index(xb))
        out = gl.where(valid[:, None], acc, 0.0).to(out_ptr.dtype.element_ty)
        # whole 32-byte sectors per store (the MMA layout writes 4-byte pairs: half sectors, twice the L2 writes)
        out = gl.convert_layout(out, ls)
        rows_s = gl.convert_layout(rows, gl.SliceLayout(1, ls))
        gl.store(out_ptr + rows_s[:, None] * DH + ds[None, :], out)


@gluon.jit
def gluon_expert_fwd_ws_kernel(
    x_ptr, row_slot_ptr, block_group_ptr, group_block_start_ptr, group_nblocks_ptr, w1_ptr, w2_ptr,  # inputs
    out_ptr,  # output (P, DH)
    K: gl.constexpr, DH: gl.constexpr, DE: gl.constexpr, G: gl.constexpr, NUM_BLOCKS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr, NS: gl.constexpr, FAST_TANH: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Warp-specialised persistent forward: one producer warp group loads (X rows gathered by cp.async, W1 / W2
    chunks into a ring of NS slots), two consumer warp groups (the default partition and one worker) each
    compute half of every row block from the shared buffers; mbarriers hand the buffers over. Program i takes
    the used row blocks [i U / n, (i + 1) U / n); blocks made only of padding get zero rows."""
    gl.static_assert(num_warps == 4, "num_warps: one warp group per partition")
    gl.static_assert(NS >= 3 or NS == DE // BLOCK_E,
                     "NS: a consumer holds two ring slots (chunks j, j + 1) while it waits to release chunk j - 1")
    N: gl.constexpr = DE // BLOCK_E
    cdt: gl.constexpr = w1_ptr.dtype.element_ty
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    used = gl.load(group_block_start_ptr + (G - 1)) + gl.load(group_nblocks_ptr + (G - 1))
    start = pid * used // nprog
    end = (pid + 1) * used // nprog

    x_smem = gl.allocate_shared_memory(cdt, [2, BLOCK_M, DH], gl.NVMMASharedLayout.get_default_for([BLOCK_M, DH],
                                                                                                  cdt))
    w1_smem = gl.allocate_shared_memory(cdt, [NS, DH, BLOCK_E], gl.NVMMASharedLayout.get_default_for([DH, BLOCK_E],
                                                                                                    cdt))
    w2_smem = gl.allocate_shared_memory(cdt, [NS, BLOCK_E, DH], gl.NVMMASharedLayout.get_default_for([BLOCK_E, DH],
                                                                                                    cdt))
    x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(x_ready.index(i), count=num_warps * 32)  # one cp.async arrival per producer thread
        mbarrier.init(x_empty.index(i), count=2)  # one arrival per consumer
    for i in gl.static_range(NS):
        mbarrier.init(w_ready.index(i), count=num_warps * 32)
        mbarrier.init(w_empty.index(i), count=2)
    args = (x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, x_smem, w1_smem, w2_smem, x_ready,
            x_empty, w_ready, w_empty, start, end)
    gl.warp_specialize([(_ws_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 0)),
                        (_ws_consumer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 1)),
                        (_ws_producer, (args, K, DH, DE, BLOCK_M, BLOCK_E, NS, FAST_TANH, 0))],
                       [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    lz: gl.constexpr = _copy_layout(DH, num_warps)
    zr = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lz))
    zc = gl.arange(0, DH, layout=gl.SliceLayout(0, lz))
    for b in range(used + pid, NUM_BLOCKS, nprog):  # blocks made only of padding
        rows = b.to(gl.int64) * BLOCK_M + zr
        gl.store(out_ptr + rows[:, None] * DH + zc[None, :], gl.zeros((BLOCK_M, DH), out_ptr.dtype.element_ty, lz))


def gluon_experts_fwd_ws(x, pk, w1, w2, k: int, pack_block: int, block_e: int = 64, ns: int = 4,
                         consumer_regs: int = 208, producer_regs: int = 88, maxnreg: int = 168,
                         programs: int | None = None, out=None):
    """Torch launcher of the warp-specialised forward; pk: `kernels.torch_experts.TorchPacking`."""
    import torch

    p, (_, dh), (g_count, _, de) = pk.row_slot.shape[0], x.shape, w1.shape
    if de % block_e or pack_block < 128:
        raise ValueError(f"block_e={block_e}, pack_block={pack_block}: expected a divisor of de={de} and a "
                         "packing block of >= 128 rows (two 64-row consumer halves)")
    out = torch.empty(p, dh, dtype=x.dtype, device=x.device) if out is None else out
    nb = p // pack_block
    programs = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    gluon_expert_fwd_ws_kernel[(min(programs, nb),)](
        x.contiguous(), pk.row_slot, pk.block_group, pk.group_block_start, pk.group_nblocks, w1.contiguous(),
        w2.contiguous(), out, K=k, DH=dh, DE=de, G=g_count, NUM_BLOCKS=nb, BLOCK_M=pack_block, BLOCK_E=block_e,
        NS=ns, FAST_TANH=True, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4,
        maxnreg=maxnreg)
    return out
