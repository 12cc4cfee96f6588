"""IO-aware top-k router (paper section 3.3, Algorithms 1 and 2), framework-free Triton kernels.

Per head h, scores s = x W_r[h] (fp32); the selection is the top-k of (s + b[h]) and the outputs are
the selected *raw* scores (bias added before the selection, removed after) and their expert indices.

Layout (all contiguous, row-major; slot (n, h, j) = (n * H + h) * K + j):
- x:     (N, H, DH)        bf16 (or fp32)
- w:     (PARTS, H, DH, NE) the router weight: for bf16 x split into WEIGHT_PARTS bf16 terms w = w[0] + w[1] + w[2]
         (hi, mid, lo); bf16 x times bf16 terms are exact products on the tensor cores, so three terms recover all
         24 bits of the fp32 weight. For fp32 x the fp32 weight itself (PARTS = 1, "ieee" dots).
- bias:  (H, NE)            fp32 (no gradient)
- vals:  (N, H, K)          fp32 raw scores of the selected experts, by decreasing biased score
- idx:   (N, H, K)          int32 expert indices; ties go to the lower index (as jax.lax.top_k)

Forward (`router_fwd_kernel`, grid (cdiv(N, BLOCK_N * ROW_TILES), H)): the X block stays on chip; W_r
streams through in BLOCK_E expert blocks; biased scores become order-preserving uint64 keys
(fp32 key << 32 | (NE - e)): one integer compare orders by score, then by lower index. Per block only scores
above the running K-th can enter; the kernel takes row maxima in as many rounds as the most candidates any row has
(at most K), packs only the winners and merges them into the running top-KP (max against the flipped list, then a
KP-wide sort). Only (N, H, K) values and indices are written: HBM traffic O(N k + params), independent of NE. With
ROW_TILES = 2 two row tiles share each W_r block (half the L2 traffic of W_r per row).

Backward (Alg. 2 without float atomics, so dW_r is bitwise reproducible):
- `router_bwd_dx_kernel`, grid (cdiv(N, BLOCK_N), H): dx[n, h] = sum_j dv[n, h, j] W_r^T[h, idx_j]
  (k gathered rows of W_r^T (H, NE, DH) fp32, fixed order j = 0..K-1): O(k) per token.
- `router_bwd_dw_partial_kernel`, grid (NB,): slots sorted per head by expert (stable; the caller
  sorts) are cut into blocks of at most CB slots of one (head, expert) group; each block sums
  dv * x over its slots in order into one fp32 partial row (NB, DHP).
- `router_bwd_dw_reduce_kernel`, grid (cdiv(NE, BLOCK_E), H): dW_r[h, :, e] = sum of group (h, e)'s
  partial rows, in block order. Work O(N k DH + H NE DH); skewed routing spreads over many blocks.

Parameters follow jax-triton's binding order: inputs, then one pointer per output, then constexprs.
Under TRITON_INTERPRET=1 pass UPCAST=True: bf16 arithmetic is broken in the interpreter, so every
operand is upcast right after its load (bf16 x bf16 products are exact in fp32: same function).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tuning import RouterTiles

WEIGHT_PARTS = 3  # bf16 terms W_r is split into for bf16 x (exact products, fp32 accumulation)


def next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def check_router_args(n: int, h: int, dh: int, ne: int, k: int, tiles: RouterTiles) -> None:
    """Clear errors for shapes and tiles the kernels do not handle."""
    if min(n, h, dh, ne) < 1:
        raise ValueError(f"router: empty shape N={n}, H={h}, dh={dh}, Ne={ne}")
    if not 1 <= k <= ne:
        raise ValueError(f"router: k={k} must be in [1, Ne={ne}]")
    kp = max(2, next_pow2(k))
    for name in ("block_n", "block_e", "dx_block_n", "dw_sub", "red_block_e"):
        v = getattr(tiles, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"router tiles: {name}={v} must be a power of 2 >= 16")
    if tiles.row_tiles not in (1, 2):
        raise ValueError(f"router tiles: row_tiles={tiles.row_tiles} must be 1 or 2")
    if tiles.block_e < kp:
        raise ValueError(f"router tiles: block_e={tiles.block_e} must be >= next power of 2 of k ({kp})")
    if tiles.dw_block % tiles.dw_sub:
        raise ValueError(f"router tiles: dw_block={tiles.dw_block} must be a multiple of dw_sub={tiles.dw_sub}")
    if ne >= 2**31 - 1 or n * h * max(dh, k) >= 2**31:
        raise ValueError(f"router: sizes too large for int32 offsets (N={n}, H={h}, dh={dh}, Ne={ne}, k={k})")


def dw_num_blocks(num_slots: int, num_groups: int, block: int) -> int:
    """Static bound on the dW partial blocks: every non-empty group adds at most one partial block."""
    return -(-num_slots // block) + min(num_groups, num_slots)


# ---------------------------------------------------------------------------------------- forward


@triton.jit
def _float_key(s):
    """fp32 -> uint32 whose unsigned order is the float order (negatives flipped, sign bit set)."""
    i = s.to(tl.int32, bitcast=True)
    i = i ^ ((i >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    return i.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _key_float(u):
    """Inverse of `_float_key`: uint32 -> fp32."""
    i = (u ^ 0x80000000).to(tl.int32, bitcast=True)
    i = i ^ ((i >> 31) & 0x7FFFFFFF)
    return i.to(tl.float32, bitcast=True)


@triton.jit
def _pack(sb, e, NE: tl.constexpr):
    """Biased fp32 scores and expert indices (same shape) -> uint64 keys: (float key << 32) | (NE - e).
    One unsigned compare orders by score, then by the lower index; every valid key is > 0."""
    return (_float_key(sb).to(tl.uint64) << 32) | (NE - e).to(tl.uint64)


@triton.jit
def _take_row_max(sv, m, cand, cols, kcol, j, NE: tl.constexpr):
    """One selection round: each row's max m (lowest index among equals) is packed into column j of cand
    (0 where the row has no candidate) and removed from sv; returns sv, cand and the rows' next max."""
    e = tl.min(tl.where(sv == m[:, None], cols[None, :], NE), axis=1)
    key = _pack(m, e, NE)
    key = tl.where(m > float("-inf"), key, tl.zeros_like(key))
    cand = tl.where(kcol == j, key[:, None], cand)
    sv = tl.where(cols[None, :] == e[:, None], float("-inf"), sv)
    return sv, cand, tl.max(sv, axis=1)


