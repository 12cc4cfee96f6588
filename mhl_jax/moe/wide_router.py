"""The router for inputs wider than the router kernels take (MoE and LatentMoE route on d = 1024): XLA's bf16 GEMMs on
a three-term split of the fp32 W_r, with a backward that only touches the k selected scores.

Same contract as `mhl_jax.moe.router.route_topk_reference` (selection = top-k of scores + bias, ties to the lower
index; values the raw scores; no gradient for the bias), for bf16 x. The reference multiplies in fp32 at HIGHEST
precision, which a GPU runs on its CUDA cores, several times slower than its tensor cores. Here:

    W_r = w1 + w2 + w3 exactly (each bf16: 3 x 8 mantissa bits cover fp32's 24)
    scores = [x x x] @ [w1; w2; w3]      one bf16 GEMM, K = 3 dh: every product exact, accumulated in fp32

so the scores are fp32 dot products of bf16 x and fp32 W_r, as the reference's, up to the order of the fp32 sum.
Backward, from the cotangent g (N, H, k) of the selected scores, dS (N, H, Ne) zero but at the selected experts:

    dW_r = x^T dS      dS = d1 + d2 + d3 split like W_r: exact products, fp32 sums (one GEMM, K = 3 N)
    dx   = dS W_r^T    the six products d_i w_j with i + j <= 4 (one GEMM, K = 6 Ne): ~22 significant bits,
                       then rounded to x's bf16

No atomics (dS is written by compares, not a scatter): repeatable to the bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mhl_jax.moe.router import check_router_shapes


def _top_bits(a: jax.Array) -> jax.Array:
    """fp32 a truncated to its sign, exponent and top 7 mantissa bits: a value bf16 holds exactly."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def split3(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """fp32 a -> (a1, a2, a3) bf16 with a1 + a2 + a3 == a exactly for finite |a| >= 2^-103 (each term holds the next 8
    of the 24 significant bits; below, a3 can be subnormal, which a device may flush to zero; inf gives NaN). By
    truncating bit masks, not by rounding casts: XLA may drop an fp32 -> bf16 -> fp32 round trip as excess precision
    (the GPU default), which would leave the remainders zero."""
    a1 = _top_bits(a)
    r = a - a1  # exact: the low 16 bits of a's significand
    a2 = _top_bits(r)
    return a1.astype(jnp.bfloat16), a2.astype(jnp.bfloat16), (r - a2).astype(jnp.bfloat16)  # all three exact


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum of bf16 a and b, products exact and summed in fp32. XLA's CPU runtime lacks a bf16 x bf16 -> fp32 dot
    for some layouts; there (tests) the same products are made from the operands widened to fp32, exactly."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), preferred_element_type=jnp.float32,
                          precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _scores(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (N, H, dh) bf16 @ w (H, dh, Ne) fp32 -> (N, H, Ne) fp32, as one bf16 GEMM over the split of w."""
    return _dot("nhd,hde->nhe", jnp.concatenate([x] * 3, axis=-1), jnp.concatenate(split3(w), axis=1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def route_topk_wide(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x (N, H, dh) bf16, w_r (H, dh, Ne) fp32, bias (H, Ne) fp32 -> values (N, H, k) fp32, indices (N, H, k) int32
    (module doc)."""
    return _route_fwd(x, w_r, bias, k)[0]


def _route_fwd(x, w_r, bias, k):
    check_router_shapes(x, w_r, bias, k)
    if x.dtype != jnp.bfloat16 or w_r.dtype != jnp.float32:
        raise ValueError(f"route_topk_wide: x {x.dtype}, w_r {w_r.dtype}; expected bfloat16 x and float32 w_r")
    scores = _scores(x, w_r)
    _, idx = jax.lax.top_k(scores + bias[None], k)
    vals = jnp.take_along_axis(scores, idx, axis=-1)
    idx = idx.astype(jnp.int32)
    return (vals, idx), (x, w_r, bias, idx)


def _route_bwd(k, res, cts):
    x, w_r, bias, idx = res
    g = cts[0]  # the indices' cotangent is float0
    experts = jnp.arange(w_r.shape[2], dtype=jnp.int32)
    ds = jnp.sum(jnp.where(idx[..., None] == experts, g[..., None], 0.0), axis=-2)  # (N, H, Ne), k nonzeros a row
    d1, d2, d3 = split3(ds)
    dw = _dot("nhd,nhe->hde", jnp.concatenate([x] * 3, axis=0), jnp.concatenate([d1, d2, d3], axis=0))
    w1, w2, w3 = split3(w_r)
    dx = _dot("nhe,hde->nhd", jnp.concatenate([d1, d1, d2, d1, d2, d3], axis=-1),
              jnp.concatenate([w1, w2, w1, w3, w2, w1], axis=-1))
    return dx.astype(x.dtype), dw, jnp.zeros_like(bias)


route_topk_wide.defvjp(_route_fwd, _route_bwd)
