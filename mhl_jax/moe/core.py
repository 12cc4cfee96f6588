"""The sparse MoE computation shared by all MoE variants: route, gate, run the experts.

Every variant reduces to H independent MoEs over sub-tokens (MoE and LatentMoE: H = 1):

    values, idx = top-k over (x_route W_r + b)        # bias in the selection only
    gates       = softmax(values)                      # over the k selected raw scores, fp32
    y           = sum_j gates_j * E_{h, idx_j}(x_expert)

An *executor* runs this on global arrays. `local_moe` runs it on one device; the head-parallel and
expert-parallel executors in `mhl_jax/parallel/` wrap the same function in `jax.shard_map`, so the
model code never changes with the mesh.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from mhl_jax.moe.context import ExpertContext
from mhl_jax.moe.experts import expert_ffn, triton_packing_spec
from mhl_jax.moe.plan import MAX_TRITON_EXPERT_WIDTH, MAX_TRITON_ROUTER_WIDTH, triton_expert_path
from mhl_jax.moe.router import route_topk, router_gates


def moe_heads(x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array, w1: jax.Array,
              w2: jax.Array, k: int, impl: str, cfg=None, weights_cast=None,
              grad_acc=None) -> tuple[jax.Array, jax.Array]:
    """x_route: (N, H, dr); x_expert: (N, H, dh) compute dtype; w_r: (H, dr, Ne) fp32; bias: (H, Ne) fp32;
    w1: (H, Ne, dh, de) fp32; w2: (H, Ne, de, dh) fp32. cfg: the triton experts' config (None: default).
    weights_cast: (w1, w2) already in x_expert's dtype, made by the caller (the train step casts them once per step
    instead of once per micro-batch), read by the expert kernels instead of casting here; only where
    `reads_weights_cast` says so. w1 and w2 still get the gradients, in their own dtype.
    grad_acc: (acc1, acc2) shaped and typed as w1 / w2, the gradients summed so far by the caller (the train step's
    micro-batch loop): the gradients of w1 / w2 then come back as acc + dW, bitwise the caller's own add, which the
    caller then skips. The fused Triton core and the grouped Triton experts add in their backward kernels, in place
    (`accumulates_in_place`); other paths add in XLA (`accumulate_grad`).

    Returns y (N, H, dh) in x_expert.dtype and load (H, Ne) int32 (routed slots per expert).
    """
    if weights_cast is not None and not reads_weights_cast(impl, x_expert.dtype, w1.dtype, x_expert.shape[2]):
        raise ValueError(f"moe_heads: weights_cast= is read only by the Triton experts with weights of another dtype "
                         f"than the activations (impl {impl!r}, x {x_expert.dtype}, w1 {w1.dtype})")
    grouped = impl == "triton" and triton_expert_path(x_expert.shape[2]) == "grouped"
    if grad_acc is not None and not (fused_core(impl, x_route, x_expert) or grouped):
        w1, w2 = accumulate_grad(w1, grad_acc[0]), accumulate_grad(w2, grad_acc[1])
        grad_acc = None
    if impl == "triton" and x_route.shape[2] <= MAX_TRITON_ROUTER_WIDTH:
        return moe_heads_triton(x_route, x_expert, w_r, bias, w1, w2, k, cfg, weights_cast=weights_cast,
                                grad_acc=grad_acc)
    values, idx = route_topk(x_route, w_r, bias, k, impl)
    gates = router_gates(values)  # fp32
    return expert_ffn(x_expert, idx, gates, w1, w2, impl, cfg=cfg, weights_cast=weights_cast, grad_acc=grad_acc)


@jax.custom_vjp
def accumulate_grad(w: jax.Array, acc: jax.Array) -> jax.Array:
    """w, whose gradient comes back as acc + dW (acc: a gradient summed so far, w's shape and dtype; not
    differentiated): `moe_heads`' grad_acc on the paths without an in-place kernel."""
    return w


def _accumulate_fwd(w, acc):
    return w, acc


def _accumulate_bwd(acc, g):
    return acc + g, None


accumulate_grad.defvjp(_accumulate_fwd, _accumulate_bwd)