@triton.jit
def _select_block(sb, cols, run, NE: tl.constexpr, KP: tl.constexpr, K: tl.constexpr):
    """sb: (BN, BE) fp32 biased scores of experts `cols` (BE,); run: (BN, KP) uint64 running top-KP,
    descending (0 = empty). Returns the top-KP of both, descending."""
    kcol = tl.arange(0, KP)[None, :]
    # Only scores above the running K-th can enter (ties: the block's indices are all higher, so they lose).
    # Take row maxima (lowest index among equals) in as many rounds as the most candidates any row has (at most
    # K, fixed once per block: no block-wide exit test per round); only the winners are packed. Cheaper than
    # a bitonic top-KP of the whole packed block, since after the first blocks few scores can enter.
    kth_key = tl.max(tl.where(kcol == K - 1, run, tl.zeros_like(run)), axis=1)
    kth = tl.where(kth_key == 0, float("-inf"), _key_float((kth_key >> 32).to(tl.uint32)))
    ok = (sb > kth[:, None]) & (cols[None, :] < NE)
    sv = tl.where(ok, sb, float("-inf"))
    cand = tl.zeros_like(run)
    m = tl.max(sv, axis=1)
    rounds = tl.minimum(tl.max(tl.sum(ok.to(tl.int32), axis=1), axis=0), K)
    for j in range(rounds):
        sv, cand, m = _take_row_max(sv, m, cand, cols, kcol, j, NE)
    # bitonic merge of two descending lists: the pairwise max against the reversed candidates holds
    # the top-KP of the union; sort it back to descending order.
    return tl.sort(tl.maximum(run, tl.flip(cand, 1)), dim=1, descending=True)


@triton.jit
def _x_tile(x_ptr, rows, N: tl.constexpr, H: tl.constexpr, h, DH: tl.constexpr, offs_d, dmask, UPCAST: tl.constexpr,
            W_BF16: tl.constexpr):
    """x rows `rows` of head h (BLOCK_N, DHP), in the dot's input dtype."""
    xrow = rows.to(tl.int64) * H + h  # (BLOCK_N,) row of x viewed as (N * H, DH)
    x = tl.load(x_ptr + xrow[:, None] * DH + offs_d[None, :], mask=(rows < N)[:, None] & dmask[None, :], other=0.0)
    if UPCAST or not W_BF16:
        x = x.to(tl.float32)
    return x


@triton.jit
def _score_dot(x, w, s, UPCAST: tl.constexpr, W_BF16: tl.constexpr):
    if UPCAST:
        return tl.dot(x, w.to(tl.float32), s, input_precision="ieee")
    elif W_BF16:
        return tl.dot(x, w, s)
    else:
        return tl.dot(x, w, s, input_precision="ieee")


