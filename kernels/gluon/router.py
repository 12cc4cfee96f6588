"""The router forward of `kernels/triton/router.py` (`router_fwd_kernel`), warp-specialised, in Gluon
(`triton.experimental.gluon`, Triton >= 3.6), Hopper only: the same top-k of the same bf16xP scores, selected by
sorting networks and insertions above a threshold instead of rounds of row maxima, with the schedule written by hand.

    scores = x_h W_r[h] (+ bias[h]),  x_h: (ROWS, DH) bf16 rows of head h, W_r[h] = sum_p W_p[h], W_p bf16 (DH, NE)

- Persistent: work items (row tile of NC * 64 tokens, head) strided over the programs.
- One producer warp group loads by cp.async: the item's x rows (zero past N) into one of two x buffers (64 rows per
  consumer), and every W_r block (the PARTS bf16 terms of 64 experts; zero past NE) into a ring of NST stages. The
  W_r stream is shared by the NC consumers: per row it is 1 / NC of the Triton kernel's (one stream per 64-row
  program), which session 8 found L2-bound at k = 1 (bench/NOTES.md, Router forward).
- NC consumer warp groups of 64 rows: per W_r block the PARTS products (wgmma, smallest term first, as the Triton
  kernel chains its dots), then the selection. The scores go to a layout where each thread holds 16 consecutive
  experts of two rows, and each thread keeps the best KP (k rounded up to a power of 2) of its own experts: per
  block, sorting networks (Batcher's odd-even merge sort) sort groups of KP of its 16 scores, merge the groups (the
  better of a_t and b_{KP-1-t}, then a bitonic merge) and merge the result into its running list. No data-dependent
  control flow, no cross-thread work until the item's end, where two butterfly shuffles merge the four threads of a
  row.
- From the second block on most scores cannot enter any more, so by default (THR > 0, `_thr_block`) a block goes
  through the networks only where some thread row of the warp group has more than THR scores above its row's
  threshold (a bound from the four threads' lists: what is not above it cannot be among the row's best KP); otherwise
  each thread inserts its candidates into its list, one per round, in as many rounds as the warp group's most
  candidates. The same total order, so the same lists' merge at the item's end: bitwise the networks' result.
  "Better" = the larger biased score, the lower expert index among equal ones (the Triton kernel's order), a total
  order on non-NaN scores: ties go exactly as there.
- Outputs as the Triton kernel: values = biased score - bias (the raw score, rounded as there), indices int32.
  Bitwise equal to it in every run so far (same products in the same order, same order of selection). Where they
  differ: -0.0 and +0.0 are equal here (the lower index wins) and ordered -0.0 < +0.0 by the Triton
  kernel's integer keys; a row with fewer than k finite biased scores gets its lowest-index -inf experts here, and
  index Ne with a NaN value there; a NaN score (a diverged model) is never selected there, and here breaks the
  order of its row (which experts that row gets is then unspecified, though the same in every run).

Measured on H100 (kernel alone, 81920 tokens x 8 heads, bench/gluon_kernels.py --kinds router; Triton in brackets;
2026-11-25, results/gluon_kernels-h100-2026-11-25-s17-router.jsonl): Ne 384 k 4 0.647 ms (0.923), Ne 768 k 4 1.16
(1.69), Ne 768 k 8 1.58 (2.29), Ne 1536 k 8 2.84 (3.81); 8192 tokens, Ne 384 k 4 0.088 (0.134), Ne 768 k 8 0.183
(0.286). With bitonic group sorts (until 2026-11-25, same process: results/gluon_router-h100-2026-11-25-s17-oddeven
.jsonl) 0.68 / 1.25 / 1.73 / 3.12 ms at 81920 tokens. Rounds of row maxima (the Triton kernel's selection) in this
kernel (2026-11-24): 0.81 / 2.40 / 3.83 ms at Ne 384 k 4 / Ne 768 k 8 / Ne 1536 k 8.
The threshold rounds (2026-11-26, session 27, same process, results/gluon_kernels-h100-2026-11-26-s27-router-tmode
.jsonl): Ne 384 k 4 0.627 ms (0.652 networks only), Ne 768 k 8 1.445 (1.594), Ne 1536 k 8 2.542 (2.833); 8192 tokens
Ne 384 k 4 0.084 (0.087).
Supported shapes: `ws_router_supported`.
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

from kernels.gluon.experts import _copy_layout, _wgmma_layout, _ws_barriers


@gluon.jit
def _better(va, ia, vb, ib):
    """(va, ia) goes before (vb, ib): the larger score, the lower expert index among equal scores."""
    return (va > vb) | ((va == vb) & (ia < ib))


@gluon.constexpr_function
def _log2(n):
    return int(n).bit_length() - 1


@gluon.jit
def _cx(v, i, N: gl.constexpr, A: gl.constexpr, B: gl.constexpr):
    """One compare-exchange of the N-tuples v / i: the better of elements A < B goes to A, the other to B."""
    s = _better(v[B], i[B], v[A], i[A])
    nv = ()
    ni = ()
    for t in gl.static_range(N):
        if t == A:
            nv = nv + (gl.where(s, v[B], v[A]),)
            ni = ni + (gl.where(s, i[B], i[A]),)
        elif t == B:
            nv = nv + (gl.where(s, v[A], v[B]),)
            ni = ni + (gl.where(s, i[A], i[B]),)
        else:
            nv = nv + (v[t],)
            ni = ni + (i[t],)
    return nv, ni


@gluon.jit
def _cas_pass(v, i, N: gl.constexpr, JJ: gl.constexpr):
    """One compare-exchange pass of a bitonic merge over the N-tuples v / i (values, indices): pairs (t, t ^ JJ), the
    pair's first element gets the better one."""
    for t in gl.static_range(N):
        if (t ^ JJ) > t:
            v, i = _cx(v, i, N, t, t ^ JJ)
    return v, i


