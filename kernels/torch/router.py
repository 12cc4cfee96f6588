"""Launch the router kernels of `kernels/triton/router.py` (and the Gluon forward of `kernels/gluon/router.py`)
on torch tensors.

Used by the CPU tests (TRITON_INTERPRET=1 set before this module is imported: operands are upcast
after their loads) and by the GPU cross-checks and benchmarks. Same contract as
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

from kernels.gluon.router import ws_router_constexprs, ws_router_items, ws_router_kernel
from kernels.torch.interpreter_patch import fix_interpreter_scalar_index
from kernels.triton.router import (
    WEIGHT_PARTS,
    check_router_args,
    dw_num_blocks,
    fwd_grid,
    next_pow2,
    router_bwd_dw_partial_kernel,
    router_bwd_dw_reduce_kernel,
    router_bwd_dx_kernel,
    router_fwd_kernel,
)
from kernels.tuning import RouterTiles, router_tiles


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


def router_weights(w: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """w (H, dh, Ne) fp32 -> the (PARTS, H, dh, Ne) operand of the forward kernels: WEIGHT_PARTS bf16 terms for
    bf16 x, else the fp32 weight itself."""
    if x_dtype == torch.bfloat16:
        return split_bf16(w, WEIGHT_PARTS).contiguous()
    return w.float().contiguous()[None]


def router_fwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int,
               tiles: RouterTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, H, dh) bf16 or fp32, w (H, dh, Ne) fp32, bias (H, Ne) fp32 -> values (N, H, k) fp32, indices (N, H, k)
    int32 (the Triton kernel)."""
    n, h, dh = x.shape
    ne = w.shape[2]
    if w.shape[:2] != (h, dh) or bias.shape != (h, ne):
        raise ValueError(f"router_fwd: shapes disagree: x {tuple(x.shape)}, w {tuple(w.shape)}, "
                         f"bias {tuple(bias.shape)}")
    tiles = tiles or router_tiles(ne, k)
    check_router_args(n, h, dh, ne, k, tiles)
    wp = router_weights(w, x.dtype)
    vals = torch.empty((n, h, k), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, h, k), dtype=torch.int32, device=x.device)
    router_fwd_kernel[fwd_grid(n, h, tiles)](
        x.contiguous(), wp, bias.float().contiguous(), vals, idx,
        N=n, H=h, DH=dh, DHP=max(16, next_pow2(dh)), NE=ne, K=k, KP=max(2, next_pow2(k)), PARTS=wp.shape[0],
        BLOCK_N=tiles.block_n, BLOCK_E=tiles.block_e, UPCAST=_interpreting(), ROW_TILES=tiles.row_tiles,
        num_warps=tiles.fwd_warps, num_stages=tiles.fwd_stages)
    return vals, idx


def gluon_router_fwd_ws(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, programs: int | None = None,
                        cast: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """The warp-specialised Gluon forward (CUDA, Hopper): x (N, H, dh) bf16, w (H, dh, Ne) fp32, bias (H, Ne) fp32
    -> values (N, H, k) fp32, indices (N, H, k) int32; programs: at most that many (default one per SM); cast: two
    fp32 tensors of one size (not necessarily one shape), also returned cast to bf16 by the caster warp group."""
    n, h, dh = x.shape
    ne = w.shape[2]
    if cast and cast[0].numel() != cast[1].numel():
        raise ValueError(f"gluon_router_fwd_ws: cast arrays of {cast[0].numel()} and {cast[1].numel()} elements")
    consts = ws_router_constexprs(n, h, dh, ne, k, cast_n=cast[0].numel() if cast else 0)
    vals = torch.empty(n, h, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, h, k, dtype=torch.int32, device=x.device)
    ins = [c.contiguous() for c in cast] if cast else [torch.empty(1, dtype=torch.float32, device=x.device)] * 2
    outs = [torch.empty(c.shape, dtype=torch.bfloat16, device=x.device) for c in ins]
    programs = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    kernel = ws_router_kernel(consts["NC"], bool(cast))
    kernel[(min(programs, ws_router_items(n, h, consts["NC"])),)](
        x.contiguous(), router_weights(w, x.dtype), bias.float().contiguous(), *ins, vals, idx, *outs, num_warps=4,
        maxnreg=kernel.mhl_compile_options["maxnreg"], **consts)
    return (vals, idx, *outs) if cast else (vals, idx)


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
        H=h, DH=dh, DHP=dhp, NE=ne, K=k, CB=tiles.dw_block, SUB=tiles.dw_sub, GLOBAL_SLOTS=global_slots,
        num_warps=tiles.dw_warps)
    dw = torch.empty((h, dh, ne), dtype=torch.float32, device=x.device)
    router_bwd_dw_reduce_kernel[(triton.cdiv(ne, tiles.red_block_e), h)](
        part, meta.group_bstart, meta.group_nblk, dw, DH=dh, DHP=dhp, NE=ne, BLOCK_E=tiles.red_block_e,
        num_warps=tiles.red_warps)
    return dx, dw


class _RouteTopk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, k, tiles):
        vals, idx = router_fwd(x, w, bias, k, tiles)
        ctx.save_for_backward(x, w, idx)
        ctx.tiles = tiles
        ctx.mark_non_differentiable(idx)
        return vals, idx

    @staticmethod
    def backward(ctx, dvals, _didx):
        x, w, idx = ctx.saved_tensors
        dx, dw = router_bwd(x, w, idx, dvals, ctx.tiles)
        return dx, dw, None, None, None


def route_topk_torch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int,
                     tiles: RouterTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd-enabled torch binding (values differentiable w.r.t. x and w; bias gets no gradient)."""
    return _RouteTopk.apply(x, w, bias, k, tiles or router_tiles(w.shape[2], k))
