"""Grouped-GEMM expert FFN over packed rows, for experts of any width (dh = 1024 in the paper's MoE and
LatentMoE, too wide for the fused kernels of `kernels/triton/experts.py`, whose (rows x dh) accumulator and
(dh x BLOCK_E) weight tiles must fit on chip).

Unlike the fused kernels, the hidden pre-activation H = X W1[g] (P x de, compute dtype) is written to
HBM once in the forward and read back by the backward (the standard MoE grouped GEMM):

    forward    H  = X W1[g], Act = gelu(H)      rows kernel, A = gathered x rows, gelu epilogue (2 outputs)
               O  = Act W2[g]                   rows kernel, A = Act rows
    backward   dH = (dO W2[g]^T) * gelu'(H)     rows kernel, A = gathered dO = gate * dy, dgelu epilogue
               dX = dH W1[g]^T                  rows kernel, A = dH rows
               dW1[g] = X^T dH                  wgrad kernel, A = gathered x, D = dH rows
               dW2[g] = Act^T dO                wgrad kernel, A = Act rows, D = gathered dy (gate on A)

gelu and gelu' are computed once per element of H, in epilogues (a gelu prologue on the A tiles of
O = gelu(H) W2 would recompute it once per N tile: dh / BLOCK_N times; measured 1.4x slower on H100).

FLOPs (P = packed rows of used blocks, padding rows included): forward 4 P dh de, backward 8 P dh de
(the fused kernels recompute H: 10 P dh de backward).

Layout: the packed rows of `kernels/triton/experts.py` (all contiguous, row-major):
- row_slot (P,) int32 (-1: padding), slot s reads source row s // K; block_group (P // PACK_BLOCK,)
  int32 (-1: block of padding only); group_block_start / group_nblocks (G,) int32; gates (M,) fp32.
- W: (G, ., .) read through explicit constexpr strides (STRIDE_BG, STRIDE_BK, STRIDE_BN), so the
  backward's W^T operands are strided views of the same tensor (no transpose copy).

Row operands (A of the rows kernel, A and D of the wgrad kernel), chosen by a MODE constexpr:
- ROWS (0):         contiguous packed rows (P, LD) (Act or dH).
- GATHER (1):       x[row_slot // K] (source (S, LD)), zero on padding rows.
- GATHER_GATED (2): gates[slot] * dy[slot // K] in fp32, zero on padding rows. In the wgrad kernel the
  gate scales the rows of the other operand A instead (A^T diag(gate) dy): D then goes from memory to
  the tensor cores untouched.
Loaded tiles are cast to the compute dtype (the B / A pointer's dtype) before each tl.dot; every dot
accumulates in fp32 and results are stored in the output pointer's dtype.

Kernels (parameters in jax-triton's order: inputs, outputs, constexprs):
- `grouped_rows_kernel`  1-D grid of (P / BLOCK_M) * (N / BLOCK_N) programs, swizzled in groups of
  GROUP_M row blocks (the same few row blocks and weight tiles stay in L2 across the N tiles).
  C[rows, n-tile] = A[rows, :] @ B[g][:, n-tile], BLOCK_K loop over KDIM; optional epilogues: also store
  ACT = gelu(C) (EPI_GELU), or C *= gelu'(HPRE[rows, n-tile]) (EPI_DGELU). Row blocks of padding only
  (block_group < 0) store zeros.
- `grouped_wgrad_kernel` grid (I / BLOCK_I, J / BLOCK_J, G): dW[g][i-tile, j-tile] = sum over the
  group's rows, BLOCK_R at a time and in order, of A[rows, i-tile]^T D[rows, j-tile]. No atomics:
  bitwise deterministic. Groups with no rows store zeros.

BLOCK_M and BLOCK_R divide PACK_BLOCK, so tiles are tuned apart from the packing (`kernels.tuning.GroupedConfig`). Under
TRITON_INTERPRET=1 pass fp32 tensors (bf16 arithmetic is broken there) and FAST_TANH=False.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.experts import _gelu, _gelu_and_grad

ROWS, GATHER, GATHER_GATED = 0, 1, 2  # row-operand modes (module docstring)


@triton.jit
def _row_source(gates_ptr, row_slot_ptr, rows, K: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """rows (BLOCK,) int64 packed row ids -> (source row (int64), valid, gate scale fp32) per row."""
    if MODE == 0:
        src = rows
        valid = rows >= 0
        scale = tl.full((BLOCK,), 1.0, tl.float32)
    else:
        slot = tl.load(row_slot_ptr + rows)
        valid = slot >= 0
        src = tl.where(valid, slot // K, 0).to(tl.int64)
        if MODE == 2:
            scale = tl.load(gates_ptr + tl.where(valid, slot, 0), mask=valid, other=0.0).to(tl.float32)
        else:
            scale = tl.full((BLOCK,), 1.0, tl.float32)
    return src, valid, scale


@triton.jit
def _load_rows(ptr, src, valid, cols, LD: tl.constexpr, MODE: tl.constexpr):
    """Tile (rows, cols) of a row operand (module docstring) as stored: no gate, ptr's dtype."""
    offs = src[:, None] * LD + cols[None, :]
    if MODE == 0:
        t = tl.load(ptr + offs)
    else:
        t = tl.load(ptr + offs, mask=valid[:, None], other=0.0)
    return t


