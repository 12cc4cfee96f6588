"""The IO-aware expert FFN on Triton, bound into JAX (jax-triton) under one `jax.custom_vjp`.

    y[n, h] = sum_j gates[n, h, j] * gelu(x[n, h] W1[h, e_j]) W2[h, e_j],   e_j = idx[n, h, j]

Pipeline (packing from `packing.py`, kernels from `kernels/triton/experts.py`):
  forward   pack idx -> fwd kernel (gathers x rows itself) -> out rows (P, dh) -> combine with gates
  backward  dW kernel (+ dX kernel unless fused) gather x rows and dO = gate * dy themselves; the dX
            kernel (or the transposed dW kernel with dX fused) also makes dgates = <dy, out row> per packed
            row from values in registers (read back per slot; in XLA from the kept output rows when the rows
            are packed or dX is fused into the row-form dW kernel);
            dx = sum over the k slots of the dX rows (fixed order)

Neither the packed copy of x, nor the packed dO (unless cfg.packed_bwd), nor the (rows x de) hidden
activations are written to HBM. cfg.dw_form picks the dW kernel, cfg.pack_impl the packing
(`kernels.triton.experts.ExpertsConfig`). Weight gradients are reduced per (head, expert) over its row
blocks in order: deterministic. Weights may be fp32 (master copy: cast to x.dtype for the matmuls,
gradients returned in fp32) or already in the compute dtype.

`backend="emulate"` runs the same custom_vjp with pure-JAX stand-ins of the three kernels, so the
plumbing (packing, gathers, combine, cotangents) is tested on CPU where jax-triton cannot run.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.triton.experts import ExpertsConfig, Tile, default_config, dgates_in_kernels
from mhl_jax.moe import packing as pk
from mhl_jax.moe.gpu import gluon as gluon_bridge
from mhl_jax.moe.gpu import packing as packing_triton
from mhl_jax.moe.plan import import_jax_triton


class Meta(NamedTuple):
    """Integer packing metadata the kernels read (no gradient)."""

    row_slot: jax.Array  # (P,) int32
    slot_row: jax.Array  # (M,) int32
    block_group: jax.Array  # (P // pack_block,) int32
    group_block_start: jax.Array  # (G,) int32
    group_nblocks: jax.Array  # (G,) int32
    group_sizes: jax.Array  # (G,) int32: rows of each group, from which the Gluon dW / backward kernels count their
    # 32-row blocks (BWD_SKIP_PADDING off: its whole packing blocks)


class Static(NamedTuple):
    cfg: ExpertsConfig
    k: int
    backend: str  # "triton" | "emulate"
    w_dtype: str  # dtype of the weights as given (their gradients come back in it)


# ------------------------------------------------------------------------------ variants (benchmarks)

VARIANTS = ("default", "v2", "t", "t_packed", "count", "new", "new_packed", "tpack", "split_bwd", "fused_bwd16",
            "triton_fwd", "triton_dw", "triton_fused_bwd", "gluon_bwd", "gluon_bwd_xw", "gluon_bwd_noxw", "pack64",
            "pack128", "fwd_e64")
DWT_TILE = Tile(64, 64, 4, 3)  # transposed dW kernel's tile (bench/experts.py --sweep: 4.05 ms on H100)


def variant_config(name: str, num_slots: int, num_groups: int, dh: int, de: int,
                   dwt_tile: Tile | None = None) -> ExpertsConfig:
    """Named configs for old-vs-new comparisons in one process: "default" = `default_config` (what the
    model runs); "v2" = the row-form dW kernel with argsort packing (the defaults until 2026-11-23); "t" =
    transposed dW kernel (`dwt_tile`, block_m clamped to the packing block); "_packed" = packed X / dO
    rows for the backward; "count" = counting-sort packing; "new" = "t" + "count" (the default of the
    afternoon of 2026-11-23 at packing block 64 up to COUNT_SORT_MAX_SLOTS slots); "tpack" = "default"
    with the Triton packing kernels (kernels/triton/packing.py), i.e. "default" itself at blocks >= 64 since the
    evening of 2026-11-23; "split_bwd" = "default" with separate dX and dW kernels where the default fuses
    them (de = 128, the default until 2026-11-24); "fused_bwd16" = the fused one down to packing block 16;
    "triton_fwd" = "default" with the Triton forward where the default runs the warp-specialised Gluon one (the
    default until the last session of 2026-11-24); "triton_dw" = "default" with the Triton dW kernel where the
    default's split backward runs the warp-specialised Gluon one (the default until the fifth session of
    2026-11-24); "triton_fused_bwd" = "default" with the Triton backward kernels where the default runs the
    warp-specialised Gluon one (the default until the seventh session of 2026-11-24); "gluon_bwd" = "default" with
    the whole backward on the warp-specialised Gluon kernel wherever it takes the shape (at de > 128 too: partial dX
    rows per 128 de, summed by the combine); "gluon_bwd_xw" / "gluon_bwd_noxw" = "default" with / without the dX warp
    group in the Gluon backward (`ExpertsConfig.bwd_xw`); "pack64" / "pack128" = the default's choices at packing
    block 64 / 128 whatever the mean rows per group (the Gluon forward and Triton packing where the default takes 32 or
    64); "fwd_e64" = "default" with the Triton forward's 64-wide de chunks at packing block 64 and de 128 (the default
    until 2026-11-27)."""
    if name not in VARIANTS:
        raise ValueError(f"variant {name!r}, expected one of {VARIANTS}")
    if name in ("split_bwd", "fused_bwd16"):
        return default_config(num_slots, num_groups, dh, de, fuse_bwd=name != "split_bwd", fuse_min_pack=16)
    if name == "fwd_e64":
        return default_config(num_slots, num_groups, dh, de, fwd_wide=False)
    if name in ("pack64", "pack128"):
        return default_config(num_slots, num_groups, dh, de, pack={"pack64": 64, "pack128": 128}[name])
    if name == "triton_dw":
        return default_config(num_slots, num_groups, dh, de, dw_ws=False)
    if name == "triton_fused_bwd":
        return default_config(num_slots, num_groups, dh, de, bwd_ws=False)
    if name in ("gluon_bwd_xw", "gluon_bwd_noxw"):
        cfg = default_config(num_slots, num_groups, dh, de)
        return replace(cfg, bwd_xw=cfg.bwd_ws and name == "gluon_bwd_xw")
    if name == "gluon_bwd":
        from kernels.gluon.experts import bwd_ws_supported

        cfg = default_config(num_slots, num_groups, dh, de)
        return replace(cfg, bwd_ws=bwd_ws_supported(dh, de, cfg.pack_block) and dgates_in_kernels(cfg, de))
    if name in ("default", "tpack", "triton_fwd"):
        cfg = default_config(num_slots, num_groups, dh, de)
        if name == "triton_fwd":
            return replace(cfg, fwd_ws=False)
        return replace(cfg, pack_impl="triton") if name == "tpack" else cfg
    cfg = default_config(num_slots, num_groups, dh, de, dw_form="rows")
    if name in ("t", "t_packed", "new", "new_packed"):
        t = dwt_tile or DWT_TILE
        cfg = replace(cfg, dw=Tile(min(t.block_m, cfg.pack_block), min(t.block_e, de), t.num_warps, t.num_stages),
                      dw_form="t")
    return replace(cfg, packed_bwd=name.endswith("_packed"), pack_impl="count" if name in (
        "count", "new", "new_packed") else "argsort").fit(de)


# ----------------------------------------------------------------------------- kernel calls (Triton)

def _opts(dtype) -> dict:
    return dict(FAST_TANH=True, PRECISION="ieee" if dtype == jnp.float32 else "tf32")


_hopper_sms = gluon_bridge.hopper_sms  # a module name the tests can patch


def _persistent_programs(work_items: int) -> int:
    """Programs of a persistent Gluon expert kernel: one per SM, at most one per work item (the launch grid, and the
    program count a dW / backward schedule is dealt for: `tile_schedule`)."""
    return min(_hopper_sms(), work_items)


def _gluon_call(*args, kernel, out_shape, programs: int, **constexprs):
    """A persistent Gluon expert kernel (kernels/gluon/experts.py) on `programs` programs (`_persistent_programs`)."""
    return gluon_bridge.gluon_call(*args, kernel=kernel, out_shape=out_shape, programs=programs, **constexprs)


def tile_schedule(group_nblocks, tiles_per_group: int, heads: int, programs: int):
    """The schedule array the persistent dW / backward kernels read: (programs + 1 + G * tiles_per_group,) int32,
    each program's offsets (counted from the array's start: program p's tiles are sched[sched[p]:sched[p + 1]]), then
    the (group, 128 de) tiles program by program (`kernels.gluon.experts.deal_schedule`: head-major, each head's groups
    largest first, dealt so that the programs' rows even out). `programs` must be the launch grid (1 to G *
    tiles_per_group). `tile_schedule_torch` is the same for the torch launchers."""
    from kernels.gluon.experts import check_schedule_args, deal_schedule

    check_schedule_args(group_nblocks.shape[0], tiles_per_group, heads, programs)
    nb = group_nblocks.reshape(heads, -1)
    go = jnp.argsort(-nb, axis=1, stable=True).astype(jnp.int32) + \
        (jnp.arange(heads, dtype=jnp.int32) * nb.shape[1])[:, None]
    tiles = (go.reshape(-1, 1) * tiles_per_group + jnp.arange(tiles_per_group, dtype=jnp.int32)).reshape(-1)
    perm, starts = deal_schedule(tiles.shape[0], heads, programs)
    return jnp.concatenate([jnp.asarray(starts + programs + 1, jnp.int32), tiles[perm]])


def _fwd_gluon(st: Static, xs, meta: Meta, w1, w2, heads: int = 1):
    """The warp-specialised forward: work items = row blocks, each head's shared by the programs in turn."""
    from kernels.gluon.experts import gluon_expert_fwd_ws_kernel, ws_constexprs

    p, (_, dh), (g, _, de) = meta.row_slot.shape[0], xs.shape, w1.shape
    nb = p // st.cfg.pack_block
    return _gluon_call(xs, meta.row_slot, meta.block_group, meta.group_block_start, meta.group_nblocks, w1, w2,
                       kernel=gluon_expert_fwd_ws_kernel, out_shape=jax.ShapeDtypeStruct((p, dh), xs.dtype),
                       programs=_persistent_programs(nb),
                       **ws_constexprs(st.k, dh, de, g, nb, st.cfg.pack_block, heads=heads,
                                       skip_padding=FWD_SKIP_PADDING))


