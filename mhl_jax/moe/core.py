"""The sparse MoE computation shared by all MoE variants: route, gate, run the experts.

Every variant reduces to H independent MoEs over sub-tokens (MoE and LatentMoE: H = 1):

    values, idx = top-k over (x_route W_r + b)        # bias in the selection only
    gates       = softmax(values)                      # over the k selected raw scores, fp32
    y           = sum_j gates_j * E_{h, idx_j}(x_expert)

An *executor* runs this on global arrays. `local_moe` runs it on one device; the head-parallel and
expert-parallel executors in `mhl_jax/parallel/` wrap the same function in `jax.shard_map`, so the
model code never changes with the mesh. Which kernels run is `mhl_jax.moe.plan`'s to say; this module
routes the calls accordingly.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from mhl_jax.moe import plan
from mhl_jax.moe.context import ExpertContext
from mhl_jax.moe.experts import REFERENCE_BLOCK, expert_ffn_reference
from mhl_jax.moe.plan import MAX_TRITON_ROUTER_WIDTH, fused_core, router_casts_weights, triton_expert_path
from mhl_jax.moe.router import check_router_shapes, route_topk_reference, router_gates
from mhl_jax.moe.wide_router import route_topk_wide


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
    with jax.named_scope("router"):
        values, idx = route_topk(x_route, w_r, bias, k, impl)
        gates = router_gates(values)  # fp32
    return expert_ffn(x_expert, idx, gates, w1, w2, impl, cfg=cfg, weights_cast=weights_cast, grad_acc=grad_acc)


def route_topk(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int, impl: str) -> tuple[jax.Array, jax.Array]:
    """The router of `impl` (contract: `mhl_jax.moe.router.route_topk_reference`): "reference" the pure-JAX one;
    "triton" the kernel binding (`mhl_jax.moe.gpu.router`), or for inputs wider than the kernels take
    (`plan.MAX_TRITON_ROUTER_WIDTH`) the split-W_r bf16 GEMMs of `mhl_jax.moe.wide_router` (bf16 x, fp32 W_r;
    else the reference)."""
    check_router_shapes(x, w_r, bias, k)
    if impl == "triton" and x.shape[2] > MAX_TRITON_ROUTER_WIDTH:
        if x.dtype == jnp.bfloat16 and w_r.dtype == jnp.float32:
            return route_topk_wide(x, w_r, bias, k)
        return route_topk_reference(x, w_r, bias, k)
    if impl == "reference":
        return route_topk_reference(x, w_r, bias, k)
    if impl != "triton":
        raise ValueError(f"route_topk: impl={impl!r}, expected 'reference' or 'triton'")
    from mhl_jax.moe.gpu.router import route_topk_triton

    return route_topk_triton(x, w_r, bias, k)


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


def moe_heads_triton(x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array, w1: jax.Array,
                     w2: jax.Array, k: int, cfg=None, backend: str | None = None,
                     weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array]:
    """`moe_heads` on the Triton router and experts with one packing: the router's forward also packs its indices the
    way the expert op wants them, and its backward takes the dW_r layout from that packing instead of sorting the
    slots again. Sub-tokens routed on themselves on the fused expert path run all of it under one custom_vjp whose
    dx comes out of one kernel (`plan.fused_core`, `mhl_jax.moe.gpu.fused`). backend "emulate": pure-JAX kernel
    stand-ins (CPU); None: the bindings' own default ("triton"; a test may swap the bindings). weights_cast: (w1, w2)
    already cast by the caller (`moe_heads`); then the router's kernel casts nothing (`plan.router_casts_weights`).
    grad_acc: `moe_heads`' (the fused core, or the grouped experts: `expert_ffn`)."""
    from mhl_jax.moe.gpu import fused as moe_triton
    from mhl_jax.moe.gpu import router as router_triton

    cast = weights_cast is None and router_casts_weights(x_route, x_expert, w1, w2)
    kw = {} if backend is None else {"backend": backend}
    if fused_core("triton", x_route, x_expert):
        return moe_triton.moe_heads_fused(x_expert, w_r, bias, w1, w2, k, cfg, cast=cast, weights_cast=weights_cast,
                                          grad_acc=grad_acc, **kw)
    spec = plan.packing_spec(x_expert.shape, k, w1.shape, cfg, backend or "triton")
    with jax.named_scope("router"):  # its kernel packs the slots too
        out = router_triton.route_topk_triton(x_route, w_r, bias, k, pack=spec, cast=(w1, w2) if cast else None,
                                              **kw)
        values, idx, packing = out[:3]
        gates = router_gates(values)  # fp32
    return expert_ffn(x_expert, idx, gates, w1, w2, "triton", cfg=cfg, packing=packing, backend=backend,
                      weights_cast=out[3] if cast else weights_cast, grad_acc=grad_acc)


