"""RMSNorm without bias, computed in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x: (..., d) any dtype; scale: (d,) fp32 -> (..., d) fp32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("norm"):
            return rms_norm(x, self.scale[...], self.eps)
