"""Top-k routing with an aux-loss-free balancing bias: the reference implementation and the gates.

`route_topk_reference(x, w_r, bias, k)` returns the k selected *raw* scores and their expert indices per
(token, head). The bias only takes part in the selection: top-k of (s + b), values s. Gates are
`router_gates(values)`: the softmax over the k selected scores (fp32).

This is the pure-JAX router (it materialises the (N, H, Ne) scores): the CPU path, the path for inputs wider than
the kernels take, and the independent reference of the IO-aware Triton router (`mhl_jax.moe.gpu.router`, the same
contract). Which one runs is the MoE core's choice (`mhl_jax.moe.core`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def router_gates(values: jax.Array) -> jax.Array:
    """The gates: softmax over the k selected scores (fp32), compiled apart from what surrounds it. XLA fuses a bare
    softmax with its neighbours, and the fusion it picks (and so the last bit of a gate) depends on the rest of the
    program: the fused MoE core and the ops apart gave gates one fp32 ulp apart, so two forwards of the same function
    were not bitwise equal. Optimisation barriers on both sides keep the softmax one computation whatever surrounds
    it."""
    return jax.lax.optimization_barrier(jax.nn.softmax(jax.lax.optimization_barrier(values), axis=-1))


def route_topk_reference(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) any float dtype; w_r: (H, dh, Ne) fp32; bias: (H, Ne) fp32 (no gradient).

    Returns values (N, H, k) fp32 = selected raw scores, indices (N, H, k) int32, ordered by
    decreasing biased score; ties go to the lower expert index (lax.top_k's order).
    """
    check_router_shapes(x, w_r, bias, k)
    scores = jnp.einsum("nhd,hde->nhe", x.astype(jnp.float32), w_r.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    _, idx = jax.lax.top_k(scores + jax.lax.stop_gradient(bias)[None], k)
    vals = jnp.take_along_axis(scores, idx, axis=-1)
    return vals, idx.astype(jnp.int32)


def check_router_shapes(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int) -> None:
    if x.ndim != 3 or w_r.ndim != 3 or bias.ndim != 2:
        raise ValueError(f"route_topk: expected x (N, H, dh), w_r (H, dh, Ne), bias (H, Ne); "
                         f"got {x.shape}, {w_r.shape}, {bias.shape}")
    n, h, dh = x.shape
    if w_r.shape[:2] != (h, dh) or bias.shape != (h, w_r.shape[2]):
        raise ValueError(f"route_topk: shapes disagree: x {x.shape}, w_r {w_r.shape}, bias {bias.shape}")
    if not 1 <= k <= w_r.shape[2]:
        raise ValueError(f"route_topk: k={k} must be in [1, Ne={w_r.shape[2]}]")
