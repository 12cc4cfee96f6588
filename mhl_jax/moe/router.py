"""Top-k routing with an aux-loss-free balancing bias.

`route_topk(x, w_r, bias, k)` returns the k selected *raw* scores and their expert indices per
(token, head). The bias only takes part in the selection: top-k of (s + b), values s. Gates are
`router_gates(values)`: the softmax over the k selected scores (done by the caller, in fp32).

Implementations: `reference` (pure JAX: materialises (N, H, Ne) scores) and `triton` (the IO-aware
kernel of paper Alg. 1/2, in `mhl_jax/moe/gpu/router.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mhl_jax.moe.plan import MAX_TRITON_ROUTER_WIDTH


def router_gates(values: jax.Array) -> jax.Array:
    """The gates: softmax over the k selected scores (fp32), compiled apart from what surrounds it. XLA fuses a bare
    softmax with its neighbours, and the fusion it picks (and so the last bit of a gate) depended on the rest of the
    program: the fused MoE core and the ops apart gave gates one fp32 ulp apart on an H100 (2026-11-26), so the two
    forwards, the same function, were not bitwise equal. Optimisation barriers on both sides keep the softmax one
    computation whatever surrounds it."""
    if not GATES_BARRIER:
        return jax.nn.softmax(values, axis=-1)
    return jax.lax.optimization_barrier(jax.nn.softmax(jax.lax.optimization_barrier(values), axis=-1))


# False: the bare softmax (as until the 2026-11-26 session 27; bench/layer.py variant "bare_gates")
GATES_BARRIER = True


def route_topk_reference(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) any float dtype; w_r: (H, dh, Ne) fp32; bias: (H, Ne) fp32 (no gradient).

    Returns values (N, H, k) fp32 = selected raw scores, indices (N, H, k) int32, ordered by
    decreasing biased score; ties go to the lower expert index (lax.top_k's order).
    """
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




def route_topk(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int,
               impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    """Dispatch to an implementation; see `route_topk_reference` for the contract. impl "triton" with
    inputs wider than MAX_TRITON_ROUTER_WIDTH runs the reference (same contract, exact fp32 scores)."""
    check_router_shapes(x, w_r, bias, k)
    if impl == "reference" or (impl == "triton" and x.shape[2] > MAX_TRITON_ROUTER_WIDTH):
        return route_topk_reference(x, w_r, bias, k)
    if impl == "triton":
        from mhl_jax.moe.gpu.router import route_topk_triton

        return route_topk_triton(x, w_r, bias, k)
    raise ValueError(f"route_topk: impl={impl!r}, expected 'reference' or 'triton'")