@gluon.jit
def _sort_net(v, i, N: gl.constexpr):
    """Sort the N-tuples (N = 1, 2, 4 or 8) into the better-first order by Batcher's odd-even merge sort: 1, 5 and 19
    compare-exchanges at N = 2, 4, 8 (a bitonic network takes 1, 6 and 24: measured 3-10% slower for the kernel, H100
    2026-11-25). The order is total (`_better`), so every sorting network gives the same result."""
    if N >= 2:
        v, i = _cx(v, i, N, 0, 1)
    if N >= 4:  # elements 0..3
        v, i = _cx(v, i, N, 2, 3)
        v, i = _cx(v, i, N, 0, 2)
        v, i = _cx(v, i, N, 1, 3)
        v, i = _cx(v, i, N, 1, 2)
    if N == 8:  # elements 4..7 as 0..3, then the odd-even merge of the two sorted halves
        v, i = _cx(v, i, N, 4, 5)
        v, i = _cx(v, i, N, 6, 7)
        v, i = _cx(v, i, N, 4, 6)
        v, i = _cx(v, i, N, 5, 7)
        v, i = _cx(v, i, N, 5, 6)
        v, i = _cx(v, i, N, 0, 4)
        v, i = _cx(v, i, N, 1, 5)
        v, i = _cx(v, i, N, 2, 6)
        v, i = _cx(v, i, N, 3, 7)
        v, i = _cx(v, i, N, 2, 4)
        v, i = _cx(v, i, N, 3, 5)
        v, i = _cx(v, i, N, 1, 2)
        v, i = _cx(v, i, N, 3, 4)
        v, i = _cx(v, i, N, 5, 6)
    return v, i


