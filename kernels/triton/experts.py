"""IO-aware expert FFN over packed rows (paper section 3.4, computed directly instead of through
FlexAttention): for each row block of one (head, expert) group g,

    out = gelu(X W1[g]) W2[g]          X: (BLOCK_M, DH), W1[g]: (DH, DE), W2[g]: (DE, DH)

streaming DE in BLOCK_E chunks like FlashAttention streams keys: the (rows x DE) hidden activations
never reach HBM; the backward recomputes them.

Layout (all contiguous, row-major):
- x:        (S, DH)  source sub-tokens, S = N * H; slot s reads row s // K
- row_slot: (P,)     int32, slot held by each packed row (-1: padding); P = NB * BLOCK_M
- block_group: (NB,) int32, group of each row block (-1: block made only of padding; skipped)
- group_block_start, group_nblocks: (G,) int32, first row block and row-block count of each group
- gates:    (M,)     fp32, gate of each slot (M = S * K); dy: (S, DH) gradient of the combined output
- w1: (G, DH, DE), w2: (G, DE, DH) in the compute dtype; dW written in the dtype of dw pointers.

Kernels:
BLOCK_M (rows per program step) divides PACK_BLOCK (the packing's row block), so the tiles can be tuned
apart from the packing.
- `expert_fwd_kernel`  grid (P / BLOCK_M,):           out rows (P, DH); padding rows written as zeros.
  `expert_fwd_cast_kernel`: the same on fp32 weights, converted as loaded, the group's first tile storing them.
- `expert_dx_kernel`   grid (P / BLOCK_M,):         dX rows (P, DH) = dH W1^T, dO = gate * dy gathered;
  with DGATES also each row's gate gradient <out row, dy row> (P,), fp32, from A and dy W2^T.
- `expert_dw_kernel`   grid (DE/BLOCK_E, G): dW1[g][:, tile], dW2[g][tile, :] summed over the group's
  row blocks in order (deterministic: no atomics); with FUSE_DX (BLOCK_E == DE) it also writes the
  dX rows, so the backward is one launch.
- `expert_dwt_kernel`  the same gradients in the transposed form of FlashAttention's dK/dV loop
  (dw_form "t"): H^T = W1_tile^T X^T (BLOCK_E, BLOCK_M), so the accumulating products
  dW2_tile += A^T dO and dW1_tile^T += dH^T X take their left operand (A^T, dH^T) straight from
  registers and their right one (X, dO rows) untransposed from shared memory; accumulators are
  (BLOCK_E, DH), so a 128-wide de tile feeds the tensor cores 128 columns per instruction. With FUSE_DX
  (BLOCK_E == DE) it also writes the dX rows and, with DGATES, each row's gate gradient: the whole backward
  in one launch (the de = 128 default).

The gather of X rows and of dO = gate * dy rows is fused into the loads (no packed copies in HBM),
unless PACKED (dX and dW kernels): x / dy then point to packed X rows and packed gate-scaled dO rows
(P, DH), zero on padding, written once by the binding, and every load is a contiguous row block.
Parameters follow jax-triton's binding order: inputs, then one pointer per output, then constexprs.
`FAST_TANH` uses the single-instruction `tanh.approx.f32` (GPU only; the interpreter takes the
sigmoid form). Under TRITON_INTERPRET=1 pass fp32 tensors (bf16 arithmetic is broken there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton
import triton.language as tl

from kernels.gluon.experts import bwd_ws_supported, dw_ws_supported, ws_supported

GELU_C = 0.7978845608028654  # sqrt(2 / pi)
GELU_A = 0.044715


@triton.jit
def _tanh(u, FAST_TANH: tl.constexpr):
    if FAST_TANH:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
    return t


@triton.jit
def _gelu(h, FAST_TANH: tl.constexpr):
    """tanh-approximate gelu of fp32 h (jax.nn.gelu's default), written as fused multiply-adds:
    u = c (h + a h^3) = h (c + c a h^2), gelu = h/2 + h/2 tanh(u)."""
    u = h * tl.fma(h * h, 0.7978845608028654 * 0.044715, 0.7978845608028654)
    t = _tanh(u, FAST_TANH)
    hh = 0.5 * h
    return tl.fma(hh, t, hh)


@triton.jit
def _gelu_and_grad(h, FAST_TANH: tl.constexpr):
    """(gelu(h), gelu'(h)) for fp32 h, as fused multiply-adds (10 fp32 instructions and one tanh, where the
    plain formula took ~18: the expert kernels issue them once per hidden value):
    gelu' = (1 + t) / 2 + h/2 (1 - t^2) c (1 + 3 a h^2)."""
    h2 = h * h
    t = _tanh(h * tl.fma(h2, 0.7978845608028654 * 0.044715, 0.7978845608028654), FAST_TANH)
    hh = 0.5 * h
    act = tl.fma(hh, t, hh)
    du = tl.fma(h2, 3.0 * 0.7978845608028654 * 0.044715, 0.7978845608028654)  # c (1 + 3 a h^2)
    grad = tl.fma(hh * tl.fma(-t, t, 1.0), du, tl.fma(t, 0.5, 0.5))
    return act, grad


@triton.jit
def _load_x_rows(x_ptr, row_slot_ptr, rows, offs_d, K: tl.constexpr, DH: tl.constexpr):
    """rows: (BLOCK_M,) packed row ids -> (X (BLOCK_M, DH) in x's dtype (zero on padding), slot, valid)."""
    slot = tl.load(row_slot_ptr + rows)
    valid = slot >= 0
    src = tl.where(valid, slot // K, 0).to(tl.int64)
    x = tl.load(x_ptr + src[:, None] * DH + offs_d[None, :], mask=valid[:, None], other=0.0)
    return x, slot, valid, src


@triton.jit
def _load_dy_gate(dy_ptr, gates_ptr, slot, valid, src, offs_d, DH: tl.constexpr):
    """dy[slot // K] rows as stored (BLOCK_M, DH) and gate[slot] fp32 (BLOCK_M,), both zero on padding."""
    gate = tl.load(gates_ptr + tl.where(valid, slot, 0), mask=valid, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + src[:, None] * DH + offs_d[None, :], mask=valid[:, None], other=0.0)
    return dy, gate


@triton.jit
def _load_do_rows(dy_ptr, gates_ptr, slot, valid, src, offs_d, DH: tl.constexpr):
    """dO rows = gate[slot] * dy[slot // K], fp32 (BLOCK_M, DH), zero on padding."""
    dy, gate = _load_dy_gate(dy_ptr, gates_ptr, slot, valid, src, offs_d, DH)
    return dy.to(tl.float32) * gate[:, None]


@triton.jit
def _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K: tl.constexpr, DH: tl.constexpr,
               PACKED: tl.constexpr):
    """X rows (x's dtype) and dO rows (fp32) of packed rows `rows`, gathered or (PACKED) contiguous."""
    if PACKED:
        ptrs = rows[:, None] * DH + offs_d[None, :]
        x = tl.load(x_ptr + ptrs)
        do = tl.load(dy_ptr + ptrs).to(tl.float32)
    else:
        x, slot, valid, src = _load_x_rows(x_ptr, row_slot_ptr, rows, offs_d, K, DH)
        do = _load_do_rows(dy_ptr, gates_ptr, slot, valid, src, offs_d, DH)
    return x, do


@triton.jit
def _expert_fwd(x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, gstart_ptr, w1c_ptr, w2c_ptr,
                K: tl.constexpr, DH: tl.constexpr, DE: tl.constexpr, PACK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_E: tl.constexpr, FAST_TANH: tl.constexpr, PRECISION: tl.constexpr, CAST: tl.constexpr):
    """One BLOCK_M-row tile of `expert_fwd_kernel` / `expert_fwd_cast_kernel` (CAST: the weights arrive in fp32 and
    are converted to x's dtype as loaded; the group's first tile also stores them, w1c / w2c)."""
    pid = tl.program_id(0)
    g = tl.load(block_group_ptr + pid // (PACK_BLOCK // BLOCK_M))
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DH)
    out_ptrs = out_ptr + rows[:, None] * DH + offs_d[None, :]
    if g < 0:  # block made only of padding: nothing to compute
        tl.store(out_ptrs, tl.zeros((BLOCK_M, DH), out_ptr.dtype.element_ty))
    else:
        if CAST:
            cdt = x_ptr.dtype.element_ty
            first = pid == tl.load(gstart_ptr + g) * (PACK_BLOCK // BLOCK_M)  # the group's first tile
        else:
            cdt = w1_ptr.dtype.element_ty
        x, slot, valid, src = _load_x_rows(x_ptr, row_slot_ptr, rows, offs_d, K, DH)
        x = x.to(cdt)
        offs_e = tl.arange(0, BLOCK_E)
        w1_base = w1_ptr + g.to(tl.int64) * (DH * DE)
        w2_base = w2_ptr + g.to(tl.int64) * (DE * DH)
        acc = tl.zeros((BLOCK_M, DH), tl.float32)
        for e0 in range(0, DE, BLOCK_E):
            w1_off = offs_d[:, None] * DE + (e0 + offs_e)[None, :]
            w1 = tl.load(w1_base + w1_off).to(cdt)  # (DH, BLOCK_E)
            h = tl.dot(x, w1, input_precision=PRECISION)  # (BLOCK_M, BLOCK_E) fp32
            a = _gelu(h, FAST_TANH).to(cdt)
            w2_off = (e0 + offs_e)[:, None] * DH + offs_d[None, :]
            w2 = tl.load(w2_base + w2_off).to(cdt)  # (BLOCK_E, DH)
            if CAST:
                if first:
                    tl.store(w1c_ptr + g.to(tl.int64) * (DH * DE) + w1_off, w1)
                    tl.store(w2c_ptr + g.to(tl.int64) * (DE * DH) + w2_off, w2)
            acc = tl.dot(a, w2, acc, input_precision=PRECISION)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def expert_fwd_kernel(
    x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr,  # inputs
    out_ptr,  # output (P, DH)
    K: tl.constexpr, DH: tl.constexpr, DE: tl.constexpr, PACK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr, FAST_TANH: tl.constexpr, PRECISION: tl.constexpr,
):
    _expert_fwd(x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, out_ptr, out_ptr, out_ptr, K, DH, DE,
                PACK_BLOCK, BLOCK_M, BLOCK_E, FAST_TANH, PRECISION, False)


@triton.jit
def expert_fwd_cast_kernel(
    x_ptr, row_slot_ptr, block_group_ptr, group_block_start_ptr, w1_ptr, w2_ptr,  # inputs (w1, w2 fp32)
    out_ptr, w1c_ptr, w2c_ptr,  # outputs (P, DH); w1 / w2 in x's dtype (written for groups with rows only)
    K: tl.constexpr, DH: tl.constexpr, DE: tl.constexpr, PACK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr, FAST_TANH: tl.constexpr, PRECISION: tl.constexpr,
):
    """`expert_fwd_kernel` on the fp32 master weights: each tile converts them to x's dtype as it loads them (the
    same values as a cast before the launch: the same products), and each group's first tile stores the converted
    weights for the backward, so the fp32 weights come from HBM about once per group (the group's other tiles run
    beside it and find them in L2, if it holds them) and no separate cast pass reads and writes them. A group
    without rows has no tile: its converted weights are left unwritten. The backward kernels may load them (their
    weight tiles are fetched per group) but no output depends on them: a group without rows has no row block, so
    no product uses them and its weight gradients stay zero."""
    _expert_fwd(x_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr, out_ptr, group_block_start_ptr, w1c_ptr, w2c_ptr,
                K, DH, DE, PACK_BLOCK, BLOCK_M, BLOCK_E, FAST_TANH, PRECISION, True)


@triton.jit
def expert_dx_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, block_group_ptr, w1_ptr, w2_ptr,  # inputs
    dx_ptr, dgate_ptr,  # outputs (P, DH): gradient of each packed row's input; (P,) fp32 (DGATES only)
    K: tl.constexpr, DH: tl.constexpr, DE: tl.constexpr, PACK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr, FAST_TANH: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr = False,
    DGATES: tl.constexpr = False,
):
    """DGATES (not with PACKED): also the combine's gate gradient of each packed row, from values already
    in registers: with dA' = dy W2^T (ungated; dA = gate * dA'), <out row, dy> = <A W2, dy> = sum over de
    of A * dA', A = gelu(H) rounded to the compute dtype as the forward rounds it. fp32, 0 on padding.
    No read of the forward's output rows, no gather of them per slot in XLA."""
    pid = tl.program_id(0)
    g = tl.load(block_group_ptr + pid // (PACK_BLOCK // BLOCK_M))
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DH)
    dx_ptrs = dx_ptr + rows[:, None] * DH + offs_d[None, :]
    if g < 0:
        tl.store(dx_ptrs, tl.zeros((BLOCK_M, DH), dx_ptr.dtype.element_ty))
        if DGATES:
            tl.store(dgate_ptr + rows, tl.zeros((BLOCK_M,), tl.float32))
    else:
        cdt = w1_ptr.dtype.element_ty
        if DGATES:  # d = dy rows as stored (the gate is applied to dA' in fp32 below)
            x, slot, valid, src = _load_x_rows(x_ptr, row_slot_ptr, rows, offs_d, K, DH)
            d, gate = _load_dy_gate(dy_ptr, gates_ptr, slot, valid, src, offs_d, DH)
        else:  # d = dO = gate * dy rows
            x, d = _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K, DH, PACKED)
        x = x.to(cdt)
        d = d.to(cdt)
        offs_e = tl.arange(0, BLOCK_E)
        w1_base = w1_ptr + g.to(tl.int64) * (DH * DE)
        w2_base = w2_ptr + g.to(tl.int64) * (DE * DH)
        acc = tl.zeros((BLOCK_M, DH), tl.float32)
        gacc = tl.zeros((BLOCK_M, BLOCK_E), tl.float32)
        for e0 in range(0, DE, BLOCK_E):
            w1 = tl.load(w1_base + offs_d[:, None] * DE + (e0 + offs_e)[None, :])  # (DH, BLOCK_E)
            w2t = tl.load(w2_base + (e0 + offs_e)[None, :] * DH + offs_d[:, None])  # (DH, BLOCK_E) = W2^T
            h = tl.dot(x, w1, input_precision=PRECISION)
            a, dgelu = _gelu_and_grad(h, FAST_TANH)
            da = tl.dot(d, w2t, input_precision=PRECISION)  # (BLOCK_M, BLOCK_E): dA, or dA' with DGATES
            if DGATES:
                gacc = tl.fma(a.to(cdt).to(tl.float32), da, gacc)
                da = da * gate[:, None]
            dh = (da * dgelu).to(cdt)
            acc = tl.dot(dh, tl.trans(w1), acc, input_precision=PRECISION)
        tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty))
        if DGATES:
            tl.store(dgate_ptr + rows, tl.sum(gacc, axis=1))