def expert_ffn(x: jax.Array, idx: jax.Array, gates: jax.Array, w1: jax.Array, w2: jax.Array,
               impl: str = "reference", cfg=None, packing=None, backend: str | None = None, weights_cast=None,
               grad_acc=None) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) compute dtype; idx: (N, H, k) int32; gates: (N, H, k) fp32; w1: (H, Ne, dh, de) fp32; w2: (H,
    Ne, de, dh) fp32. impl "reference": `mhl_jax.moe.experts.expert_ffn_reference`; "triton": the plan's expert path
    (`plan.triton_expert_path`): the fused IO-aware kernels (`cfg`: a `kernels.tuning.ExpertsConfig`) or the
    grouped-GEMM kernels (`cfg`: a `kernels.tuning.GroupedConfig`); None picks the tuned defaults.

    `packing` (triton only): the packing of idx made by the router with `plan.packing_spec`; `backend` (triton
    only): "emulate" runs pure-JAX stand-ins of the kernels (CPU tests); None: the bindings' default ("triton").
    `weights_cast` (triton only): (w1, w2) already in x's dtype. `grad_acc` (the grouped triton path only): running
    gradient sums of w1 / w2, returned as their gradients plus dW (`moe_heads`).

    Returns y (N, H, dh) in x.dtype and the per-(head, expert) load counts (H, Ne) int32.
    """
    n, h, dh = x.shape
    hw, ne, dhw, de = w1.shape
    if (hw, dhw) != (h, dh) or w2.shape != (h, ne, de, dh) or idx.shape != gates.shape or idx.shape[:2] != (n, h):
        raise ValueError(f"expert_ffn: shapes disagree: x {x.shape}, idx {idx.shape}, gates {gates.shape}, "
                         f"w1 {w1.shape}, w2 {w2.shape}")
    if impl == "triton":
        from mhl_jax.moe.gpu import experts as experts_triton
        from mhl_jax.moe.gpu import grouped as experts_grouped

        kw = {} if backend is None else {"backend": backend}
        if grad_acc is not None and triton_expert_path(dh) != "grouped":
            raise ValueError(f"expert_ffn: grad_acc= belongs to the grouped Triton expert path (dh={dh} takes the "
                             "fused one)")
        with jax.named_scope("experts"):  # the fused path's packing and combine scope themselves inside
            if triton_expert_path(dh) == "grouped":
                return experts_grouped.expert_ffn_grouped(x, idx, gates, w1, w2, cfg=cfg, packing=packing,
                                                          weights_cast=weights_cast, grad_acc=grad_acc, **kw)
            return experts_triton.expert_ffn_triton(x, idx, gates, w1, w2, cfg=cfg, packing=packing,
                                                    weights_cast=weights_cast, **kw)
    if impl != "reference":
        raise ValueError(f"expert_ffn: impl={impl!r}, expected 'reference' or 'triton'")
    if packing is not None or backend is not None or weights_cast is not None or grad_acc is not None:
        raise ValueError("expert_ffn: packing=, backend=, weights_cast= and grad_acc= belong to impl='triton'; the "
                         f"reference packs with its own block {REFERENCE_BLOCK}")
    return expert_ffn_reference(x, idx, gates, w1, w2)


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
