"""Expert FFN over routed sub-tokens: y[n, h] = sum_j gate[n,h,j] * E_{h, idx[n,h,j]}(x[n, h]).

E_{h,e}(x) = gelu(x W1[h, e]) W2[h, e]  (tanh-approx gelu, as jax.nn.gelu's default).

`reference`: pure JAX over the packed layout of `packing.py` (each R-row block multiplies the
weights of its own (head, expert): a block-diagonal batched matmul; exact and dropless).
`triton`: the IO-aware kernel (`mhl_jax/moe/gpu/experts.py`), same packing, same function; for
inputs wider than its tiles fit, the grouped-GEMM kernels (`mhl_jax/moe/gpu/grouped.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mhl_jax.gather import take_rows
from mhl_jax.moe import packing as pk
from mhl_jax.moe.plan import triton_expert_path

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


def triton_packing_spec(x_shape: tuple[int, ...], k: int, w1_shape: tuple[int, ...], cfg=None,
                        backend: str = "triton") -> tuple[int, str]:
    """(row block, packing method) that `expert_ffn(..., impl="triton", cfg=cfg)` packs with, for x of
    shape (N, H, dh) and w1 (H, Ne, dh, de): the router can then make that packing once for both
    (`route_topk_triton(..., pack=)`, handed back through `expert_ffn(..., packing=)`)."""
    from mhl_jax.moe.gpu.experts import pack_method

    n, h, dh = x_shape
    _, ne, _, de = w1_shape
    if triton_expert_path(dh) == "grouped":
        from mhl_jax.moe.gpu.grouped import resolve_grouped_config

        c = resolve_grouped_config(n * h * k, h * ne, dh, de, cfg)
    else:
        from mhl_jax.moe.gpu.experts import resolve_config

        c = resolve_config(n * h * k, h * ne, dh, de, cfg)
    return c.pack_block, pack_method(c.pack_impl, backend)


def expert_ffn(x: jax.Array, idx: jax.Array, gates: jax.Array, w1: jax.Array, w2: jax.Array,
               impl: str = "reference", cfg=None, packing: pk.Packing | None = None,
               backend: str | None = None, weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) compute dtype; idx: (N, H, k) int32; gates: (N, H, k) fp32;
    w1: (H, Ne, dh, de) fp32; w2: (H, Ne, de, dh) fp32. impl "triton": the fused IO-aware kernels for
    dh <= MAX_TRITON_EXPERT_WIDTH (`cfg`: a `kernels.triton.experts.ExpertsConfig`), the grouped-GEMM kernels
    above (`cfg`: a `kernels.triton.grouped.GroupedConfig`); None picks the measured defaults.

    `packing` (triton only): the packing of idx made by the router with `triton_packing_spec`;
    `backend` (triton only): "emulate" runs pure-JAX stand-ins of the kernels (CPU tests); None: the
    bindings' default ("triton"). `weights_cast` (triton only): (w1, w2) already in x's dtype. `grad_acc` (the grouped
    triton path only): running gradient sums of w1 / w2, returned as their gradients plus dW (`moe_core.moe_heads`).

    Returns y (N, H, dh) in x.dtype and the per-(head, expert) load counts (H, Ne) int32.
    """
    n, h, dh = x.shape
    hw, ne, dhw, de = w1.shape
    if (hw, dhw) != (h, dh) or w2.shape != (h, ne, de, dh) or idx.shape != gates.shape or idx.shape[:2] != (n, h):
        raise ValueError(f"expert_ffn: shapes disagree: x {x.shape}, idx {idx.shape}, gates {gates.shape}, "
                         f"w1 {w1.shape}, w2 {w2.shape}")
    k = idx.shape[2]
    if impl == "triton":
        kw = {} if backend is None else {"backend": backend}
        if triton_expert_path(dh) == "grouped":
            from mhl_jax.moe.gpu import grouped as experts_grouped

            return experts_grouped.expert_ffn_grouped(x, idx, gates, w1, w2, cfg=cfg, packing=packing,
                                                      weights_cast=weights_cast, grad_acc=grad_acc, **kw)
        if grad_acc is not None:
            raise ValueError(f"expert_ffn: grad_acc= belongs to the grouped Triton expert path (dh={dh} takes the "
                             "fused one)")
        from mhl_jax.moe.gpu import experts as experts_triton

        return experts_triton.expert_ffn_triton(x, idx, gates, w1, w2, cfg=cfg, packing=packing,
                                                weights_cast=weights_cast, **kw)
    if impl != "reference":
        raise ValueError(f"expert_ffn: impl={impl!r}, expected 'reference' or 'triton'")
    if packing is not None or backend is not None or weights_cast is not None or grad_acc is not None:
        raise ValueError("expert_ffn: packing=, backend=, weights_cast= and grad_acc= belong to impl='triton'; the "
                         "reference "
                         f"packs with its own block {REFERENCE_BLOCK}")
    packing = pk.pack(idx, ne, REFERENCE_BLOCK)
    rows = pk.gather_rows(x, packing, k)
    out = expert_rows_reference(rows, packing.block_group, w1.reshape(h * ne, dh, de),
                                w2.reshape(h * ne, de, dh), REFERENCE_BLOCK)
    y = pk.combine_rows(out, packing, gates)
    return y, packing.group_sizes.reshape(h, ne)
