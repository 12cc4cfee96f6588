"""Aux-loss-free global load balancing (DeepSeek-V3 style; paper §2.2).

After each optimizer step, with load[e] the fraction of all routed slots of the global batch
(all data-parallel ranks, all micro-batches) that chose expert e, per layer and per head:

    u = sign(mean_e(load) - load);   b += gamma * (u - mean_e(u))

Overloaded experts get a lower bias (picked less), underloaded ones a higher bias. The bias takes
part only in the top-k selection, never in the gate values, and receives no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """Balancing bias (H, Ne) fp32: updated by `update_bias`, not by the optimizer."""


def load_fractions(counts: jax.Array) -> jax.Array:
    """counts (..., Ne) -> fraction of the routed slots per expert (sums to 1 over the last axis)."""
    counts = counts.astype(jnp.float32)
    return counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)


def update_bias(bias: jax.Array, counts: jax.Array, gamma: float) -> jax.Array:
    """bias: (..., Ne) fp32; counts: (..., Ne) global routed-slot counts -> the updated bias."""
    load = load_fractions(counts)
    u = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return bias + gamma * (u - jnp.mean(u, axis=-1, keepdims=True))


def load_stats(counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Max and min expert load relative to uniform (1.0 = perfectly balanced), over all heads."""
    load = load_fractions(counts) * counts.shape[-1]
    return jnp.max(load), jnp.min(load)
