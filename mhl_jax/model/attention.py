"""Causal multi-head self-attention with rotary position embeddings (RoPE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mhl_jax.config import ConfigError
from mhl_jax.model.batch_split import batch_sharded
from mhl_jax.model.init import normal_param
from mhl_jax.moe.plan import triton_available


def rope_tables(seq_len: int | jax.Array, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin: (T, head_dim // 2) fp32 for positions 0..T-1 (seq_len an int), or (..., head_dim // 2) for the
    positions in an int array (the same values as the table's rows at them)."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos = jnp.arange(seq_len) if jnp.ndim(seq_len) == 0 else jnp.asarray(seq_len)
    ang = pos.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: (B, T, nh, hd); cos, sin: (T, hd // 2), or (B, T, hd // 2) for positions of each row; rotate the two halves
    of each head (GPT-NeoX layout), in fp32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


def attention_impl(choice: str, compute_dtype: str = "bfloat16") -> str:
    """'auto' -> triton on a GPU in bf16 with jax-triton installed (our flash attention, bitwise repeatable; cudnn's
    backward is not), xla elsewhere (the CPU, float32 models, whose attention the bf16 kernels would round, and
    installs without the `kernels` extra). 'triton' needs all three, 'cudnn' a GPU."""
    if choice == "auto":
        return "triton" if compute_dtype == "bfloat16" and triton_available() else "xla"
    if choice == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.attention_impl='cudnn' needs a GPU JAX backend; backend is "
                          f"{jax.default_backend()!r}. Use model.attention_impl=auto or xla.")
    if choice == "triton" and not triton_available():
        raise ConfigError(f"model.attention_impl='triton' needs a GPU JAX backend and jax-triton (the `kernels` "
                          f"extra); backend is {jax.default_backend()!r}. Use model.attention_impl=auto or xla.")
    if choice == "triton" and compute_dtype != "bfloat16":
        raise ConfigError(f"model.attention_impl='triton' runs bf16 kernels; model.compute_dtype is {compute_dtype!r}. "
                          "Use model.attention_impl=auto or xla, or model.compute_dtype=bfloat16.")
    return choice


def _qkv(x: jax.Array, w_qkv: jax.Array, head_dim: int, rope_base: float, positions: jax.Array | None = None):
    """x: (B, T, d) -> q, k, v (B, T, nh, hd) in x's dtype, q and k rotated for positions 0..T-1 (None) or for
    `positions` (B, T)."""
    qkv = jnp.einsum("btd,dsnh->btsnh", x, w_qkv.astype(x.dtype))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    cos, sin = rope_tables(x.shape[1] if positions is None else positions, head_dim, rope_base)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def causal_attention(x: jax.Array, w_qkv: jax.Array, w_o: jax.Array, n_heads: int, head_dim: int,
                     rope_base: float, impl: str, mesh: Mesh | None = None,
                     keep_kv: bool = False) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """x: (B, T, d) compute dtype; w_qkv: (d, 3, nh, hd); w_o: (nh, hd, d) -> (B, T, d) compute dtype. mesh: the
    device mesh the batch is split over (triton only). keep_kv: also return the rotated keys and the values (B, T, nh,
    hd), a KV cache of the T positions (`decode_attention`)."""
    q, k, v = _qkv(x, w_qkv, head_dim, rope_base)
    if impl == "triton":
        from mhl_jax.model.flash_attention import flash_attention  # needs triton (the `kernels` extra)

        o = batch_sharded(flash_attention, mesh, q, k, v, what="attention")
    else:
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    o = jnp.einsum("btnh,nhd->btd", o, w_o.astype(x.dtype))
    return (o, (k, v)) if keep_kv else o


def decode_attention(x: jax.Array, w_qkv: jax.Array, w_o: jax.Array, head_dim: int, rope_base: float,
                     cache: tuple[jax.Array, jax.Array], pos: jax.Array):
    """One new token per row against a KV cache: x (B, 1, d) compute dtype at positions pos (B,) int32; cache: keys
    and values (B, Tc, nh, hd) of the positions before (entries at pos and after are ignored) -> (output (B, 1, d),
    the cache with this token's key and value written at pos). The token attends to positions 0..pos (XLA's attention
    with that mask: one query per row, nothing for a flash kernel to tile). Each pos must be in [0, Tc): nothing
    checks it here (out of range, the write is dropped and the mask lets the token see the whole cache)."""
    q, k, v = _qkv(x, w_qkv, head_dim, rope_base, pos[:, None])
    rows = jnp.arange(x.shape[0])
    kc, vc = cache[0].at[rows, pos].set(k[:, 0]), cache[1].at[rows, pos].set(v[:, 0])
    mask = (jnp.arange(kc.shape[1])[None, :] <= pos[:, None])[:, None, None, :]  # (B, 1 head, 1 query, Tc)
    o = jax.nn.dot_product_attention(q, kc, vc, mask=mask, implementation="xla")
    return jnp.einsum("btnh,nhd->btd", o, w_o.astype(x.dtype)), (kc, vc)


class Attention(nnx.Module):
    def __init__(self, d: int, n_heads: int, head_dim: int, rope_base: float, impl: str,
                 std: float, out_std: float, rngs: nnx.Rngs, mesh: Mesh | None = None):
        """mesh: the devices the batch is split over (`batch_sharded`; None: one device)."""
        self.w_qkv = normal_param(rngs, (d, 3, n_heads, head_dim), std)
        self.w_o = normal_param(rngs, (n_heads, head_dim, d), out_std)
        self.n_heads, self.head_dim, self.rope_base, self.impl = n_heads, head_dim, rope_base, impl
        self.mesh = mesh

    def __call__(self, x: jax.Array, keep_kv: bool = False):
        """x (B, T, d) -> (B, T, d); keep_kv: and the KV cache of the T positions (`causal_attention`)."""
        with jax.named_scope("attention"):
            return causal_attention(x, self.w_qkv[...], self.w_o[...], self.n_heads, self.head_dim,
                                    self.rope_base, attention_impl(self.impl, jnp.dtype(x.dtype).name), self.mesh,
                                    keep_kv)

    def decode(self, x: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array):
        """One token per row at pos against the cache (`decode_attention`)."""
        return decode_attention(x, self.w_qkv[...], self.w_o[...], self.head_dim, self.rope_base, cache, pos)
