"""The IO-aware expert FFN on Triton, bound into JAX (jax-triton) under one `jax.custom_vjp`.

    y[n, h] = sum_j gates[n, h, j] * gelu(x[n, h] W1[h, e_j]) W2[h, e_j],   e_j = idx[n, h, j]

Pipeline (packing from `packing.py`, kernels launched by `expert_kernels.py`, chosen by `mhl_jax.moe.plan`):
  forward   pack idx -> fwd kernel (gathers x rows itself) -> out rows (P, dh) -> combine with gates
  backward  the dW kernel (+ the dX kernel unless fused, or the one Gluon kernel) gather x rows and dO = gate * dy
            themselves, and make dgates = <dy, out row> per packed row from values in registers (in XLA from the
            kept output rows where dX is fused into the row-form dW kernel); dx = sum over the k slots of the dX
            rows (fixed order)

Neither the packed copy of x, nor the packed dO, nor the (rows x de) hidden activations are written to HBM. Weight
gradients are reduced per (head, expert) over its row blocks in order: deterministic. Weights may be fp32 (master
copy: cast to x.dtype for the matmuls, gradients returned in fp32) or already in the compute dtype.

`backend="emulate"` runs the same custom_vjp with pure-JAX stand-ins of the kernels, so the plumbing (packing,
gathers, combine, cotangents) is tested on CPU where jax-triton cannot run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.triton.combine import combine_grid, out_combine_constexprs, out_combine_kernel
from kernels.tuning import ExpertsConfig, dgates_in_kernels, out_combine_tiles
from mhl_jax.moe import packing as pk
from mhl_jax.moe import plan
from mhl_jax.moe.gpu import packing as packing_triton
from mhl_jax.moe.gpu.expert_kernels import Static, backward_kernels, forward_rows, fwd_triton
from mhl_jax.moe.plan import experts_config as resolve_config
from mhl_jax.moe.plan import pack_method

__all__ = ["Static", "expert_ffn_triton", "experts_static", "expert_packing", "resolve_config", "pack_method"]


def expert_packing(idx: jax.Array, num_experts: int, block: int, pack_impl: str, backend: str,
                   packing: pk.Packing | None, who: str) -> pk.Packing:
    """The packing of idx (N, H, k) for an expert op, which its kernels read. A packing handed in (made
    by the router, `route_topk_triton(..., pack=)`) is checked against the one the op would make with
    row block `block`; otherwise it is made here with `pack_impl` (`pack_method` under `backend`)."""
    n, h, k = idx.shape
    if packing is None:
        packing = packing_triton.pack(idx, num_experts, block, pack_method(pack_impl, backend))
    else:
        want = (pk.padded_rows(n * h * k, h * num_experts, block), n * h * k, h * num_experts)
        got = (packing.row_slot.shape[0], packing.slot_row.shape[0], packing.group_sizes.shape[0])
        if got != want:
            raise ValueError(f"{who}: the given packing has (rows, slots, groups) = {got}, expected {want} "
                             f"(row block {block}: make it with mhl_jax.moe.plan.packing_spec)")
    return packing


def take_slots(rows, slot_row):
    """rows (P, D), slot_row (M,) -> (M, D) fp32: each slot's packed row, zero for an empty slot (-1,
    e.g. the unused tail of an expert-parallel receive buffer)."""
    got = jnp.take(rows, jnp.maximum(slot_row, 0), axis=0).astype(jnp.float32)
    return jnp.where((slot_row >= 0)[:, None], got, 0.0)


def dgates_and_dy_rows(out_rows, slot_row, dy, gates):
    """Backward of the combine: dy (N, H, dh) as rows (N * H, dh) for the kernels, and dgates (N, H, k)
    in gates' dtype = <output row of each slot, dy> (a fused multiply-reduce, like `_combine`)."""
    n, h, k = gates.shape
    dh = dy.shape[-1]
    per_slot = take_slots(out_rows, slot_row).reshape(n, h, k, dh)
    dgates = jnp.sum(per_slot * dy.astype(jnp.float32)[:, :, None, :], axis=-1)
    return dy.reshape(n * h, dh), dgates.astype(gates.dtype)


def combine_rows(out_rows, slot_row, gates, x_dtype, backend: str):
    """out_rows (P, dh), slot_row (M,), gates (N, H, k) fp32 -> (N, H, dh) in x_dtype: each sub-token's k output rows
    weighted by its gates and summed in fp32 (an empty slot adds 0), rounded once: the plan's `out_combine` (the
    Triton `out_combine_kernel` or XLA's `_combine`)."""
    n, h, k = gates.shape
    if plan.out_combine(backend, "fused") == "triton":
        jt = plan.import_jax_triton()
        dh = out_rows.shape[1]
        tiles = out_combine_tiles(dh)
        y = jt.triton_call(out_rows, slot_row, gates.reshape(-1), kernel=out_combine_kernel,
                           out_shape=jax.ShapeDtypeStruct((n * h, dh), x_dtype), grid=combine_grid(n * h, tiles),
                           num_warps=tiles.num_warps, **out_combine_constexprs(n * h, dh, k, tiles))
        return y.reshape(n, h, dh)
    return _combine(out_rows, slot_row, gates).astype(x_dtype)