@triton.jit
def _store_topk(run, rows, b_ptr, vals_ptr, idx_ptr, N: tl.constexpr, H: tl.constexpr, h, NE: tl.constexpr,
                K: tl.constexpr, KP: tl.constexpr):
    """Running top-KP keys (BLOCK_N, KP) -> raw selected scores (bias removed) and expert indices."""
    e = NE - (run & 0xFFFFFFFF).to(tl.int32)
    biased = _key_float((run >> 32).to(tl.uint32))
    kcol = tl.arange(0, KP)
    omask = (rows < N)[:, None] & (kcol[None, :] < K)
    b_sel = tl.load(b_ptr + h * NE + e, mask=omask & (e < NE), other=0.0)
    out = (rows.to(tl.int64) * H + h)[:, None] * K + kcol[None, :]
    tl.store(vals_ptr + out, biased - b_sel, mask=omask)
    tl.store(idx_ptr + out, e, mask=omask)


@triton.jit
def router_fwd_kernel(
    x_ptr, w_ptr, b_ptr,  # inputs: x (N, H, DH), w (PARTS, H, DH, NE), bias (H, NE) fp32
    vals_ptr, idx_ptr,  # outputs: (N, H, K) fp32, (N, H, K) int32
    N: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, NE: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, PARTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, UPCAST: tl.constexpr,
    ROW_TILES: tl.constexpr = 1,
):
    """ROW_TILES = 2: the program takes two BLOCK_N-row tiles that share each streamed W_r block (half the
    W_r traffic per row); each tile keeps its own running top-k and round counts."""
    tl.static_assert(ROW_TILES == 1 or ROW_TILES == 2, "ROW_TILES must be 1 or 2")
    pid = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, DHP)
    dmask = offs_d < DH
    w_is_bf16: tl.constexpr = w_ptr.dtype.element_ty == tl.bfloat16
    rows0 = pid * (BLOCK_N * ROW_TILES) + tl.arange(0, BLOCK_N)
    x0 = _x_tile(x_ptr, rows0, N, H, h, DH, offs_d, dmask, UPCAST, w_is_bf16)
    run0 = tl.zeros((BLOCK_N, KP), tl.uint64)
    if ROW_TILES == 2:
        rows1 = rows0 + BLOCK_N
        x1 = _x_tile(x_ptr, rows1, N, H, h, DH, offs_d, dmask, UPCAST, w_is_bf16)
        run1 = tl.zeros((BLOCK_N, KP), tl.uint64)
    offs_e = tl.arange(0, BLOCK_E)
    for e0 in range(0, NE, BLOCK_E):
        cols = e0 + offs_e
        cmask = cols < NE
        s0 = tl.zeros((BLOCK_N, BLOCK_E), tl.float32)
        if ROW_TILES == 2:
            s1 = tl.zeros((BLOCK_N, BLOCK_E), tl.float32)
        for q in tl.static_range(PARTS):  # smallest term first
            part = PARTS - 1 - q
            w = tl.load(w_ptr + (part * H + h) * DH * NE + offs_d[:, None] * NE + cols[None, :],
                        mask=dmask[:, None] & cmask[None, :], other=0.0)
            s0 = _score_dot(x0, w, s0, UPCAST, w_is_bf16)
            if ROW_TILES == 2:
                s1 = _score_dot(x1, w, s1, UPCAST, w_is_bf16)
        bias = tl.load(b_ptr + h * NE + cols, mask=cmask, other=0.0)
        run0 = _select_block(s0 + bias[None, :], cols, run0, NE, KP, K)
        if ROW_TILES == 2:
            run1 = _select_block(s1 + bias[None, :], cols, run1, NE, KP, K)
    _store_topk(run0, rows0, b_ptr, vals_ptr, idx_ptr, N, H, h, NE, K, KP)
    if ROW_TILES == 2:
        _store_topk(run1, rows1, b_ptr, vals_ptr, idx_ptr, N, H, h, NE, K, KP)


# --------------------------------------------------------------------------------------- backward