@gluon.jit
def _merge_top(av, ai, bv, bi, KP: gl.constexpr):
    """The best KP of two better-first lists of KP, better-first: the better of a_t and b_{KP-1-t} (a bitonic
    sequence holding the top KP), then a bitonic merge."""
    cv = ()
    ci = ()
    for t in gl.static_range(KP):
        s = _better(av[t], ai[t], bv[KP - 1 - t], bi[KP - 1 - t])
        cv = cv + (gl.where(s, av[t], bv[KP - 1 - t]),)
        ci = ci + (gl.where(s, ai[t], bi[KP - 1 - t]),)
    for lj in gl.static_range(_log2(KP)):
        cv, ci = _cas_pass(cv, ci, KP, KP >> (lj + 1))
    return cv, ci


@gluon.jit
def _split_cols(t):
    """(64, 4, 16) -> the 16 (64, 4) slices t[:, :, j], j = 0..15 (the columns each thread holds)."""
    a0 = t.reshape([64, 4, 8, 2])
    e, o = gl.split(a0)  # j = 2m, 2m + 1
    out = ()
    for u in gl.static_range(2):
        x1 = (e if u == 0 else o).reshape([64, 4, 4, 2])
        e1, o1 = gl.split(x1)  # m = 2m1, 2m1 + 1
        for u1 in gl.static_range(2):
            x2 = (e1 if u1 == 0 else o1).reshape([64, 4, 2, 2])
            e2, o2 = gl.split(x2)
            for u2 in gl.static_range(2):
                x3 = (e2 if u2 == 0 else o2)
                e3, o3 = gl.split(x3)
                out = out + (e3, o3)
    # leaf 8 u + 4 u1 + 2 u2 + u3 holds column u + 2 u1 + 4 u2 + 8 u3 (bit-reversed); the index grids go through the
    # same splits, so values and indices stay paired
    return out


@gluon.jit
def _block_leaves(sc, e0, h, b_ptr, NE: gl.constexpr):
    """The biased scores of one 64-expert block and their expert indices, each thread's 16 columns of its rows as 16
    (64, 4) leaves (bit-reversed column order, `_split_cols`); sc (64, 64) in the wgmma layout."""
    l16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    cols = e0 + gl.arange(0, 64, layout=gl.SliceLayout(0, l16))
    bias = gl.load(b_ptr + h * NE + cols, mask=cols < NE, other=0.0)
    sb = gl.convert_layout(sc, l16) + bias[None, :]
    # columns past NE are -inf. NaN scores are left as they are (see the module docstring): mapping them to -inf
    # measured 5-11% slower (a select on sb == sb: 0.725 vs 0.685 ms at Ne 384 k 4; max.f32 with -inf: 1.85 vs 1.72
    # at Ne 768 k 8, H100, results/gluon_router-h100-2026-11-24-nan{mask,max}.jsonl)
    sb = gl.where((cols < NE)[None, :], sb, float("-inf"))
    cb = gl.full([64, 64], 0, gl.int32, l16) + cols[None, :]
    return _split_cols(sb.reshape([64, 4, 16])), _split_cols(cb.reshape([64, 4, 16]))


