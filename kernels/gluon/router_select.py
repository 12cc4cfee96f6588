"""The selection of the warp-specialised Gluon router forward (`kernels/gluon/router.py`): each consumer thread keeps
the best KP (k rounded up to a power of 2) of its own experts, and the four threads of a row merge at the end.

"Better" = the larger biased score, the lower expert index among equal ones (the Triton kernel's order): a total
order on non-NaN scores, so ties go exactly as there and every sorting network gives the same result.

- The scores of a 64-expert block go to a layout where each thread holds 16 consecutive experts of two rows
  (`_block_leaves`).
- Sorting networks (`_net_merge`): Batcher's odd-even merge sort of groups of KP of a thread's 16 scores, merges
  of the groups (the better of a_t and b_{KP-1-t}, then a bitonic merge), then into the running list. No
  data-dependent control flow, no cross-thread work.
- Most scores cannot enter, so `select_block` first bounds each row and lets each thread insert only its scores above
  that bound (at or above it in the first block), one per round, in as many rounds as the warp group's most candidates;
  a block with more than THR of them goes through the networks. From the second block on the bound comes from the four
  threads' lists; in the first, where the lists are empty, from the block itself at KP <= 4 (the KP-th best of the
  threads' best two: ~1 candidate per thread row at k 4, instead of sorting all 16); both in
  `kernels/gluon/router_bounds.py`. At KP 8 that bound is too loose, and the networks take the first block. Every score
  of a row's best KP still reaches its thread's list, so the rows' merged results are bitwise the networks'.
- `finish_lists`: two butterfly shuffles merge the four threads of a row; `store_topk` writes the row's best K.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.gluon.router_bounds import _block_bound, _row_bound, _shfl_bfly


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
    compare-exchanges at N = 2, 4, 8 (a bitonic network takes 1, 6 and 24: 3-10% slower for the kernel). The order is
    total (`_better`), so every sorting network gives the same result."""
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
def block_bias(b_ptr, h, e0, NE: gl.constexpr):
    """bias[h, e0:e0 + 64] in the selection's column layout, 0 past NE (loaded before the block's scores are waited
    for, so that its L2 latency hides under the products)."""
    l16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    cols = e0 + gl.arange(0, 64, layout=gl.SliceLayout(0, l16))
    return gl.load(b_ptr + h * NE + cols, mask=cols < NE, other=0.0)


