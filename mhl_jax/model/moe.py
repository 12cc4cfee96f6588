"""The FFN variants built on the shared sparse core (`mhl_jax.moe.core`): MoE, LatentMoE, MH-LatentMoE.

- MoE (Mixtral form, paper §2.2): route x (d) over Ne experts d -> de -> d.
- LatentMoE: route on x (d); down-project d -> l; experts l -> de -> l; up-project l -> d.
- Multi-Head LatentMoE (paper §3.1): W_in x (d -> Nh*dh) split into Nh sub-tokens; head i is an
  independent MoE (own router dh -> Ne, own Ne experts dh -> de -> dh); concat; W_out.
Residual-writing weights (MoE expert W2, LatentMoE up-projection, MH W_out) get the 1/sqrt(2L) init.
Each variant takes the step context (`mhl_jax.moe.context`) and hands it, untouched, to its `ExpertBank`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.init import normal_param
from mhl_jax.moe.context import StepContext
from mhl_jax.moe.core import LocalMoE, MoEExecutor


class ExpertBank(nnx.Module):
    """H independent MoEs: routers (H, dr, Ne), biases (H, Ne), experts (H, Ne, dh, de) and back. layer: the model
    layer it sits in, its key in the step context."""

    def __init__(self, heads: int, d_route: int, d_expert: int, num_experts: int, hidden: int, k: int,
                 std: float, out_std: float, rngs: nnx.Rngs, layer: int = 0):
        self.w_router = normal_param(rngs, (heads, d_route, num_experts), std)
        self.bias = RouterBias(jnp.zeros((heads, num_experts), jnp.float32))
        self.w1 = normal_param(rngs, (heads, num_experts, d_expert, hidden), std)
        self.w2 = normal_param(rngs, (heads, num_experts, hidden, d_expert), out_std)
        self.k = k
        self.layer = layer

    def __call__(self, executor: MoEExecutor, x_route: jax.Array, x_expert: jax.Array,
                 ctx: StepContext | None = None) -> tuple[jax.Array, jax.Array]:
        """`MoEExecutor`'s call on this bank's weights, with this layer's part of the step context, if any."""
        args = (x_route, x_expert, self.w_router[...], self.bias[...], self.w1[...], self.w2[...], self.k)
        mine = None if ctx is None else ctx.expert(self.layer)
        with jax.named_scope("moe"):  # the executor's own work: layouts, exchanges; its parts scope themselves
            return executor(*args) if mine is None else executor(*args, ctx=mine)


class MoE(nnx.Module):
    def __init__(self, d: int, num_experts: int, hidden: int, k: int, std: float, out_std: float,
                 rngs: nnx.Rngs, executor: MoEExecutor | None = None, layer: int = 0):
        self.experts = ExpertBank(1, d, d, num_experts, hidden, k, std, out_std, rngs, layer)
        self.executor = executor or LocalMoE()

    def __call__(self, x: jax.Array, ctx: StepContext | None = None) -> tuple[jax.Array, jax.Array]:
        """x: (B, T, d) compute dtype -> (B, T, d), load (1, Ne) int32."""
        b, t, d = x.shape
        xs = x.reshape(b * t, 1, d)
        y, load = self.experts(self.executor, xs, xs, ctx)
        return y.reshape(b, t, d), load


class LatentMoE(nnx.Module):
    def __init__(self, d: int, latent: int, num_experts: int, hidden: int, k: int, std: float,
                 out_std: float, rngs: nnx.Rngs, executor: MoEExecutor | None = None, layer: int = 0):
        self.w_down = normal_param(rngs, (d, latent), std)
        self.w_up = normal_param(rngs, (latent, d), out_std)
        self.experts = ExpertBank(1, d, latent, num_experts, hidden, k, std, std, rngs, layer)
        self.executor = executor or LocalMoE()

    def __call__(self, x: jax.Array, ctx: StepContext | None = None) -> tuple[jax.Array, jax.Array]:
        """x: (B, T, d) compute dtype -> (B, T, d), load (1, Ne) int32: routed on x, the experts on its projection."""
        b, t, d = x.shape
        xs = x.reshape(b * t, 1, d)
        with jax.named_scope("moe_proj"):
            latent = xs @ self.w_down[...].astype(x.dtype)
        y, load = self.experts(self.executor, xs, latent, ctx)
        with jax.named_scope("moe_proj"):
            return (y @ self.w_up[...].astype(x.dtype)).reshape(b, t, d), load


class MHLatentMoE(nnx.Module):
    def __init__(self, d: int, heads: int, head_dim: int, num_experts: int, hidden: int, k: int,
                 std: float, out_std: float, rngs: nnx.Rngs, executor: MoEExecutor | None = None, layer: int = 0,
                 routing_tokens: str = "shared"):
        """routing_tokens "separate": a second projection W_route (d -> Nh*dh) gives each head a sub-token to route
        on, apart from the one its experts compute on (the paper's ablation; together W_in and W_route are its
        2d x d W_in, split)."""
        self.w_in = normal_param(rngs, (d, heads, head_dim), std)
        self.w_out = normal_param(rngs, (heads, head_dim, d), out_std)
        self.experts = ExpertBank(heads, head_dim, head_dim, num_experts, hidden, k, std, std, rngs, layer)
        self.w_route = normal_param(rngs, (d, heads, head_dim), std) if routing_tokens == "separate" else None
        self.executor = executor or LocalMoE()

    def __call__(self, x: jax.Array, ctx: StepContext | None = None) -> tuple[jax.Array, jax.Array]:
        """x: (B, T, d) compute dtype -> (B, T, d), load (Nh, Ne) int32."""
        b, t, d = x.shape
        x = x.reshape(b * t, d)
        groups = getattr(self.executor, "head_groups", 1)
        project = (lambda w: jnp.einsum("nd,dhc->nhc", x, w)) if groups == 1 else \
            (lambda w: grouped_project_in(x, w, groups))
        with jax.named_scope("moe_proj"):
            sub = project(self.w_in[...].astype(x.dtype))
            # shared: the same array routes and computes (the fused core takes it once; Head Parallel sends it once)
            route = sub if self.w_route is None else project(self.w_route[...].astype(x.dtype))
        y, load = self.experts(self.executor, route, sub, ctx)
        with jax.named_scope("moe_proj"):
            w_out = self.w_out[...].astype(x.dtype)
            out = jnp.einsum("nhc,hcd->nd", y, w_out) if groups == 1 else grouped_project_out(y, w_out)
            return out.reshape(b, t, d), load


def grouped_project_in(x: jax.Array, w_in: jax.Array, groups: int) -> jax.Array:
    """x (N, d) @ W_in (d, Nh, dh) emitted head-group-major: (groups, N, Nh / groups, dh).

    Head Parallel sends head group p to device p: in this layout each destination's block is
    contiguous, so the all_to_all needs no transpose of the (N, Nh, dh) sub-tokens first."""
    d, heads, dh = w_in.shape
    return jnp.einsum("nd,dghc->gnhc", x, w_in.reshape(d, groups, heads // groups, dh))


def grouped_project_out(y: jax.Array, w_out: jax.Array) -> jax.Array:
    """y (groups, N, Nh / groups, dh) @ W_out (Nh, dh, d) -> (N, d): one contraction over (group, head, dh).

    As fast as the token-major projection for fwd+bwd on an H100 at 81920 tokens; a sum of one matmul per group was
    0.3-0.5 ms slower."""
    groups, _, hl, dh = y.shape
    return jnp.einsum("gnhc,ghcd->nd", y, w_out.reshape(groups, hl, dh, -1))
