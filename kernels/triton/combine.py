"""The backward's dX combine of the MoE core with the router's dX folded in (one Triton kernel), and the forward's
combine of the expert output rows (`out_combine_kernel`, at the end).

For every sub-token row r = n * H + h (N * H rows of width DH), slots s_j = r * K + j:

    dg_j  = sum_q dgate_rows[slot_row[s_j], q]                    (the gate gradients of the expert backward)
    dv_j  = g_j dg_j - g_j sum_i g_i dg_i                         (softmax's backward: the router's dvalues)
    dx[r] = sum_j ( sum_q rows[slot_row[s_j], q]  +  dv_j W_r^T[h, idx[s_j]] )

rows (P, PARTS * DH): the expert backward's packed dX rows (PARTS partials per row where its kernel
splits de in 128-wide tiles); dgate_rows (P, PARTS) fp32: its gate gradients per packed row (or, DG_BY_SLOT,
already per slot); slot_row (N * H * K,): each slot's packed row (-1: none, contributes 0); gates, idx
(N * H * K,): the router's softmax gates and choices; wt (H, NE, DH) fp32: W_r transposed, so a gathered row
is contiguous. Writes dx and dv (for the router's dW_r). Accumulates in fp32 in a fixed order (j, then the
partials, then the router term), rounds once to dx's dtype. No atomics: each output row is one program's.

Apart, the expert op's combine (XLA: gather k rows, sum) and the router's dX kernel (k rows of W_r^T
from L2 per row) would each write an (N * H, DH) array for XLA to add. Here the HBM gather of the dX
rows (k x 256 B per row at DH 128) bounds the time and the W_r^T rows come from L2 beside it. Tiles:
`kernels.tuning.CombineTiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tuning import CombineTiles, out_combine_tiles


def check_combine_args(r: int, h: int, dh: int, ne: int, k: int, parts: int, tiles: CombineTiles) -> None:
    if r % h:
        raise ValueError(f"dx combine: {r} rows are not a multiple of H={h} heads")
    if min(r, h, dh, ne, k, parts) < 1:
        raise ValueError(f"dx combine: rows={r}, H={h}, dh={dh}, Ne={ne}, k={k}, parts={parts}: all must be >= 1")
    if tiles.block_r < 1 or tiles.block_r & (tiles.block_r - 1):
        raise ValueError(f"dx combine: block_r={tiles.block_r}, expected a power of 2")


@triton.jit
def _gate_and_dgate(slot_row_ptr, dgr_ptr, gates_ptr, r64, rmask, j, K: tl.constexpr, PARTS: tl.constexpr,
                    DG_BY_SLOT: tl.constexpr):
    """(BLOCK_R,) gate and gate gradient of slot j of rows r (the gradient's partials summed; 0 for an empty slot)."""
    slot = r64 * K + j
    g = tl.load(gates_ptr + slot, mask=rmask, other=0.0)
    if DG_BY_SLOT:  # dgates already per slot
        dg = tl.load(dgr_ptr + slot, mask=rmask, other=0.0)
    else:  # per packed row, gathered through slot_row
        s = tl.load(slot_row_ptr + slot, mask=rmask, other=-1)
        dg = tl.zeros_like(g)
        for q in tl.static_range(PARTS):
            dg += tl.load(dgr_ptr + s.to(tl.int64) * PARTS + q, mask=s >= 0, other=0.0)
    return g, dg


@triton.jit
def dx_combine_kernel(
    rows_ptr, slot_row_ptr, dgr_ptr, gates_ptr, idx_ptr, wt_ptr,  # inputs (module docstring)
    dx_ptr, dv_ptr,  # outputs: dx (R, DH) in dx's dtype; dv (R * K,) fp32 (ROUTER only)
    R: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, NE: tl.constexpr, K: tl.constexpr,
    PARTS: tl.constexpr, ROUTER: tl.constexpr, DG_BY_SLOT: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    h = r % H
    r64 = r.to(tl.int64)
    offs_d = tl.arange(0, DHP)
    dmask = offs_d < DH
    acc = tl.zeros((BLOCK_R, DHP), tl.float32)
    ssum = tl.zeros((BLOCK_R,), tl.float32)
    if ROUTER:  # the softmax's backward, pass 1: sum_j g_j dg_j (j in order)
        for j in tl.static_range(K):
            g, dg = _gate_and_dgate(slot_row_ptr, dgr_ptr, gates_ptr, r64, rmask, j, K, PARTS, DG_BY_SLOT)
            ssum += g * dg
    dvs = ()
    for j in tl.static_range(K):  # fixed order: deterministic
        s = tl.load(slot_row_ptr + r64 * K + j, mask=rmask, other=-1)
        ok = (s >= 0)[:, None] & dmask[None, :]
        base = s.to(tl.int64) * (PARTS * DH)
        for q in tl.static_range(PARTS):
            acc += tl.load(rows_ptr + base[:, None] + q * DH + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        if ROUTER:  # pass 2: dv_j = g_j dg_j - g_j sum (the form of jax.nn.softmax's VJP), then the router's row
            g, dg = _gate_and_dgate(slot_row_ptr, dgr_ptr, gates_ptr, r64, rmask, j, K, PARTS, DG_BY_SLOT)
            dv = g * dg - g * ssum
            dvs = dvs + (dv,)
            e = tl.load(idx_ptr + r64 * K + j, mask=rmask, other=0)
            wrow = (h * NE + e).to(tl.int64)
            w = tl.load(wt_ptr + wrow[:, None] * DH + offs_d[None, :], mask=rmask[:, None] & dmask[None, :],
                        other=0.0)
            acc += dv[:, None] * w
    if ROUTER:  # stored after every load: a store between them would keep the next slot's loads behind it
        for j in tl.static_range(K):
            tl.store(dv_ptr + r64 * K + j, dvs[j], mask=rmask)
    tl.store(dx_ptr + r64[:, None] * DH + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


@triton.jit
def out_combine_kernel(
    rows_ptr, slot_row_ptr, gates_ptr,  # inputs: expert output rows (P, DH); slot_row, gates (R * K,)
    out_ptr,  # output (R, DH) in out's dtype
    R: tl.constexpr, DH: tl.constexpr, DHP: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """The forward's combine: out[r] = sum_j gates[r K + j] rows[slot_row[r K + j]] (an empty slot, -1, adds 0), in
    fp32 in the order j = 0 .. K - 1, rounded once. Each output row is one program's: deterministic."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    r64 = r.to(tl.int64)
    offs_d = tl.arange(0, DHP)
    dmask = offs_d < DH
    acc = tl.zeros((BLOCK_R, DHP), tl.float32)
    for j in tl.static_range(K):
        s = tl.load(slot_row_ptr + r64 * K + j, mask=rmask, other=-1)
        g = tl.load(gates_ptr + r64 * K + j, mask=rmask, other=0.0)
        ok = (s >= 0)[:, None] & dmask[None, :]
        row = tl.load(rows_ptr + s.to(tl.int64)[:, None] * DH + offs_d[None, :], mask=ok, other=0.0)
        acc += row.to(tl.float32) * g[:, None]
    tl.store(out_ptr + r64[:, None] * DH + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


def out_combine_constexprs(r: int, dh: int, k: int, tiles: CombineTiles) -> dict:
    check_combine_args(r, 1, dh, 1, k, 1, tiles)
    return dict(R=r, DH=dh, DHP=max(16, triton.next_power_of_2(dh)), K=k, BLOCK_R=tiles.block_r)


def out_combine_torch(rows, slot_row, gates, k: int, out_dtype=None, tiles: CombineTiles | None = None):
    """`out_combine_kernel` on torch tensors: rows (P, DH), slot_row (R * K,) int32, gates (R * K,) fp32 -> (R, DH)
    in out_dtype (default rows.dtype). tiles: None = `out_combine_tiles` (as the JAX binding)."""
    import torch

    r, dh = slot_row.shape[0] // k, rows.shape[-1]
    tiles = tiles or out_combine_tiles(dh)
    out = torch.empty((r, dh), dtype=out_dtype or rows.dtype, device=rows.device)
    out_combine_kernel[combine_grid(r, tiles)](rows.contiguous(), slot_row.contiguous(), gates.reshape(-1).contiguous(),
                                               out, num_warps=tiles.num_warps,
                                               **out_combine_constexprs(r, dh, k, tiles))
    return out


def combine_constexprs(r: int, h: int, dh: int, ne: int, k: int, parts: int, router: bool,
                       tiles: CombineTiles, dg_by_slot: bool = False) -> dict:
    check_combine_args(r, h, dh, ne, k, parts, tiles)
    return dict(R=r, H=h, DH=dh, DHP=max(16, triton.next_power_of_2(dh)), NE=ne, K=k, PARTS=parts,
                ROUTER=router, DG_BY_SLOT=dg_by_slot, BLOCK_R=tiles.block_r)


def combine_grid(r: int, tiles: CombineTiles) -> tuple[int]:
    return (triton.cdiv(r, tiles.block_r),)


def dx_combine_torch(rows, slot_row, dgate_rows, gates, idx, wt, heads: int, k: int, out_dtype=None,
                     tiles: CombineTiles | None = None, dg_by_slot: bool = False):
    """The kernel on torch tensors (CPU interpreter tests, GPU kernel benchmark). rows (P, PARTS, DH) or (P, DH);
    slot_row, idx (N * H * K,) int32; dgate_rows (P, PARTS) fp32 (dg_by_slot: (N * H * K,) per slot); gates
    (N * H * K,) fp32; wt (H, NE, DH) fp32; or dgate_rows = gates = idx = wt = None (no router term)
    -> dx (N * H, DH) in out_dtype (default rows.dtype), dv (N * H * K,) fp32 (None without the router term)."""
    import torch

    tiles = tiles or CombineTiles()
    p, dh = rows.shape[0], rows.shape[-1]
    parts = rows.shape[1] if rows.dim() == 3 else 1
    m = slot_row.shape[0]
    r = m // k
    router = wt is not None
    dx = torch.empty((r, dh), dtype=out_dtype or rows.dtype, device=rows.device)
    dv = torch.empty((m if router else 1,), dtype=torch.float32, device=rows.device)
    none_i, none_f = (torch.zeros((1,), dtype=t, device=rows.device) for t in (torch.int32, torch.float32))
    dx_combine_kernel[combine_grid(r, tiles)](
        rows.reshape(p, parts * dh).contiguous(), slot_row.contiguous(),
        dgate_rows.reshape(-1).contiguous() if router else none_f, gates.reshape(-1).contiguous() if router else none_f,
        idx.reshape(-1).contiguous() if router else none_i, wt.contiguous() if router else none_f, dx, dv,
        num_warps=tiles.num_warps,
        **combine_constexprs(r, heads, dh, wt.shape[1] if router else 1, k, parts, router, tiles, dg_by_slot))
    return dx, (dv if router else None)