def use_fwd_gluon(st: Static, dtype) -> bool:
    """Whether the forward runs on the warp-specialised Gluon kernel: cfg.fwd_ws (set by default_config only at the
    shapes that kernel takes; ws_constexprs names the shape if a hand-made config asks for it elsewhere), bf16, a
    Hopper GPU; else the Triton kernel (`_fwd_triton`)."""
    return bool(st.cfg.fwd_ws and dtype == jnp.bfloat16 and _hopper_sms())


def _fwd_triton(st: Static, xs, meta: Meta, w1, w2, heads: int = 1):
    if use_fwd_gluon(st, xs.dtype):
        return _fwd_gluon(st, xs, meta, w1, w2, heads if st.k >= FWD_HEAD_MAJOR_MIN_K else 1)
    return _fwd_triton_call(st, xs, meta, w1, w2, cast=False)


def _fwd_triton_call(st: Static, xs, meta: Meta, w1, w2, cast: bool):
    """The Triton forward's launch: out rows (P, dh) (`expert_fwd_kernel`); with cast, w1 (G, dh, de) and w2 (G, de,
    dh) arrive in fp32 and are converted as loaded (`expert_fwd_cast_kernel`): (out rows, w1 and w2 in xs's dtype
    for the backward; a group without rows keeps its converted weights unwritten: no output depends on them, as it
    has no row block)."""
    from kernels.triton.experts import expert_fwd_cast_kernel, expert_fwd_kernel

    jt = import_jax_triton()
    p, (_, dh), de = meta.row_slot.shape[0], xs.shape, w1.shape[2]
    t = st.cfg.cast_tile if cast else st.cfg.fwd
    out = jax.ShapeDtypeStruct((p, dh), xs.dtype)
    if cast:
        inputs, kernel = (xs, meta.row_slot, meta.block_group, meta.group_block_start, w1, w2), expert_fwd_cast_kernel
        out = [out, jax.ShapeDtypeStruct(w1.shape, xs.dtype), jax.ShapeDtypeStruct(w2.shape, xs.dtype)]
    else:
        inputs, kernel = (xs, meta.row_slot, meta.block_group, w1, w2), expert_fwd_kernel
    return jt.triton_call(
        *inputs, kernel=kernel, out_shape=out, grid=(p // t.block_m,), num_warps=t.num_warps, num_stages=t.num_stages,
        K=st.k, DH=dh, DE=de, PACK_BLOCK=st.cfg.pack_block, BLOCK_M=t.block_m, BLOCK_E=t.block_e,
        **_opts(xs.dtype))


def fwd_casts_weights(st: Static, x_dtype, w_dtype, cast_given: bool) -> bool:
    """Whether the forward converts the fp32 weights in its own loads (`expert_fwd_cast_kernel`) instead of XLA
    casting them before it: FWD_CASTS_WEIGHTS, the Triton forward (not the Gluon one) on a GPU, fp32 weights, bf16
    x, and no cast made elsewhere (the router's caster, or the train step's once-per-step cast)."""
    return bool(FWD_CASTS_WEIGHTS and st.backend == "triton" and not cast_given and w_dtype == jnp.float32
                and x_dtype == jnp.bfloat16 and not use_fwd_gluon(st, x_dtype))


def use_dw_gluon(cfg: ExpertsConfig, dtype, dh: int, de: int) -> bool:
    """Whether the backward's weight gradients run on the warp-specialised Gluon kernel: cfg.dw_ws on a split
    backward (no fused dX, unpacked rows, not the whole backward on Gluon: `use_bwd_gluon`), bf16, a Hopper GPU, a
    shape the kernel takes; else the Triton dW kernel."""
    from kernels.gluon.experts import dw_ws_supported

    return (cfg.dw_ws and cfg.dw.block_e != de and not cfg.packed_bwd and dtype == jnp.bfloat16
            and dw_ws_supported(dh, de, cfg.pack_block) and bool(_hopper_sms())
            and not use_bwd_gluon(cfg, dtype, dh, de))


def _dw_gluon(st: Static, xs, dys, gates, meta: Meta, w1, w2, dw_dtype, heads: int, acc=None):
    """dW1, dW2 by the warp-specialised Gluon kernel: work items = (group, 128 de) tiles. acc: see `_tiled_call`."""
    from kernels.gluon.experts import dw_ws_constexprs, gluon_expert_dw_ws_kernel

    (_, dh), (g, _, de) = xs.shape, w1.shape
    return _tiled_call(gluon_expert_dw_ws_kernel, xs, dys, gates, meta, w1, w2, heads,
                       [jax.ShapeDtypeStruct((g, dh, de), dw_dtype), jax.ShapeDtypeStruct((g, de, dh), dw_dtype)],
                       dw_ws_constexprs(st.k, dh, de, st.cfg.pack_block, accum=acc is not None), acc)


def _tiled_call(kernel, xs, dys, gates, meta: Meta, w1, w2, heads: int, out_shape, constexprs: dict, acc=None):
    """A persistent dW / backward Gluon kernel over (group, 128 de) tiles: the launch grid (`_persistent_programs`)
    and the schedule dealt for exactly that many programs (`tile_schedule`). acc: (acc1, acc2) shaped and typed as
    the first two outputs (dW1, dW2), aliased to them, which come back as acc + dW (constexprs' ACCUM); None: the
    kernel's acc inputs are w1 / w2, unread."""
    tiles_per_group = w1.shape[2] // 128
    programs = _persistent_programs(w1.shape[0] * tiles_per_group)
    # acc1, acc2 (after the 9 inputs) -> dW1, dW2 (their shapes checked by the public ops: `moe_heads_fused`)
    alias = {} if acc is None else {"input_output_aliases": {9: 0, 10: 1}}
    return _gluon_call(xs, dys, gates, meta.row_slot, meta.group_block_start, meta.group_sizes,
                       tile_schedule(meta.group_nblocks, tiles_per_group, heads, programs), w1, w2,
                       *((w1, w2) if acc is None else acc), kernel=kernel, out_shape=out_shape, programs=programs,
                       **alias, **constexprs)


def use_bwd_gluon(cfg: ExpertsConfig, dtype, dh: int, de: int) -> bool:
    """Whether the backward (dX, gate gradients and weight gradients) runs as the one warp-specialised Gluon kernel:
    cfg.bwd_ws on a backward whose kernels make the gate gradients (unpacked rows), bf16, a Hopper GPU, a shape the
    kernel takes; else the Triton kernel(s) of cfg (fused at de = 128, dX and dW apart otherwise)."""
    from kernels.gluon.experts import bwd_ws_supported

    return (cfg.bwd_ws and dgates_in_kernels(cfg, de) and dtype == jnp.bfloat16
            and bwd_ws_supported(dh, de, cfg.pack_block) and bool(_hopper_sms()))


def _bwd_gluon(st: Static, xs, dys, gates, meta: Meta, w1, w2, dw_dtype, heads: int, acc=None):
    """dX rows (P, de / 128, dh), dW1, dW2, gate gradients (P, de / 128) by the warp-specialised fused Gluon kernel
    (one partial per 128 de: the callers sum them); work items = (group, 128 de) tiles. acc: `_tiled_call`'s."""
    from kernels.gluon.experts import bwd_kernel

    p, (_, dh), (g, _, de) = meta.row_slot.shape[0], xs.shape, w1.shape
    kernel, constexprs = bwd_kernel(st.cfg.bwd_xw)  # with the dX warp group or without
    dw1, dw2, dx, dgate = _tiled_call(
        kernel, xs, dys, gates, meta, w1, w2, heads,
        [jax.ShapeDtypeStruct((g, dh, de), dw_dtype), jax.ShapeDtypeStruct((g, de, dh), dw_dtype),
         jax.ShapeDtypeStruct((p, de // 128 * dh), xs.dtype), jax.ShapeDtypeStruct((p, de // 128), jnp.float32)],
        dict(constexprs(st.k, dh, de, st.cfg.pack_block), ACCUM=acc is not None), acc)
    return dx.reshape(p, de // 128, dh), dw1, dw2, dgate


def _bwd_triton(st: Static, xs, dys, gates, meta: Meta, w1, w2, dw_dtype, heads: int, acc=None):
    """dX rows, dW1, dW2 and (when `dgates_in_kernels`) each packed row's gate gradient (P,) fp32, made by the
    dX kernel or, with dX fused, by the dW kernel. acc: (acc1, acc2) as dW1 / dW2, returned as acc + dW (the Gluon
    kernels add in place; after the Triton kernels XLA adds)."""
    p, (_, dh), (g, _, de) = meta.row_slot.shape[0], xs.shape, w1.shape
    if use_bwd_gluon(st.cfg, xs.dtype, dh, de):
        return _bwd_gluon(st, xs, dys, gates, meta, w1, w2, dw_dtype, heads, acc)
    jt = import_jax_triton()

    from kernels.triton.experts import expert_dw_kernel, expert_dwt_kernel, expert_dx_kernel

    fuse = st.cfg.dw.block_e == de
    dgates = dgates_in_kernels(st.cfg, de)
    common = dict(K=st.k, DH=dh, DE=de, PACK_BLOCK=st.cfg.pack_block, PACKED=st.cfg.packed_bwd, **_opts(xs.dtype))
    if st.cfg.packed_bwd:  # the kernels then read packed X / dO rows contiguously (gates unused)
        xs, dys = packed_bwd_rows(st, xs, dys, gates, meta)
    t = st.cfg.dw
    fused_dgates = fuse and dgates  # the fused dW kernel makes the gate gradients (transposed form only)
    if use_dw_gluon(st.cfg, xs.dtype, dh, de):
        dw1, dw2 = _dw_gluon(st, xs, dys, gates, meta, w1, w2, dw_dtype, heads, acc)
        acc = None  # added in the kernel
    else:
        dw1, dw2, dx_fused, dgate_fused = jt.triton_call(
            xs, dys, gates, meta.row_slot, meta.group_block_start, meta.group_nblocks, w1, w2,
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
        xs, dys, gates, meta.row_slot, meta.block_group, w1, w2, kernel=expert_dx_kernel,
        out_shape=[jax.ShapeDtypeStruct((p, dh), xs.dtype), jax.ShapeDtypeStruct((p if dgates else 1,), jnp.float32)],
        grid=(p // t.block_m,), num_warps=t.num_warps, num_stages=t.num_stages, BLOCK_M=t.block_m,
        BLOCK_E=t.block_e, DGATES=dgates, **common)
    return dx, dw1, dw2, dgate_rows if dgates else None


def packed_bwd_rows(st: Static, xs, dys, gates, meta: Meta):
    """Packed X rows and dO rows = gate * dy (P, dh) in xs.dtype, zero on padding (cfg.packed_bwd)."""
    valid = (meta.row_slot >= 0)[:, None]
    slot = jnp.maximum(meta.row_slot, 0)
    xp = jnp.where(valid, jnp.take(xs, slot // st.k, axis=0), 0).astype(xs.dtype)
    do = jnp.take(dys, slot // st.k, axis=0).astype(jnp.float32) * jnp.take(gates, slot)[:, None]
    return xp, jnp.where(valid, do, 0).astype(xs.dtype)


# ------------------------------------------------------------------- kernel stand-ins (pure JAX, CPU)

def _rows_fn(st: Static, meta: Meta, xs, w1, w2):
    from mhl_jax.moe.experts import expert_rows_reference

    valid = (meta.row_slot >= 0)[:, None]
    rows = jnp.where(valid, jnp.take(xs, jnp.maximum(meta.row_slot, 0) // st.k, axis=0), 0)
    return expert_rows_reference(rows, meta.block_group, w1, w2, st.cfg.pack_block)


def _fwd_emulate(st: Static, xs, meta: Meta, w1, w2, heads: int = 1):
    """`_fwd_triton`'s signature; heads (a launch order) means nothing to the emulation."""
    return _rows_fn(st, meta, xs, w1, w2)


def _bwd_emulate(st: Static, xs, dys, gates, meta: Meta, w1, w2, dw_dtype, heads: int, acc=None):
    rows, do = packed_bwd_rows(st, xs, dys, gates, meta)
    from mhl_jax.moe.experts import expert_rows_reference

    _, vjp = jax.vjp(lambda r, a, b: expert_rows_reference(r, meta.block_group, a, b, st.cfg.pack_block),
                     rows, w1, w2)
    drows, dw1, dw2 = vjp(do)
    dgate_rows = None
    if dgates_in_kernels(st.cfg, w1.shape[2]):  # the kernels' DGATES output: <out row, dy row> per row
        out_rows = _fwd_emulate(st, xs, meta, w1, w2)  # the kernel's A W2, recomputed (none kept for it)
        dy_rows = jnp.take(dys, jnp.maximum(meta.row_slot, 0) // st.k, axis=0).astype(jnp.float32)
        dgate_rows = jnp.where(meta.row_slot >= 0, jnp.sum(out_rows.astype(jnp.float32) * dy_rows, axis=1), 0.0)
    dw1, dw2 = dw1.astype(dw_dtype), dw2.astype(dw_dtype)
    if acc is not None:
        dw1, dw2 = acc[0] + dw1, acc[1] + dw2
    return drows, dw1, dw2, dgate_rows


# ------------------------------------------------------------------------------------ the custom_vjp

def pack_method(pack_impl: str, backend: str) -> str:
    """The packing method of a config under a backend: the Triton packing needs jax-triton, so the
    emulated (CPU) path packs with the JAX sort instead (same arrays)."""
    return "argsort" if pack_impl == "triton" and backend != "triton" else pack_impl


def resolve_config(num_slots: int, num_groups: int, dh: int, de: int, cfg: ExpertsConfig | None) -> ExpertsConfig:
    """The config the op runs: `cfg` or the measured default, fitted to de."""
    return (cfg or default_config(num_slots, num_groups, dh, de)).fit(de)


def packed_meta(idx: jax.Array, num_experts: int, block: int, pack_impl: str, backend: str,
                packing: pk.Packing | None, who: str) -> tuple[pk.Packing, Meta]:
    """The packing of idx (N, H, k) for an expert op, and the kernels' Meta. A packing handed in (made
    by the router, `route_topk_triton(..., pack=)`) is checked against the one the op would make with
    row block `block`; otherwise it is made here with `pack_impl` (`pack_method` under `backend`)."""
    n, h, k = idx.shape
    if packing is None:
        packing = pk.pack(idx, num_experts, block, pack_method(pack_impl, backend))
    else:
        want = (pk.padded_rows(n * h * k, h * num_experts, block), n * h * k, h * num_experts)
        got = (packing.row_slot.shape[0], packing.slot_row.shape[0], packing.group_sizes.shape[0])
        if got != want:
            raise ValueError(f"{who}: the given packing has (rows, slots, groups) = {got}, expected {want} "
                             f"(row block {block}: make it with mhl_jax.moe.experts.triton_packing_spec)")
    if backend == "triton" and packing_triton.META_KERNELS:
        start, count, _ = packing_triton.group_blocks_triton(packing.group_sizes, block)
    else:
        start, count = pk.group_blocks(packing.group_sizes, block)
    # read here, in the forward, so that the backward (traced later, outside any switch a caller flips around the
    # forward) gets the setting the forward ran with
    sizes = packing.group_sizes if BWD_SKIP_PADDING else count * block
    return packing, Meta(packing.row_slot, packing.slot_row, packing.block_group, start, count, sizes)


def take_slots(rows, slot_row):
    """rows (P, D), slot_row (M,) -> (M, D) fp32: each slot's packed row, zero for an empty slot (-1,
    e.g. the unused tail of an expert-parallel receive buffer)."""
    got = jnp.take(rows, jnp.maximum(slot_row, 0), axis=0).astype(jnp.float32)
    return jnp.where((slot_row >= 0)[:, None], got, 0.0)


def dgates_and_dy_rows(out_rows, slot_row, dy, gates):
    """Backward of the combine: dy (N, H, dh) as rows (N * H, dh) for the kernels, and dgates (N, H, k)
    in gates' dtype = <output row of each slot, dy> (a fused multiply-reduce, like `_combine`)."""
    n, h, k = gates.shape
    dh = dy.shape[-1]
    per_slot = take_slots(out_rows, slot_row).reshape(n, h, k, dh)
    dgates = jnp.sum(per_slot * dy.astype(jnp.float32)[:, :, None, :], axis=-1)
    return dy.reshape(n * h, dh), dgates.astype(gates.dtype)


# The forward's combine (gather each sub-token's k output rows, weight by the gates, sum) as a Triton kernel
# (`kernels.triton.combine.out_combine_kernel`, its sum in a fixed order) where the expert kernels run on Triton. H100,
# 2026-11-26, layer fwd+bwd in one process: 0.01-0.07 ms faster than XLA's gather-reduce fusion at the table's rows;
# both run at the HBM rate (bench/NOTES.md, Layer, Session 23). False: XLA's (`_combine`) everywhere.
OUT_COMBINE_KERNEL = True
# From k = FWD_HEAD_MAJOR_MIN_K on, the Gluon forward's programs take each head's row blocks in turn: all programs
# gather one head's x rows at a time, k times each, from L2; below it every program takes a contiguous share of all
# heads' blocks (keeping its weights across more of a group's blocks). H100, 81920 tokens, kernel alone: 1.077 vs
# 1.150 ms at 768/8/128, 1.275 vs 1.352 at 1536/8/128, but 0.779 vs 0.752 at 384/4/256 and level at 768/4/256; the
# layer -0.11 / -0.09 ms at the k 8 rows (bench/NOTES.md, Layer, Session 26). A large value: never (layer variant
# "fwd_all_heads").
FWD_HEAD_MAJOR_MIN_K = 8
# The Gluon dW / backward kernels compute (and write) only the 32-row blocks that hold a group's rows, not the blocks of
# padding after them at the end of its last packing block (up to pack_block - 32 rows; ~4% of the blocks at 768/8/128,
# ~13% at 1536/8/128 and 768/4/256, 81920 tokens). False: every block of the group's packing blocks, as until the
# 2026-11-26 session 28 (layer variant "bwd_pad_blocks").
BWD_SKIP_PADDING = True
# The Triton forward (the 64-row packing blocks: the 8192-token rows) on fp32 master weights converts them as it loads
# them and stores the converted weights from each group's first tile for the backward (`expert_fwd_cast_kernel`),
# instead of XLA casting them in a pass of its own before it (1.2 GB read and written at 201M parameters, then 0.4 GB
# read again by the forward). False: XLA's cast, as until the 2026-11-27 session 32 (layer variant "xla_cast").
FWD_CASTS_WEIGHTS = True
# The Gluon forward skips the second 64-row half of a packing block when it holds only padding (about every other
# group's last block: 3.5% of the halves at 768/8/128, ~6.5% at 1536/8/128 and 768/4/256, 81920 tokens): not computed,
# its rows left unwritten (the combines read real rows only). False: every half computed, padding rows 0, as until
# the 2026-11-26 session 29 (layer variant "fwd_pad_halves").
FWD_SKIP_PADDING = True


def combine_rows(out_rows, slot_row, gates, x_dtype, backend: str):
    """out_rows (P, dh), slot_row (M,), gates (N, H, k) fp32 -> (N, H, dh) in x_dtype: each sub-token's k output rows
    weighted by its gates and summed in fp32 (an empty slot adds 0), rounded once. Backend "triton" (and
    OUT_COMBINE_KERNEL): `out_combine_kernel`; else XLA (`_combine`)."""
    n, h, k = gates.shape
    if backend == "triton" and OUT_COMBINE_KERNEL:
        from kernels.triton.combine import combine_grid, out_combine_constexprs, out_combine_kernel, out_combine_tiles

        jt = import_jax_triton()
        dh = out_rows.shape[1]
        tiles = out_combine_tiles(dh)
        y = jt.triton_call(out_rows, slot_row, gates.reshape(-1), kernel=out_combine_kernel,
                           out_shape=jax.ShapeDtypeStruct((n * h, dh), x_dtype), grid=combine_grid(n * h, tiles),
                           num_warps=tiles.num_warps, **out_combine_constexprs(n * h, dh, k, tiles))
        return y.reshape(n, h, dh)
    return _combine(out_rows, slot_row, gates).astype(x_dtype)


def _combine(out_rows, slot_row, gates):
    """out_rows (P, dh), slot_row (M,), gates (N, H, k) fp32 -> (N, H, dh) fp32, fixed-order sum over k."""
    n, h, k = gates.shape
    per_slot = take_slots(out_rows, slot_row).reshape(n, h, k, -1)
    # a multiply-reduce over k, not a k = 4 dot: XLA fuses the row gather into the reduction instead of
    # materialising the (M, dh) fp32 rows as a dot operand
    return jnp.sum(per_slot * gates[..., None], axis=2)


def _forward(st: Static, x, gates, w1, w2, meta: Meta, wc):
    n, h, dh = x.shape
    _, ne, _, de = w1.shape
    xs = x.reshape(n * h, dh)
    if fwd_casts_weights(st, x.dtype, w1.dtype, wc is not None):
        out_rows, w1c, w2c = _fwd_triton_call(st, xs, meta, w1.reshape(h * ne, dh, de), w2.reshape(h * ne, de, dh),
                                              cast=True)
    else:
        w1c, w2c = (w1, w2) if wc is None else wc  # wc: the weights already cast (by the router's kernel)
        w1c = w1c.reshape(h * ne, dh, de).astype(x.dtype)
        w2c = w2c.reshape(h * ne, de, dh).astype(x.dtype)
        fwd = _fwd_triton if st.backend == "triton" else _fwd_emulate
        out_rows = fwd(st, xs, meta, w1c, w2c, h)
    y = combine_rows(out_rows, meta.slot_row, gates.astype(jnp.float32), x.dtype, st.backend)
    # the output rows are kept for the backward only where no kernel makes the gate gradients
    keep = None if dgates_in_kernels(st.cfg, de) else out_rows
    return y, (xs, gates, keep, w1c, w2c, meta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(st: Static, x, gates, w1, w2, meta: Meta, wc):
    return _forward(st, x, gates, w1, w2, meta, wc)[0]


def _experts_fwd(st: Static, x, gates, w1, w2, meta: Meta, wc):
    return _forward(st, x, gates, w1, w2, meta, wc)


def experts_bwd_kernels(st: Static, res, dy, acc=None):
    """The backward's kernels: packed dX rows (P, dh) or partial rows (P, parts, dh), dW1 (G, dh, de), dW2 (G, de,
    dh) in the weights' dtype, and the gate gradients per packed row (P, parts) fp32 where the kernels make them
    (`dgates_in_kernels`), else None (`slot_dgates` makes them in XLA); dx itself is left to the combine. acc:
    (acc1, acc2) gradients summed so far, shaped as w1 / w2 (H, Ne, ...) in the weights' dtype: dW1 / dW2 come back
    as acc + dW (in place in the Gluon kernels)."""
    xs, gates, _, w1c, w2c, meta = res
    n, h, _ = gates.shape
    bwd = _bwd_triton if st.backend == "triton" else _bwd_emulate
    if acc is not None:
        acc = (acc[0].reshape(w1c.shape), acc[1].reshape(w2c.shape))
    # the kernel accumulates in fp32 and writes the gradient straight in the weights' dtype
    dxr, dw1, dw2, dgate_rows = bwd(st, xs, dy.reshape(n * h, -1), gates.reshape(-1).astype(jnp.float32), meta,
                                    w1c, w2c, jnp.dtype(st.w_dtype), h, acc)
    if dgate_rows is not None:
        dgate_rows = dgate_rows.reshape(dgate_rows.shape[0], -1)
    return dxr, dw1, dw2, dgate_rows


def slot_dgates(res, dy, dgate_rows):
    """dgates (N, H, k) in gates' dtype: the kernels' per-row gate gradients (partials summed) per slot (empty: 0),
    or, where they make none (packed dO rows, or dX fused into the row-form dW kernel), <output row, dy> in XLA."""
    _, gates, out_rows, _, _, meta = res
    if dgate_rows is None:
        return dgates_and_dy_rows(out_rows, meta.slot_row, dy, gates)[1]
    return take_slots(dgate_rows, meta.slot_row).sum(-1).reshape(gates.shape).astype(gates.dtype)


def _experts_bwd(st: Static, res, dy):
    dxr, dw1, dw2, dgate_rows = experts_bwd_kernels(st, res, dy)
    dgates = slot_dgates(res, dy, dgate_rows)
    return bwd_cotangents(dxr, dgates, dw1, dw2, res[0].dtype, res[5]) + (None,)  # the weights' cast: none


def bwd_cotangents(dx_rows, dgates, dw1, dw2, x_dtype, meta: Meta):
    """The custom_vjp's cotangents (x, gates, w1, w2, meta) from the packed dX rows (P, dh) or partial rows
    (P, parts, dh), dgates (N, H, k) and the per-group dW1 (G, dh, de), dW2 (G, de, dh): dx sums each sub-token's
    k slots (and their partials) in fp32; the weights go back to (H, Ne, ...)."""
    n, h, k = dgates.shape
    g, dh, de = dw1.shape
    p = dx_rows.shape[0]
    dx = take_slots(dx_rows.reshape(p, -1), meta.slot_row).reshape(n, h, k, -1, dh).sum((2, 3))
    zero_meta = jax.tree.map(lambda a: None, meta)
    return (dx.astype(x_dtype), dgates, dw1.reshape(h, g // h, dh, de), dw2.reshape(h, g // h, de, dh), zero_meta)


_experts.defvjp(_experts_fwd, _experts_bwd)


def expert_ffn_triton(x: jax.Array, idx: jax.Array, gates: jax.Array, w1: jax.Array, w2: jax.Array,
                      cfg: ExpertsConfig | None = None, backend: str = "triton",
                      packing: pk.Packing | None = None, weights_cast=None) -> tuple[jax.Array, jax.Array]:
    """x: (N, H, dh) bf16 (fp32 allowed: exact but slow); idx: (N, H, k) int32; gates: (N, H, k) fp32;
    w1: (H, Ne, dh, de), w2: (H, Ne, de, dh) fp32 or x.dtype.

    Returns y (N, H, dh) in x.dtype and the load (H, Ne) int32 (routed slots per (head, expert)).
    Same contract as `expert_ffn(..., impl="reference")`; `cfg` overrides the packing block and tiles;
    `packing`: the packing of idx already made (by the router, `route_topk_triton(..., pack=)`) with
    this config's block (`mhl_jax.moe.experts.triton_packing_spec`), else it is made here; `weights_cast`:
    (w1, w2) already cast to x's dtype (by the router's kernel, `route_topk_triton(..., cast=)`), read instead of
    casting here (w1, w2 still get the gradients, in their own dtype).
    """
    n, h, _ = x.shape
    ne = w1.shape[1]
    if idx.shape != gates.shape or idx.shape[:2] != (n, h):
        raise ValueError(f"expert_ffn_triton: shapes disagree: x {x.shape}, idx {idx.shape}, gates "
                         f"{gates.shape}, w1 {w1.shape}, w2 {w2.shape}")
    st = experts_static(x, idx.shape[2], w1, w2, cfg, backend, weights_cast)
    packing, meta = packed_meta(idx, ne, st.cfg.pack_block, st.cfg.pack_impl, backend, packing, "expert_ffn_triton")
    y = _experts(st, x, gates.astype(jnp.float32), w1, w2, meta, weights_cast)
    return y, packing.group_sizes.reshape(h, ne)


def experts_static(x: jax.Array, k: int, w1: jax.Array, w2: jax.Array, cfg: ExpertsConfig | None = None,
                   backend: str = "triton", weights_cast=None) -> Static:
    """`expert_ffn_triton`'s arguments checked, as the Static its custom_vjp (or `moe_triton`'s) runs with."""
    n, h, dh = x.shape
    ne, de = w1.shape[1], w1.shape[3]
    if backend not in ("triton", "emulate"):
        raise ValueError(f"expert_ffn_triton: backend={backend!r}, expected 'triton' or 'emulate'")
    if w1.shape != (h, ne, dh, de) or w2.shape != (h, ne, de, dh):
        raise ValueError(f"expert_ffn_triton: shapes disagree: x {x.shape}, w1 {w1.shape}, w2 {w2.shape}")
    cfg = resolve_config(n * h * k, h * ne, dh, de, cfg)
    cfg.check(dh, de)
    if w1.dtype != w2.dtype:
        raise ValueError(f"expert_ffn_triton: w1 {w1.dtype} and w2 {w2.dtype} must share a dtype")
    if weights_cast is not None and any(c.shape != w.shape or c.dtype != x.dtype
                                        for c, w in zip(weights_cast, (w1, w2))):
        raise ValueError(f"expert_ffn_triton: weights_cast must be w1, w2 in {x.dtype}, got "
                         f"{[(c.shape, c.dtype) for c in weights_cast]}")
    return Static(cfg, k, backend, jnp.dtype(w1.dtype).name)
