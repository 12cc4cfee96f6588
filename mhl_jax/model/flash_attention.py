"""Causal flash attention by the Triton kernels of kernels/triton/attention.py, bound through jax-triton under a
custom_vjp (GPU only; the CPU tests run the same kernels under the Triton interpreter through the torch launcher,
kernels/torch/attention.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.triton import attention as ka
from kernels.tuning import ATTENTION_TILES, AttentionTiles
from mhl_jax.moe.plan import import_jax_triton


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, tiles: AttentionTiles = ATTENTION_TILES) -> jax.Array:
    """Causal attention of (B, T, nh, hd) bf16 q, k, v at scale hd^-0.5 -> (B, T, nh, hd). A T that is not a multiple
    of the tiles is zero-padded at the end and the output cut back: under the causal mask no real query sees a padded
    key, and the cut queries pass no gradient back."""
    t = q.shape[1]
    pad = -t % tiles.tile()
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    o = _attention(q, k, v, tiles)
    return o[:, :t] if pad else o


def _forward(q, k, v, tiles: AttentionTiles):
    b, t, nh, _ = q.shape
    grid, kw = ka.fwd_launch(q.shape, tiles)
    o, lse = import_jax_triton().triton_call(
        q, k, v, kernel=ka.attn_fwd_kernel, grid=grid,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, nh, t), jnp.float32)], **kw)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, tiles: AttentionTiles):
    return _forward(q, k, v, tiles)[0]


def _attention_fwd(q, k, v, tiles):
    o, lse = _forward(q, k, v, tiles)
    return o, (q, k, v, o, lse)


def _attention_bwd(tiles, res, do):
    q, k, v, o, lse = res
    grid, kw = ka.bwd_launch(q.shape, tiles)
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    dq, dk, dv = import_jax_triton().triton_call(
        q, k, v, do.astype(q.dtype), lse, delta, kernel=ka.attn_bwd_kernel, grid=grid,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3, **kw)
    return dq, dk, dv


_attention.defvjp(_attention_fwd, _attention_bwd)