def _combine(out_rows, slot_row, gates):
    """out_rows (P, dh), slot_row (M,), gates (N, H, k) fp32 -> (N, H, dh) fp32, fixed-order sum over k."""
    n, h, k = gates.shape
    per_slot = take_slots(out_rows, slot_row).reshape(n, h, k, -1)
    # a multiply-reduce over k, not a k = 4 dot: XLA fuses the row gather into the reduction instead of
    # materialising the (M, dh) fp32 rows as a dot operand
    return jnp.sum(per_slot * gates[..., None], axis=2)


def _forward(st: Static, x, gates, w1, w2, packing: pk.Packing, wc):
    n, h, dh = x.shape
    _, ne, _, de = w1.shape
    xs = x.reshape(n * h, dh)
    kernel = plan.expert_fwd_kernel(st.cfg, x.dtype, w1.dtype, st.backend, cast_given=wc is not None)
    if kernel == "triton-cast":  # the kernel converts the fp32 weights and keeps them for the backward
        out_rows, w1c, w2c = fwd_triton(st, xs, packing, w1.reshape(h * ne, dh, de), w2.reshape(h * ne, de, dh),
                                        cast=True)
    else:
        w1c, w2c = (w1, w2) if wc is None else wc  # wc: the weights already cast (by the router's kernel, the caller)
        w1c = w1c.reshape(h * ne, dh, de).astype(x.dtype)
        w2c = w2c.reshape(h * ne, de, dh).astype(x.dtype)
        out_rows = forward_rows(kernel, st, xs, packing, w1c, w2c, h)
    with jax.named_scope("combine"):
        y = combine_rows(out_rows, packing.slot_row, gates.astype(jnp.float32), x.dtype, st.backend)
    # the output rows are kept for the backward only where no kernel makes the gate gradients
    keep = None if dgates_in_kernels(st.cfg, de) else out_rows
    return y, (xs, gates, keep, w1c, w2c, packing)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(st: Static, x, gates, w1, w2, packing: pk.Packing, wc):
    return _forward(st, x, gates, w1, w2, packing, wc)[0]


def _experts_fwd(st: Static, x, gates, w1, w2, packing: pk.Packing, wc):
    return _forward(st, x, gates, w1, w2, packing, wc)


def experts_bwd_kernels(st: Static, res, dy, acc=None):
    """The backward's kernels: packed dX rows (P, dh) or partial rows (P, parts, dh), dW1 (G, dh, de), dW2 (G, de,
    dh) in the weights' dtype, and the gate gradients per packed row (P, parts) fp32 where the kernels make them
    (`dgates_in_kernels`), else None (`slot_dgates` makes them in XLA); dx itself is left to the combine. acc:
    (acc1, acc2) gradients summed so far, shaped as w1 / w2 (H, Ne, ...) in the weights' dtype: dW1 / dW2 come back
    as acc + dW (in place in the Gluon kernels)."""
    xs, gates, _, w1c, w2c, packing = res
    n, h, _ = gates.shape
    (_, dh), (_, _, de) = xs.shape, w1c.shape
    kernel = plan.expert_bwd_kernel(st.cfg, xs.dtype, dh, de, st.backend)
    if acc is not None:
        acc = (acc[0].reshape(w1c.shape), acc[1].reshape(w2c.shape))
    # the kernel accumulates in fp32 and writes the gradient straight in the weights' dtype
    dxr, dw1, dw2, dgate_rows = backward_kernels(kernel, st, xs, dy.reshape(n * h, -1),
                                                 gates.reshape(-1).astype(jnp.float32), packing, w1c, w2c,
                                                 jnp.dtype(st.w_dtype), h, acc)
    if dgate_rows is not None:
        dgate_rows = dgate_rows.reshape(dgate_rows.shape[0], -1)
    return dxr, dw1, dw2, dgate_rows


def slot_dgates(res, dy, dgate_rows):
    """dgates (N, H, k) in gates' dtype: the kernels' per-row gate gradients (partials summed) per slot (empty: 0),
    or, where they make none (dX fused into the row-form dW kernel), <output row, dy> in XLA."""
    _, gates, out_rows, _, _, packing = res
    if dgate_rows is None:
        return dgates_and_dy_rows(out_rows, packing.slot_row, dy, gates)[1]
    return take_slots(dgate_rows, packing.slot_row).sum(-1).reshape(gates.shape).astype(gates.dtype)


