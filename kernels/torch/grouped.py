"""Launch the grouped-GEMM expert kernels of `kernels/triton/grouped.py` on torch tensors.

Used by the CPU tests (TRITON_INTERPRET=1 set before this module is imported, fp32 tensors) and by GPU
cross-checks (bf16 on CUDA). Packing from `kernels.torch.experts.pack_torch` (the layout of
`mhl_jax.moe.packing.pack`).

Shapes: x (S, dh) with S = N * H sub-tokens, slot s = (n * H + h) * k + j reads x[s // k];
w1 (G, dh, de), w2 (G, de, dh) in the compute dtype, G = H * Ne; hpre, act (P, de); rows (P, dh).
"""

from __future__ import annotations

import torch

from kernels.torch.experts import TorchPacking, pack_torch
from kernels.torch.interpreter_patch import fix_interpreter_scalar_index
from kernels.triton.grouped import GATHER, GATHER_GATED, ROWS, b_strides, grouped_rows_kernel, grouped_wgrad_kernel
from kernels.tuning import GroupedConfig, default_grouped_config

fix_interpreter_scalar_index()


def _opts(t: torch.Tensor) -> dict:
    return dict(FAST_TANH=t.is_cuda, PRECISION="ieee" if t.dtype == torch.float32 else "tf32")