@gluon.jit
def _block_leaves(sc, e0, bias, NE: gl.constexpr):
    """The biased scores of one 64-expert block and their expert indices, each thread's 16 columns of its rows as 16
    (64, 4) leaves (bit-reversed column order, `_split_cols`); sc (64, 64) in the wgmma layout, bias from
    `block_bias`."""
    l16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    cols = e0 + gl.arange(0, 64, layout=gl.SliceLayout(0, l16))
    sb = gl.convert_layout(sc, l16) + bias[None, :]
    # columns past NE are -inf. NaN scores are left as they are (the module docstring of kernels/gluon/router.py):
    # mapping them to -inf made the kernel 5-11% slower
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
    list, so v must be strictly larger to go before an element (an element not larger leaves the list as it is).
    The empty lists' -inf fillers have indices above every expert's; the first block inserts none of -inf (its
    bound is then -inf, 16 candidates: the networks take that block)."""
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
def _candidates(by_col, thr, STRICT: gl.constexpr):
    """Per thread row: the mask of its columns whose score is above thr (STRICT) or at or above it, and their count."""
    m = gl.zeros_like(thr, dtype=gl.int32)
    cnt = gl.zeros_like(thr, dtype=gl.int32)
    for c in gl.static_range(16):
        if STRICT:
            ok = by_col[c] > thr
        else:
            ok = by_col[c] >= thr
        m = m | gl.where(ok, 1 << c, 0)
        cnt = cnt + ok.to(gl.int32)
    return m, cnt


@gluon.jit
def select_block(sc, e0, bias, rv, ri, floor, NE: gl.constexpr, KP: gl.constexpr, THR: gl.constexpr):
    """One 64-expert block by a threshold and insertions. The first block (e0 0, a uniform branch): at KP <= 4, scores
    at or above `_block_bound` (KP of the block's own scores are), which becomes `floor`; at KP 8 the networks take it
    (floor -inf), since that bound lets most of the block through anyway (~10 insertion rounds on average). Later
    blocks: only scores strictly above the row's threshold can enter (`_row_bound` of the lists, or `floor`, whichever
    is higher), since KP scores of the row, of lower indices, are at or above it. Each thread inserts its candidates one
    by one, lowest column first, in as many rounds as the most candidates any thread row of the warp group has (one
    reduction per block). Above THR rounds the block goes through the sorting networks instead (adversarial orders, a
    NaN score in the first block). Every score of the row's best KP enters its thread's list and stays there, so the
    rows' final merge (`finish_lists`) gives exactly the networks' result. Returns the lists and the floor."""
    gl.static_assert(THR < 16, "THR: a block whose bound is -inf (16 candidates) must go through the networks")
    lv, li = _block_leaves(sc, e0, bias, NE)
    by_col = ()  # the leaves in column order
    for c in gl.static_range(16):
        by_col = by_col + (lv[_rev4(c)],)
    if e0 == 0:
        if KP > 4:  # the eight values bound KP 8 too loosely: the networks take the first block
            floor = gl.full_like(rv[0], float("-inf"))
            m = gl.zeros_like(ri[0])
            cnt = gl.full_like(ri[0], 16)
        else:
            thr = _block_bound(lv, KP)
            bad = thr != thr  # a NaN score: this block through the networks, as if the bound were -inf
            floor = gl.where(bad, float("-inf"), thr)
            m, cnt = _candidates(by_col, thr, False)
            cnt = gl.where(bad, 16, cnt)
    else:
        m, cnt = _candidates(by_col, gl.maximum(_row_bound(rv, KP), floor), True)
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
    return rv, ri, floor


@gluon.jit
def _net_grid():
    """(row, column) indices of the l16 layout's (64, 64) tile, as the per-thread (64, 4) slices `_split_cols` gives."""
    l16: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    z = gl.full([64, 64], 0, gl.int32, l16)
    r = z + gl.arange(0, 64, layout=gl.SliceLayout(1, l16))[:, None]
    c = z + gl.arange(0, 64, layout=gl.SliceLayout(0, l16))[None, :]
    return _split_cols(r.reshape([64, 4, 16])), _split_cols(c.reshape([64, 4, 16]))


@gluon.jit
def init_lists(NE: gl.constexpr, KP: gl.constexpr):
    """Empty running lists: KP x (-inf, NE + column) per thread and row (distinct indices: a total order)."""
    _, c = _net_grid()
    rv = ()
    ri = ()
    for u in gl.static_range(KP):
        rv = rv + (gl.where(c[u] >= 0, float("-inf"), 0.0),)
        ri = ri + (c[u] + NE,)
    return rv, ri


@gluon.jit
def store_topk(rv, ri, row0, h, b_ptr, vals_ptr, idx_ptr, N: gl.constexpr, H: gl.constexpr, NE: gl.constexpr,
               K: gl.constexpr):
    """Rows row0 + (0..63): the best K (the same in the row's four threads: the first of them stores). A row with
    NaN scores can end with a column past NE (Ne not a multiple of 64: every compare with NaN is false); it stores
    expert 0 there, since the backward gathers W_r rows by these indices."""
    r, c = _net_grid()
    rows = row0 + r[0]
    mask = (rows < N) & (c[0] < 16)  # c[0] = 16 q: the row's first thread
    out = (rows.to(gl.int64) * H + h) * K
    for j in gl.static_range(K):
        b_sel = gl.load(b_ptr + h * NE + ri[j], mask=mask & (ri[j] < NE), other=0.0)
        gl.store(vals_ptr + out + j, rv[j] - b_sel, mask=mask)
        gl.store(idx_ptr + out + j, gl.where(ri[j] < NE, ri[j], 0), mask=mask)


@gluon.jit
def finish_lists(rv, ri, KP: gl.constexpr):
    """The row's best KP from its four threads' lists (lanes 4r .. 4r + 3 of the l16 layout): two butterfly merges."""
    for d in gl.static_range(2):
        pv = ()
        pi = ()
        for t in gl.static_range(KP):
            pv = pv + (_shfl_bfly(rv[t], 1 << d),)
            pi = pi + (_shfl_bfly(ri[t], 1 << d),)
        rv, ri = _merge_top(rv, ri, pv, pi, KP)
    return rv, ri
