"""The reference expert FFN over routed sub-tokens, in pure JAX:

    y[n, h] = sum_j gate[n,h,j] * E_{h, idx[n,h,j]}(x[n, h])

E_{h,e}(x) = gelu(x W1[h, e]) W2[h, e]  (tanh-approx gelu, as jax.nn.gelu's default).

Over the packed layout of `packing.py`: each R-row block multiplies the weights of its own (head, expert), a
block-diagonal batched matmul; exact and dropless. The Triton kernels (`mhl_jax/moe/gpu/`) compute the same
function; `expert_rows_reference` is also their CPU stand-in. `mhl_jax.moe.core.expert_ffn` picks between them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mhl_jax.gather import take_rows
from mhl_jax.moe import packing as pk

REFERENCE_BLOCK = 16  # row block of the pure-JAX path (small: padding waste is computed there)


def expert_rows_reference(rows: jax.Array, block_group: jax.Array, w1: jax.Array, w2: jax.Array,
                          block: int) -> jax.Array:
    """rows: (P, dh); block_group: (P // R,) in [-1, G); w1: (G, dh, de); w2: (G, de, dh) -> (P, dh).

    Matmuls in rows.dtype with fp32 accumulation; all-padding blocks produce zeros.
    """
    p, dh = rows.shape
    nb = p // block
    g = jnp.maximum(block_group, 0)
    xb = rows.reshape(nb, block, dh)
    # one weight copy per block (blocks of a group are consecutive); the gradient sums a group's blocks
    # without atomics (take_rows), so the reference path is deterministic on GPU too
    w1b = take_rows(w1, g).astype(rows.dtype)
    w2b = take_rows(w2, g).astype(rows.dtype)
    hid = jnp.einsum("brd,bde->bre", xb, w1b, preferred_element_type=jnp.float32)
    act = jax.nn.gelu(hid).astype(rows.dtype)
    out = jnp.einsum("bre,bed->brd", act, w2b, preferred_element_type=jnp.float32)
    out = jnp.where((block_group >= 0)[:, None, None], out, 0.0)
    return out.reshape(p, dh).astype(rows.dtype)


def expert_ffn_reference(x: jax.Array, idx: jax.Array, gates: jax.Array, w1: jax.Array,
                         w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) compute dtype; idx: (N, H, k) int32; gates: (N, H, k) fp32; w1: (H, Ne, dh, de) fp32; w2: (H,
    Ne, de, dh) fp32 (shapes checked by the caller, `mhl_jax.moe.core.expert_ffn`). Packs with row block
    REFERENCE_BLOCK. Returns y (N, H, dh) in x.dtype and the per-(head, expert) load counts (H, Ne) int32."""
    _, h, dh = x.shape
    _, ne, _, de = w1.shape
    with jax.named_scope("packing"):
        packing = pk.pack(idx, ne, REFERENCE_BLOCK)
        rows = pk.gather_rows(x, packing, idx.shape[2])
    with jax.named_scope("experts"):
        out = expert_rows_reference(rows, packing.block_group, w1.reshape(h * ne, dh, de),
                                    w2.reshape(h * ne, de, dh), REFERENCE_BLOCK)
    with jax.named_scope("combine"):
        y = pk.combine_rows(out, packing, gates)
    return y, packing.group_sizes.reshape(h, ne)
