"""The causal flash attention kernels (`kernels/triton/attention.py`) launched on torch tensors: GPU, or CPU under
TRITON_INTERPRET=1 in the tests (the JAX binding, `mhl_jax/model/flash_attention.py`, runs only on a GPU). Same grids
and arguments as the binding."""

from __future__ import annotations

import torch

from kernels.torch.interpreter_patch import fix_interpreter_scalar_index
from kernels.triton import attention as ka
from kernels.tuning import ATTENTION_TILES, AttentionTiles

fix_interpreter_scalar_index()  # the kernels' loop bounds are computed from the program id


def attention_fwd_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: AttentionTiles = ATTENTION_TILES):
    """(B, T, nh, hd) q, k, v -> (o (B, T, nh, hd), lse (B, nh, T) fp32, base 2)."""
    b, t, nh, _ = q.shape
    grid, kw = ka.fwd_launch(q.shape, tiles)
    o = torch.empty_like(q)
    lse = torch.empty((b, nh, t), dtype=torch.float32, device=q.device)
    ka.attn_fwd_kernel[grid](q, k, v, o, lse, **kw)
    return o, lse


def attention_bwd_torch(q, k, v, o, lse, do, tiles: AttentionTiles = ATTENTION_TILES):
    """The gradients (dq, dk, dv) of sum(o * do), from the forward's o and lse."""
    grid, kw = ka.bwd_launch(q.shape, tiles)
    delta = torch.einsum("btnh,btnh->bnt", o.float(), do.float()).contiguous()
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    ka.attn_bwd_kernel[grid](q, k, v, do.to(q.dtype).contiguous(), lse, delta, dq, dk, dv, **kw)
    return dq, dk, dv
