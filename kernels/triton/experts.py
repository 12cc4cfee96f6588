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
  dX rows, so the backward is one launch. The small-block backward (packing blocks below 64).
- `expert_dwt_kernel`  the same gradients in the transposed form of FlashAttention's dK/dV loop
  (dw_form "t"): H^T = W1_tile^T X^T (BLOCK_E, BLOCK_M), so the accumulating products
  dW2_tile += A^T dO and dW1_tile^T += dH^T X take their left operand (A^T, dH^T) straight from
  registers and their right one (X, dO rows) untransposed from shared memory; accumulators are
  (BLOCK_E, DH), so a 128-wide de tile feeds the tensor cores 128 columns per instruction. With FUSE_DX
  (BLOCK_E == DE) it also writes the dX rows and, with DGATES, each row's gate gradient: the whole backward
  in one launch (the Triton backward at de = 128).

The gather of X rows and of dO = gate * dy rows is fused into the loads: no packed copies in HBM.
The tiles each shape runs with: `kernels.tuning.default_config`.
Parameters follow jax-triton's binding order: inputs, then one pointer per output, then constexprs.
`FAST_TANH` uses the single-instruction `tanh.approx.f32` (GPU only; the interpreter takes the
sigmoid form). Under TRITON_INTERPRET=1 pass fp32 tensors (bf16 arithmetic is broken there).
"""

from __future__ import annotations

import triton
import triton.language as tl

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
def _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K: tl.constexpr, DH: tl.constexpr):
    """X rows (x's dtype) and dO rows (fp32) of packed rows `rows`, gathered."""
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
    BLOCK_E: tl.constexpr, FAST_TANH: tl.constexpr, PRECISION: tl.constexpr, DGATES: tl.constexpr = False,
):
    """DGATES: also the combine's gate gradient of each packed row, from values already
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
            x, d = _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K, DH)
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
    DGATES: tl.constexpr = False,
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
        x, do = _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K, DH)
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
    DGATES: tl.constexpr = False,
):
    """`expert_dw_kernel` in transposed form (module docstring); same grid, outputs and order of sums.

    DGATES (with FUSE_DX: the program holds all of DE for its rows) also writes each packed row's
    gate gradient as the dX kernel's DGATES does: the dy rows are loaded as stored, dA'^T = W2 dy^T, and
    <out row, dy> = sum over de of A * dA' (A rounded to the compute dtype); the gate then scales the columns
    (dA^T = dA'^T diag(gate), dW2 += (A^T diag(gate)) dy)."""
    tl.static_assert(not DGATES or (FUSE_DX and BLOCK_E == DE), "DGATES needs FUSE_DX (all of DE per program)")
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
            x, do = _load_x_do(x_ptr, dy_ptr, gates_ptr, row_slot_ptr, rows, offs_d, K, DH)
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


__all__ = ["expert_fwd_kernel", "expert_fwd_cast_kernel", "expert_dx_kernel", "expert_dw_kernel", "expert_dwt_kernel",
           "GELU_A", "GELU_C"]
