"""Parameter initialisation (paper appendix A): N(0, 0.02); residual-writing weights / sqrt(2L)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    """An fp32 master weight drawn from N(0, std^2). The barrier keeps the draw and the scaling apart under jit (the
    train state is created under jit, mhl_jax.train.state): without it XLA folds std into the sampler's own
    constants, and the jitted weights differ by an ulp from these eager ones (measured on the CPU)."""
    return nnx.Param(std * jax.lax.optimization_barrier(jax.random.normal(rngs.params(), shape, jnp.float32)))


def residual_std(std: float, n_layers: int) -> float:
    """Std of projections that write into the residual stream (GPT-2: scaled by 1/sqrt(2L))."""
    return std / math.sqrt(2 * n_layers)
