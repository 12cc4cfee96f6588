"""Parameter initialisation (paper appendix A): N(0, 0.02); residual-writing weights / sqrt(2L)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> nnx.Param:
    """An fp32 master weight drawn from N(0, std^2)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


def residual_std(std: float, n_layers: int) -> float:
    """Std of projections that write into the residual stream (GPT-2: scaled by 1/sqrt(2L))."""
    return std / math.sqrt(2 * n_layers)
