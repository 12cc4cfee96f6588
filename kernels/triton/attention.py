"""Causal flash attention on Triton: forward and backward, bf16 in and out, fp32 accumulation, no atomics.

Layout: q, k, v, o and their gradients (B, T, NH, HD), row (b, t, h) at ((b * T + t) * NH + h) * HD; the softmax
statistics lse and the backward's delta = rowsum(o * do) (B, NH, T) fp32. Scores are kept in base 2: q . k is scaled
by sm_scale * log2(e) and lse = m + log2(l), so every exponential is an exp2 (one MUFU op).

Forward, grid (T / BLOCK_M, B * NH): one program per q block, heaviest (last) blocks first. The kv blocks left of the
diagonal need no mask; the BLOCK_M / BLOCK_N blocks on it do.

Backward, grid (T / BLOCK_N1, B * NH), in one launch and without atomics: program j computes dK and dV of kv block j
(the q blocks from the diagonal down, in BLOCK_M1 steps) and then dQ of q block j (the kv blocks from the left up to
the diagonal, in BLOCK_N2 steps). Each output element is written by one program, so the gradients are bitwise
repeatable. With BLOCK_M2 == BLOCK_N1 the two halves' work adds to the same count for every j (kv block j meets
T / BLOCK_N1 - j q blocks, q block j meets j + 1 kv blocks): the grid is balanced under the causal mask. The scores S
and dP are computed twice (once per half), the price of having no float atomics: 7 matmuls against the 5 a single pass
with atomic dQ sums would do.

Parameters follow jax-triton's binding order: inputs, then one pointer per output, then constexprs.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from kernels.tuning import AttentionTiles

LOG2E = math.log2(math.e)


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, k_ptr, v_ptr, offs_m, offs_d, lo, hi, QK_SCALE: tl.constexpr,
                ROW: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """Online softmax of q (BLOCK_M, HD) against the keys [lo, hi) in BLOCK_N steps; k_ptr, v_ptr: row 0 of this
    (batch, head), rows ROW elements apart."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(k_ptr + offs_n[None, :] * ROW + offs_d[:, None])
        s = tl.dot(q, kt) * QK_SCALE
        if MASK:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs_n[:, None] * ROW + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr,
                    QK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """o = softmax(q k^T * sm_scale, causal) v and lse (base 2) of one q block (module docstring)."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    ROW: tl.constexpr = NH * HD
    base = (bh // NH) * T * ROW + (bh % NH) * HD
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HD)
    q = tl.load(q_ptr + base + offs_m[:, None] * ROW + offs_d[None, :])
    acc = tl.zeros((BLOCK_M, HD), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_ptr + base, v_ptr + base, offs_m, offs_d, 0, start_m,
                                QK_SCALE, ROW, BLOCK_N, False)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, k_ptr + base, v_ptr + base, offs_m, offs_d, start_m,
                                start_m + BLOCK_M, QK_SCALE, ROW, BLOCK_N, True)
    tl.store(o_ptr + base + offs_m[:, None] * ROW + offs_d[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + bh * T + offs_m, m_i + tl.math.log2(l_i))


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, offs_n, offs_d, lo, hi, QK_SCALE: tl.constexpr,
                 ROW: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr):
    """dK, dV (BLOCK_N, HD) of the keys offs_n from the queries [lo, hi) in BLOCK_M steps, on transposed tiles (keys x
    queries: the probabilities come out in the orientation dV's and dK's products take)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt = tl.load(q_ptr + offs_m[None, :] * ROW + offs_d[:, None])
        lse = tl.load(lse_ptr + offs_m)
        pt = tl.math.exp2(tl.dot(k, qt) * QK_SCALE - lse[None, :])
        if MASK:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        do = tl.load(do_ptr + offs_m[:, None] * ROW + offs_d[None, :])
        dv += tl.dot(pt.to(do.dtype), do)
        delta = tl.load(delta_ptr + offs_m)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
    return dk, dv


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, lo, hi, QK_SCALE: tl.constexpr,
               ROW: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """dQ (BLOCK_M, HD) of the queries offs_m from the keys [lo, hi) in BLOCK_N steps."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = tl.load(k_ptr + offs_n[None, :] * ROW + offs_d[:, None])
        p = tl.math.exp2(tl.dot(q, kt) * QK_SCALE - lse[:, None])
        if MASK:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        vt = tl.load(v_ptr + offs_n[None, :] * ROW + offs_d[:, None])
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    return dq


@triton.jit
def attn_bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, T: tl.constexpr,
                    NH: tl.constexpr, HD: tl.constexpr, SM_SCALE: tl.constexpr, QK_SCALE: tl.constexpr,
                    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_N2: tl.constexpr):
    """dK, dV of kv block j, then dQ of q block j (module docstring; BLOCK_M2 = BLOCK_N1)."""
    j0 = tl.program_id(0) * BLOCK_N1
    bh = tl.program_id(1)
    ROW: tl.constexpr = NH * HD
    base = (bh // NH) * T * ROW + (bh % NH) * HD
    q_ptr, k_ptr, v_ptr, do_ptr = q_ptr + base, k_ptr + base, v_ptr + base, do_ptr + base
    lse_ptr, delta_ptr = lse_ptr + bh * T, delta_ptr + bh * T
    offs_d = tl.arange(0, HD)
    offs_j = j0 + tl.arange(0, BLOCK_N1)
    tile = offs_j[:, None] * ROW + offs_d[None, :]

    k, v = tl.load(k_ptr + tile), tl.load(v_ptr + tile)
    dk = tl.zeros((BLOCK_N1, HD), tl.float32)
    dv = tl.zeros((BLOCK_N1, HD), tl.float32)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, offs_j, offs_d, j0, j0 + BLOCK_N1,
                          QK_SCALE, ROW, BLOCK_M1, True)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, offs_j, offs_d, j0 + BLOCK_N1, T,
                          QK_SCALE, ROW, BLOCK_M1, False)
    tl.store(dk_ptr + base + tile, (dk * SM_SCALE).to(dk_ptr.dtype.element_ty))
    tl.store(dv_ptr + base + tile, dv.to(dv_ptr.dtype.element_ty))

    q, do = tl.load(q_ptr + tile), tl.load(do_ptr + tile)
    lse, delta = tl.load(lse_ptr + offs_j), tl.load(delta_ptr + offs_j)
    dq = tl.zeros((BLOCK_N1, HD), tl.float32)
    dq = _dq_blocks(dq, q, do, lse, delta, k_ptr, v_ptr, offs_j, offs_d, 0, j0, QK_SCALE, ROW, BLOCK_N2, False)
    dq = _dq_blocks(dq, q, do, lse, delta, k_ptr, v_ptr, offs_j, offs_d, j0, j0 + BLOCK_N1, QK_SCALE, ROW,
                    BLOCK_N2, True)
    tl.store(dq_ptr + base + tile, (dq * SM_SCALE).to(dq_ptr.dtype.element_ty))


def check_shape(b: int, t: int, nh: int, hd: int, tiles: AttentionTiles) -> None:
    """The kernels' shape rules: HD and the tiles powers of two >= 16 (tl.arange, tl.dot), T a whole number of every
    tile, the diagonal tiles nested, and offsets that fit int32."""
    blocks = (("block_m", tiles.block_m), ("block_n", tiles.block_n), ("block_m1", tiles.block_m1),
              ("block_n1", tiles.block_n1), ("block_n2", tiles.block_n2))
    for name, v in (("head_dim", hd), *blocks):
        if v < 16 or v & (v - 1):
            raise ValueError(f"triton attention: {name}={v} must be a power of two >= 16")
    for name, v in blocks:
        if t % v:
            raise ValueError(f"triton attention: sequence length {t} must be a multiple of {name}={v}")
    if tiles.block_m % tiles.block_n or tiles.block_n1 % tiles.block_m1 or tiles.block_n1 % tiles.block_n2:
        raise ValueError(f"triton attention: block_n={tiles.block_n} must divide block_m={tiles.block_m}, and "
                         f"block_m1={tiles.block_m1} and block_n2={tiles.block_n2} must divide "
                         f"block_n1={tiles.block_n1}")
    if b * t * nh * hd >= 2 ** 31:
        raise ValueError(f"triton attention: {b} x {t} x {nh} x {hd} elements per device; the kernels' int32 offsets "
                         "take fewer than 2^31 (split the batch over more devices or micro-batches)")


def fwd_launch(shape: tuple[int, ...], tiles: AttentionTiles) -> tuple[tuple[int, int], dict]:
    """(grid, keyword arguments: constexprs, warps, stages) of `attn_fwd_kernel` for q, k, v of `shape` (B, T, NH,
    HD), after `check_shape`: the one launch both launchers make (jax-triton's binding, the torch tests')."""
    b, t, nh, hd = shape
    check_shape(b, t, nh, hd, tiles)
    return (t // tiles.block_m, b * nh), dict(
        T=t, NH=nh, HD=hd, QK_SCALE=hd ** -0.5 * LOG2E, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.fwd_warps, num_stages=tiles.fwd_stages)


def bwd_launch(shape: tuple[int, ...], tiles: AttentionTiles) -> tuple[tuple[int, int], dict]:
    """(grid, keyword arguments) of `attn_bwd_kernel`, as `fwd_launch`."""
    b, t, nh, hd = shape
    check_shape(b, t, nh, hd, tiles)
    return (t // tiles.block_n1, b * nh), dict(
        T=t, NH=nh, HD=hd, SM_SCALE=hd ** -0.5, QK_SCALE=hd ** -0.5 * LOG2E, BLOCK_M1=tiles.block_m1,
        BLOCK_N1=tiles.block_n1, BLOCK_N2=tiles.block_n2, num_warps=tiles.bwd_warps, num_stages=tiles.bwd_stages)