@triton.jit
def expert_dw_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_nblocks_ptr, w1_ptr, w2_ptr,
    dw1_ptr, dw2_ptr, dx_ptr, dgate_ptr,  # outputs: (G, DH, DE), (G, DE, DH), (P, DH) (FUSE_DX), dgate unused
    K: tl.constexpr, DH: tl.constexpr, DE: tl.constexpr, PACK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr, FAST_TANH: tl.constexpr, PRECISION: tl.constexpr, FUSE_DX: tl.constexpr,
    PACKED: tl.constexpr = False, DGATES: tl.constexpr = False,
):
    tl.static_assert(not DGATES, "the row-form dW kernel does not make the gate gradients")
    tile = tl.program_id(0)
    gi = tl.program_id(1)
    start = tl.load(group_block_start_ptr + gi)
    nblk = tl.load(group_nblocks_ptr + gi)
    g = gi.to(tl.int64)
    cdt = w1_ptr.dtype.element_ty
    offs_d = tl.arange(0, DH)
    offs_e = tile * BLOCK_E + tl.arange(0, BLOCK_E)
    w1_ptrs = w1_ptr + g * (DH * DE) + offs_d[:, None] * DE + offs_e[None, :]  # (DH, BLOCK_E)
    w2t_ptrs = w2_ptr + g * (DE * DH) + offs_e[None, :] * DH + offs_d[:, None]  # (DH, BLOCK_E) = W2^T
    w1 = tl.load(w1_ptrs)
    w2t = tl.load(w2t_ptrs)
    acc1 = tl.zeros((DH, BLOCK_E), tl.float32)  # dW1 tile
    acc2 = tl.zeros((DH, BLOCK_E), tl.float32)  # dW2 tile, transposed
    row0 = start.to(tl.int64) * PACK_BLOCK
    for i in range(0, nblk * (PACK_BLOCK // BLOCK_M)):
        rows = row0 + i * BLOCK_M + tl.arange(0, BLOCK_M)
        x, do = _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K, DH, PACKED)
        x = x.to(cdt)
        do = do.to(cdt)
        h = tl.dot(x, w1, input_precision=PRECISION)  # (BLOCK_M, BLOCK_E)
        a, dgelu = _gelu_and_grad(h, FAST_TANH)
        da = tl.dot(do, w2t, input_precision=PRECISION)
        dh = (da * dgelu).to(cdt)
        acc1 = tl.dot(tl.trans(x), dh, acc1, input_precision=PRECISION)
        acc2 = tl.dot(tl.trans(do), a.to(cdt), acc2, input_precision=PRECISION)
        if FUSE_DX:
            dx = tl.dot(dh, tl.trans(w1), input_precision=PRECISION)
            tl.store(dx_ptr + rows[:, None] * DH + offs_d[None, :], dx.to(dx_ptr.dtype.element_ty))
    tl.store(dw1_ptr + g * (DH * DE) + offs_d[:, None] * DE + offs_e[None, :], acc1.to(dw1_ptr.dtype.element_ty))
    tl.store(dw2_ptr + g * (DE * DH) + offs_e[None, :] * DH + offs_d[:, None], acc2.to(dw2_ptr.dtype.element_ty))


@triton.jit
def expert_dwt_kernel(
    x_ptr, dy_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_nblocks_ptr, w1_ptr, w2_ptr,
    dw1_ptr, dw2_ptr, dx_ptr, dgate_ptr,  # outputs: (G, DH, DE), (G, DE, DH), (P, DH) (FUSE_DX), (P,) (DGATES)
    K: tl.constexpr, DH: tl.constexpr, DE: tl.constexpr, PACK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr, FAST_TANH: tl.constexpr, PRECISION: tl.constexpr, FUSE_DX: tl.constexpr,
    PACKED: tl.constexpr, DGATES: tl.constexpr = False,
):
    """`expert_dw_kernel` in transposed form (module docstring); same grid, outputs and order of sums.

    DGATES (with FUSE_DX, not PACKED: the program holds all of DE for its rows) also writes each packed row's
    gate gradient as the dX kernel's DGATES does: the dy rows are loaded as stored, dA'^T = W2 dy^T, and
    <out row, dy> = sum over de of A * dA' (A rounded to the compute dtype); the gate then scales the columns
    (dA^T = dA'^T diag(gate), dW2 += (A^T diag(gate)) dy)."""
    tl.static_assert(not DGATES or (FUSE_DX and BLOCK_E == DE and not PACKED),
                     "DGATES needs FUSE_DX (all of DE per program) and unpacked rows")
    tile = tl.program_id(0)
    gi = tl.program_id(1)
    start = tl.load(group_block_start_ptr + gi)
    nblk = tl.load(group_nblocks_ptr + gi)
    g = gi.to(tl.int64)
    cdt = w1_ptr.dtype.element_ty
    offs_d = tl.arange(0, DH)
    offs_e = tile * BLOCK_E + tl.arange(0, BLOCK_E)
    w1t_off = g * (DH * DE) + offs_d[None, :] * DE + offs_e[:, None]  # (BLOCK_E, DH): W1[:, tile]^T
    w2_off = g * (DE * DH) + offs_e[:, None] * DH + offs_d[None, :]  # (BLOCK_E, DH): W2[tile, :]
    w1t = tl.load(w1_ptr + w1t_off)
    w2 = tl.load(w2_ptr + w2_off)
    acc1 = tl.zeros((BLOCK_E, DH), tl.float32)  # dW1 tile, transposed
    acc2 = tl.zeros((BLOCK_E, DH), tl.float32)  # dW2 tile
    row0 = start.to(tl.int64) * PACK_BLOCK
    for i in range(0, nblk * (PACK_BLOCK // BLOCK_M)):
        rows = row0 + i * BLOCK_M + tl.arange(0, BLOCK_M)
        if DGATES:  # do = dy rows as stored; the gate is applied to the products below
            x, slot, valid, src = _load_x_rows(x_ptr, row_slot_ptr, rows, offs_d, K, DH)
            do, gate = _load_dy_gate(dy_ptr, gates_ptr, slot, valid, src, offs_d, DH)
        else:
            x, do = _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K, DH, PACKED)
        x = x.to(cdt)
        do = do.to(cdt)
        ht = tl.dot(w1t, tl.trans(x), input_precision=PRECISION)  # (BLOCK_E, BLOCK_M) = H^T
        a, dgelu = _gelu_and_grad(ht, FAST_TANH)
        dat = tl.dot(w2, tl.trans(do), input_precision=PRECISION)  # dA^T (dA'^T with DGATES)
        if DGATES:
            tl.store(dgate_ptr + rows, tl.sum(a.to(cdt).to(tl.float32) * dat, axis=0))
            dat = dat * gate[None, :]
            a = a * gate[None, :]
        dht = (dat * dgelu).to(cdt)
        acc2 = tl.dot(a.to(cdt), do, acc2, input_precision=PRECISION)
        acc1 = tl.dot(dht, x, acc1, input_precision=PRECISION)
        if FUSE_DX:
            dx = tl.dot(tl.trans(dht), w1t, input_precision=PRECISION)  # (BLOCK_M, DH)
            tl.store(dx_ptr + rows[:, None] * DH + offs_d[None, :], dx.to(dx_ptr.dtype.element_ty))
    tl.store(dw1_ptr + w1t_off, acc1.to(dw1_ptr.dtype.element_ty))
    tl.store(dw2_ptr + w2_off, acc2.to(dw2_ptr.dtype.element_ty))


def check_blocks(dh: int, de: int, pack_block: int, block_m: int, block_e: int) -> None:
    """Shape rules of the kernels (powers of two for tl.arange, tiles that divide DE and PACK_BLOCK)."""
    for name, v in (("dh", dh), ("pack_block", pack_block), ("block_m", block_m), ("block_e", block_e)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"expert kernels: {name}={v} must be a power of two >= 16")
    if pack_block % block_m:
        raise ValueError(f"expert kernels: block_m={block_m} must divide the packing block {pack_block}")
    if de % block_e:
        raise ValueError(f"expert kernels: de={de} must be a multiple of block_e={block_e}")


@dataclass(frozen=True)
class Tile:
    """Launch shape of one kernel: rows per program step, DE chunk, warps, software-pipeline depth."""

    block_m: int = 64
    block_e: int = 64
    num_warps: int = 4
    num_stages: int = 2


def dgates_in_kernels(cfg: "ExpertsConfig", de: int) -> bool:
    """Whether a backward kernel also makes the gate gradients (DGATES), reading raw dy rows (not packed
    gate-scaled dO rows): the dX kernel, or the transposed dW kernel when dX is fused into it (its programs
    then hold all of de for their rows). Else the binding reduces the kept output rows against dy."""
    return not cfg.packed_bwd and (cfg.dw.block_e != de or cfg.dw_form == "t")


DW_FORMS = ("rows", "t")  # expert_dw_kernel | expert_dwt_kernel
PACK_IMPLS = ("argsort", "count", "triton")  # mhl_jax.moe.packing.pack(method=...); triton: kernels/triton/packing.py


@dataclass(frozen=True)
class ExpertsConfig:
    """Packing row block and the tiles of the kernels (forward, its converting form's own where `fwd_cast` is set, dX,
    dW). dw.block_e == de fuses dX into the dW kernel.

    Variants (old defaults first): dw_form "rows" | "t" (which dW kernel); packed_bwd: write packed X and
    gate-scaled dO rows once and let the dX / dW kernels read them contiguously; pack_impl "argsort" |
    "count" | "triton" (the JAX packing: key sort, or the chunked counting sort; or the Triton kernels of
    kernels/triton/packing.py, emulated runs use the JAX sort instead)."""

    pack_block: int = 128
    fwd: Tile = Tile(128, 64, 8, 2)
    dx: Tile = Tile(128, 64, 8, 2)
    dw: Tile = Tile(64, 64, 8, 2)
    dw_form: str = "rows"
    packed_bwd: bool = False
    pack_impl: str = "argsort"
    # the forward as the warp-specialised Gluon kernel (kernels/gluon/experts.py) where the JAX binding runs on a
    # Hopper GPU and the shape is `gluon_experts.ws_supported`; elsewhere `fwd` (Triton) as before
    fwd_ws: bool = False
    # the converting forward's tile (`expert_fwd_cast_kernel`, fp32 weights converted as loaded); None: `fwd`'s
    fwd_cast: Tile | None = None
    # the weight gradients of a split backward (dX kernel apart) as the warp-specialised Gluon kernel where the JAX
    # binding runs on a Hopper GPU in bf16 and the shape is `gluon_experts.dw_ws_supported`; elsewhere `dw`
    # (`experts_triton.use_dw_gluon`)
    dw_ws: bool = False
    # the whole backward (dX rows, gate and weight gradients) as the warp-specialised Gluon kernel where the JAX
    # binding runs on a Hopper GPU in bf16, the kernels make the gate gradients (unpacked rows) and the shape is
    # `gluon_experts.bwd_ws_supported`: in place of the fused Triton kernel at de = 128, of the split backward at de
    # = 256 (partial dX rows per 128 de, summed by the binding); elsewhere the Triton kernels (`use_bwd_gluon`)
    bwd_ws: bool = False
    # with bwd_ws: the Gluon backward with a fourth warp group for the dX rows and gate gradients
    # (`gluon_experts.gluon_expert_bwd_xw_kernel`, same outputs bitwise)
    bwd_xw: bool = False

    def check(self, dh: int, de: int) -> None:
        for t in (self.fwd, self.cast_tile, self.dx, self.dw):
            check_blocks(dh, de, self.pack_block, min(t.block_m, self.pack_block), min(t.block_e, de))
        if self.dw_form not in DW_FORMS or self.pack_impl not in PACK_IMPLS:
            raise ValueError(f"expert kernels: dw_form={self.dw_form!r} (one of {DW_FORMS}), "
                             f"pack_impl={self.pack_impl!r} (one of {PACK_IMPLS})")

    def fit(self, de: int) -> ExpertsConfig:
        """Clamp tiles to the packing block and to de (small shapes in tests)."""
        def f(t: Tile) -> Tile:
            return Tile(min(t.block_m, self.pack_block), min(t.block_e, de), t.num_warps, t.num_stages)

        return replace(self, fwd=f(self.fwd), dx=f(self.dx), dw=f(self.dw),
                       fwd_cast=self.fwd_cast and f(self.fwd_cast))

    @property
    def cast_tile(self) -> Tile:
        """The converting forward's tile: `fwd_cast`, else `fwd`'s."""
        return self.fwd_cast or self.fwd


# smallest packing block where the fused de = 128 backward is the default: measured at 128, 64 and 32 (H100,
# 2026-11-24, layer fwd+bwd: 81920 tokens Ne 768 / 1536, k 8: 13.16 -> 12.50 / 16.18 -> 15.56 ms; 8192 tokens
# Ne 768: 2.60 -> 2.59, Ne 1536 (packing block 32): 4.40 -> 3.97)
FUSED_BWD_MIN_PACK = 32
# largest packing block where the split backward takes the Gluon dW kernel: H100 2026-11-24, layer fwd+bwd, default
# vs without it, two runs (results/layer-h100-2026-11-24-dwws{,-8192}.jsonl): 8192 tokens 3.54 / 3.47 vs 3.66 / 3.62
# ms (768/4/256, block 32), 2.13 / 2.14 vs 2.18 / 2.14 (384/4/256, block 64); at 81920 tokens (block 128) level
# alone (2.02 vs 2.06 ms) but 9.47 vs 9.24 in the 384/4/256 layer. (At de 128 the fused backward stays: split with
# the Gluon dW, 768/8/128 at 8192 tokens, 2.59 / 2.60 vs 2.59 / 2.55.) Re-measured after its gates moved into shared
# memory (seventh session of 2026-11-24, results/layer-h100-2026-11-24-pack128.jsonl): alone 1.97 vs 2.05 ms at
# 81920 tokens 384/4/256, but in the layer with it at block 128: 9.05 vs 8.87 ms (384/4/256), 10.55 vs 10.64
# (768/4/256): not taken there.
DW_WS_MAX_PACK = 64
# largest de where the Gluon backward (one partial dX row per 128 de) replaces the split one: measured at 256 only
# (H100 2026-11-24, eighth session, its tiles dealt head by head, against variant triton_fused_bwd in one process:
# layer 8.85 vs 8.96 ms at 81920 tokens 384/4/256, 10.48 vs 10.64 at 768/4/256, 2.00 vs 2.09 and 3.32 vs 3.57 at 8192
# tokens; results/layer-h100-2026-11-24-s8-review.jsonl); before the dealing it lost at packing block 128 (9.24 vs
# 9.01: the layer's uneven groups left its busiest program 16% above the mean)
BWD_WS_WIDE_MAX_DE = 256
# fewest routed slots where the Gluon backward runs with the dX warp group (`ExpertsConfig.bwd_xw`): H100
# 2026-11-25, layer fwd+bwd against the same kernel without it, one process (results/layer-h100-2026-11-25-xw.jsonl):
# 81920 tokens (2.6M / 5.2M slots) 8.51 vs 8.84 ms (384/4/256), 10.83 vs 10.96 (768/8/128), 10.19 vs 10.51
# (768/4/256), 13.58 vs 13.84 (1536/8/128); 8192 tokens (262K / 524K slots) 2.01 vs 2.02, 2.33 vs 2.32, 3.34 vs
# 3.25, 3.81 vs 3.67: not taken there (unmeasured in between). Once both kernels left the gate gradient per warp the
# gap closed (results/layer-h100-2026-11-25-final.jsonl: 8.21 vs 8.20, 10.30 vs 10.43, 9.74 vs 9.77, 13.16 vs 13.19
# at 81920 tokens): kept, level or ahead at those rows
BWD_XW_MIN_SLOTS = 1 << 21
# fewest mean rows per group where the packing block is 64 (32 below): H100 2026-11-26 (session 30), layer fwd+bwd at
# 8192 tokens, mean 42.7 (768/4/256 and 1536/8/128; the 4.2B configs' shape), one process
# (results/layer-h100-2026-11-26-s30-pack.jsonl): 2.97 vs 3.13 ms and 3.28 vs 3.48 at block 64 vs 32 (at such means
# most groups take two 32-row blocks anyway, so the padding barely grows while the blocks halve; block 128 there:
# 2.98 / 3.32). At mean 85 (384/4/256, 768/8/128) block 128 measured 1.88 / 2.10 vs 1.86 / 2.08 at 64. Was 48
PACK64_MIN_MEAN = 32
# fewest mean rows per group where the converting forward takes 32-wide de chunks at packing block 64, de 256
# (`default_config`'s fwd_cast; measured at means 85 and 42.7 only)
CAST_E32_MIN_MEAN = 64
COUNT_SORT_MAX_SLOTS = 1 << 19  # the counting-sort packing where it was measured (262144 slots); argsort above


def default_config(num_slots: int, num_groups: int, dh: int, de: int, dw_form: str | None = None,
                   fuse_bwd: bool = True, fuse_min_pack: int | None = None, dw_ws: bool = True,
                   bwd_ws: bool = True, pack: int | None = None, fwd_wide: bool = True) -> ExpertsConfig:
    """Pick the packing block from the mean rows per group (padding waste ~ block / 2 per group) and
    tiles that keep the accumulators in registers on Hopper (tuned in bench/NOTES.md).

    dw_form None = the measured choice: the transposed dW kernel ("t", tile 64 x 64, 4 warps, 3 stages)
    at packing blocks 64 and 128 (H100: dW 4.05 ms vs 5.60 ms for "rows" at 81920 tokens, Ne 384, de 256;
    with the counting-sort packing the 8192-token layer 2.47 ms vs 2.76 ms), "rows" below (unmeasured
    there). Packing: the Triton kernels (kernels/triton/packing.py) at blocks 64 and 128, else the JAX sort.
    "rows" | "t" force a form ("rows" with argsort packing = the defaults until 2026-11-23, variant "v2").

    fuse_bwd: at de = 128 one backward kernel instead (dX and the gate gradients made by the transposed dW
    kernel, tile min(block, 64) x 128, 8 warps, 3 stages) at packing blocks >= fuse_min_pack (default
    FUSED_BWD_MIN_PACK), where it was measured faster; False keeps the dX and dW kernels apart (the default
    until 2026-11-24, variant "split_bwd").

    dw_ws: the split backward's weight gradients by the warp-specialised Gluon kernel where it takes the shape
    (`dw_ws_supported`) at packing blocks up to DW_WS_MAX_PACK; False: the Triton dW kernel there (variant
    "triton_dw").

    bwd_ws: the backward as the one warp-specialised Gluon kernel where it takes the shape (`bwd_ws_supported`): at
    de = 128 in place of the fused Triton kernel, at larger de (up to BWD_WS_WIDE_MAX_DE) in place of the split
    backward; False: the Triton kernels of the other fields (variant "triton_fused_bwd"). From BWD_XW_MIN_SLOTS
    routed slots on, that kernel runs with its dX warp group (bwd_xw).

    pack: force the packing block (16, 32, 64 or 128; None: from the mean rows per group as above).

    fwd_wide: the Triton forward at packing block 64 and de 128 takes the whole de per chunk (tile 64 x 128, 2 stages);
    False: 64-wide chunks, 3 stages, as at the other shapes (the default until 2026-11-27, variant "fwd_e64")."""
    mean = num_slots / max(num_groups, 1)
    if pack is None:
        pack = 128 if mean >= 384 else 64 if mean >= PACK64_MIN_MEAN else 32 if mean >= 12 else 16
    elif pack not in (16, 32, 64, 128):
        raise ValueError(f"default_config: pack={pack}, expected None or one of 16, 32, 64, 128")
    if dh > 128:
        return _wide_config(pack, num_slots, de, dw_form)
    measured = pack >= 64 and dw_form is None
    min_pack = FUSED_BWD_MIN_PACK if fuse_min_pack is None else fuse_min_pack
    fused_bwd = fuse_bwd and dw_form is None and de == 128 and pack >= min_pack
    gluon_dw = dw_ws and dw_form is None and not fused_bwd and dw_ws_supported(dh, de, pack) and pack <= DW_WS_MAX_PACK
    # the fused backward warp-specialised wherever it takes the shape: H100 2026-11-24, kernel alone
    # (results/gluon_kernels-h100-2026-11-24-bwd-gates.jsonl) 81920 tokens 3.54 vs 3.94 ms (Ne 768, k 8), 4.14 vs
    # 4.77 (Ne 1536); 8192 tokens 0.78 vs 1.02, 1.29 vs 1.57; layer at 81920 tokens 11.22 vs 11.40, 14.01 vs 14.51
    # At de > 128 it writes one partial dX row per 128 de (the combine sums them): alone 3.60 vs 3.95 ms (81920 tokens,
    # 384/4/256), 4.23 vs 4.59 (768/4/256), 0.80 vs 0.78 / 1.25 vs 1.40 at 8192 tokens against the split backward,
    # but in the layer (results/layer-h100-2026-11-24-gluon-bwd-de256.jsonl, two runs) 9.26 / 9.22 vs 9.00 / 9.02,
    # 10.77 / 10.88 vs 10.67 / 10.76 at 81920 tokens, until its tiles were dealt longest-first (the layer's groups are
    # uneven, the kernel-alone inputs were not): see BWD_WS_WIDE_MAX_DE
    gluon_bwd = bwd_ws and dw_form is None and bwd_ws_supported(dh, de, pack) and (
        fused_bwd or de <= BWD_WS_WIDE_MAX_DE)
    gluon_xw = gluon_bwd and num_slots >= BWD_XW_MIN_SLOTS
    form = dw_form or ("t" if pack >= 64 or fused_bwd else "rows")
    # the Triton packing where measured (H100, 2026-11-23: layer 2.30 -> 2.22 ms at 8192 tokens, 10.26 ->
    # 10.10 at 81920; packing alone 0.135 / 0.23 ms vs 0.20 / 0.52 for the best JAX one); emulated
    # (CPU) runs pack with the JAX sort instead (`experts_triton.pack_method`, same arrays)
    pack_impl = "triton" if measured else "argsort"
    # dX kernel: 64-row blocks, 32-wide de chunks (168 registers, 80 KB of shared memory: two programs per
    # SM); H100 2026-11-24, kernel alone: 1.78 ms vs 1.98 for (128, 32, 4, 3) at 81920 tokens, 0.275 ms at
    # 8192 (bench/kernel_tiles.py)
    dx = Tile(64, 32, 4, 3)
    # de = 128: one backward kernel (dX and the gate gradients fused into the transposed dW kernel, 8 warps,
    # each warpgroup 64 of the 128 de rows); H100 2026-11-24, kernels alone, 81920 tokens, Ne 768, k 8: 3.96 ms
    # vs 2.51 (dX) + 2.13 (dW) split, Ne 1536: 4.77 vs 2.79 + 2.62; 8192 tokens, Ne 768: 1.02 vs 0.36 + 0.69
    fused = Tile(64, 128, 8, 3) if fused_bwd else None  # (fit clamps the rows to the packing block)
    if pack >= 128:  # measured on H100 at 81920 tokens, Ne 384, de 256 (bench/NOTES.md)
        dw = fused or (Tile(64, 64, 4, 3) if form == "t" else Tile(128, 64, 8, 2))
        # warp-specialised Gluon forward: H100 2026-11-24, kernel alone at 81920 tokens, 0.88 vs 1.05 ms (Ne 384,
        # de 256) ... 1.16 vs 1.52 (Ne 768, de 128, k 8); bench/gluon_kernels.py
        return ExpertsConfig(pack, Tile(128, 32, 4, 3), dx, dw, dw_form=form, pack_impl=pack_impl,
                             fwd_ws=measured and ws_supported(dh, de, pack), dw_ws=gluon_dw,
                             bwd_ws=gluon_bwd, bwd_xw=gluon_xw).fit(de)
    bm = pack
    # forward at 64-row blocks and de 128: the whole de in one chunk, 2 stages (H100 2026-11-27, kernel alone, 8192
    # tokens, results/kernel_tiles-h100-2026-11-27-fwd8192.jsonl: 0.262 vs 0.303 ms at 768/8/128, 0.385 vs 0.411 at
    # 1536/8/128; at de 256 (64, 64, 4, 3) stayed the best: 0.220 / 0.337 ms at 384/4/256 / 768/4/256)
    fwd = Tile(bm, 128, 4, 2) if pack == 64 and de == 128 and fwd_wide else Tile(bm, 64, 4, 3)
    # the converting forward at 64-row blocks and de 256 with ~two blocks per group: 32-wide de chunks (H100 2026-11-27,
    # session 33, layer at 8192 tokens 384/4/256 (mean 85 rows) in three processes: 1.68 / 1.72, 1.71 / 1.70, 1.70 ms
    # vs 1.76 / 1.73, 1.75 / 1.79, 1.79 with `fwd`'s (64, 64, 4, 3); kernel alone 0.648 vs 0.712; at 768/4/256 (mean
    # 42.7) level to +0.03 ms: `fwd`'s kept there; results/layer-h100-2026-11-27-s33-{fwd-cast-tiles{,2},cast-tile-ab}
    # .jsonl). The plain forward keeps (64, 64, 4, 3): with 32-wide chunks the 2.2B step (mean 170) measured 0.309 vs
    # 0.3055 s (train_scale-h100-2026-11-27-s33-fwd-e32-*.jsonl, two processes) with bitwise the same losses. The two
    # forwards agree bitwise at this tile too (tests/kernels/test_combine.py's converting-forward GPU test, case 64-256-64-32,
    # passed on an H100 2026-11-27, session 34)
    fwd_cast = Tile(bm, 32, 4, 3) if pack == 64 and de == 256 and mean >= CAST_E32_MIN_MEAN else None
    return ExpertsConfig(
        pack_block=pack,
        fwd=fwd,
        fwd_cast=fwd_cast,
        dx=dx if pack >= 64 else Tile(bm, 64, 4, 3),
        dw=fused or Tile(min(bm, 64), 64, 4, 3),
        dw_form=form,
        pack_impl=pack_impl,
        dw_ws=gluon_dw,
        bwd_ws=gluon_bwd,
        bwd_xw=gluon_xw,
    ).fit(de)


def _wide_config(pack: int, num_slots: int, de: int, dw_form: str | None) -> ExpertsConfig:
    """Tiles for dh > 128 (the model sends such experts to the grouped kernels, kernels_select.
    MAX_TRITON_EXPERT_WIDTH; these serve explicit fused calls, measured at dh 256). The dh = 128 tiles
    keep (BLOCK_M, DH) and 2 x (BLOCK_E, DH) fp32 accumulators in registers; at DH = 256 with 4 warps
    those take 256-512 registers per thread and spill (the small d = 256 MoE then never finished a train
    step on H100, 2026-11-23). Here: 8 warps, row blocks of at most 64 and a 32-wide de chunk in the dW
    kernel, i.e. 64 accumulator registers per thread at DH = 256 (the dW kernel also holds its two
    (BLOCK_E, DH) weight tiles). Packing block as `default_config` picks it; the JAX counting sort or
    sort (the Triton packing was measured at dh 128 only)."""
    form = dw_form or "t"
    bm = min(pack, 64)
    count = dw_form is None and pack >= 64 and num_slots <= COUNT_SORT_MAX_SLOTS
    return ExpertsConfig(pack_block=pack, fwd=Tile(bm, 64, 8, 2), dx=Tile(bm, 64, 8, 2),
                         dw=Tile(bm, 32, 8, 2), dw_form=form, pack_impl="count" if count else "argsort").fit(de)


__all__ = ["expert_fwd_kernel", "expert_fwd_cast_kernel",
           "expert_dx_kernel", "expert_dw_kernel", "expert_dwt_kernel", "check_blocks", "Tile",
           "dgates_in_kernels", "DW_WS_MAX_PACK", "BWD_WS_WIDE_MAX_DE",
           "ExpertsConfig", "DW_FORMS", "PACK_IMPLS", "COUNT_SORT_MAX_SLOTS", "PACK64_MIN_MEAN", "default_config",
           "triton"]