@triton.jit
def grouped_rows_kernel(
    a_ptr, gates_ptr, row_slot_ptr, block_group_ptr, b_ptr, hpre_ptr,  # inputs
    c_ptr, act_ptr,  # outputs (P, N); act only with EPI_GELU (else never written: any buffer)
    K: tl.constexpr, KDIM: tl.constexpr, N: tl.constexpr,
    STRIDE_BG: tl.constexpr, STRIDE_BK: tl.constexpr, STRIDE_BN: tl.constexpr,
    PACK_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, A_MODE: tl.constexpr, EPI_GELU: tl.constexpr, EPI_DGELU: tl.constexpr,
    FAST_TANH: tl.constexpr, PRECISION: tl.constexpr,
):
    """C (P, N) = A rows @ B[g] per row block, with optional epilogues (module docstring).

    a: (P, KDIM) packed rows (A_MODE 0) or (S, KDIM) source rows (1, 2); gates (M,) fp32 (A_MODE 2);
    b: (G, ., .) compute dtype, B[g][k, n] = b[g * STRIDE_BG + k * STRIDE_BK + n * STRIDE_BN];
    hpre: (P, N) pre-activation for the gelu' epilogue (EPI_DGELU; otherwise never read)."""
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = N // BLOCK_N
    m_tiles = tl.num_programs(0) // n_tiles
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    g = tl.load(block_group_ptr + pid_m // (PACK_BLOCK // BLOCK_M))
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_offs = rows[:, None] * N + offs_n[None, :]
    if g < 0:  # block of padding only
        tl.store(c_ptr + out_offs, tl.zeros((BLOCK_M, BLOCK_N), c_ptr.dtype.element_ty))
        if EPI_GELU:
            tl.store(act_ptr + out_offs, tl.zeros((BLOCK_M, BLOCK_N), act_ptr.dtype.element_ty))
    else:
        cdt = b_ptr.dtype.element_ty
        src, valid, scale = _row_source(gates_ptr, row_slot_ptr, rows, K, A_MODE, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        b_ptrs = b_ptr + g.to(tl.int64) * STRIDE_BG + offs_k[:, None] * STRIDE_BK + offs_n[None, :] * STRIDE_BN
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, KDIM, BLOCK_K):
            a = _load_rows(a_ptr, src, valid, k0 + offs_k, KDIM, A_MODE)
            if A_MODE == 2:
                a = a.to(tl.float32) * scale[:, None]
            a = a.to(cdt)
            b = tl.load(b_ptrs + k0 * STRIDE_BK)  # (BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if EPI_DGELU:
            _, dgelu = _gelu_and_grad(tl.load(hpre_ptr + out_offs).to(tl.float32), FAST_TANH)
            acc = acc * dgelu
        tl.store(c_ptr + out_offs, acc.to(c_ptr.dtype.element_ty))
        if EPI_GELU:
            tl.store(act_ptr + out_offs, _gelu(acc, FAST_TANH).to(act_ptr.dtype.element_ty))


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, d_ptr, gates_ptr, row_slot_ptr, group_block_start_ptr, group_nblocks_ptr, acc_ptr,  # inputs
    dw_ptr,  # output (G, I, J)
    K: tl.constexpr, I: tl.constexpr, J: tl.constexpr, PACK_BLOCK: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
    A_MODE: tl.constexpr, D_MODE: tl.constexpr, PRECISION: tl.constexpr, ACCUM: tl.constexpr,
):
    """dW[g] (I, J) = sum over group g's packed rows of A[row, :]^T D[row, :] (module docstring).

    a: row operand of width I (A_MODE), d: row operand of width J (D_MODE); a gate (either operand
    GATHER_GATED) scales A's rows in fp32. Both are cast to a's dtype (the compute dtype) for the dots.
    ACCUM: dw holds a gradient summed so far (acc, the same buffer: the JAX binding aliases them; the torch launcher
    passes dw for both) and each tile adds its own to it in fp32 (acc + dW, bitwise XLA's add); acc_ptr itself is
    never read."""
    pid_i = tl.program_id(0)
    pid_j = tl.program_id(1)
    gi = tl.program_id(2)
    start = tl.load(group_block_start_ptr + gi)
    nblk = tl.load(group_nblocks_ptr + gi)
    cdt = a_ptr.dtype.element_ty
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_I, BLOCK_J), tl.float32)
    row0 = start.to(tl.int64) * PACK_BLOCK
    for r in range(0, nblk * (PACK_BLOCK // BLOCK_R)):
        rows = row0 + r * BLOCK_R + tl.arange(0, BLOCK_R)
        src_a, valid_a, scale_a = _row_source(gates_ptr, row_slot_ptr, rows, K, A_MODE, BLOCK_R)
        src_d, valid_d, scale_d = _row_source(gates_ptr, row_slot_ptr, rows, K, D_MODE, BLOCK_R)
        a = _load_rows(a_ptr, src_a, valid_a, offs_i, I, A_MODE)
        if A_MODE == 2 or D_MODE == 2:
            a = a.to(tl.float32) * (scale_a * scale_d)[:, None]
        a = a.to(cdt)
        d = _load_rows(d_ptr, src_d, valid_d, offs_j, J, D_MODE).to(cdt)
        acc = tl.dot(tl.trans(a), d, acc, input_precision=PRECISION)  # (BLOCK_I, BLOCK_J)
    out = dw_ptr + gi.to(tl.int64) * (I * J) + offs_i[:, None] * J + offs_j[None, :]
    if ACCUM:
        acc = tl.load(out).to(tl.float32) + acc
    tl.store(out, acc.to(dw_ptr.dtype.element_ty))


def b_strides(shape: tuple[int, int, int], transpose: bool) -> dict:
    """Strides of B[g] (KDIM, N) over a contiguous weight tensor of `shape` (G, R, C): B[g] = W[g]
    (KDIM = R, N = C), or with `transpose` B[g] = W[g]^T (KDIM = C, N = R)."""
    _, r, c = shape
    bk, bn = (1, c) if transpose else (c, 1)
    return dict(STRIDE_BG=r * c, STRIDE_BK=bk, STRIDE_BN=bn)


__all__ = ["grouped_rows_kernel", "grouped_wgrad_kernel", "b_strides", "ROWS", "GATHER", "GATHER_GATED"]
