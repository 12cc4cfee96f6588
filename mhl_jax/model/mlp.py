"""Dense gelu MLP: d -> hidden -> d."""

from __future__ import annotations

import jax
from flax import nnx

from mhl_jax.model.init import normal_param


def mlp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    """x: (..., d) compute dtype; w1: (d, h); w2: (h, d) -> (..., d) compute dtype."""
    dt = x.dtype
    return jax.nn.gelu(x @ w1.astype(dt)) @ w2.astype(dt)


class MLP(nnx.Module):
    def __init__(self, d: int, hidden: int, std: float, out_std: float, rngs: nnx.Rngs):
        self.w1 = normal_param(rngs, (d, hidden), std)
        self.w2 = normal_param(rngs, (hidden, d), out_std)

    def __call__(self, x: jax.Array, ctx=None) -> tuple[jax.Array, None]:
        """x: (..., d) compute dtype -> (..., d), no expert load. ctx: the step context, which concerns only expert
        layers (taken so that every FFN has one call)."""
        with jax.named_scope("mlp"):
            return mlp(x, self.w1[...], self.w2[...]), None
