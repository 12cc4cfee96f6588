"""Launch the router kernels of `kernels/triton/router.py` on torch tensors.

Used by the CPU tests (TRITON_INTERPRET=1 set before this module is imported: operands are upcast
after their loads) and by the GPU cross-checks and benchmark. Same contract as
`mhl_jax.moe.router.route_topk_reference`:

    x (N, H, dh) bf16, w_r (H, dh, Ne) fp32, bias (H, Ne) fp32
    -> values (N, H, k) fp32 (selected raw scores), indices (N, H, k) int32

`DwMeta` is the expert-sorted slot layout the dW kernels read; `mhl_jax.moe.gpu.router` computes
the same arrays in JAX.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton

from kernels.torch.interpreter_patch import fix_interpreter_scalar_index
from kernels.triton.router import (
    RouterTiles,
    check_router_args,
    dw_num_blocks,
    fwd_grid,
    next_pow2,
    router_bwd_dw_partial_kernel,
    router_bwd_dw_reduce_kernel,
    router_bwd_dx_kernel,
    router_fwd_kernel,
    router_tiles,
    weight_parts,
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


fix_interpreter_scalar_index()


def split_bf16(w: torch.Tensor, parts: int) -> torch.Tensor:
    """w fp32 (...) -> (parts, ...) bf16 with w ~= sum of the parts (hi first). Every part but the last
    is the residual truncated to its top 16 bits (exact in bf16, and the next residual is exact); the
    last is rounded. parts=3 is exact for normal fp32 values (3 x 8 significant bits). Bit-identical
    to `mhl_jax.moe.gpu.router.split_bf16`."""
    out, r = [], w.float().contiguous()
    for q in range(parts):
        if q == parts - 1:
            out.append(r.to(torch.bfloat16))
            break
        hi = (r.view(torch.int32) & -65536).view(torch.float32)
        out.append(hi.to(torch.bfloat16))
        r = r - hi
    return torch.stack(out)


def _weights_for(w: torch.Tensor, precision: str) -> torch.Tensor:
    """w (H, dh, Ne) fp32 -> the (PARTS, H, dh, Ne) operand of the forward kernel."""
    if precision.startswith("bf16"):
        return split_bf16(w, weight_parts(precision)).contiguous()
    return w.float().contiguous()[None]


def router_fwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, precision: str = "bf16x3",
               tiles: RouterTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, H, dh), w (H, dh, Ne) fp32, bias (H, Ne) fp32 -> values (N, H, k) fp32, indices (N, H, k) int32."""
    n, h, dh = x.shape
    ne = w.shape[2]
    if w.shape[:2] != (h, dh) or bias.shape != (h, ne):
        raise ValueError(f"router_fwd: shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"bias {tuple(bias.shape)}")
    tiles = tiles or router_tiles(ne, k)
    check_router_args(n, h, dh, ne, k, tiles)
    weight_parts(precision)  # validates the name
    if precision.startswith("bf16") and x.dtype != torch.bfloat16:
        raise ValueError(f"router_fwd: precision {precision!r} needs bf16 x (exact products), got {x.dtype}")
    wp = _weights_for(w, precision)
    vals = torch.empty((n, h, k), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, h, k), dtype=torch.int32, device=x.device)
    router_fwd_kernel[fwd_grid(n, h, tiles)](
        x.contiguous(), wp, bias.float().contiguous(), vals, idx,
        N=n, H=h, DH=dh, DHP=max(16, next_pow2(dh)), NE=ne, K=k, KP=max(2, next_pow2(k)), PARTS=wp.shape[0],
        PRECISION=precision if not precision.startswith("bf16") else "ieee",
        BLOCK_N=tiles.block_n, BLOCK_E=tiles.block_e, SELECT=tiles.select, UPCAST=_interpreting(),
        ROW_TILES=tiles.row_tiles, num_warps=tiles.fwd_warps, num_stages=tiles.fwd_stages)
    return vals, idx


class DwMeta(NamedTuple):
    """Expert-sorted slot layout for the dW kernels (all int32; G = H * Ne groups, NB blocks)."""

    order: torch.Tensor  # (H * N * k,) per head, local slots n * k + j sorted by expert (stable)
    block_group: torch.Tensor  # (NB,) group h * Ne + e of each block, -1 past the used blocks
    group_start: torch.Tensor  # (G,) first position of the group in `order`
    group_bstart: torch.Tensor  # (G,) first block of the group
    group_size: torch.Tensor  # (G,) slots of the group (the expert load of that head)
    group_nblk: torch.Tensor  # (G,) blocks of the group