def fused_core(impl: str, x_route: jax.Array, x_expert: jax.Array) -> bool:
    """Whether `moe_heads` runs the fused Triton core (`mhl_jax.moe.gpu.fused`): sub-tokens routed on themselves, on
    the Triton router and the fused expert kernels (FUSE_ROUTER_DX)."""
    return (impl == "triton" and FUSE_ROUTER_DX and x_route is x_expert
            and x_route.shape[2] <= MAX_TRITON_ROUTER_WIDTH and triton_expert_path(x_expert.shape[2]) == "fused")


def accumulates_in_place(impl: str, x_dtype, w_dtype, dh: int) -> bool:
    """Whether the expert backward adds its weight gradients to the caller's accumulators in place (`moe_heads`'
    grad_acc): the Triton experts (the fused core's Gluon / Triton backward for sub-tokens routed on themselves, the
    grouped wgrad kernel) with fp32 weights and activations of another dtype (the kernels' fp32 add is then bitwise
    XLA's). The fused expert kernels on sub-tokens routed apart (x_route not x_expert) take the sums too, through
    `accumulate_grad` (an XLA add, as the caller's)."""
    return impl == "triton" and jnp.dtype(w_dtype) == jnp.float32 and jnp.dtype(x_dtype) != jnp.dtype(w_dtype)


def reads_weights_cast(impl: str, x_dtype, w_dtype, dh: int) -> bool:
    """Whether `moe_heads` can take the expert weights already cast (`weights_cast=`): the Triton experts (fused or
    grouped) with weights held in another dtype than the activations."""
    return impl == "triton" and jnp.dtype(x_dtype) != jnp.dtype(w_dtype)


# The router's Gluon kernel also casts the fp32 expert weights to bf16 (its caster warp group, beside two consumers)
# instead of a separate XLA cast before the expert op; the gradients are bitwise the same either way (see
# `kernels.triton.experts.default_config`'s fwd_cast for the one tile where the two forwards' chunk widths differ). The casts
# are 0.40 / 0.80 ms of the 768/8/128 and 1536/8/128 layers at 81920 tokens; the caster's HBM traffic slows the router
# by 0.1 / 0.28 ms, so the layer gains 0.23 / 0.39 ms (H100 2026-11-25, bench/router_cast.py; bench/NOTES.md, Layer,
# session 19). At k <= 4 (three consumers without the caster) too: 7.27 vs 7.43 ms (384/4/256), 8.70 vs 8.93
# (768/4/256) at 81920 tokens (H100 2026-11-26, session 24).
ROUTER_CASTS_WEIGHTS = True
# ... where the router runs long enough to hide the cast: its time grows as N x H x Ne, the cast's as H x Ne x dh x de,
# so the caster runs from N >= ROUTER_CAST_MIN_TOKENS_PER_WEIGHT x dh x de tokens on. Measured gains at N = 2.5 dh de
# (81920 tokens, de 256, k 4: above) and 5 dh de (de 128, k 8); losses at 0.5 dh de (8192 tokens, de 128, k 8: 2.36 vs
# 2.29 ms at 768/8/128, 3.81 vs 3.64 at 1536/8/128); between them not measured.
ROUTER_CAST_MIN_TOKENS_PER_WEIGHT = 2


# Sub-tokens routed on themselves (x_route is x_expert: MH-LatentMoE) on the fused expert path run router, gates and
# experts under one custom_vjp (`mhl_jax.moe.gpu.fused`) whose backward sums each sub-token's expert dX rows and the
# router's dX in one kernel; False: the router's and the experts' ops apart (XLA adds their dx).
FUSE_ROUTER_DX = True


def router_casts_weights(x_route: jax.Array, x_expert: jax.Array, w1: jax.Array, w2: jax.Array) -> bool:
    """Whether `moe_heads_triton` hands the expert weights' cast to the router (ROUTER_CASTS_WEIGHTS; bf16
    activations, fp32 weights, an expert width the Triton kernels take, and enough tokens to hide it). The router's
    binding decides the rest (the Gluon kernel; else XLA casts)."""
    n, _, dh = x_expert.shape
    return (ROUTER_CASTS_WEIGHTS and x_expert.dtype == x_route.dtype == jnp.bfloat16
            and w1.dtype == w2.dtype == jnp.float32 and dh <= MAX_TRITON_EXPERT_WIDTH
            and n >= ROUTER_CAST_MIN_TOKENS_PER_WEIGHT * dh * w1.shape[-1])