@triton.jit
def router_bwd_dx_kernel(
    idx_ptr, dv_ptr, wt_ptr,  # inputs: idx (N, H, K) int32, dvals (N, H, K) fp32, W_r^T (H, NE, DH) fp32
    dx_ptr,  # output: (N, H, DH) in dx's dtype
    N: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, NE: tl.constexpr,
    K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    xrow = rows.to(tl.int64) * H + h
    offs_d = tl.arange(0, DHP)
    dmask = offs_d < DH
    acc = tl.zeros((BLOCK_N, DHP), tl.float32)
    for j in tl.static_range(K):  # fixed order: deterministic
        e = tl.load(idx_ptr + xrow * K + j, mask=rmask, other=0)
        g = tl.load(dv_ptr + xrow * K + j, mask=rmask, other=0.0)
        wrow = (h * NE + e).to(tl.int64)
        w = tl.load(wt_ptr + wrow[:, None] * DH + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        acc += g[:, None] * w
    tl.store(dx_ptr + xrow[:, None] * DH + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


@triton.jit
def router_bwd_dw_partial_kernel(
    x_ptr, dv_ptr, order_ptr, block_group_ptr, group_start_ptr, group_bstart_ptr, group_size_ptr,  # inputs
    part_ptr,  # output: (NB, DHP) fp32 partial sums
    H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, NE: tl.constexpr, K: tl.constexpr,
    CB: tl.constexpr, SUB: tl.constexpr, GLOBAL_SLOTS: tl.constexpr = False,
):
    """order: (H * N * K,) int32, per head the local slots n * K + j sorted by expert (stable), or any
    layout in which each group's slots are contiguous from group_start (e.g. the experts' packed rows);
    GLOBAL_SLOTS: `order` holds global slots (n * H + h) * K + j instead (the packing's row_slot as it is);
    the same rows and products either way. block_group: (NB,) group h * NE + e of each block or -1;
    group_start (G,): first position of the group in `order`; group_bstart (G,): its first block;
    group_size (G,): its slot count. Each step's SUB products are summed over the slots into one (DHP,) fp32 row
    (a fixed tree), then added to the running row: faster than a (SUB, DHP) accumulator summed at the end."""
    b = tl.program_id(0)
    g = tl.load(block_group_ptr + b)
    offs_d = tl.arange(0, DHP)
    dmask = offs_d < DH
    if g >= 0:
        h = g // NE
        lb = b - tl.load(group_bstart_ptr + g)
        pos0 = tl.load(group_start_ptr + g) + lb * CB
        cnt = tl.minimum(tl.load(group_size_ptr + g) - lb * CB, CB)
        acc = tl.zeros((DHP,), tl.float32)
        for i in range(0, cnt, SUB):
            o = i + tl.arange(0, SUB)
            m = o < cnt
            slot = tl.load(order_ptr + pos0 + o, mask=m, other=0)
            if GLOBAL_SLOTS:  # (n * H + h) * K + j: the sub-token's row n * H + h, dv at the slot itself
                xrow = (slot // K).to(tl.int64)
                gv = tl.load(dv_ptr + slot, mask=m, other=0.0)
            else:
                xrow = (slot // K).to(tl.int64) * H + h
                gv = tl.load(dv_ptr + xrow * K + slot % K, mask=m, other=0.0)
            xr = tl.load(x_ptr + xrow[:, None] * DH + offs_d[None, :], mask=m[:, None] & dmask[None, :], other=0.0)
            acc += tl.sum(gv[:, None] * xr.to(tl.float32), axis=0)
        tl.store(part_ptr + b.to(tl.int64) * DHP + offs_d, acc)


@triton.jit
def router_bwd_dw_reduce_kernel(
    part_ptr, group_bstart_ptr, group_nblk_ptr,  # inputs: (NB, DHP) fp32, (G,) int32, (G,) int32
    dw_ptr,  # output: (H, DH, NE) fp32
    DH: tl.constexpr, DHP: tl.constexpr, NE: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pe = tl.program_id(0)
    h = tl.program_id(1)
    e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    em = e < NE
    bs = tl.load(group_bstart_ptr + h * NE + e, mask=em, other=0)
    nb = tl.load(group_nblk_ptr + h * NE + e, mask=em, other=0)
    offs_d = tl.arange(0, DHP)
    dmask = offs_d < DH
    acc = tl.zeros((BLOCK_E, DHP), tl.float32)
    for i in range(0, tl.max(nb, axis=0)):  # each group's blocks in order: deterministic
        m = em & (i < nb)
        acc += tl.load(part_ptr + (bs + i).to(tl.int64)[:, None] * DHP + offs_d[None, :], mask=m[:, None], other=0.0)
    out = dw_ptr + h * DH * NE + offs_d[:, None] * NE + e[None, :]
    tl.store(out, tl.trans(acc), mask=dmask[:, None] & em[None, :])


def fwd_grid(n: int, h: int, tiles: RouterTiles) -> tuple[int, int]:
    return (triton.cdiv(n, tiles.block_n * tiles.row_tiles), h)
