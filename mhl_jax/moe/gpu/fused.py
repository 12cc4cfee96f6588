"""The MoE core on Triton as one `jax.custom_vjp`, for sub-tokens routed on themselves (x_route is x_expert, as
MH-LatentMoE routes): router + softmax gates + experts forward, and a backward whose last step, one kernel
(`kernels/triton/combine.py`), makes per sub-token the softmax's backward (the router's dvalues from the expert
kernels' gate gradients) and dx: its k expert dX rows and the router's dX summed.

    x (N, H, dh) bf16, w_r (H, dh, Ne) fp32, bias (H, Ne) fp32, w1 (H, Ne, dh, de), w2 (H, Ne, de, dh)
    -> y (N, H, dh) in x's dtype, load (H, Ne) int32

The router's and the experts' custom_vjps (`mhl_jax.moe.gpu.router`, `mhl_jax.moe.gpu.experts`) apart each return
their own dx: the experts' is a gather and sum of the packed dX rows (XLA), the router's a kernel gathering k rows of
W_r^T, and XLA adds the two; between them XLA gathers the gate gradients per slot and runs the softmax's backward.
Here one kernel gathers the dX rows, the gate gradients and the W_r^T rows side by side and writes dx and dvalues
once. Every other
step is the same code as the two ops apart (same kernels, same packing): y, dW1, dW2, the load and bias's zero are
bitwise those of the ops apart; dvalues (so dW_r) differ from XLA's softmax backward in fp32 rounding only, and dx
in its rounding (one rounding of the fp32 sum instead of three: two bf16 terms rounded, then their sum).

`backend="emulate"` runs pure-JAX stand-ins of every kernel (CPU).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.triton.combine import combine_constexprs, combine_grid, dx_combine_kernel
from kernels.tuning import CombineTiles
from mhl_jax.moe.gpu import experts as ext
from mhl_jax.moe.gpu import router as rtr
from mhl_jax.moe.plan import import_jax_triton, packing_spec
from mhl_jax.moe.router import router_gates


class Static(NamedTuple):
    router: rtr.Static
    experts: ext.Static
    cast: bool  # the router's kernel casts the expert weights (`mhl_jax.moe.plan.router_casts_weights`)
    combine: CombineTiles


def dx_combine(dx_rows, slot_row, dgate_rows, gates, idx, wt, x_dtype, tiles: CombineTiles, backend: str,
               dg_by_slot: bool = False):
    """dx (N, H, dh) in x_dtype and the router's dvalues (N, H, k) fp32. dx: each sub-token's k packed dX rows (P, dh)
    or partial rows (P, parts, dh) and the router's sum_j dv_j W_r^T[h, idx_j] (wt (H, Ne, dh) fp32), summed in fp32
    and rounded once; dv = the softmax's backward of the gate gradients: dgate_rows (P, parts) fp32 per packed row
    (partials summed), or with dg_by_slot the gate gradients (N, H, k) per slot; gates (N, H, k) fp32."""
    n, h, k = idx.shape
    p, dh = dx_rows.shape[0], dx_rows.shape[-1]
    parts = dx_rows.size // (p * dh)
    if not dg_by_slot and dgate_rows.size != p * parts:  # the kernel reads dgate_rows[s * parts + q]
        raise ValueError(f"dx combine: gate gradients {dgate_rows.shape} do not match {parts} partial dX rows of "
                         f"{p} packed rows")
    if backend == "triton":
        jt = import_jax_triton()

        consts = combine_constexprs(n * h, h, dh, wt.shape[1], k, parts, True, tiles, dg_by_slot)
        dx, dv = jt.triton_call(
            dx_rows.reshape(p, parts * dh), slot_row, dgate_rows.reshape(-1), gates.reshape(-1), idx.reshape(-1), wt,
            kernel=dx_combine_kernel, out_shape=[jax.ShapeDtypeStruct((n * h, dh), x_dtype),
                                                 jax.ShapeDtypeStruct((n * h * k,), jnp.float32)],
            grid=combine_grid(n * h, tiles), num_warps=tiles.num_warps, **consts)
        return dx.reshape(n, h, dh), dv.reshape(n, h, k)
    if dg_by_slot:
        dg = dgate_rows.reshape(n, h, k).astype(jnp.float32)
    else:
        dg = ext.take_slots(dgate_rows.reshape(p, -1), slot_row).sum(-1).reshape(n, h, k)
    gdg = gates * dg
    dv = gdg - gates * gdg.sum(-1, keepdims=True)
    experts = ext.take_slots(dx_rows.reshape(p, -1), slot_row).reshape(n, h, k, parts, dh).sum(3)
    router = dv[..., None] * jnp.take_along_axis(wt[None], idx[..., None], axis=2)  # (N, H, k, dh)
    return (experts + router).sum(2).astype(x_dtype), dv


def _forward(st: Static, x, w_r, bias, w1, w2, wc):
    with jax.named_scope("router"):  # its kernel packs the slots too
        vals, idx, packing, *made = rtr._forward(st.router, x, w_r, bias, (w1, w2) if st.cast else None)
        gates = router_gates(vals)  # fp32
    with jax.named_scope("packing"):
        packing = ext.expert_packing(idx, w1.shape[1], st.experts.cfg.pack_block, st.experts.cfg.pack_impl,
                                     st.experts.backend, packing, "moe_heads_fused")
    with jax.named_scope("experts"):  # the output combine scopes itself inside
        y, res = ext._forward(st.experts, x, gates, w1, w2, packing, made[0] if made else wc)
    return (y, packing.group_sizes.reshape(w1.shape[:2])), (x, w_r, bias, idx, packing, res)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moe(st: Static, x, w_r, bias, w1, w2, wc, acc):
    return _forward(st, x, w_r, bias, w1, w2, wc)[0]


def _moe_fwd(st: Static, x, w_r, bias, w1, w2, wc, acc):
    out, res = _forward(st, x, w_r, bias, w1, w2, wc)
    return out, res + (acc,)


def _moe_bwd(st: Static, res, cts):
    x, w_r, bias, idx, packing, res_e, acc = res
    dy = cts[0]  # the load's cotangent is float0
    with jax.named_scope("experts"):
        dxr, dw1, dw2, dgate_rows = ext.experts_bwd_kernels(st.experts, res_e, dy, acc)
    by_slot = dgate_rows is None  # no gate gradients from the kernels (`dgates_in_kernels` False): XLA's, per slot
    with jax.named_scope("combine"):  # the backward of the output combine and of the dispatch gather
        dg = ext.slot_dgates(res_e, dy, None) if by_slot else dgate_rows
        dx, dvals = dx_combine(dxr, res_e[5].slot_row, dg, res_e[1], idx, rtr.transposed_weights(w_r), x.dtype,
                               st.combine, st.experts.backend, by_slot)
    with jax.named_scope("router"):
        dw_r = rtr.router_dw(st.router, x, w_r, idx, packing, dvals)
    h, ne = w_r.shape[0], w_r.shape[2]
    # the weights' cast (wc) and the accumulators (acc): no cotangents; w1 and w2 get theirs (acc + dW with acc)
    return (dx, dw_r, jnp.zeros_like(bias), dw1.reshape(h, ne, *dw1.shape[1:]), dw2.reshape(h, ne, *dw2.shape[1:]),
            None, None)


_moe.defvjp(_moe_fwd, _moe_bwd)


def moe_heads_fused(x: jax.Array, w_r: jax.Array, bias: jax.Array, w1: jax.Array, w2: jax.Array, k: int,
                    cfg=None, backend: str = "triton", cast: bool = False,
                    combine: CombineTiles | None = None, weights_cast=None,
                    grad_acc=None) -> tuple[jax.Array, jax.Array]:
    """`mhl_jax.moe.core.moe_heads_triton` for x_route = x_expert = x (N, H, dh) on the fused Triton expert path
    (`mhl_jax.moe.plan.fused_core`): y (N, H, dh) in x's dtype, load (H, Ne) int32. cfg: the experts' ExpertsConfig
    (None: the tuned default); cast: the router's kernel casts the expert weights (`plan.router_casts_weights`);
    combine: the dx combine's tiles (None: the tuned default); weights_cast: (w1, w2) already
    in x's dtype (made by the caller, e.g. once per train step), read instead of casting here (not with cast);
    grad_acc: (acc1, acc2) shaped and typed as w1 / w2, gradients summed so far (the train step's accumulation over
    micro-batches): the "gradients" of w1 / w2 then come back as acc + dW, added in place by the expert backward
    (`mhl_jax.moe.core.moe_heads`' grad_acc)."""
    if grad_acc is not None:
        grad_acc = tuple(grad_acc)
        if [(a.shape, a.dtype) for a in grad_acc] != [(w.shape, w.dtype) for w in (w1, w2)]:
            raise ValueError(f"moe_heads_fused: grad_acc {[(a.shape, str(a.dtype)) for a in grad_acc]} must be shaped "
                             f"and typed as w1 {w1.shape} / w2 {w2.shape} ({w1.dtype})")
    if cast and weights_cast is not None:
        raise ValueError("moe_heads_fused: cast=True (the router's kernel casts the weights) and weights_cast= (cast "
                         "by the caller) exclude each other")
    est = ext.experts_static(x, k, w1, w2, cfg, backend, weights_cast)
    spec = packing_spec(x.shape, k, w1.shape, est.cfg, backend)
    rst = rtr.router_static(x, w_r, bias, k, backend=backend, pack=spec, cast=(w1, w2) if cast else None)
    combine = combine or CombineTiles()
    return _moe(Static(rst, est, bool(cast), combine), x, w_r, bias, w1, w2,
                None if weights_cast is None else tuple(weights_cast), grad_acc)