@gluon.jit
def _net_merge(lv, li, rv, ri, KP: gl.constexpr):
    """A block's 16 leaves per thread and row into the running best KP by sorting networks: the best KP of each group
    of KP leaves, then a tree of merges, then into the running list."""
    lists_v = ()
    lists_i = ()
    for g in gl.static_range(16 // KP):
        gv = ()
        gi = ()
        for u in gl.static_range(KP):
            gv = gv + (lv[g * KP + u],)
            gi = gi + (li[g * KP + u],)
        gv, gi = _sort_net(gv, gi, KP)
        lists_v = lists_v + (gv,)
        lists_i = lists_i + (gi,)
    n: gl.constexpr = 16 // KP
    for lvl in gl.static_range(_log2(16 // KP)):
        nv = ()
        ni = ()
        for g in gl.static_range(n >> (lvl + 1)):
            mv, mi = _merge_top(lists_v[2 * g], lists_i[2 * g], lists_v[2 * g + 1], lists_i[2 * g + 1], KP)
            nv = nv + (mv,)
            ni = ni + (mi,)
        lists_v = nv
        lists_i = ni
    return _merge_top(rv, ri, lists_v[0], lists_i[0], KP)


@gluon.jit
def _net_block(sc, e0, h, b_ptr, rv, ri, NE: gl.constexpr, KP: gl.constexpr):
    """One 64-expert block by sorting networks, each thread on its own 16 columns of its rows: sc (64, 64) scores
    of experts e0..e0+63 in the wgmma layout; rv / ri the thread's running best KP (KP-tuples of (64, 4))."""
    lv, li = _block_leaves(sc, e0, h, b_ptr, NE)
    return _net_merge(lv, li, rv, ri, KP)


@gluon.constexpr_function
def _rev4(c):
    """The leaf of column c (0-15) in `_split_cols`' bit-reversed order (an involution)."""
    c = int(c)
    return ((c & 1) << 3) | ((c & 2) << 1) | ((c & 4) >> 1) | ((c & 8) >> 3)


@gluon.jit
def _bfind(x):
    """The position of the highest set bit of x (int32, elementwise; 0xffffffff where x is 0)."""
    return gl.inline_asm_elementwise("bfind.u32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _insert_new(rv, ri, v, i, KP: gl.constexpr):
    """(v, i) into the better-first list rv / ri (its last element dropped), where i is above every index in the
    list, so v must be strictly larger to go before an element (an element not larger leaves the list as it is)."""
    nv = ()
    ni = ()
    gp = v > rv[0]
    nv = nv + (gl.where(gp, v, rv[0]),)
    ni = ni + (gl.where(gp, i, ri[0]),)
    for t in gl.static_range(1, KP):
        g = v > rv[t]
        nv = nv + (gl.where(g, gl.where(gp, rv[t - 1], v), rv[t]),)
        ni = ni + (gl.where(g, gl.where(gp, ri[t - 1], i), ri[t]),)
        gp = g
    return nv, ni


@gluon.jit
def _row_bound(rv, KP: gl.constexpr, TMODE: gl.constexpr):
    """A bound per row from its four threads' lists rv (lanes 4r .. 4r + 3) with KP of the row's scores, all of lower
    indices than the next block's, at or above it (TMODE: see WS_ROUTER_TMODE)."""
    if TMODE == 0 or KP < 2:  # the best of the four threads' KP-th
        thr = rv[KP - 1]
        thr = gl.maximum(thr, _shfl_bfly(thr, 1))
        return gl.maximum(thr, _shfl_bfly(thr, 2))
    if TMODE != 3 or KP < 4:  # the second best of their (KP / 2)-th: two threads hold KP / 2 each
        a = rv[KP // 2 - 1]
        a1 = _shfl_bfly(a, 1)
        hi = gl.maximum(a, a1)
        lo = gl.minimum(a, a1)
        half = gl.maximum(gl.minimum(hi, _shfl_bfly(hi, 2)), gl.maximum(lo, _shfl_bfly(lo, 2)))
        if TMODE == 1 or KP < 4:
            return half
    q = rv[KP // 4 - 1]  # the worst of their (KP / 4)-th: each holds KP / 4
    q = gl.minimum(q, _shfl_bfly(q, 1))
    q = gl.minimum(q, _shfl_bfly(q, 2))
    if TMODE == 2:
        return gl.maximum(half, q)
    return q


@gluon.jit
def _thr_block(sc, e0, h, b_ptr, rv, ri, NE: gl.constexpr, KP: gl.constexpr, THR: gl.constexpr,
               TMODE: gl.constexpr):
    """One 64-expert block by a threshold and insertions: only scores strictly above the row's threshold
    (`_row_bound`) can enter, since KP scores of the row, of lower indices, are at or above it. Each thread inserts its
    candidates one by one, lowest column first, in as many rounds as the most candidates any thread row of the warp
    group has (one reduction per block). Above THR rounds the block goes through the sorting networks instead (the
    first blocks, where the lists are still filling, and adversarial orders). Every score of the row's best KP enters
    its thread's list and stays there, so the rows' final merge (`_net_finish`) gives exactly the networks' result."""
    lv, li = _block_leaves(sc, e0, h, b_ptr, NE)
    thr = _row_bound(rv, KP, TMODE)
    by_col = ()  # the leaves in column order
    for c in gl.static_range(16):
        by_col = by_col + (lv[_rev4(c)],)
    m = gl.zeros_like(ri[0])
    cnt = gl.zeros_like(ri[0])
    for c in gl.static_range(16):
        ok = by_col[c] > thr
        m = m | gl.where(ok, 1 << c, 0)
        cnt = cnt + ok.to(gl.int32)
    rounds = gl.max(cnt, axis=None)
    if rounds > THR:
        rv, ri = _net_merge(lv, li, rv, ri, KP)
    else:
        base = li[0]  # leaf 0 holds the thread's first column: e0 + 16 q
        for _ in range(rounds):
            low = m & (0 - m)
            m = m ^ low
            p = _bfind(low)
            sel = by_col
            for lvl in gl.static_range(4):  # a select tree on p's bits
                bit = ((p >> lvl) & 1) != 0
                nxt = ()
                for u in gl.static_range(16 >> (lvl + 1)):
                    nxt = nxt + (gl.where(bit, sel[2 * u + 1], sel[2 * u]),)
                sel = nxt
            v = gl.where(low != 0, sel[0], float("-inf"))
            rv, ri = _insert_new(rv, ri, v, base + p, KP)
    return rv, ri


@gluon.jit
def _net_grid():
    """(row, column) indices of the l16 layout's (64, 64) tile, as the per-thread (64, 4) slices `_split_cols` gives."""
    l16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    z = gl.full([64, 64], 0, gl.int32, l16)
    r = z + gl.arange(0, 64, layout=gl.SliceLayout(1, l16))[:, None]
    c = z + gl.arange(0, 64, layout=gl.SliceLayout(0, l16))[None, :]
    return _split_cols(r.reshape([64, 4, 16])), _split_cols(c.reshape([64, 4, 16]))


@gluon.jit
def _net_init(NE: gl.constexpr, KP: gl.constexpr):
    """Empty running lists: KP x (-inf, NE + column) per thread and row (distinct indices: a total order)."""
    _, c = _net_grid()
    rv = ()
    ri = ()
    for u in gl.static_range(KP):
        rv = rv + (gl.where(c[u] >= 0, float("-inf"), 0.0),)
        ri = ri + (c[u] + NE,)
    return rv, ri


@gluon.jit
def _net_store(rv, ri, row0, h, b_ptr, vals_ptr, idx_ptr, N: gl.constexpr, H: gl.constexpr, NE: gl.constexpr,
               K: gl.constexpr):
    """Rows row0 + (0..63): the best K (the same in the row's four threads: the first of them stores)."""
    r, c = _net_grid()
    rows = row0 + r[0]
    mask = (rows < N) & (c[0] < 16)  # c[0] = 16 q: the row's first thread
    out = (rows.to(gl.int64) * H + h) * K
    for j in gl.static_range(K):
        b_sel = gl.load(b_ptr + h * NE + ri[j], mask=mask & (ri[j] < NE), other=0.0)
        gl.store(vals_ptr + out + j, rv[j] - b_sel, mask=mask)
        gl.store(idx_ptr + out + j, ri[j], mask=mask)


@gluon.jit
def _shfl_bfly(x, LANES: gl.constexpr):
    """x (32-bit) of the lane LANES apart (shfl.sync.bfly over the full warp), elementwise."""
    if LANES == 1:
        y = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;", "=r,r", [x], dtype=x.dtype,
                                      is_pure=True, pack=1)
    else:
        y = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, -1;", "=r,r", [x], dtype=x.dtype,
                                      is_pure=True, pack=1)
    return y


@gluon.jit
def _net_finish(rv, ri, KP: gl.constexpr):
    """The row's best KP from its four threads' lists (lanes 4r .. 4r + 3 of the l16 layout): two butterfly merges."""
    for d in gl.static_range(2):
        pv = ()
        pi = ()
        for t in gl.static_range(KP):
            pv = pv + (_shfl_bfly(rv[t], 1 << d),)
            pi = pi + (_shfl_bfly(ri[t], 1 << d),)
        rv, ri = _merge_top(rv, ri, pv, pi, KP)
    return rv, ri


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
def _router_consumer(a, N: gl.constexpr, H: gl.constexpr, DH: gl.constexpr, NE: gl.constexpr, K: gl.constexpr,
                     PARTS: gl.constexpr, NST: gl.constexpr, NC: gl.constexpr, C: gl.constexpr, THR: gl.constexpr,
                     TMODE: gl.constexpr):
    """Consumer C: rows [C * 64, C * 64 + 64) of every item, block by block (the other consumers' selections run
    under this one's products; issuing block b + 1's before block b's selection measured slower: the second
    accumulator's registers)."""
    (x_ptr, w_ptr, b_ptr, vals_ptr, idx_ptr, x_smem, w_smem, x_ready, x_empty, w_ready, w_empty, T) = a
    NW: gl.constexpr = gl.num_warps()
    KP: gl.constexpr = 1 << _log2(2 * K - 1)  # K rounded up to a power of 2
    zero = gl.zeros((64, 64), gl.float32, _wgmma_layout(64, NW))
    q = 0
    t = 0
    for item in range(gl.program_id(0), T, gl.num_programs(0)):
        h = item % H
        xb = t % 2
        rv, ri = _net_init(NE, KP)
        mbarrier.wait(x_ready.index(xb), (t // 2) & 1)
        xs = x_smem.index(xb * NC + C)
        for e0 in range(0, NE, 64):
            s = q % NST
            mbarrier.wait(w_ready.index(s), (q // NST) & 1)
            fence_async_shared()  # the cp.async writes (generic proxy) before the wgmma reads (async proxy)
            sc = _block_scores(xs, w_smem, s, zero, PARTS)
            mbarrier.arrive(w_empty.index(s))
            if THR > 0:
                rv, ri = _thr_block(sc, e0, h, b_ptr, rv, ri, NE, KP, THR, TMODE)
            else:
                rv, ri = _net_block(sc, e0, h, b_ptr, rv, ri, NE, KP)
            q += 1
        mbarrier.arrive(x_empty.index(xb))
        t += 1
        rv, ri = _net_finish(rv, ri, KP)
        _net_store(rv, ri, (item // H) * (NC * 64) + C * 64, h, b_ptr, vals_ptr, idx_ptr, N, H, NE, K)


@gluon.jit
def _router_caster(c, CAST_N: gl.constexpr):
    """A side job beside the router (NC 2 only): cast two fp32 arrays of CAST_N elements to bf16, chunks of 8 values
    per thread strided over the programs, one chunk of each array per step (two loads in flight). It shares nothing
    with the other partitions, but its HBM traffic slows the router's producer: 2.86 -> 3.14 ms at Ne 1536 k 8
    casting 2.4 GB (H100; more loads in flight or evict-first loads did not help: bench/NOTES.md, Layer, session
    19), against 0.80 ms for the cast alone."""
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
    CAST_N: gl.constexpr = 0, CAST_REGS: gl.constexpr = 40, THR: gl.constexpr = 0, TMODE: gl.constexpr = 0,
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
        gl.warp_specialize([(_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0, THR, TMODE)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 1, THR, TMODE)),
                            (_router_producer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0)),
                            (_router_caster, ((c1_ptr, c2_ptr, o1_ptr, o2_ptr), CAST_N))],
                           [4, 4, 4], [CONSUMER_REGS, PRODUCER_REGS, CAST_REGS])
    elif NC == 2:
        gl.warp_specialize([(_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0, THR, TMODE)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 1, THR, TMODE)),
                            (_router_producer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0))],
                           [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0, THR, TMODE)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 1, THR, TMODE)),
                            (_router_consumer, (args, N, H, DH, NE, K, PARTS, NST, NC, 2, THR, TMODE)),
                            (_router_producer, (args, N, H, DH, NE, K, PARTS, NST, NC, 0))],
                           [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# Defaults (H100, 81920 tokens x 8 heads, kernel alone, bench/gluon_kernels.py --kinds router; results/gluon_router-
# h100-2026-11-24-net2.jsonl): three consumers (192-row items: a third of the W_r stream per row) and two ring stages of
# 3 x 16 KB at k <= 4 (Ne 384: 0.685 vs 0.699 ms with two consumers, Ne 768: 1.24 vs 1.34); two consumers and three
# stages at k > 4, where lists of 8 want the registers (Ne 768 k 8: 1.72 vs 1.82, Ne 1536: 3.13 vs 3.48). Four
# consumers do not fit in shared memory with the layout conversion's scratch. Worker registers (consumer, producer)
# and the launch limit (all partitions in one 64K-register SM: setmaxnreg moves registers within the CTA's launch
# allocation) per consumer count; the default-partition consumer gets the rest (168 at NC 3, 256 at NC 2).
WS_ROUTER_NST = {2: 3, 3: 2}
WS_ROUTER_REGS = {2: (200, 40), 3: (152, 40)}
WS_ROUTER_MAXNREG = {2: 168, 3: 128}
WS_ROUTER_CAST_REGS = 40
# The threshold selection (`_thr_block`): at most WS_ROUTER_THR rounds of insertions per block (more: the networks),
# the row's threshold by WS_ROUTER_TMODE (0: the best of the four threads' KP-th; 1: also the second best of their
# (KP / 2)-th; 2: also the worst of their (KP / 4)-th; 3: that one alone where KP >= 4). WS_ROUTER_THR = 0: the
# networks for every block (as until the 2026-11-26 session 27; layer variant "router_networks").
WS_ROUTER_THR = 8
WS_ROUTER_TMODE = 2
gluon_router_fwd_ws_kernel.mhl_compile_options = {"maxnreg": WS_ROUTER_MAXNREG[3]}
# the same kernel compiled with the two-consumer launch limit (jax-triton takes the limit from the kernel object)
gluon_router_fwd_ws_kernel_nc2 = gluon.jit(gluon_router_fwd_ws_kernel.fn)
gluon_router_fwd_ws_kernel_nc2.mhl_compile_options = {"maxnreg": WS_ROUTER_MAXNREG[2]}
# two consumers and the caster: four warp groups in 64K registers (the default consumer gets 512 - 200 - 40 - 40)
WS_ROUTER_CAST_MAXNREG = 128
gluon_router_fwd_ws_kernel_nc2_cast = gluon.jit(gluon_router_fwd_ws_kernel.fn)
gluon_router_fwd_ws_kernel_nc2_cast.mhl_compile_options = {"maxnreg": WS_ROUTER_CAST_MAXNREG}


def ws_router_consumers(k: int) -> int:
    """Consumer warp groups of the default launch: 3 at k <= 4, 2 above (lists of 8)."""
    return 3 if k <= 4 else 2


def ws_router_kernel(nc: int, cast: bool = False):
    """The kernel object compiled with nc consumers' launch limit (cast: with the caster warp group, nc 2)."""
    if cast:
        return gluon_router_fwd_ws_kernel_nc2_cast
    return gluon_router_fwd_ws_kernel if nc == 3 else gluon_router_fwd_ws_kernel_nc2


def ws_router_supported(dh: int, ne: int, k: int, parts: int) -> bool:
    """Shapes of the warp-specialised router forward: dh 128, NE a multiple of 8 (16-byte W_r rows for cp.async),
    1 <= k <= 8, bf16 W_r terms (1-3 parts)."""
    return dh == 128 and ne % 8 == 0 and 1 <= k <= min(8, ne) and 1 <= parts <= 3


def ws_router_constexprs(n: int, h: int, dh: int, ne: int, k: int, parts: int, nc: int | None = None,
                         stages: int | None = None, cast_n: int = 0, thr: int | None = None,
                         tmode: int | None = None) -> dict:
    """The kernel's constexpr arguments (torch and JAX launchers alike; nc / stages default by k, nc 2 with a cast;
    cast_n: elements of each array the caster warp group casts, which fits beside two consumers only); raises on
    unsupported shapes."""
    nc = nc or (2 if cast_n else ws_router_consumers(k))
    stages = stages or WS_ROUTER_NST.get(nc, 2)
    if not ws_router_supported(dh, ne, k, parts) or nc not in WS_ROUTER_REGS:
        raise ValueError(f"warp-specialised router forward: dh={dh}, Ne={ne}, k={k}, parts={parts}, nc={nc}; "
                         "expected dh 128, Ne a multiple of 8, 1 <= k <= 8, 1-3 bf16 parts, 2 or 3 consumers")
    thr = WS_ROUTER_THR if thr is None else thr
    tmode = WS_ROUTER_TMODE if tmode is None else tmode
    if thr < 0 or tmode not in (0, 1, 2, 3):
        raise ValueError(f"warp-specialised router forward: thr={thr}, tmode={tmode}; expected thr >= 0 (0: the "
                         "networks in every block) and tmode 0-3")
    if cast_n and nc != 2:
        raise ValueError(f"warp-specialised router forward: a cast of {cast_n} elements needs 2 consumers, got nc={nc}")
    regs = WS_ROUTER_REGS[nc]
    return dict(N=n, H=h, DH=dh, NE=ne, K=k, PARTS=parts, NST=stages, NC=nc, CONSUMER_REGS=regs[0],
                PRODUCER_REGS=regs[1], CAST_N=cast_n, CAST_REGS=WS_ROUTER_CAST_REGS,
                THR=thr, TMODE=tmode)


def ws_router_items(n: int, h: int, nc: int) -> int:
    return h * -(-n // (nc * 64))


def gluon_router_fwd_ws(x, wp, bias, k: int, programs: int | None = None, cast=None, **options):
    """Torch launcher (CUDA, Hopper): x (N, H, dh) bf16, wp (parts, H, dh, Ne) bf16 (`torch_router.split_bf16`),
    bias (H, Ne) fp32 -> values (N, H, k) fp32, indices (N, H, k) int32; cast: two fp32 tensors of one size (not
    necessarily one shape), also returned cast to bf16 by the caster warp group (nc 2); options:
    `ws_router_constexprs`' nc / stages (probes)."""
    import torch

    n, h, dh = x.shape
    parts, ne = wp.shape[0], wp.shape[3]
    if cast and cast[0].numel() != cast[1].numel():
        raise ValueError(f"gluon_router_fwd_ws: cast arrays of {cast[0].numel()} and {cast[1].numel()} elements")
    consts = ws_router_constexprs(n, h, dh, ne, k, parts, cast_n=cast[0].numel() if cast else 0, **options)
    vals = torch.empty(n, h, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, h, k, dtype=torch.int32, device=x.device)
    ins = [c.contiguous() for c in cast] if cast else [torch.empty(1, dtype=torch.float32, device=x.device)] * 2
    outs = [torch.empty(c.shape, dtype=torch.bfloat16, device=x.device) for c in ins]
    programs = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    kernel = ws_router_kernel(consts["NC"], bool(cast))
    kernel[(min(programs, ws_router_items(n, h, consts["NC"])),)](
        x.contiguous(), wp.contiguous(), bias.float().contiguous(), *ins, vals, idx, *outs, num_warps=4,
        maxnreg=kernel.mhl_compile_options["maxnreg"], **consts)
    return (vals, idx, *outs) if cast else (vals, idx)