def rows_matmul(a: torch.Tensor, gates: torch.Tensor, pk: TorchPacking, w: torch.Tensor, k: int,
                cfg: GroupedConfig, *, a_mode: int, transpose_w: bool = False, hpre: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                act_out: torch.Tensor | bool | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """C (P, N) = A rows @ B[g] per row block (`grouped_rows_kernel`).

    a: (P, KDIM) packed rows (a_mode ROWS) or (S, KDIM) source rows (GATHER, GATHER_GATED with gates
    (M,) fp32); w: (G, R, C) compute dtype, B[g] = w[g] (KDIM = R) or w[g]^T (transpose_w, KDIM = C);
    hpre (P, N): multiply by gelu'(hpre) (the dH epilogue). act_out (True or a (P, N) buffer): also
    return gelu(C) (the forward's epilogue). `out` (P, N), if given, is written in place."""
    p, kdim = pk.row_slot.shape[0], a.shape[1]
    w = w.contiguous()
    wk, wn = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    if wk != kdim:
        raise ValueError(f"rows_matmul: A width {kdim} != weight reduction dim {wk} (w {tuple(w.shape)}, "
                         f"transpose_w={transpose_w})")
    t = cfg.rows
    for name, size, tile in (("N", wn, t.block_n), ("KDIM", kdim, t.block_k), ("pack_block", cfg.pack_block,
                                                                                 t.block_m)):
        if size % tile:
            raise ValueError(f"rows_matmul: {name}={size} must be a multiple of the tile {tile}")
    out = torch.empty(p, wn, dtype=out_dtype or a.dtype, device=a.device) if out is None else out
    epi_gelu = act_out is not None and act_out is not False
    act = torch.empty_like(out) if act_out is True else act_out if epi_gelu else out
    grid = ((p // t.block_m) * (wn // t.block_n),)
    grouped_rows_kernel[grid](
        a.contiguous(), gates, pk.row_slot, pk.block_group, w, w if hpre is None else hpre.contiguous(), out, act,
        K=k, KDIM=kdim, N=wn, **b_strides(tuple(w.shape), transpose_w), PACK_BLOCK=cfg.pack_block,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=cfg.group_m, A_MODE=a_mode,
        EPI_GELU=epi_gelu, EPI_DGELU=hpre is not None, num_warps=t.num_warps, num_stages=t.num_stages,
        **_opts(w))
    return (out, act) if epi_gelu else out


def wgrad(a: torch.Tensor, d: torch.Tensor, gates: torch.Tensor, pk: TorchPacking, k: int, cfg: GroupedConfig,
          *, a_mode: int, d_mode: int, dw_dtype: torch.dtype | None = None,
          out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """dW (G, I, J) = per group, sum over its rows of A^T D (`grouped_wgrad_kernel`); a: width I, d:
    width J, each packed rows (ROWS) or source rows (GATHER / GATHER_GATED). accumulate: added to what `out` holds."""
    if accumulate and out is None:
        raise ValueError("wgrad: accumulate=True needs the running sums in out=")
    g = pk.group_nblocks.shape[0]
    i, j = a.shape[1], d.shape[1]
    t = cfg.wgrad
    out = torch.empty(g, i, j, dtype=dw_dtype or a.dtype, device=a.device) if out is None else out
    grouped_wgrad_kernel[(i // t.block_m, j // t.block_n, g)](
        a.contiguous(), d.contiguous(), gates, pk.row_slot, pk.group_block_start, pk.group_nblocks, out, out,
        K=k, I=i, J=j, PACK_BLOCK=cfg.pack_block, BLOCK_I=t.block_m, BLOCK_J=t.block_n, BLOCK_R=t.block_k,
        A_MODE=a_mode, D_MODE=d_mode, num_warps=t.num_warps, num_stages=t.num_stages,
        PRECISION=_opts(a)["PRECISION"], ACCUM=accumulate)
    return out


def grouped_fwd(x: torch.Tensor, pk: TorchPacking, w1: torch.Tensor, w2: torch.Tensor, k: int,
                cfg: GroupedConfig, outs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (S, dh) -> (H, gelu(H) rows (P, de) in w1.dtype, O rows (P, dh) in x.dtype); padding rows are 0.
    `outs` may hold preallocated "hpre", "act", "out" buffers (tests poison them)."""
    cfg.check(x.shape[1], w1.shape[2])
    outs = outs or {}
    gates = torch.empty(1, dtype=torch.float32, device=x.device)  # unused (no gated operand)
    hpre, act = rows_matmul(x, gates, pk, w1, k, cfg, a_mode=GATHER, out_dtype=w1.dtype, out=outs.get("hpre"),
                            act_out=outs.get("act", True))
    o = rows_matmul(act, gates, pk, w2, k, cfg, a_mode=ROWS, out_dtype=x.dtype, out=outs.get("out"))
    return hpre, act, o


def grouped_bwd(x: torch.Tensor, dy: torch.Tensor, gates: torch.Tensor, hpre: torch.Tensor, act: torch.Tensor,
                pk: TorchPacking, w1: torch.Tensor, w2: torch.Tensor, k: int, cfg: GroupedConfig,
                dw_dtype: torch.dtype | None = None, outs: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the packed rows with dO[row] = gate[slot] * dy[slot // k].

    x, dy (S, dh); gates (M,) fp32; hpre, act (P, de) from `grouped_fwd`. Returns dH rows (P, de) in
    w1.dtype, dX rows (P, dh) in x.dtype, dW1 (G, dh, de) and dW2 (G, de, dh) in dw_dtype (default
    w1.dtype). `outs` may hold preallocated "dh", "dx", "dw1", "dw2" buffers (tests poison them)."""
    cfg.check(x.shape[1], w1.shape[2])
    outs = outs or {}
    x, dy, gates = x.contiguous(), dy.contiguous(), gates.contiguous().float()
    dh = rows_matmul(dy, gates, pk, w2, k, cfg, a_mode=GATHER_GATED, transpose_w=True, hpre=hpre,
                     out_dtype=w1.dtype, out=outs.get("dh"))
    dx = rows_matmul(dh, gates, pk, w1, k, cfg, a_mode=ROWS, transpose_w=True, out_dtype=x.dtype,
                     out=outs.get("dx"))
    dw1 = wgrad(x, dh, gates, pk, k, cfg, a_mode=GATHER, d_mode=ROWS, dw_dtype=dw_dtype or w1.dtype,
                out=outs.get("dw1"))
    dw2 = wgrad(act, dy, gates, pk, k, cfg, a_mode=ROWS, d_mode=GATHER_GATED,
                dw_dtype=dw_dtype or w1.dtype, out=outs.get("dw2"))
    return dh, dx, dw1, dw2


class GroupedExpertFFN(torch.autograd.Function):
    """y (N, H, dh) = sum_j gates[..., j] * E_{h, idx[..., j]}(x) on the grouped-GEMM kernels.

    forward(x (N, H, dh), gates (N, H, k) fp32, w1 (H, Ne, dh, de), w2 (H, Ne, de, dh), pk, k, cfg);
    x and the weights in the compute dtype."""

    @staticmethod
    def forward(ctx, x, gates, w1, w2, pk: TorchPacking, k: int, cfg: GroupedConfig):
        n, h, dh = x.shape
        ne, de = w1.shape[1], w1.shape[3]
        w1g, w2g = w1.reshape(h * ne, dh, de), w2.reshape(h * ne, de, dh)
        xs = x.reshape(n * h, dh)
        hpre, act, out = grouped_fwd(xs, pk, w1g, w2g, k, cfg)
        per_slot = out[pk.slot_row.long()].view(n, h, k, dh).float()
        y = torch.einsum("nhkd,nhk->nhd", per_slot, gates.float()).to(x.dtype)
        ctx.save_for_backward(xs, gates, hpre, act, out, w1g, w2g)
        ctx.meta = (pk, k, cfg, (n, h, dh, ne, de))
        return y

    @staticmethod
    def backward(ctx, dy):
        xs, gates, hpre, act, out, w1g, w2g = ctx.saved_tensors
        pk, k, cfg, (n, h, dh, ne, de) = ctx.meta
        dy = dy.contiguous()
        sr = pk.slot_row.long()
        per_slot = out[sr].view(n, h, k, dh).float()
        dgates = torch.einsum("nhkd,nhd->nhk", per_slot, dy.float())
        _, dxr, dw1, dw2 = grouped_bwd(xs, dy.reshape(n * h, dh), gates.reshape(-1), hpre, act, pk, w1g, w2g, k,
                                       cfg)
        dx = dxr[sr].view(n, h, k, dh).float().sum(2).to(xs.dtype)
        return dx.view(n, h, dh), dgates, dw1.view(h, ne, dh, de), dw2.view(h, ne, de, dh), None, None, None


def grouped_expert_ffn(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor, cfg: GroupedConfig | None = None) -> torch.Tensor:
    """Torch entry point: x (N, H, dh); idx, gates (N, H, k); w1 (H, Ne, dh, de); w2 (H, Ne, de, dh)."""
    n, h, k = idx.shape
    ne, dh, de = w1.shape[1], w1.shape[2], w1.shape[3]
    if x.shape != (n, h, dh) or w1.shape[0] != h or w2.shape != (h, ne, de, dh) or gates.shape != idx.shape:
        raise ValueError(f"grouped_expert_ffn: shapes disagree: x {tuple(x.shape)}, idx {tuple(idx.shape)}, "
                         f"gates {tuple(gates.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    cfg = (cfg or default_grouped_config(n * h * k, h * ne, dh, de)).fit(dh, de)
    cfg.check(dh, de)
    pk = pack_torch(idx, ne, cfg.pack_block)
    return GroupedExpertFFN.apply(x, gates, w1, w2, pk, k, cfg)