def moe_heads_triton(x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array, w1: jax.Array,
                     w2: jax.Array, k: int, cfg=None, backend: str | None = None,
                     weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array]:
    """`moe_heads` on the Triton router and experts with one packing: the router's forward also packs
    its indices the way the expert op wants them, and its backward takes the dW_r layout from that
    packing instead of sorting the slots again. With x_route is x_expert on the fused expert path (FUSE_ROUTER_DX) all
    of it runs under one custom_vjp whose dx comes out of one kernel (`mhl_jax.moe.gpu.fused`). backend "emulate":
    pure-JAX kernel stand-ins (CPU); None: the bindings' own default ("triton"; a test may swap the bindings).
    weights_cast: (w1, w2) already cast by the caller (`moe_heads`); then the router's kernel casts nothing. grad_acc:
    `moe_heads`' (the fused core, or the grouped experts: `expert_ffn`)."""
    from mhl_jax.moe.gpu import router as router_triton

    cast = weights_cast is None and router_casts_weights(x_route, x_expert, w1, w2)
    kw = {} if backend is None else {"backend": backend}
    if FUSE_ROUTER_DX and x_route is x_expert and triton_expert_path(x_expert.shape[2]) == "fused":
        from mhl_jax.moe.gpu import fused as moe_triton

        return moe_triton.moe_heads_fused(x_expert, w_r, bias, w1, w2, k, cfg, cast=cast, weights_cast=weights_cast,
                                          grad_acc=grad_acc, **kw)
    spec = triton_packing_spec(x_expert.shape, k, w1.shape, cfg, backend or "triton")
    out = router_triton.route_topk_triton(x_route, w_r, bias, k, pack=spec, cast=(w1, w2) if cast else None, **kw)
    values, idx, packing = out[:3]
    gates = router_gates(values)  # fp32
    return expert_ffn(x_expert, idx, gates, w1, w2, "triton", cfg=cfg, packing=packing, backend=backend,
                      weights_cast=out[3] if cast else weights_cast, grad_acc=grad_acc)


class MoEExecutor(Protocol):
    """Runs `moe_heads` on global arrays: `LocalMoE` here, the Head / Expert Parallel executors in
    `mhl_jax.parallel`. ctx: one layer's part of the step context (`mhl_jax.moe.context`), turned into `moe_heads`'
    weights_cast= / grad_acc=. An executor that can take them also answers, for the code building the context,
    `reads_weights_cast(x_dtype, w_dtype, dh)` and `accumulates_in_place(x_dtype, w_dtype, dh)`; one without those
    methods is never given either."""

    def __call__(self, x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array,
                 w1: jax.Array, w2: jax.Array, k: int,
                 ctx: ExpertContext | None = None) -> tuple[jax.Array, jax.Array]: ...


class LocalMoE:
    """Runs `moe_heads` on whatever device holds the arrays (single device, or plain jit)."""

    def __init__(self, impl: str = "reference"):
        self.impl = impl

    def __call__(self, x_route, x_expert, w_r, bias, w1, w2, k, ctx: ExpertContext | None = None):
        ctx = ctx or ExpertContext()
        return moe_heads(x_route, x_expert, w_r, bias, w1, w2, k, self.impl, weights_cast=ctx.weights_cast,
                         grad_acc=ctx.grad_acc)

    def reads_weights_cast(self, x_dtype, w_dtype, dh: int) -> bool:
        return reads_weights_cast(self.impl, x_dtype, w_dtype, dh)

    def accumulates_in_place(self, x_dtype, w_dtype, dh: int) -> bool:
        return accumulates_in_place(self.impl, x_dtype, w_dtype, dh)

    def __repr__(self) -> str:
        return f"LocalMoE(impl={self.impl!r})"
