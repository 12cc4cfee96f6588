"""Grouped-GEMM expert FFN on Triton (`kernels/triton/grouped.py`), bound into JAX under one `jax.custom_vjp`:
the path for experts wider than the fused kernels take (dh > MAX_TRITON_EXPERT_WIDTH, e.g. the paper's
MoE / LatentMoE at dh = 1024).

    y[n, h] = sum_j gates[n, h, j] * gelu(x[n, h] W1[h, e_j]) W2[h, e_j],   e_j = idx[n, h, j]

Pipeline (packing from `packing.py`; G = H * Ne groups, P packed rows):
  forward   pack idx -> H = X W1[g] and Act = gelu(H) (P, de) (one launch; gathers x rows itself)
            -> O = Act W2[g] (P, dh) -> combine with gates (fixed-order sum over k)
  backward  dgates = <dy, O row> per slot; dH = (dO W2^T) * gelu'(H) with dO = gate * dy gathered in
            the kernel; dX rows = dH W1^T; dW1 = X^T dH, dW2 = Act^T dO per group over its row
            blocks in order (deterministic); dx = sum over the k slots of the dX rows (fixed order)

Residuals: H and Act (P, de) and the output rows (P, dh), in the compute dtype.
Weights may be fp32 (master copy: cast to x.dtype for the matmuls, gradients returned in fp32) or
already in x.dtype. `backend="emulate"` replaces every kernel launch by a pure-JAX stand-in that computes
what that launch computes (per-block weight copies: small shapes only), so packing, residuals and
cotangent plumbing are tested on CPU where jax-triton cannot run.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.triton.experts import GELU_A, GELU_C
from kernels.triton.grouped import (
    GATHER,
    GATHER_GATED,
    ROWS,
    b_strides,
    grouped_rows_kernel,
    grouped_wgrad_kernel,
)
from kernels.tuning import GroupedConfig
from mhl_jax.moe import packing as pk
from mhl_jax.moe.gpu.experts import _combine, bwd_cotangents, dgates_and_dy_rows, expert_packing
from mhl_jax.moe.plan import grouped_config, import_jax_triton

BACKENDS = ("triton", "emulate")


class Static(NamedTuple):
    cfg: GroupedConfig
    k: int
    backend: str  # "triton" | "emulate"
    w_dtype: str  # dtype of the weights as given (their gradients come back in it)


def _precision(dtype) -> str:
    return "ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32"


# ----------------------------------------------------------------------------- kernel calls (Triton)

def _rows_triton(st: Static, a, gates, packing: pk.Packing, w, *, a_mode, transpose_w, epi_gelu, hpre, out_dtype):
    jt = import_jax_triton()
    p, kdim = packing.row_slot.shape[0], a.shape[1]
    n = w.shape[1] if transpose_w else w.shape[2]
    t = st.cfg.rows
    c, act = jt.triton_call(
        a, gates, packing.row_slot, packing.block_group, w, w if hpre is None else hpre, kernel=grouped_rows_kernel,
        out_shape=[jax.ShapeDtypeStruct((p, n), out_dtype),
                   jax.ShapeDtypeStruct((p, n) if epi_gelu else (1, 1), out_dtype)],
        grid=((p // t.block_m) * (n // t.block_n),), num_warps=t.num_warps, num_stages=t.num_stages,
        K=st.k, KDIM=kdim, N=n, **b_strides(w.shape, transpose_w), PACK_BLOCK=st.cfg.pack_block,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=st.cfg.group_m, A_MODE=a_mode,
        EPI_GELU=epi_gelu, EPI_DGELU=hpre is not None, FAST_TANH=True, PRECISION=_precision(w.dtype))
    return (c, act) if epi_gelu else c


def _wgrad_triton(st: Static, a, d, gates, packing: pk.Packing, *, a_mode, d_mode, num_groups, dw_dtype, acc=None):
    """acc: (G, I, J) in dw_dtype, aliased to the output, which comes back as acc + dW (the kernel's ACCUM; its shape
    checked by `expert_ffn_grouped`)."""
    jt = import_jax_triton()
    i, j = a.shape[1], d.shape[1]
    t = st.cfg.wgrad
    out_shape = jax.ShapeDtypeStruct((num_groups, i, j), dw_dtype)
    return jt.triton_call(
        a, d, gates, packing.row_slot, packing.group_block_start, packing.group_nblocks, gates if acc is None else acc,
        kernel=grouped_wgrad_kernel, out_shape=out_shape, input_output_aliases={} if acc is None else {6: 0},
        grid=(i // t.block_m, j // t.block_n, num_groups), num_warps=t.num_warps, num_stages=t.num_stages,
        K=st.k, I=i, J=j, PACK_BLOCK=st.cfg.pack_block, BLOCK_I=t.block_m, BLOCK_J=t.block_n,
        BLOCK_R=t.block_k, A_MODE=a_mode, D_MODE=d_mode, PRECISION=_precision(a.dtype), ACCUM=acc is not None)


# ------------------------------------------------------------------- kernel stand-ins (pure JAX, CPU)

def _gelu_grad(h):
    """d/dh of the tanh-approximate gelu (the kernels' `_gelu_and_grad`), fp32."""
    t = jnp.tanh(GELU_C * (h + GELU_A * h * h * h))
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * h * h)