def _experts_bwd(st: Static, res, dy):
    dxr, dw1, dw2, dgate_rows = experts_bwd_kernels(st, res, dy)
    with jax.named_scope("combine"):  # the backward of the output combine and of the dispatch gather
        dgates = slot_dgates(res, dy, dgate_rows)
        return bwd_cotangents(dxr, dgates, dw1, dw2, res[0].dtype, res[5]) + (None,)  # the weights' cast: none


def bwd_cotangents(dx_rows, dgates, dw1, dw2, x_dtype, packing: pk.Packing):
    """The custom_vjp's cotangents (x, gates, w1, w2, packing) from the packed dX rows (P, dh) or partial rows
    (P, parts, dh), dgates (N, H, k) and the per-group dW1 (G, dh, de), dW2 (G, de, dh): dx sums each sub-token's
    k slots (and their partials) in fp32; the weights go back to (H, Ne, ...)."""
    n, h, k = dgates.shape
    g, dh, de = dw1.shape
    p = dx_rows.shape[0]
    dx = take_slots(dx_rows.reshape(p, -1), packing.slot_row).reshape(n, h, k, -1, dh).sum((2, 3))
    zero_packing = jax.tree.map(lambda a: None, packing)
    return (dx.astype(x_dtype), dgates, dw1.reshape(h, g // h, dh, de), dw2.reshape(h, g // h, de, dh), zero_packing)


_experts.defvjp(_experts_fwd, _experts_bwd)


def expert_ffn_triton(x: jax.Array, idx: jax.Array, gates: jax.Array, w1: jax.Array, w2: jax.Array,
                      cfg: ExpertsConfig | None = None, backend: str = "triton",
                      packing: pk.Packing | None = None, weights_cast=None) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) bf16 (fp32 allowed: exact but slow); idx: (N, H, k) int32; gates: (N, H, k) fp32;
    w1: (H, Ne, dh, de), w2: (H, Ne, de, dh) fp32 or x.dtype.

    Returns y (N, H, dh) in x.dtype and the load (H, Ne) int32 (routed slots per (head, expert)).
    Same contract as `expert_ffn(..., impl="reference")`; `cfg` overrides the packing block and tiles;
    `packing`: the packing of idx already made (by the router, `route_topk_triton(..., pack=)`) with
    this config's block (`mhl_jax.moe.plan.packing_spec`), else it is made here; `weights_cast`:
    (w1, w2) already cast to x's dtype (by the router's kernel, `route_topk_triton(..., cast=)`), read instead of
    casting here (w1, w2 still get the gradients, in their own dtype).
    """
    n, h, _ = x.shape
    ne = w1.shape[1]
    if idx.shape != gates.shape or idx.shape[:2] != (n, h):
        raise ValueError(f"expert_ffn_triton: shapes disagree: x {x.shape}, idx {idx.shape}, gates "
                         f"{gates.shape}, w1 {w1.shape}, w2 {w2.shape}")
    st = experts_static(x, idx.shape[2], w1, w2, cfg, backend, weights_cast)
    with jax.named_scope("packing"):
        packing = expert_packing(idx, ne, st.cfg.pack_block, st.cfg.pack_impl, backend, packing, "expert_ffn_triton")
    y = _experts(st, x, gates.astype(jnp.float32), w1, w2, packing, weights_cast)
    return y, packing.group_sizes.reshape(h, ne)


def experts_static(x: jax.Array, k: int, w1: jax.Array, w2: jax.Array, cfg: ExpertsConfig | None = None,
                   backend: str = "triton", weights_cast=None) -> Static:
    """`expert_ffn_triton`'s arguments checked, as the Static its custom_vjp (or the fused core's) runs with."""
    n, h, dh = x.shape
    ne, de = w1.shape[1], w1.shape[3]
    if backend not in ("triton", "emulate"):
        raise ValueError(f"expert_ffn_triton: backend={backend!r}, expected 'triton' or 'emulate'")
    if w1.shape != (h, ne, dh, de) or w2.shape != (h, ne, de, dh):
        raise ValueError(f"expert_ffn_triton: shapes disagree: x {x.shape}, w1 {w1.shape}, w2 {w2.shape}")
    cfg = resolve_config(n * h * k, h * ne, dh, de, cfg)
    cfg.check(dh, de)
    if w1.dtype != w2.dtype:
        raise ValueError(f"expert_ffn_triton: w1 {w1.dtype} and w2 {w2.dtype} must share a dtype")
    if weights_cast is not None and any(c.shape != w.shape or c.dtype != x.dtype
                                        for c, w in zip(weights_cast, (w1, w2))):
        raise ValueError(f"expert_ffn_triton: weights_cast must be w1, w2 in {x.dtype}, got "
                         f"{[(c.shape, c.dtype) for c in weights_cast]}")
    return Static(cfg, k, backend, jnp.dtype(w1.dtype).name)
