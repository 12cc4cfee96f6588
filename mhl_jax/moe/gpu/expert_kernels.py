"""The fused expert kernels' launches from JAX (jax-triton), and their pure-JAX stand-ins (`backend="emulate"`).

Which kernel runs is the plan's (`mhl_jax.moe.plan.expert_fwd_kernel` / `expert_bwd_kernel`); this module launches
it: the Triton kernels of `kernels/triton/experts.py`, or the warp-specialised Gluon kernels of `kernels/gluon/`
(persistent: one program per SM). The stand-ins compute what each launch computes with the reference row kernel
(`mhl_jax.moe.experts.expert_rows_reference`), so the plumbing around them is tested on CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.gluon import schedule
from kernels.gluon.experts_bwd import dw_ws_constexprs, gluon_expert_dw_ws_kernel
from kernels.gluon.experts_bwd_fused import bwd_kernel
from kernels.gluon.experts_fwd import fwd_constexprs, gluon_expert_fwd_ws_kernel
from kernels.gluon.schedule import EXTRA_CHUNKS_PER_PROGRAM, check_schedule_args
from kernels.triton.dw_chunks import dw_chunks_constexprs, dw_chunks_kernel, partial_shape
from kernels.triton.experts import (
    expert_dw_kernel,
    expert_dwt_kernel,
    expert_dx_kernel,
    expert_fwd_cast_kernel,
    expert_fwd_kernel,
)
from kernels.tuning import FWD_HEAD_MAJOR_MIN_K, ExpertsConfig, dgates_in_kernels
from mhl_jax.moe import plan
from mhl_jax.moe.experts import expert_rows_reference
from mhl_jax.moe.gpu import gluon as gluon_bridge
from mhl_jax.moe.packing import Packing


class Static(NamedTuple):
    cfg: ExpertsConfig
    k: int
    backend: str  # "triton" | "emulate"
    w_dtype: str  # dtype of the weights as given (their gradients come back in it)


def _opts(dtype) -> dict:
    return dict(FAST_TANH=True, PRECISION="ieee" if dtype == jnp.float32 else "tf32")


def _persistent_programs(work_items: int) -> int:
    """Programs of a persistent Gluon expert kernel: one per SM, at most one per work item (the launch grid, and the
    program count a dW / backward schedule is dealt for: `tile_schedule`)."""
    return min(plan.hopper_sms(), work_items)


def tile_schedule(packing: Packing, tiles_per_group: int, heads: int, programs: int, block_m: int, pack_block: int):
    """The schedule array the persistent dW / backward kernels read (`kernels.gluon.schedule.tile_schedule`, which
    describes it) for `packing`, traced. `programs` must be the launch grid (1 to G * tiles_per_group)."""
    check_schedule_args(packing.group_nblocks.shape[0], tiles_per_group, heads, programs, packing.row_slot.shape[0])
    return schedule.tile_schedule(jnp, packing.group_sizes, packing.group_nblocks, packing.group_block_start,
                                  tiles_per_group, heads, programs, block_m, pack_block)


# ------------------------------------------------------------------------------------------------ forward

def forward_rows(kernel: str, st: Static, xs, packing: Packing, w1, w2, heads: int):
    """Output rows (P, dh) of the plan's forward `kernel` ("gluon-ws" | "triton" | "emulate") on weights already in
    xs's dtype (G, dh, de) / (G, de, dh). heads: the heads the groups split into (the Gluon kernel's launch order)."""
    if kernel == "gluon-ws":
        return _fwd_gluon(st, xs, packing, w1, w2, heads if st.k >= FWD_HEAD_MAJOR_MIN_K else 1)
    if kernel == "triton":
        return fwd_triton(st, xs, packing, w1, w2, cast=False)
    if kernel == "emulate":
        return _rows_emulate(st, packing, xs, w1, w2)
    raise ValueError(f"expert forward: kernel {kernel!r}, expected gluon-ws, triton or emulate here")


def _fwd_gluon(st: Static, xs, packing: Packing, w1, w2, heads: int):
    """The warp-specialised forward: work items = row blocks, each head's shared by the programs in turn."""
    p, (_, dh), (g, _, de) = packing.row_slot.shape[0], xs.shape, w1.shape
    nb = p // st.cfg.pack_block
    return gluon_bridge.gluon_call(xs, packing.row_slot, packing.block_group, packing.group_block_start,
                                   packing.group_nblocks,
                                   w1, w2, kernel=gluon_expert_fwd_ws_kernel,
                                   out_shape=jax.ShapeDtypeStruct((p, dh), xs.dtype), programs=_persistent_programs(nb),
                                   **fwd_constexprs(st.k, dh, de, g, nb, st.cfg.pack_block, heads=heads))