def dw_metadata(idx: torch.Tensor, ne: int, block: int) -> DwMeta:
    """idx (N, H, k) int -> DwMeta with blocks of at most `block` slots."""
    n, h, k = idx.shape
    mh, dev = n * k, idx.device
    e = idx.permute(1, 0, 2).reshape(h, mh).long()
    se, order = torch.sort(e, dim=-1, stable=True)
    bounds = torch.searchsorted(se, torch.arange(ne + 1, device=dev).expand(h, ne + 1).contiguous())
    size = (bounds[:, 1:] - bounds[:, :-1]).reshape(-1)
    start = (bounds[:, :-1] + torch.arange(h, device=dev)[:, None] * mh).reshape(-1)
    nblk = (size + block - 1) // block
    cum = torch.cumsum(nblk, 0)
    nb = dw_num_blocks(n * h * k, h * ne, block)
    blocks = torch.arange(nb, device=dev)
    bg = torch.searchsorted(cum, blocks, right=True)
    bg = torch.where(blocks < cum[-1], bg, -1)
    i32 = lambda t: t.to(torch.int32).contiguous()
    return DwMeta(i32(order.reshape(-1)), i32(bg), i32(start), i32(cum - nblk), i32(size), i32(nblk))


def router_bwd(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, dvals: torch.Tensor,
               tiles: RouterTiles | None = None, dx_dtype: torch.dtype | None = None,
               meta: DwMeta | None = None, global_slots: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, H, dh), w (H, dh, Ne) fp32, idx (N, H, k) int32, dvals (N, H, k) fp32
    -> dx (N, H, dh) in dx_dtype (default x.dtype), dw (H, dh, Ne) fp32. Deterministic. global_slots: meta.order
    holds global slots (a packing's row_slot; the dW partial kernel's GLOBAL_SLOTS)."""
    n, h, dh = x.shape
    ne, k = w.shape[2], idx.shape[2]
    tiles = tiles or router_tiles(ne, k)
    check_router_args(n, h, dh, ne, k, tiles)
    if idx.shape != (n, h, k) or dvals.shape != (n, h, k):
        raise ValueError(f"router_bwd: idx {tuple(idx.shape)} and dvals {tuple(dvals.shape)} must be {(n, h, k)}")
    dhp = max(16, next_pow2(dh))
    x, idx, dvals = x.contiguous(), idx.to(torch.int32).contiguous(), dvals.float().contiguous()
    wt = w.float().transpose(1, 2).contiguous()  # (H, Ne, dh): gathered rows are contiguous
    dx = torch.empty((n, h, dh), dtype=dx_dtype or x.dtype, device=x.device)
    router_bwd_dx_kernel[(triton.cdiv(n, tiles.dx_block_n), h)](
        idx, dvals, wt, dx, N=n, H=h, DH=dh, DHP=dhp, NE=ne, K=k, BLOCK_N=tiles.dx_block_n,
        num_warps=tiles.dx_warps)
    meta = meta or dw_metadata(idx, ne, tiles.dw_block)
    nb = meta.block_group.shape[0]
    part = torch.empty((nb, dhp), dtype=torch.float32, device=x.device)
    router_bwd_dw_partial_kernel[(nb,)](
        x, dvals, meta.order, meta.block_group, meta.group_start, meta.group_bstart, meta.group_size, part,
        H=h, DH=dh, DHP=dhp, NE=ne, K=k, CB=tiles.dw_block, SUB=tiles.dw_sub, UPCAST=_interpreting(),
        ROWSUM=tiles.dw_rowsum, GLOBAL_SLOTS=global_slots,
        num_warps=tiles.dw_warps)
    dw = torch.empty((h, dh, ne), dtype=torch.float32, device=x.device)
    router_bwd_dw_reduce_kernel[(triton.cdiv(ne, tiles.red_block_e), h)](
        part, meta.group_bstart, meta.group_nblk, dw, DH=dh, DHP=dhp, NE=ne, BLOCK_E=tiles.red_block_e,
        num_warps=tiles.red_warps)
    return dx, dw


class _RouteTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, k, precision, tiles):
        vals, idx = router_fwd(x, w, bias, k, precision, tiles)
        ctx.save_for_backward(x, w, idx)
        ctx.tiles = tiles
        ctx.mark_non_differentiable(idx)
        return vals, idx

    @staticmethod
    def backward(ctx, dvals, _didx):
        x, w, idx = ctx.saved_tensors
        dx, dw = router_bwd(x, w, idx, dvals, ctx.tiles)
        return dx, dw, None, None, None, None


def route_topk_torch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, precision: str = "bf16x3",
                     tiles: RouterTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd-enabled torch binding (values differentiable w.r.t. x and w; bias gets no gradient)."""
    return _RouteTopk.apply(x, w, bias, k, precision, tiles or router_tiles(w.shape[2], k))
