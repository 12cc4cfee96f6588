"""The FFN variants built on the shared sparse core (`moe_core.py`): MoE, LatentMoE, MH-LatentMoE.

- MoE (Mixtral form, paper §2.2): route x (d) over Ne experts d -> de -> d.
- LatentMoE: route on x (d); down-project d -> l; experts l -> de -> l; up-project l -> d.
- Multi-Head LatentMoE (paper §3.1): W_in x (d -> Nh*dh) split into Nh sub-tokens; head i is an
  independent MoE (own router dh -> Ne, own Ne experts dh -> de -> dh); concat; W_out.
Residual-writing weights (MoE expert W2, LatentMoE up-projection, MH W_out) get the 1/sqrt(2L) init.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.init import normal_param
from mhl_jax.moe.core import LocalMoE, MoEExecutor


class ExpertBank(nnx.Module):
    """H independent MoEs: routers (H, dr, Ne), biases (H, Ne), experts (H, Ne, dh, de) and back."""

    def __init__(self, heads: int, d_route: int, d_expert: int, num_experts: int, hidden: int, k: int,
                 std: float, out_std: float, rngs: nnx.Rngs):
        self.w_router = normal_param(rngs, (heads, d_route, num_experts), std)
        self.bias = RouterBias(jnp.zeros((heads, num_experts), jnp.float32))
        self.w1 = normal_param(rngs, (heads, num_experts, d_expert, hidden), std)
        self.w2 = normal_param(rngs, (heads, num_experts, hidden, d_expert), out_std)
        self.k = k

    def __call__(self, executor: MoEExecutor, x_route: jax.Array, x_expert: jax.Array, weights_cast=None,
                 grad_acc=None):
        """weights_cast: (w1, w2) in x_expert's dtype from `weight_casts` (None: the executor casts them); grad_acc:
        (acc1, acc2) gradients of w1 / w2 summed so far, where `accumulates_in_place` (`moe_core.moe_heads`)."""
        args = (x_route, x_expert, self.w_router[...], self.bias[...], self.w1[...], self.w2[...], self.k)
        kw = {k: v for k, v in (("weights_cast", weights_cast), ("grad_acc", grad_acc)) if v is not None}
        return executor(*args, **kw)

    def accumulates_in_place(self, executor: MoEExecutor, dtype) -> bool:
        """Whether the executor's expert backward adds w1's / w2's gradients to the caller's accumulators in place at
        this compute dtype (`MoEExecutor`); the train step then hands them over instead of adding the gradients."""
        w1 = self.w1[...]
        fn = getattr(executor, "accumulates_in_place", None)
        return fn is not None and fn(dtype, w1.dtype, w1.shape[2])

    def weight_casts(self, executor: MoEExecutor, dtype) -> tuple[jax.Array, jax.Array] | None:
        """(w1, w2) cast to the compute dtype where the executor reads them cast (`MoEExecutor`), else None. The train
        step makes them once per step, outside its micro-batch loop, and hands them to every micro-batch's call."""
        w1, w2 = self.w1[...], self.w2[...]
        reads = getattr(executor, "reads_weights_cast", None)
        if reads is None or not reads(dtype, w1.dtype, w1.shape[2]):
            return None
        return w1.astype(dtype), w2.astype(dtype)


class MoE(nnx.Module):
    def __init__(self, d: int, num_experts: int, hidden: int, k: int, std: float, out_std: float,
                 rngs: nnx.Rngs, executor: MoEExecutor | None = None):
        self.experts = ExpertBank(1, d, d, num_experts, hidden, k, std, out_std, rngs)
        self.executor = executor or LocalMoE()

    def __call__(self, x: jax.Array, weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array]:
        """x: (B, T, d) compute dtype -> (B, T, d), load (1, Ne). weights_cast, grad_acc: `ExpertBank`'s."""
        b, t, d = x.shape
        xs = x.reshape(b * t, 1, d)
        y, load = self.experts(self.executor, xs, xs, weights_cast, grad_acc)
        return y.reshape(b, t, d), load


class LatentMoE(nnx.Module):
    def __init__(self, d: int, latent: int, num_experts: int, hidden: int, k: int, std: float,
                 out_std: float, rngs: nnx.Rngs, executor: MoEExecutor | None = None):
        self.w_down = normal_param(rngs, (d, latent), std)
        self.w_up = normal_param(rngs, (latent, d), out_std)
        self.experts = ExpertBank(1, d, latent, num_experts, hidden, k, std, std, rngs)
        self.executor = executor or LocalMoE()

    def __call__(self, x: jax.Array, weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array]:
        b, t, d = x.shape
        xs = x.reshape(b * t, 1, d)
        latent = xs @ self.w_down[...].astype(x.dtype)
        y, load = self.experts(self.executor, xs, latent, weights_cast, grad_acc)
        return (y @ self.w_up[...].astype(x.dtype)).reshape(b, t, d), load


class MHLatentMoE(nnx.Module):
    def __init__(self, d: int, heads: int, head_dim: int, num_experts: int, hidden: int, k: int,
                 std: float, out_std: float, rngs: nnx.Rngs, executor: MoEExecutor | None = None):
        self.w_in = normal_param(rngs, (d, heads, head_dim), std)
        self.w_out = normal_param(rngs, (heads, head_dim, d), out_std)
        self.experts = ExpertBank(heads, head_dim, head_dim, num_experts, hidden, k, std, std, rngs)
        self.executor = executor or LocalMoE()

    def __call__(self, x: jax.Array, weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array]:
        """x: (B, T, d) -> (B, T, d), load (Nh, Ne). weights_cast, grad_acc: `ExpertBank`'s."""
        b, t, d = x.shape
        w_in, w_out = self.w_in[...].astype(x.dtype), self.w_out[...].astype(x.dtype)
        groups = getattr(self.executor, "head_groups", 1)
        if groups == 1:
            sub = jnp.einsum("nd,dhc->nhc", x.reshape(b * t, d), w_in)
            y, load = self.experts(self.executor, sub, sub, weights_cast, grad_acc)
            out = jnp.einsum("nhc,hcd->nd", y, w_out)
        else:
            sub = grouped_project_in(x.reshape(b * t, d), w_in, groups)
            y, load = self.experts(self.executor, sub, sub, weights_cast, grad_acc)
            out = grouped_project_out(y, w_out)
        return out.reshape(b, t, d), load


def grouped_project_in(x: jax.Array, w_in: jax.Array, groups: int) -> jax.Array:
    """x (N, d) @ W_in (d, Nh, dh) emitted head-group-major: (groups, N, Nh / groups, dh).

    Head Parallel sends head group p to device p: in this layout each destination's block is
    contiguous, so the all_to_all needs no transpose of the (N, Nh, dh) sub-tokens first."""
    d, heads, dh = w_in.shape
    return jnp.einsum("nd,dghc->gnhc", x, w_in.reshape(d, groups, heads // groups, dh))


def grouped_project_out(y: jax.Array, w_out: jax.Array) -> jax.Array:
    """y (groups, N, Nh / groups, dh) @ W_out (Nh, dh, d) -> (N, d): one contraction over (group, head, dh).

    Measured on an H100 at 81920 tokens (bench/hp_proj.py): as fast as the token-major projection for
    fwd+bwd; a sum of one matmul per group was 0.3-0.5 ms slower."""
    groups, _, hl, dh = y.shape
    return jnp.einsum("gnhc,ghcd->nd", y, w_out.reshape(groups, hl, dh, -1))