def _operand(st: Static, a, packing: pk.Packing, mode: int):
    """A row operand of the kernels (`kernels.triton.grouped._load_rows`) for all P packed rows, as stored."""
    if mode == ROWS:
        return a
    a = jnp.take(a, jnp.maximum(packing.row_slot, 0) // st.k, axis=0)
    return jnp.where((packing.row_slot >= 0)[:, None], a, 0).astype(a.dtype)


def _row_gate(gates, packing: pk.Packing):
    """(P, 1) fp32 gate of each packed row (0 on padding rows)."""
    g = jnp.take(gates, jnp.maximum(packing.row_slot, 0))
    return jnp.where(packing.row_slot >= 0, g, 0.0)[:, None]


def _dot_precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _rows_emulate(st: Static, a, gates, packing: pk.Packing, w, *, a_mode, transpose_w, epi_gelu, hpre, out_dtype):
    p, pb = packing.row_slot.shape[0], st.cfg.pack_block
    ar = _operand(st, a, packing, a_mode)
    if a_mode == GATHER_GATED:
        ar = ar.astype(jnp.float32) * _row_gate(gates, packing)
    ar = ar.astype(w.dtype).reshape(p // pb, pb, -1)
    b = jnp.swapaxes(w, 1, 2) if transpose_w else w
    wb = jnp.take(b, jnp.maximum(packing.block_group, 0), axis=0)  # (blocks, KDIM, N): one copy per block
    c = jnp.einsum("brk,bkn->brn", ar, wb, preferred_element_type=jnp.float32, precision=_dot_precision(w.dtype))
    if hpre is not None:
        c = c * _gelu_grad(hpre.astype(jnp.float32)).reshape(c.shape)
    c = jnp.where((packing.block_group >= 0)[:, None, None], c, 0.0).reshape(p, -1)
    if epi_gelu:
        return c.astype(out_dtype), jax.nn.gelu(c, approximate=True).astype(out_dtype)
    return c.astype(out_dtype)


def _wgrad_emulate(st: Static, a, d, gates, packing: pk.Packing, *, a_mode, d_mode, num_groups, dw_dtype, acc=None):
    p, pb = packing.row_slot.shape[0], st.cfg.pack_block
    ar = _operand(st, a, packing, a_mode)
    gated = [m for m in (a_mode, d_mode) if m == GATHER_GATED]
    if gated:  # the kernel applies the gate (of either operand) to A's rows
        ar = ar.astype(jnp.float32) * _row_gate(gates, packing) ** len(gated)
    ar = ar.astype(a.dtype).reshape(p // pb, pb, -1)
    dr = _operand(st, d, packing, d_mode).astype(a.dtype).reshape(p // pb, pb, -1)
    per_block = jnp.einsum("bri,brj->bij", ar, dr, preferred_element_type=jnp.float32,
                           precision=_dot_precision(a.dtype))
    seg = jnp.where(packing.block_group >= 0, packing.block_group, num_groups)  # padding blocks: dropped segment
    dw = jax.ops.segment_sum(per_block, seg, num_segments=num_groups + 1)[:num_groups].astype(dw_dtype)
    return dw if acc is None else acc + dw


def _rows(st: Static, *args, **kw):
    return (_rows_triton if st.backend == "triton" else _rows_emulate)(st, *args, **kw)


def _wgrad(st: Static, *args, **kw):
    return (_wgrad_triton if st.backend == "triton" else _wgrad_emulate)(st, *args, **kw)


# ------------------------------------------------------------------------------------ the custom_vjp

def _forward(st: Static, x, gates, w1, w2, packing: pk.Packing, wc):
    n, h, dh = x.shape
    _, ne, _, de = w1.shape
    w1c, w2c = (w1, w2) if wc is None else wc  # wc: the weights already cast (by the caller, once per train step)
    w1c = w1c.reshape(h * ne, dh, de).astype(x.dtype)
    w2c = w2c.reshape(h * ne, de, dh).astype(x.dtype)
    xs = x.reshape(n * h, dh)
    g32 = gates.reshape(-1).astype(jnp.float32)
    hpre, act = _rows(st, xs, g32, packing, w1c, a_mode=GATHER, transpose_w=False, epi_gelu=True, hpre=None,
                      out_dtype=x.dtype)  # (P, de) each: H = X W1, gelu(H)
    out_rows = _rows(st, act, g32, packing, w2c, a_mode=ROWS, transpose_w=False, epi_gelu=False, hpre=None,
                     out_dtype=x.dtype)  # (P, dh)
    # XLA's combine (`mhl_jax.moe.plan.out_combine`): at d_model-wide rows the Triton one measured slower
    y = _combine(out_rows, packing.slot_row, gates.astype(jnp.float32)).astype(x.dtype)
    return y, (xs, gates, hpre, act, out_rows, w1c, w2c, packing)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(st: Static, x, gates, w1, w2, packing: pk.Packing, wc, acc):
    return _forward(st, x, gates, w1, w2, packing, wc)[0]


def _experts_fwd(st: Static, x, gates, w1, w2, packing: pk.Packing, wc, acc):
    y, res = _forward(st, x, gates, w1, w2, packing, wc)
    return y, res + (acc,)


def _experts_bwd(st: Static, res, dy):
    xs, gates, hpre, act, out_rows, w1c, w2c, packing, acc = res
    g = w1c.shape[0]
    dys, dgates = dgates_and_dy_rows(out_rows, packing.slot_row, dy, gates)
    g32 = gates.reshape(-1).astype(jnp.float32)
    dw_dtype = jnp.dtype(st.w_dtype)
    dh_rows = _rows(st, dys, g32, packing, w2c, a_mode=GATHER_GATED, transpose_w=True, epi_gelu=False, hpre=hpre,
                    out_dtype=xs.dtype)  # (P, de) = (dO W2^T) * gelu'(H)
    dx_rows = _rows(st, dh_rows, g32, packing, w1c, a_mode=ROWS, transpose_w=True, epi_gelu=False, hpre=None,
                    out_dtype=xs.dtype)  # (P, dh) = dH W1^T
    # the wgrad kernel accumulates in fp32 and writes straight in the weights' dtype
    # with acc (the caller's running sums, `expert_ffn_grouped`'s grad_acc) the kernel adds into them in place
    acc1, acc2 = (None, None) if acc is None else (acc[0].reshape(w1c.shape), acc[1].reshape(w2c.shape))
    dw1 = _wgrad(st, xs, dh_rows, g32, packing, a_mode=GATHER, d_mode=ROWS, num_groups=g,
                 dw_dtype=dw_dtype, acc=acc1)  # (G, dh, de) = X^T dH
    dw2 = _wgrad(st, act, dys, g32, packing, a_mode=ROWS, d_mode=GATHER_GATED, num_groups=g,
                 dw_dtype=dw_dtype, acc=acc2)  # (G, de, dh) = gelu(H)^T dO
    return bwd_cotangents(dx_rows, dgates, dw1, dw2, xs.dtype, packing) + (None, None)  # wc, acc: none


_experts.defvjp(_experts_fwd, _experts_bwd)


def expert_ffn_grouped(x: jax.Array, idx: jax.Array, gates: jax.Array, w1: jax.Array, w2: jax.Array,
                       cfg: GroupedConfig | None = None, backend: str = "triton",
                       packing: pk.Packing | None = None, weights_cast=None,
                       grad_acc=None) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) bf16 (fp32 allowed: exact but slow); idx: (N, H, k) int32 in [0, Ne);
    gates: (N, H, k) fp32; w1: (H, Ne, dh, de), w2: (H, Ne, de, dh), both fp32 or both x.dtype.

    Returns y (N, H, dh) in x.dtype and the load (H, Ne) int32 (routed slots per (head, expert)).
    Same contract as `expert_ffn(..., impl="reference")` and `expert_ffn_triton`; any dh, de that are
    multiples of 16 (tiles shrink to fit, `GroupedConfig.fit`). `cfg` overrides packing and tiles;
    `packing` as in `expert_ffn_triton`; `weights_cast`: (w1, w2) already in x's dtype, read instead of casting here;
    `grad_acc`: (acc1, acc2) fp32 running gradient sums shaped as w1 / w2 (fp32 weights only): the gradients of w1 / w2
    come back as acc + dW, added by the wgrad kernel in place (`mhl_jax.moe.core.moe_heads`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"expert_ffn_grouped: backend={backend!r}, expected one of {BACKENDS}")
    if x.ndim != 3 or w1.ndim != 4 or idx.ndim != 3:
        raise ValueError(f"expert_ffn_grouped: expected x (N, H, dh), idx (N, H, k), w1 (H, Ne, dh, de); got x "
                         f"{x.shape}, idx {idx.shape}, w1 {w1.shape}")
    n, h, dh = x.shape
    _, ne, _, de = w1.shape
    k = idx.shape[2]
    if w1.shape != (h, ne, dh, de) or w2.shape != (h, ne, de, dh) or idx.shape != gates.shape or \
            idx.shape[:2] != (n, h):
        raise ValueError(f"expert_ffn_grouped: shapes disagree: x {x.shape}, idx {idx.shape}, gates "
                         f"{gates.shape}, w1 {w1.shape}, w2 {w2.shape}")
    if w1.dtype != w2.dtype or w1.dtype not in (jnp.dtype(jnp.float32), x.dtype):
        raise ValueError(f"expert_ffn_grouped: w1 {w1.dtype} and w2 {w2.dtype} must share a dtype, fp32 or "
                         f"x's {x.dtype}")
    cfg = grouped_config(n * h * k, h * ne, dh, de, cfg)
    cfg.check(dh, de)
    packing = expert_packing(idx, ne, cfg.pack_block, cfg.pack_impl, backend, packing, "expert_ffn_grouped")
    if weights_cast is not None and [(c.shape, c.dtype) for c in weights_cast] != [(w.shape, x.dtype)
                                                                                    for w in (w1, w2)]:
        raise ValueError(f"expert_ffn_grouped: weights_cast must be w1, w2 in {x.dtype}, got "
                         f"{[(c.shape, str(c.dtype)) for c in weights_cast]}")
    if grad_acc is not None and (w1.dtype != jnp.float32 or
                                 [(a.shape, a.dtype) for a in grad_acc] != [(w.shape, w.dtype) for w in (w1, w2)]):
        raise ValueError(f"expert_ffn_grouped: grad_acc must be shaped and typed as fp32 w1 {w1.shape} / w2 "
                         f"{w2.shape} ({w1.dtype}), got {[(a.shape, str(a.dtype)) for a in grad_acc]}")
    y = _experts(Static(cfg, k, backend, jnp.dtype(w1.dtype).name), x, gates.astype(jnp.float32), w1, w2, packing,
                 None if weights_cast is None else tuple(weights_cast), None if grad_acc is None else tuple(grad_acc))
    return y, packing.group_sizes.reshape(h, ne)
