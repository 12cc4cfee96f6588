"""The router forward of `kernels/triton/router.py` (`router_fwd_kernel`), warp-specialised, in Gluon
(`triton.experimental.gluon`, Triton >= 3.6), Hopper only: the same top-k of the same bf16x3 scores, selected by
sorting networks and insertions above a threshold (`kernels/gluon/router_select.py`) instead of rounds of row maxima,
with the schedule written by hand.

    scores = x_h W_r[h] (+ bias[h]),  x_h: (ROWS, DH) bf16 rows of head h, W_r[h] = sum_p W_p[h], W_p bf16 (DH, NE)

- Persistent: work items (row tile of NC * 64 tokens, head) strided over the programs.
- One producer warp group loads by cp.async: the item's x rows (zero past N) into one of two x buffers (64 rows per
  consumer), and every W_r block (the PARTS bf16 terms of 64 experts; zero past NE) into a ring of NST stages. The
  W_r stream is shared by the NC consumers: per row it is 1 / NC of the Triton kernel's (one stream per 64-row
  program), which is bound by L2 at small k.
- NC consumer warp groups of 64 rows: per W_r block the PARTS products (wgmma, smallest term first, as the Triton
  kernel chains its dots), then the selection; at the item's end the row's four threads merge their lists.
- Beside two consumers, an optional fourth warp group casts two fp32 arrays to bf16 (the expert weights: the router
  reads little HBM, so the cast hides under it).
- Outputs as the Triton kernel: values = biased score - bias (the raw score, rounded as there), indices int32.
  Bitwise equal to it (same products in the same order, same order of selection). Where they differ: -0.0 and +0.0
  are equal here (the lower index wins) and ordered -0.0 < +0.0 by the Triton kernel's integer keys; a row with
  fewer than k finite biased scores gets its lowest-index -inf experts here, and index Ne with a NaN value there; a
  NaN score (a diverged model) is never selected there, and here breaks the order of its row (which experts that
  row gets is then unspecified, possibly one twice, though the same in every run; always indices below Ne).

Faster than the Triton forward at every measured shape (H100, kernel alone, 81920 tokens x 8 heads: Ne 384 k 4 0.63
vs 0.92 ms, Ne 1536 k 8 2.54 vs 3.81). Supported shapes: `ws_router_supported`; tuning: kernels/tuning.py.
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

from kernels.gluon.common import _copy_layout, _wgmma_layout, _ws_barriers
from kernels.gluon.router_select import _log2, block_bias, finish_lists, init_lists, select_block, store_topk
from kernels.triton.router import WEIGHT_PARTS
from kernels.tuning import (
    WS_ROUTER_CAST_MAXNREG,
    WS_ROUTER_CAST_REGS,
    WS_ROUTER_MAX_K3,
    WS_ROUTER_MAXNREG,
    WS_ROUTER_REGS,
    WS_ROUTER_STAGES,
    WS_ROUTER_THR,
)


@gluon.jit
def _block_scores(xs, w_smem, s, zero, PARTS: gl.constexpr):
    """The scores of one W_r block: its PARTS products (smallest term first) chained in one accumulator."""
    acc = warpgroup_mma(xs, w_smem.index(s * PARTS + PARTS - 1), zero, use_acc=False, is_async=True)
    for q in gl.static_range(1, PARTS):
        acc = warpgroup_mma(xs, w_smem.index(s * PARTS + PARTS - 1 - q), acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _router_producer(a, N: gl.constexpr, H: gl.constexpr, DH: gl.constexpr, NE: gl.constexpr, K: gl.constexpr,
                     PARTS: gl.constexpr, NST: gl.constexpr, NC: gl.constexpr, C: gl.constexpr):
    """Per item: its x rows into x buffer t % 2, then W_r block by block (all PARTS terms) into the ring."""
    (x_ptr, w_ptr, b_ptr, vals_ptr, idx_ptr, x_smem, w_smem, x_ready, x_empty, w_ready, w_empty, T) = a
    PW: gl.constexpr = gl.num_warps()
    lx: gl.constexpr = _copy_layout(DH, PW)
    rr = gl.arange(0, 64, layout=gl.SliceLayout(1, lx))
    cc = gl.arange(0, DH, layout=gl.SliceLayout(0, lx))
    lw: gl.constexpr = _copy_layout(64, PW)
    wr = gl.arange(0, DH, layout=gl.SliceLayout(1, lw))
    wc = gl.arange(0, 64, layout=gl.SliceLayout(0, lw))
    q = 0
    t = 0
    for item in range(gl.program_id(0), T, gl.num_programs(0)):
        h = item % H
        xb = t % 2
        mbarrier.wait(x_empty.index(xb), ((t // 2) & 1) ^ 1)
        fence_async_shared()
        for c in gl.static_range(NC):
            rows = (item // H) * (NC * 64) + c * 64 + rr
            src = (rows.to(gl.int64) * H + h)[:, None] * DH + cc[None, :]
            async_copy.async_copy_global_to_shared(x_smem.index(xb * NC + c), x_ptr + src, mask=(rows < N)[:, None])
        async_copy.mbarrier_arrive(x_ready.index(xb), increment_count=False)
        for e0 in range(0, NE, 64):
            s = q % NST
            mbarrier.wait(w_empty.index(s), ((q // NST) & 1) ^ 1)
            fence_async_shared()
            wmask = (e0 + wc < NE)[None, :]
            for p in gl.static_range(PARTS):
                base = w_ptr + (p * H + h).to(gl.int64) * (DH * NE) + e0
                async_copy.async_copy_global_to_shared(w_smem.index(s * PARTS + p),
                                                       base + wr[:, None] * NE + wc[None, :], mask=wmask)
            async_copy.mbarrier_arrive(w_ready.index(s), increment_count=False)
            q += 1
        t += 1


@gluon.jit
def _next_scores(xs, w_smem, w_ready, w_empty, q, zero, NST: gl.constexpr, PARTS: gl.constexpr):
    """The scores of the q-th W_r block of the ring (waits for it, hands its stage back after the products)."""
    s = q % NST
    mbarrier.wait(w_ready.index(s), (q // NST) & 1)
    fence_async_shared()  # the cp.async writes (generic proxy) before the wgmma reads (async proxy)
    sc = _block_scores(xs, w_smem, s, zero, PARTS)
    mbarrier.arrive(w_empty.index(s))
    return sc


@gluon.jit
def _router_consumer(a, N: gl.constexpr, H: gl.constexpr, DH: gl.constexpr, NE: gl.constexpr, K: gl.constexpr,
                     PARTS: gl.constexpr, NST: gl.constexpr, NC: gl.constexpr, C: gl.constexpr, THR: gl.constexpr):
    """Consumer C: rows [C * 64, C * 64 + 64) of every item, block by block (the other consumers' selections run
    under this one's products; issuing block b + 1's before block b's selection measured slower: the second
    accumulator's registers). At k <= 4 the first block is selected against a bound from its own scores, at k 8
    through the networks; the later ones against the lists' bound (`select_block`)."""
    (x_ptr, w_ptr, b_ptr, vals_ptr, idx_ptr, x_smem, w_smem, x_ready, x_empty, w_ready, w_empty, T) = a
    NW: gl.constexpr = gl.num_warps()
    KP: gl.constexpr = 1 << _log2(2 * K - 1)  # K rounded up to a power of 2
    zero = gl.zeros((64, 64), gl.float32, _wgmma_layout(64, NW))
    q = 0
    t = 0
    for item in range(gl.program_id(0), T, gl.num_programs(0)):
        h = item % H
        xb = t % 2
        rv, ri = init_lists(NE, KP)
        floor = gl.full_like(rv[0], float("-inf"))  # made by the first block
        mbarrier.wait(x_ready.index(xb), (t // 2) & 1)
        xs = x_smem.index(xb * NC + C)
        for e0 in range(0, NE, 64):
            bias = block_bias(b_ptr, h, e0, NE)  # before the W_r wait: its L2 latency hides under it and the products
            sc = _next_scores(xs, w_smem, w_ready, w_empty, q, zero, NST, PARTS)
            rv, ri, floor = select_block(sc, e0, bias, rv, ri, floor, NE, KP, THR)
            q += 1
        mbarrier.arrive(x_empty.index(xb))
        t += 1
        rv, ri = finish_lists(rv, ri, KP)
        store_topk(rv, ri, (item // H) * (NC * 64) + C * 64, h, b_ptr, vals_ptr, idx_ptr, N, H, NE, K)


@gluon.jit
def _router_caster(c, CAST_N: gl.constexpr):
    """A side job beside the router (NC 2 only): cast two fp32 arrays of CAST_N elements to bf16, chunks of 8 values
    per thread strided over the programs, one chunk of each array per step (two loads in flight). It shares nothing
    with the other partitions, but its HBM traffic slows the router's producer: 2.86 -> 3.14 ms at Ne 1536 k 8
    casting 2.4 GB on an H100, against 0.80 ms for the cast alone (more loads in flight or evict-first loads did not
    help)."""
    (c1_ptr, c2_ptr, o1_ptr, o2_ptr) = c
    PW: gl.constexpr = gl.num_warps()
    CH: gl.constexpr = 8 * 32 * PW
    offs = gl.arange(0, CH, layout=gl.BlockedLayout([8], [32], [PW], [0]))
    for j in range(gl.program_id(0), (CAST_N + CH - 1) // CH, gl.num_programs(0)):
        o = j.to(gl.int64) * CH + offs
        m = o < CAST_N
        v1 = gl.load(c1_ptr + o, mask=m)
        v2 = gl.load(c2_ptr + o, mask=m)
        gl.store(o1_ptr + o, v1.to(o1_ptr.dtype.element_ty), mask=m)
        gl.store(o2_ptr + o, v2.to(o2_ptr.dtype.element_ty), mask=m)


@gluon.jit
def gluon_router_fwd_ws_kernel(
    x_ptr, w_ptr, b_ptr,  # inputs: x (N, H, DH) bf16, w (PARTS, H, DH, NE) bf16, bias (H, NE) fp32
    c1_ptr, c2_ptr,  # inputs: two fp32 arrays of CAST_N elements to cast (unused at CAST_N 0)
    vals_ptr, idx_ptr,  # outputs: (N, H, K) fp32, (N, H, K) int32
    o1_ptr, o2_ptr,  # outputs: the casts, bf16 (unused at CAST_N 0)
    N: gl.constexpr, H: gl.constexpr, DH: gl.constexpr, NE: gl.constexpr, K: gl.constexpr, PARTS: gl.constexpr,
    NST: gl.constexpr, NC: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    THR: gl.constexpr, CAST_N: gl.constexpr = 0, CAST_REGS: gl.constexpr = 40,
):
    """Warp-specialised persistent router forward: items (NC * 64 rows, head) strided over the programs; one
    producer warp group (cp.async of x rows and 64-expert W_r blocks), NC consumer warp groups of 64 rows (NC - 1
    workers at CONSUMER_REGS, the producer at PRODUCER_REGS, the default-partition consumer at what Triton leaves it:
    168 at NC 3, 256 at NC 2, 232 at NC 2 with the caster); mbarriers hand the buffers over. CAST_N > 0 (NC 2 only):
    a fourth warp group (`_router_caster`, CAST_REGS) casts c1, c2 into o1, o2 meanwhile."""
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == 4, "num_warps: one warp group per partition (launch with num_warps=4)")
    gl.static_assert(NC == 2 or NC == 3, "NC: two or three consumer warp groups")
    gl.static_assert(NST >= 2, "NST: the producer fills one stage while the consumers read another")
    gl.static_assert(CAST_N == 0 or NC == 2, "CAST_N: the caster warp group fits beside two consumers only")
    cdt: gl.constexpr = x_ptr.dtype.element_ty
    T = H * ((N + NC * 64 - 1) // (NC * 64))
    x_smem = gl.allocate_shared_memory(cdt, [2 * NC, 64, DH], gl.NVMMASharedLayout.get_default_for([64, DH], cdt))
    w_smem = gl.allocate_shared_memory(cdt, [NST * PARTS, DH, 64], gl.NVMMASharedLayout.get_default_for([DH, 64], cdt))
    x_ready, x_empty = _ws_barriers(2, NW * 32, NC)  # the producer warp group has NW warps too
    w_ready, w_empty = _ws_barriers(NST, NW * 32, NC)
    args = (x_ptr, w_ptr, b_ptr, vals_ptr, idx_ptr, x_smem, w_smem, x_ready, x_empty, w_ready, w_empty, T)
    if NC == 2 and CAST_N > 0:
        gl.warp_specialize([(_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0, THR)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 1, THR)),
                            (_router_producer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0)),
                            (_router_caster, ((c1_ptr, c2_ptr, o1_ptr, o2_ptr), CAST_N))],
                           [4, 4, 4], [CONSUMER_REGS, PRODUCER_REGS, CAST_REGS])
    elif NC == 2:
        gl.warp_specialize([(_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0, THR)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 1, THR)),
                            (_router_producer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0))],
                           [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0, THR)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 1, THR)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 2, THR)),
                            (_router_producer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0))],
                           [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# jax-triton takes the register limit from the kernel object, so each launch limit is its own object.
gluon_router_fwd_ws_kernel.mhl_compile_options = {"maxnreg": WS_ROUTER_MAXNREG[3]}
gluon_router_fwd_ws_kernel_nc2 = gluon.jit(gluon_router_fwd_ws_kernel.fn)
gluon_router_fwd_ws_kernel_nc2.mhl_compile_options = {"maxnreg": WS_ROUTER_MAXNREG[2]}
gluon_router_fwd_ws_kernel_nc2_cast = gluon.jit(gluon_router_fwd_ws_kernel.fn)
gluon_router_fwd_ws_kernel_nc2_cast.mhl_compile_options = {"maxnreg": WS_ROUTER_CAST_MAXNREG}


def ws_router_supported(dh: int, ne: int, k: int) -> bool:
    """Shapes of the warp-specialised router forward: dh 128, NE a multiple of 8 (16-byte W_r rows for cp.async),
    1 <= k <= 8 (lists of at most 8 per thread)."""
    return dh == 128 and ne % 8 == 0 and 1 <= k <= min(8, ne)


def ws_router_consumers(k: int, cast: bool = False) -> int:
    """Consumer warp groups: two beside the caster; else three at k <= WS_ROUTER_MAX_K3, two above."""
    return 2 if cast or k > WS_ROUTER_MAX_K3 else 3


def ws_router_kernel(nc: int, cast: bool = False):
    """The kernel object compiled with nc consumers' launch limit (cast: with the caster warp group, nc 2)."""
    if cast:
        return gluon_router_fwd_ws_kernel_nc2_cast
    return gluon_router_fwd_ws_kernel if nc == 3 else gluon_router_fwd_ws_kernel_nc2


def ws_router_constexprs(n: int, h: int, dh: int, ne: int, k: int, cast_n: int = 0) -> dict:
    """The kernel's constexpr arguments (torch and JAX launchers alike); cast_n: elements of each array the caster
    warp group casts (0: no caster). Raises on unsupported shapes."""
    if not ws_router_supported(dh, ne, k):
        raise ValueError(f"warp-specialised router forward: dh={dh}, Ne={ne}, k={k}; expected dh 128, Ne a multiple "
                         "of 8, 1 <= k <= 8")
    nc = ws_router_consumers(k, bool(cast_n))
    regs = WS_ROUTER_REGS[nc]
    return dict(N=n, H=h, DH=dh, NE=ne, K=k, PARTS=WEIGHT_PARTS, NST=WS_ROUTER_STAGES[nc], NC=nc,
                CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], CAST_N=cast_n, CAST_REGS=WS_ROUTER_CAST_REGS,
                THR=WS_ROUTER_THR)


def ws_router_items(n: int, h: int, nc: int) -> int:
    return h * -(-n // (nc * 64))
