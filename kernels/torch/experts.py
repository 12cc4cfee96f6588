"""Launch the expert kernels of `kernels/triton/experts.py` on torch tensors.

Used by the CPU tests (TRITON_INTERPRET=1 set before this module is imported, fp32 tensors) and by
the GPU cross-checks and benchmarks (bf16 on CUDA); the warp-specialised Gluon kernels (kernels/gluon/) at the end
(CUDA, Hopper only). Packing metadata comes from
`mhl_jax.moe.packing` (as int32 tensors) or from `pack_torch` below, which computes the same layout.

Shapes: x (S, dh) with S = N * H sub-tokens; slot s = (n * H + h) * k + j reads x[s // k];
w1 (G, dh, de), w2 (G, de, dh) with G = H * Ne groups; row_slot (P,), block_group (P // block,),
group_block_start / group_nblocks / group_sizes (G,), all int32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.gluon.experts_bwd import dw_ws_constexprs, gluon_expert_dw_ws_kernel
from kernels.gluon.experts_bwd_fused import bwd_kernel
from kernels.gluon.experts_fwd import fwd_constexprs, gluon_expert_fwd_ws_kernel
from kernels.gluon.schedule import EXTRA_CHUNKS_PER_PROGRAM, tile_schedule_torch
from kernels.torch.interpreter_patch import fix_interpreter_scalar_index
from kernels.triton.dw_chunks import dw_chunks_constexprs, dw_chunks_kernel, partial_shape
from kernels.triton.experts import (
    expert_dw_kernel,
    expert_dwt_kernel,
    expert_dx_kernel,
    expert_fwd_cast_kernel,
    expert_fwd_kernel,
)
from kernels.tuning import ExpertsConfig, Tile, default_config, dgates_in_kernels

fix_interpreter_scalar_index()


class TorchPacking(NamedTuple):
    row_slot: torch.Tensor  # (P,) int32, -1 for padding
    slot_row: torch.Tensor  # (M,) int32
    block_group: torch.Tensor  # (P // block,) int32, -1 for all-padding blocks
    group_sizes: torch.Tensor  # (G,) int32
    group_block_start: torch.Tensor  # (G,) int32
    group_nblocks: torch.Tensor  # (G,) int32
    num_blocks: int  # blocks in use (host int: the torch paths may synchronise)


def padded_rows(num_slots: int, num_groups: int, block: int) -> int:
    """Same static upper bound as `mhl_jax.moe.packing.padded_rows`."""
    rows = num_slots + min(num_groups, num_slots) * (block - 1)
    return -(-rows // block) * block


def pack_torch(idx: torch.Tensor, num_experts: int, block: int) -> TorchPacking:
    """idx: (N, H, k) int expert indices -> the packing of `mhl_jax.moe.packing.pack` (same rows)."""
    n, h, k = idx.shape
    m, g_count = n * h * k, h * num_experts
    dev = idx.device
    p = padded_rows(m, g_count, block)
    group = (torch.arange(h, device=dev).view(1, h, 1) * num_experts + idx.long()).reshape(m)
    order = torch.sort(group, stable=True).indices
    sizes = torch.bincount(group, minlength=g_count)
    nblk = (sizes + block - 1) // block
    bstart = torch.cumsum(nblk, 0) - nblk
    starts = torch.cumsum(sizes, 0) - sizes
    sg = group[order]
    dest = bstart[sg] * block + torch.arange(m, device=dev) - starts[sg]
    row_slot = torch.full((p,), -1, dtype=torch.int32, device=dev)
    row_slot[dest] = order.to(torch.int32)
    slot_row = torch.empty(m, dtype=torch.int32, device=dev)
    slot_row[order] = dest.to(torch.int32)
    num_blocks = int(nblk.sum())
    block_group = torch.full((p // block,), -1, dtype=torch.int32, device=dev)
    block_group[:num_blocks] = torch.repeat_interleave(torch.arange(g_count, device=dev), nblk).to(torch.int32)
    return TorchPacking(row_slot, slot_row, block_group, sizes.int(), bstart.int(), nblk.int(), num_blocks)


def _launch_opts(x: torch.Tensor) -> dict:
    return dict(FAST_TANH=x.is_cuda, PRECISION="ieee" if x.dtype == torch.float32 else "tf32")


def experts_fwd(x: torch.Tensor, row_slot: torch.Tensor, block_group: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, k: int, cfg: ExpertsConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: (S, dh); w1: (G, dh, de); w2: (G, de, dh) -> out rows (P, dh) in x.dtype (padding rows 0).
    `out` (P, dh), if given, is written in place (tests poison it first)."""
    out = torch.empty(row_slot.shape[0], x.shape[1], dtype=x.dtype, device=x.device) if out is None else out
    _launch_fwd(expert_fwd_kernel, x, (row_slot, block_group, w1.contiguous(), w2.contiguous()), (out,), w1, k, cfg)
    return out