def fwd_triton(st: Static, xs, packing: Packing, w1, w2, cast: bool):
    """The Triton forward: out rows (P, dh) (`expert_fwd_kernel`); with cast ("triton-cast"), w1 (G, dh, de) and w2
    (G, de, dh) arrive in fp32 and are converted as loaded (`expert_fwd_cast_kernel`): (out rows, w1 and w2 in xs's
    dtype for the backward; a group without rows keeps its converted weights unwritten: no output depends on them,
    as it has no row block)."""
    jt = plan.import_jax_triton()
    p, (_, dh), de = packing.row_slot.shape[0], xs.shape, w1.shape[2]
    t = st.cfg.cast_tile if cast else st.cfg.fwd
    out = jax.ShapeDtypeStruct((p, dh), xs.dtype)
    if cast:
        inputs = (xs, packing.row_slot, packing.block_group, packing.group_block_start, w1, w2)
        kernel = expert_fwd_cast_kernel
        out = [out, jax.ShapeDtypeStruct(w1.shape, xs.dtype), jax.ShapeDtypeStruct(w2.shape, xs.dtype)]
    else:
        inputs, kernel = (xs, packing.row_slot, packing.block_group, w1, w2), expert_fwd_kernel
    return jt.triton_call(
        *inputs, kernel=kernel, out_shape=out, grid=(p // t.block_m,), num_warps=t.num_warps, num_stages=t.num_stages,
        K=st.k, DH=dh, DE=de, PACK_BLOCK=st.cfg.pack_block, BLOCK_M=t.block_m, BLOCK_E=t.block_e,
        **_opts(xs.dtype))


# ----------------------------------------------------------------------------------------------- backward

def backward_kernels(kernel: str, st: Static, xs, dys, gates, packing: Packing, w1, w2, dw_dtype, heads: int, acc=None):
    """The plan's backward `kernel` (`mhl_jax.moe.plan.expert_bwd_kernel`): (dX rows (P, dh) or partial rows (P,
    parts, dh), dW1, dW2 in dw_dtype, gate gradients per packed row (P,) / (P, parts) fp32 where `dgates_in_kernels`,
    else None). acc: (acc1, acc2) shaped as dW1 / dW2, returned as acc + dW (the Gluon kernels add in place; after
    the Triton kernels XLA adds)."""
    if kernel == "emulate":
        return _bwd_emulate(st, xs, dys, gates, packing, w1, w2, dw_dtype, acc)
    if kernel in ("gluon-ws", "gluon-ws-xw"):
        return _bwd_gluon(st, xs, dys, gates, packing, w1, w2, dw_dtype, heads, kernel == "gluon-ws-xw", acc)
    if kernel not in ("triton-fused", "triton-split", "triton-split-gluon-dw"):
        raise ValueError(f"expert backward: kernel {kernel!r}")
    jt = plan.import_jax_triton()
    p, (_, dh), (g, _, de) = packing.row_slot.shape[0], xs.shape, w1.shape
    fuse = kernel == "triton-fused"
    dgates = dgates_in_kernels(st.cfg, de)
    common = dict(K=st.k, DH=dh, DE=de, PACK_BLOCK=st.cfg.pack_block, **_opts(xs.dtype))
    t = st.cfg.dw
    fused_dgates = fuse and dgates  # the fused dW kernel makes the gate gradients (transposed form only)
    if kernel == "triton-split-gluon-dw":
        dw1, dw2 = _dw_gluon(st, xs, dys, gates, packing, w1, w2, dw_dtype, heads, acc)
        acc = None  # added in the kernel
    else:
        dw1, dw2, dx_fused, dgate_fused = jt.triton_call(
            xs, dys, gates, packing.row_slot, packing.group_block_start, packing.group_nblocks, w1, w2,
            kernel=expert_dwt_kernel if st.cfg.dw_form == "t" else expert_dw_kernel,
            out_shape=[jax.ShapeDtypeStruct((g, dh, de), dw_dtype), jax.ShapeDtypeStruct((g, de, dh), dw_dtype),
                       jax.ShapeDtypeStruct((p, dh) if fuse else (1, dh), xs.dtype),
                       jax.ShapeDtypeStruct((p if fused_dgates else 1,), jnp.float32)],
            grid=(de // t.block_e, g), num_warps=t.num_warps, num_stages=t.num_stages,
            BLOCK_M=t.block_m, BLOCK_E=t.block_e, FUSE_DX=fuse, DGATES=fused_dgates, **common)
    if acc is not None:
        dw1, dw2 = acc[0] + dw1, acc[1] + dw2
    if fuse:
        return dx_fused, dw1, dw2, dgate_fused if fused_dgates else None
    t = st.cfg.dx
    dx, dgate_rows = jt.triton_call(
        xs, dys, gates, packing.row_slot, packing.block_group, w1, w2, kernel=expert_dx_kernel,
        out_shape=[jax.ShapeDtypeStruct((p, dh), xs.dtype), jax.ShapeDtypeStruct((p if dgates else 1,), jnp.float32)],
        grid=(p // t.block_m,), num_warps=t.num_warps, num_stages=t.num_stages, BLOCK_M=t.block_m,
        BLOCK_E=t.block_e, DGATES=dgates, **common)
    return dx, dw1, dw2, dgate_rows if dgates else None


def _tiled_call(kernel, xs, dys, gates, packing: Packing, w1, w2, heads: int, pack_block: int, out_shape,
                constexprs: dict, acc=None):
    """A persistent dW / backward Gluon kernel over (group, 128 de) tiles: the launch grid (`_persistent_programs`)
    and the schedule dealt for exactly that many programs (`tile_schedule`), then the split tiles' chunks added
    into dW1 / dW2 (`kernels.triton.dw_chunks`). acc: (acc1, acc2) shaped and typed as the first two outputs (dW1,
    dW2), aliased to them, which come back as acc + dW (constexprs' ACCUM); None: the kernel's acc inputs are w1 /
    w2, unread."""
    (_, dh), (g, _, de) = xs.shape, w1.shape
    tiles_per_group = de // 128
    programs = _persistent_programs(g * tiles_per_group)
    sched = tile_schedule(packing, tiles_per_group, heads, programs, constexprs["BLOCK_M"], pack_block)
    # acc1, acc2 (after the 7 inputs) -> dW1, dW2 (their shapes checked by the public ops: `moe_heads_fused`)
    alias = {} if acc is None else {"input_output_aliases": {7: 0, 8: 1}}
    part = jax.ShapeDtypeStruct(partial_shape(programs, dh, de), out_shape[0].dtype)  # dW's dtype
    *outs, parts = gluon_bridge.gluon_call(xs, dys, gates, packing.row_slot, sched, w1, w2,
                                           *((w1, w2) if acc is None else acc),
                                           kernel=kernel, out_shape=[*out_shape, part], programs=programs, **alias,
                                           **constexprs)
    outs[:2] = _add_chunks(sched, parts, outs[0], outs[1], programs, acc is not None)
    return outs


def _add_chunks(sched, parts, dw1, dw2, programs: int, accum: bool):
    """The split tiles' partial sums added into dW1 / dW2 in place (`kernels.triton.dw_chunks`): (dW1, dW2)."""
    (g, dh, de), jt = dw1.shape, plan.import_jax_triton()
    return jt.triton_call(sched, parts, dw1, dw2, kernel=dw_chunks_kernel,
                          out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in (dw1, dw2)],
                          grid=(EXTRA_CHUNKS_PER_PROGRAM * programs,), num_warps=4, input_output_aliases={2: 0, 3: 1},
                          **dw_chunks_constexprs(programs, g * de // 128, dh, de, accum))


def _dw_gluon(st: Static, xs, dys, gates, packing: Packing, w1, w2, dw_dtype, heads: int, acc=None):
    """dW1, dW2 by the warp-specialised Gluon kernel: work items = (group, 128 de) tiles. acc: see `_tiled_call`."""
    (_, dh), (g, _, de) = xs.shape, w1.shape
    return _tiled_call(gluon_expert_dw_ws_kernel, xs, dys, gates, packing, w1, w2, heads, st.cfg.pack_block,
                       [jax.ShapeDtypeStruct((g, dh, de), dw_dtype), jax.ShapeDtypeStruct((g, de, dh), dw_dtype)],
                       dw_ws_constexprs(st.k, dh, de, st.cfg.pack_block, accum=acc is not None), acc)


def _bwd_gluon(st: Static, xs, dys, gates, packing: Packing, w1, w2, dw_dtype, heads: int, xw: bool, acc=None):
    """dX rows (P, de / 128, dh), dW1, dW2, gate gradients (P, de / 128) by the warp-specialised fused Gluon kernel
    (one partial per 128 de: the callers sum them); work items = (group, 128 de) tiles. xw: with the dX warp group.
    acc: `_tiled_call`'s."""
    p, (_, dh), (g, _, de) = packing.row_slot.shape[0], xs.shape, w1.shape
    kernel, constexprs = bwd_kernel(xw)
    dw1, dw2, dx, dgate = _tiled_call(
        kernel, xs, dys, gates, packing, w1, w2, heads, st.cfg.pack_block,
        [jax.ShapeDtypeStruct((g, dh, de), dw_dtype), jax.ShapeDtypeStruct((g, de, dh), dw_dtype),
         jax.ShapeDtypeStruct((p, de // 128 * dh), xs.dtype), jax.ShapeDtypeStruct((p, de // 128), jnp.float32)],
        dict(constexprs(st.k, dh, de, st.cfg.pack_block), ACCUM=acc is not None), acc)
    return dx.reshape(p, de // 128, dh), dw1, dw2, dgate


# ------------------------------------------------------------------- kernel stand-ins (pure JAX, CPU)

def _packed_rows(st: Static, xs, dys, gates, packing: Packing):
    """Packed X rows and dO rows = gate * dy (P, dh) in xs.dtype, zero on padding."""
    valid = (packing.row_slot >= 0)[:, None]
    slot = jnp.maximum(packing.row_slot, 0)
    xp = jnp.where(valid, jnp.take(xs, slot // st.k, axis=0), 0).astype(xs.dtype)
    do = jnp.take(dys, slot // st.k, axis=0).astype(jnp.float32) * jnp.take(gates, slot)[:, None]
    return xp, jnp.where(valid, do, 0).astype(xs.dtype)


def _rows_emulate(st: Static, packing: Packing, xs, w1, w2):
    valid = (packing.row_slot >= 0)[:, None]
    rows = jnp.where(valid, jnp.take(xs, jnp.maximum(packing.row_slot, 0) // st.k, axis=0), 0)
    return expert_rows_reference(rows, packing.block_group, w1, w2, st.cfg.pack_block)


def _bwd_emulate(st: Static, xs, dys, gates, packing: Packing, w1, w2, dw_dtype, acc=None):
    rows, do = _packed_rows(st, xs, dys, gates, packing)
    _, vjp = jax.vjp(lambda r, a, b: expert_rows_reference(r, packing.block_group, a, b, st.cfg.pack_block),
                     rows, w1, w2)
    drows, dw1, dw2 = vjp(do)
    dgate_rows = None
    if dgates_in_kernels(st.cfg, w1.shape[2]):  # the kernels' DGATES output: <out row, dy row> per row
        out_rows = _rows_emulate(st, packing, xs, w1, w2)  # the kernel's A W2, recomputed (none kept for it)
        dy_rows = jnp.take(dys, jnp.maximum(packing.row_slot, 0) // st.k, axis=0).astype(jnp.float32)
        dgate_rows = jnp.where(packing.row_slot >= 0, jnp.sum(out_rows.astype(jnp.float32) * dy_rows, axis=1), 0.0)
    dw1, dw2 = dw1.astype(dw_dtype), dw2.astype(dw_dtype)
    if acc is not None:
        dw1, dw2 = acc[0] + dw1, acc[1] + dw2
    return drows, dw1, dw2, dgate_rows