def experts_fwd_cast(x: torch.Tensor, pk: TorchPacking, w1: torch.Tensor, w2: torch.Tensor, k: int,
                     cfg: ExpertsConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`experts_fwd` on fp32 weights w1 (G, dh, de), w2 (G, de, dh), converted to x's dtype inside the kernel
    (`expert_fwd_cast_kernel`): (out rows (P, dh), w1 and w2 in x's dtype). The converted weights of a group without
    rows are left unwritten (here: zeros)."""
    out = torch.empty(pk.row_slot.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    w1c, w2c = (torch.zeros(w.shape, dtype=x.dtype, device=x.device) for w in (w1, w2))
    inputs = (pk.row_slot, pk.block_group, pk.group_block_start, w1.float().contiguous(), w2.float().contiguous())
    _launch_fwd(expert_fwd_cast_kernel, x, inputs, (out, w1c, w2c), w1, k, cfg, cfg.cast_tile)
    return out, w1c, w2c


def _launch_fwd(kernel, x: torch.Tensor, inputs: tuple, outputs: tuple, w1: torch.Tensor, k: int,
                cfg: ExpertsConfig, tile: Tile | None = None) -> None:
    """One launch of a forward kernel (`expert_fwd_kernel` / `expert_fwd_cast_kernel`) over the packed rows: x
    first, then `inputs`, then `outputs` (the first the out rows (P, dh)), at `tile` (default cfg.fwd)."""
    (_, dh), de, p = x.shape, w1.shape[2], outputs[0].shape[0]
    cfg.check(dh, de)
    t = tile or cfg.fwd
    kernel[(p // t.block_m,)](
        x.contiguous(), *inputs, *outputs,
        K=k, DH=dh, DE=de, PACK_BLOCK=cfg.pack_block, BLOCK_M=t.block_m, BLOCK_E=t.block_e,
        num_warps=t.num_warps, num_stages=t.num_stages, **_launch_opts(x))


def experts_bwd(x: torch.Tensor, dy: torch.Tensor, gates: torch.Tensor, pk: TorchPacking, w1: torch.Tensor,
                w2: torch.Tensor, k: int, cfg: ExpertsConfig, dw_dtype: torch.dtype | None = None,
                dgates: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of the packed expert rows with dO[row] = gate[slot] * dy[slot // k].

    x, dy: (S, dh); gates: (M,) fp32. Returns dX rows (P, dh) in x.dtype (rows of all-padding blocks
    are unspecified when dX is fused into the dW kernel, cfg.dw.block_e == de), dW1 (G, dh, de) and
    dW2 (G, de, dh) in dw_dtype (default w1.dtype), and each packed row's gate gradient <output row,
    dy[slot // k]> (P,) fp32 made by the dX kernel or the fused dW kernel when `dgates` and
    `dgates_in_kernels(cfg, de)` (all-padding blocks unspecified when fused), else None.
    """
    cfg.check(x.shape[1], w1.shape[2])
    x, dy, gates, w1, w2 = (t.contiguous() for t in (x, dy, gates, w1, w2))
    if cfg.dw.block_e == w1.shape[2]:  # dX (and the gate gradients) fused into the dW kernel
        dx = torch.empty(pk.row_slot.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        dw1, dw2, dgate_rows = experts_dw(x, dy, gates, pk, w1, w2, k, cfg, dw_dtype, dx, dgates)
    else:
        dx, dgate_rows = experts_dx(x, dy, gates, pk, w1, w2, k, cfg, dgates)
        dw1, dw2, _ = experts_dw(x, dy, gates, pk, w1, w2, k, cfg, dw_dtype)
    return dx, dw1, dw2, dgate_rows


def experts_dx(x: torch.Tensor, dy: torch.Tensor, gates: torch.Tensor, pk: TorchPacking, w1: torch.Tensor,
               w2: torch.Tensor, k: int, cfg: ExpertsConfig, dgates: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of the dX kernel (tile cfg.dx) on contiguous inputs as `experts_bwd` prepares them: dX rows
    (P, dh) and, when `dgates` and `dgates_in_kernels(cfg, de)`, the per-row gate gradients (P,) fp32."""
    p, dh, de = pk.row_slot.shape[0], x.shape[1], w1.shape[2]
    dgates = dgates and dgates_in_kernels(cfg, de)
    dx = torch.empty(p, dh, dtype=x.dtype, device=x.device)
    dgate_rows = torch.empty(p if dgates else 1, dtype=torch.float32, device=x.device)
    t = cfg.dx
    expert_dx_kernel[(p // t.block_m,)](
        x, dy, gates, pk.row_slot, pk.block_group, w1, w2, dx, dgate_rows, K=k, DH=dh, DE=de,
        PACK_BLOCK=cfg.pack_block, BLOCK_M=t.block_m, BLOCK_E=t.block_e, num_warps=t.num_warps,
        num_stages=t.num_stages, DGATES=dgates, **_launch_opts(x))
    return dx, dgate_rows if dgates else None


def experts_dw(x: torch.Tensor, dy: torch.Tensor, gates: torch.Tensor, pk: TorchPacking, w1: torch.Tensor,
               w2: torch.Tensor, k: int, cfg: ExpertsConfig, dw_dtype: torch.dtype | None = None,
               dx: torch.Tensor | None = None, dgates: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One launch of the dW kernel (cfg.dw_form, tile cfg.dw) on inputs as `experts_bwd` prepares them:
    dW1 (G, dh, de), dW2 (G, de, dh) in dw_dtype (default w1.dtype); with dX fused (cfg.dw.block_e == de)
    it also writes the dX rows into `dx` (P, dh), and then (when `dgates` and `dgates_in_kernels(cfg, de)`)
    returns the per-row gate gradients (P,) fp32 third, else None."""
    (g, dh, de), fuse = w1.shape, cfg.dw.block_e == w1.shape[2]
    if fuse and dx is None:
        raise ValueError("experts_dw: a de-wide dW tile fuses dX into the kernel: pass the dX rows buffer `dx`")
    dgates = dgates and fuse and dgates_in_kernels(cfg, de)
    dw_dtype = dw_dtype or w1.dtype
    dw1 = torch.empty(g, dh, de, dtype=dw_dtype, device=x.device)
    dw2 = torch.empty(g, de, dh, dtype=dw_dtype, device=x.device)
    dgate_rows = torch.empty(pk.row_slot.shape[0] if dgates else 1, dtype=torch.float32, device=x.device)
    t = cfg.dw
    kernel = expert_dwt_kernel if cfg.dw_form == "t" else expert_dw_kernel
    kernel[(de // t.block_e, g)](
        x, dy, gates, pk.row_slot, pk.group_block_start, pk.group_nblocks, w1, w2, dw1, dw2, x if dx is None else dx,
        dgate_rows, K=k, DH=dh, DE=de, PACK_BLOCK=cfg.pack_block, BLOCK_M=t.block_m, BLOCK_E=t.block_e,
        FUSE_DX=fuse, num_warps=t.num_warps, num_stages=t.num_stages, DGATES=dgates,
        **_launch_opts(x))
    return dw1, dw2, dgate_rows if dgates else None


class TritonExpertFFN(torch.autograd.Function):
    """y (N, H, dh) = sum_j gates[..., j] * E_{h, idx[..., j]}(x) on the Triton kernels (torch autograd).

    forward(x (N, H, dh), gates (N, H, k) fp32, w1 (H, Ne, dh, de), w2 (H, Ne, de, dh), pk, k, cfg);
    x and the weights in the compute dtype.
    """

    @staticmethod
    def forward(ctx, x, gates, w1, w2, pk: TorchPacking, k: int, cfg: ExpertsConfig):
        n, h, dh = x.shape
        ne, de = w1.shape[1], w1.shape[3]
        w1g, w2g = w1.reshape(h * ne, dh, de), w2.reshape(h * ne, de, dh)
        xs = x.reshape(n * h, dh)
        out = experts_fwd(xs, pk.row_slot, pk.block_group, w1g, w2g, k, cfg)
        per_slot = out[pk.slot_row.long()].view(n, h, k, dh).float()
        y = torch.einsum("nhkd,nhk->nhd", per_slot, gates.float()).to(x.dtype)
        ctx.save_for_backward(xs, gates, out, w1g, w2g)
        ctx.cfg = (pk, k, cfg, (n, h, dh, ne, de))
        return y

    @staticmethod
    def backward(ctx, dy):
        xs, gates, out, w1g, w2g = ctx.saved_tensors
        pk, k, cfg, (n, h, dh, ne, de) = ctx.cfg
        dy = dy.contiguous()
        sr = pk.slot_row.long()
        dxr, dw1, dw2, dgate_rows = experts_bwd(xs, dy.reshape(n * h, dh), gates.reshape(-1).float(), pk, w1g,
                                                w2g, k, cfg)
        if dgate_rows is None:  # dX fused into the row-form dW kernel: the gate gradient here
            dgates = torch.einsum("nhkd,nhd->nhk", out[sr].view(n, h, k, dh).float(), dy.float())
        else:
            dgates = dgate_rows[sr].view(n, h, k)
        dx = dxr[sr].view(n, h, k, dh).float().sum(2).to(xs.dtype)
        return dx, dgates, dw1.view(h, ne, dh, de), dw2.view(h, ne, de, dh), None, None, None


def triton_expert_ffn(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, cfg: ExpertsConfig | None = None) -> torch.Tensor:
    """Torch entry point: x (N, H, dh); idx, gates (N, H, k); w1 (H, Ne, dh, de); w2 (H, Ne, de, dh)."""
    n, h, k = idx.shape
    ne, de = w1.shape[1], w1.shape[3]
    cfg = (cfg or default_config(n * h * k, h * ne, x.shape[2], de)).fit(de)
    pk = pack_torch(idx, ne, cfg.pack_block)
    return TritonExpertFFN.apply(x, gates, w1, w2, pk, k, cfg)


# ---------------------------------------------------------------------------------- the Gluon kernels (Hopper)

def gluon_experts_fwd_ws(x, pk: TorchPacking, w1, w2, k: int, pack_block: int, programs: int | None = None, out=None,
                         heads: int = 1):
    """x (S, dh), w1 (G, dh, de), w2 (G, de, dh) -> out rows (P, dh) in x.dtype by `gluon_expert_fwd_ws_kernel`
    (padding rows 0, but for the padding-only second halves of blocks: unwritten); `out`, if given, is written in
    place; heads: `fwd_constexprs`'."""
    p, (_, dh), (g_count, _, de) = pk.row_slot.shape[0], x.shape, w1.shape
    nb = p // pack_block
    consts = fwd_constexprs(k, dh, de, g_count, nb, pack_block, heads)
    out = torch.empty(p, dh, dtype=x.dtype, device=x.device) if out is None else out
    programs = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    gluon_expert_fwd_ws_kernel[(min(programs, nb),)](
        x.contiguous(), pk.row_slot, pk.block_group, pk.group_block_start, pk.group_nblocks, w1.contiguous(),
        w2.contiguous(), out, num_warps=4, maxnreg=gluon_expert_fwd_ws_kernel.mhl_compile_options["maxnreg"],
        **consts)
    return out


def gluon_experts_bwd_ws(x, dy, gates, pk, w1, w2, k: int, pack_block: int, programs: int | None = None,
                         dw_dtype=None, out=None, *, heads: int, deal: bool = True, xw: bool = False, **options):
    """Torch launcher (CUDA, Hopper) of the fused backward: as `gluon_experts_dw_ws`, plus dX rows (P, de / 128, dh)
    in x.dtype and each packed row's gate gradient (P, de / 128) fp32, one partial per 128 de (sum them; rows of
    the kernel's row blocks (block_m, 32) made only of padding unwritten): -> (dW1, dW2, dX, dgate), or written into
    `out` (the same four).
    xw: `gluon_expert_bwd_xw_kernel` (the dX rows by a fourth warp group; options: `bwd_xw_constexprs`')."""
    p, (_, dh), (_, _, de) = pk.row_slot.shape[0], x.shape, w1.shape
    kernel, constexprs = bwd_kernel(xw)
    consts = constexprs(k, dh, de, pack_block, **options)
    dw_dtype = dw_dtype or torch.float32
    out = out or (torch.empty(w1.shape, dtype=dw_dtype, device=x.device),
                  torch.empty(w2.shape, dtype=dw_dtype, device=x.device),
                  torch.empty(p, de // 128, dh, dtype=x.dtype, device=x.device),
                  torch.empty(p, de // 128, dtype=torch.float32, device=x.device))
    _launch_tiled(kernel, x, dy, gates, pk, w1, w2, out, consts, pack_block, programs, heads, deal)
    return out


def _launch_tiled(kernel, x, dy, gates, pk, w1, w2, outs, consts: dict, pack_block: int, programs: int | None,
                  heads: int, deal: bool) -> None:
    """Launch a persistent dW / backward kernel from torch: one program per SM (or `programs`), at most one per
    (group, 128 de) tile, with `tile_schedule_torch`'s schedule for exactly that many programs; then the long tiles'
    extra chunks added into dW1 / dW2 (`kernels.triton.dw_chunks`)."""
    tiles_per_group = w1.shape[2] // 128
    tiles = w1.shape[0] * tiles_per_group
    programs = min(programs or torch.cuda.get_device_properties(x.device).multi_processor_count, tiles)
    sched = tile_schedule_torch(pk, tiles_per_group, heads, programs, consts["BLOCK_M"], pack_block, deal)
    part = torch.empty(partial_shape(programs, x.shape[1], w1.shape[2]), dtype=outs[0].dtype, device=x.device)
    kernel[(programs,)](x.contiguous(), dy.contiguous(), gates.contiguous(), pk.row_slot, sched, w1.contiguous(),
                        w2.contiguous(), outs[0], outs[1],  # acc1, acc2
                        *outs, part, num_warps=4,
                        maxnreg=kernel.mhl_compile_options["maxnreg"], **consts)
    dw_chunks_kernel[(EXTRA_CHUNKS_PER_PROGRAM * programs,)](
        sched, part, outs[0], outs[1], outs[0], outs[1], num_warps=4,
        **dw_chunks_constexprs(programs, tiles, x.shape[1], w1.shape[2], consts["ACCUM"]))


def gluon_experts_dw_ws(x, dy, gates, pk, w1, w2, k: int, pack_block: int, programs: int | None = None,
                        dw_dtype=None, out=None, *, heads: int, deal: bool = True, **options):
    """Torch launcher (CUDA, Hopper): x, dy (S, dh) rows as stored, gates (S * k,) fp32, pk a
    `kernels.torch.experts.TorchPacking`, w1 (G, dh, de), w2 (G, de, dh) -> (dW1, dW2) in dw_dtype (fp32), or
    written into `out` = (dW1, dW2) if given; options: `dw_ws_constexprs`' stages / wbuf / regs / block_m (sweeps)."""
    (_, dh), (_, _, de) = x.shape, w1.shape
    consts = dw_ws_constexprs(k, dh, de, pack_block, **options)
    dw_dtype = dw_dtype or torch.float32
    dw1, dw2 = out or (torch.empty(w1.shape, dtype=dw_dtype, device=x.device),
                       torch.empty(w2.shape, dtype=dw_dtype, device=x.device))
    _launch_tiled(gluon_expert_dw_ws_kernel, x, dy, gates, pk, w1, w2, (dw1, dw2), consts, pack_block, programs, heads,
                  deal)
    return dw1, dw2
