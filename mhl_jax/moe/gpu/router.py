"""The IO-aware router on Triton (paper Alg. 1/2, kernels in `kernels/triton/router.py`), bound into JAX with
jax-triton under one `jax.custom_vjp`.

    x (N, H, dh) bf16, w_r (H, dh, Ne) fp32, bias (H, Ne) fp32
    -> values (N, H, k) fp32 (selected raw scores), indices (N, H, k) int32

Same contract as `mhl_jax.moe.router.route_topk_reference` (selection = top-k of scores + bias, ties to the lower
index; values are the raw scores; bias gets no gradient).

forward   W_r split into three bf16 terms (exact products, fp32 accumulation; fp32 x: the fp32 W_r, "ieee" dots)
          -> one kernel streams W_r blocks and keeps a running top-k on chip; writes only (N, H, k). Which kernel
          runs is `router_kind`'s choice: on Hopper the warp-specialised Gluon one (kernels/gluon/router.py, the
          same outputs to the bit) where it takes the shape, else the Triton one.
backward  dx: k gathered rows of W_r^T per token (fixed order). dW_r: the slots grouped per (head, expert) by a
          packing of the indices (`mhl_jax.moe.gpu.packing`: a stable counting sort), cut into blocks of one
          group each; a kernel sums each block in order, another sums each group's blocks in order. No float
          atomics anywhere: gradients are bitwise reproducible. With `pack=` (the model's path,
          `mhl_jax.moe.core`) the forward packs the indices for the expert op and the backward cuts its blocks
          from that packing; alone, the backward packs them itself (rows of MIN_PACK_BLOCK).

Memory: O(N k + H Ne dh); nothing of size N x Ne exists. Works under jit and inside shard_map (use
it there: under plain jit jax-triton gathers sharded inputs). `backend="emulate"` runs the same
custom_vjp and metadata with pure-JAX stand-ins for the kernels, so the plumbing is tested on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels.gluon import router as gluon_router
from kernels.triton import router as kr
from kernels.tuning import RouterTiles, router_tiles
from mhl_jax.moe import packing as pk
from mhl_jax.moe.gpu import gluon as gluon_bridge
from mhl_jax.moe.gpu import packing as packing_triton
from mhl_jax.moe.packing import prefix_scan
from mhl_jax.moe.plan import MAX_TRITON_ROUTER_WIDTH, import_jax_triton, pack_method
from mhl_jax.moe.router import check_router_shapes, route_topk_reference

# The smallest packing row block the router takes (`pack=`): the router alone packs its indices for the dW layout in
# blocks of this size, the least padding (which the dW kernels never read).
MIN_PACK_BLOCK = 16


def router_kind(dh: int, ne: int, k: int, dtype) -> str:
    """Which router runs for inputs of width dh, Ne experts, top-k, activations of `dtype` on this process's GPU:
    "reference" for inputs wider than MAX_TRITON_ROUTER_WIDTH (the kernels keep x and W_r blocks on chip),
    "gluon-ws" (the warp-specialised forward) on Hopper for bf16 at the shapes it takes, else "triton"."""
    if dh > MAX_TRITON_ROUTER_WIDTH:
        return "reference"
    if jnp.dtype(dtype) == jnp.bfloat16 and gluon_router.ws_router_supported(dh, ne, k) and gluon_bridge.hopper_sms():
        return "gluon-ws"
    return "triton"


class Static(NamedTuple):
    k: int
    tiles: RouterTiles
    backend: str  # "triton" | "emulate"
    pack: tuple[int, str] | None = None  # (row block, method): also return the experts' packing of idx


class DwMeta(NamedTuple):
    """Expert-sorted slot layout for the dW kernels (all int32; G = H * Ne groups, NB blocks), cut from a packing
    (`dw_metadata_from_packing`)."""

    order: jax.Array  # (P,) the packed rows' local slots n * k + j, or with global_slots the packing's row_slot
    # itself (global slots (n * H + h) * k + j: the dW kernel's GLOBAL_SLOTS); padding rows never read
    block_group: jax.Array  # (NB,) group h * Ne + e of each block, -1 past the used blocks
    group_start: jax.Array  # (G,) first position of the group in `order`
    group_bstart: jax.Array  # (G,) first block of the group
    group_size: jax.Array  # (G,) slots of the group (the expert load of that head)
    group_nblk: jax.Array  # (G,) blocks of the group


def split_bf16(w: jax.Array, parts: int) -> jax.Array:
    """w fp32 (...) -> (parts, ...) bf16, w ~= sum of the parts (exact for parts=3, normal values).

    The truncation is done on the bits, not through an f32 -> bf16 -> f32 round trip, which XLA may
    fold away (xla_allow_excess_precision) and silently leave a zero residual."""
    out, r = [], w.astype(jnp.float32)
    for q in range(parts):
        if q == parts - 1:
            out.append(r.astype(jnp.bfloat16))
            break
        bits = jax.lax.bitcast_convert_type(r, jnp.uint32) & jnp.uint32(0xFFFF0000)
        hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
        out.append(hi.astype(jnp.bfloat16))
        r = r - hi
    return jnp.stack(out)


def _cut_groups(order, start, size, block: int, nb: int) -> DwMeta:
    """DwMeta for groups whose slots lie contiguous in `order` from `start` (G,), `size` (G,) long: each
    group cut into blocks of at most `block` slots, blocks numbered group after group (nb: static bound)."""
    nblk = (size + block - 1) // block
    cum = prefix_scan(jnp.add, nblk)
    bstart = cum - nblk
    blocks = jnp.arange(nb, dtype=jnp.int32)
    # mark each non-empty group's first block with the group, carry the mark forward
    g_ids = jnp.arange(size.shape[0], dtype=jnp.int32)
    marks = jnp.full((nb,), -1, jnp.int32).at[jnp.where(nblk > 0, bstart, nb)].max(g_ids, mode="drop")
    bg = jnp.where(blocks < cum[-1], prefix_scan(jnp.maximum, marks), -1)
    return DwMeta(order, bg, start, bstart, size, nblk)


def dw_metadata_from_packing(packing: pk.Packing, heads: int, k: int, pack_block: int, block: int,
                             global_slots: bool = False) -> DwMeta:
    """The dW layout taken from a packing of the indices (no sort of its own).

    The packing holds each (head, expert) group's slots in slot order (a stable sort by expert), contiguous from
    the group's first padded row (its padding follows its last slot). So `order` is the packed rows' local slots
    n * k + j (padding rows are never read: a block stops at its group's size) and the groups are cut into dW
    blocks of at most `block` slots: whatever the packing's row block, the same blocks, so the same dW_r to the
    bit. Elementwise work and scans over the G groups.

    global_slots (GPU, jax-triton): `order` is the packing's row_slot as it is (global slots (n * H + h) * k + j,
    which the dW kernel reads with GLOBAL_SLOTS) and the groups are cut by Triton launches
    (`packing_triton.group_blocks_triton`) instead of ~15 small XLA kernels and a pass over the rows; the same
    blocks."""
    n_slots, g = packing.slot_row.shape[0], packing.group_sizes.shape[0]
    nb = kr.dw_num_blocks(n_slots, g, block)
    start = packing.group_block_start * pack_block
    if global_slots:
        bstart, nblk, _, bg = packing_triton.group_blocks_triton(packing.group_sizes, block, nb)
        return DwMeta(packing.row_slot, bg, start, bstart, packing.group_sizes, nblk)
    s = packing.row_slot
    local = jnp.where(s >= 0, s // (heads * k) * k + s % k, 0).astype(jnp.int32)
    return _cut_groups(local, start, packing.group_sizes, block, nb)


def _dhp(dh: int) -> int:
    return max(16, kr.next_pow2(dh))


# ----------------------------------------------------------------------------- kernel calls (Triton)

def _fwd_gluon(st: Static, x, wp, bias, cast=None):
    """(values, indices) and, with `cast` (two fp32 arrays of one size), their bf16 casts made by the caster warp
    group beside the selection (two consumers then: `ws_router_constexprs`)."""
    n, h, dh = x.shape
    size = cast[0].size if cast else 0
    consts = gluon_router.ws_router_constexprs(n, h, dh, wp.shape[3], st.k, cast_n=size)
    cin = [c.reshape(-1) for c in cast] if cast else [jnp.zeros((1,), jnp.float32)] * 2
    out = gluon_bridge.gluon_call(
        x, wp, bias, *cin, kernel=gluon_router.ws_router_kernel(consts["NC"], bool(cast)),
        out_shape=[jax.ShapeDtypeStruct((n, h, st.k), jnp.float32), jax.ShapeDtypeStruct((n, h, st.k), jnp.int32)]
        + [jax.ShapeDtypeStruct(c.shape, jnp.bfloat16) for c in cin],
        programs=min(gluon_bridge.hopper_sms(), gluon_router.ws_router_items(n, h, consts["NC"])), **consts)
    if cast:
        return out[0], out[1], tuple(o.reshape(c.shape) for o, c in zip(out[2:], cast))
    return out[0], out[1]


def _fwd_triton(st: Static, x, w, bias, cast=None):
    """(values, indices), and a third output, the bf16 casts of `cast`, where the Gluon kernel's caster makes them."""
    n, h, dh = x.shape
    ne, t = w.shape[2], st.tiles
    wp = split_bf16(w, kr.WEIGHT_PARTS) if x.dtype == jnp.bfloat16 else w[None]
    if router_kind(dh, ne, st.k, x.dtype) == "gluon-ws":
        return _fwd_gluon(st, x, wp, bias, cast)
    jt = import_jax_triton()
    vals, idx = jt.triton_call(
        x, wp, bias, kernel=kr.router_fwd_kernel,
        out_shape=[jax.ShapeDtypeStruct((n, h, st.k), jnp.float32), jax.ShapeDtypeStruct((n, h, st.k), jnp.int32)],
        grid=kr.fwd_grid(n, h, t), num_warps=t.fwd_warps, num_stages=t.fwd_stages,
        N=n, H=h, DH=dh, DHP=_dhp(dh), NE=ne, K=st.k, KP=max(2, kr.next_pow2(st.k)), PARTS=wp.shape[0],
        BLOCK_N=t.block_n, BLOCK_E=t.block_e, UPCAST=False, ROW_TILES=t.row_tiles)
    return vals, idx  # a tuple (jax-triton returns a list), as the reference and shard_map out_specs


def _dx_triton(st: Static, idx, dvals, wt, x_dtype):
    jt = import_jax_triton()
    n, h, k = idx.shape
    _, ne, dh = wt.shape
    t = st.tiles
    return jt.triton_call(
        idx, dvals, wt, kernel=kr.router_bwd_dx_kernel, out_shape=jax.ShapeDtypeStruct((n, h, dh), x_dtype),
        grid=(-(-n // t.dx_block_n), h), num_warps=t.dx_warps,
        N=n, H=h, DH=dh, DHP=_dhp(dh), NE=ne, K=k, BLOCK_N=t.dx_block_n)


def _dw_triton(st: Static, x, dvals, meta: DwMeta, ne: int, global_slots: bool):
    jt = import_jax_triton()
    n, h, dh = x.shape
    t, nb, dhp = st.tiles, meta.block_group.shape[0], _dhp(dh)
    part = jt.triton_call(
        x, dvals, meta.order, meta.block_group, meta.group_start, meta.group_bstart, meta.group_size,
        kernel=kr.router_bwd_dw_partial_kernel, out_shape=jax.ShapeDtypeStruct((nb, dhp), jnp.float32),
        grid=(nb,), num_warps=t.dw_warps,
        H=h, DH=dh, DHP=dhp, NE=ne, K=st.k, CB=t.dw_block, SUB=t.dw_sub, GLOBAL_SLOTS=global_slots)
    return jt.triton_call(
        part, meta.group_bstart, meta.group_nblk, kernel=kr.router_bwd_dw_reduce_kernel,
        out_shape=jax.ShapeDtypeStruct((h, dh, ne), jnp.float32), grid=(-(-ne // t.red_block_e), h),
        num_warps=t.red_warps, DH=dh, DHP=dhp, NE=ne, BLOCK_E=t.red_block_e)


# ------------------------------------------------------------------- kernel stand-ins (pure JAX, CPU)

def _fwd_emulate(st: Static, x, w, bias, cast=None):
    return route_topk_reference(x, w, bias, st.k)


def _dx_emulate(st: Static, idx, dvals, wt, x_dtype):
    rows = jnp.take_along_axis(wt[None], idx[..., None], axis=2)  # (N, H, k, dh)
    return jnp.einsum("nhkd,nhk->nhd", rows, dvals, precision=jax.lax.Precision.HIGHEST).astype(x_dtype)


def _dw_emulate(st: Static, x, dvals, meta: DwMeta, ne: int, global_slots: bool):
    """Same blocks and metadata as the kernels, reduced with plain JAX ops (local slots only: no GLOBAL_SLOTS)."""
    n, h, dh = x.shape
    cb = st.tiles.dw_block
    g = jnp.maximum(meta.block_group, 0)
    lb = jnp.arange(meta.block_group.shape[0]) - meta.group_bstart[g]
    cnt = jnp.minimum(meta.group_size[g] - lb * cb, cb)
    o = jnp.arange(cb)[None]
    valid = (o < cnt[:, None]) & (meta.block_group >= 0)[:, None]  # (NB, CB)
    pos = jnp.where(valid, meta.group_start[g][:, None] + lb[:, None] * cb + o, 0)
    slot = meta.order[pos]
    xrow = (slot // st.k) * h + (g // ne)[:, None]
    contrib = x.reshape(n * h, dh)[xrow].astype(jnp.float32) * dvals.reshape(-1)[xrow * st.k + slot % st.k][..., None]
    part = jnp.where(valid[..., None], contrib, 0).sum(1)  # (NB, dh)
    dw = jax.ops.segment_sum(part, jnp.where(meta.block_group >= 0, meta.block_group, h * ne), h * ne + 1)
    return jnp.swapaxes(dw[:-1].reshape(h, ne, dh), 1, 2)


# ------------------------------------------------------------------------------------ the custom_vjp

def _forward(st: Static, x, w, bias, cast):
    """The forward's outputs: values, indices, with st.pack the packing, with `cast` the casts."""
    fwd = _fwd_triton if st.backend == "triton" else _fwd_emulate
    vals, idx, *made = fwd(st, x, w.astype(jnp.float32), bias.astype(jnp.float32), cast)
    out = (vals, idx)
    if st.pack is not None:
        block, method = st.pack
        out += (packing_triton.pack(idx, w.shape[2], block, method),)
    if cast is not None:  # made by the kernel, else by XLA
        out += (made[0] if made else tuple(c.astype(x.dtype) for c in cast),)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route(st: Static, x, w, bias, cast):
    return _forward(st, x, w, bias, cast)


def _route_fwd(st: Static, x, w, bias, cast):
    out = _forward(st, x, w, bias, cast)
    return out, (x, w, bias) + tuple(out[1:3 if st.pack is not None else 2])


def transposed_weights(w: jax.Array) -> jax.Array:
    """W_r (H, dh, Ne) -> (H, Ne, dh) fp32: the rows the dX kernels gather are contiguous."""
    return jnp.swapaxes(w.astype(jnp.float32), 1, 2)


def router_dw(st: Static, x, w, idx, packing, dvals):
    """dW_r (H, dh, Ne) in w's dtype from the cotangent of the selected scores dvals (N, H, k) fp32. The dW layout is
    cut from a packing of idx: the experts' (`packing`, when st.pack is set), else one made here in rows of
    MIN_PACK_BLOCK (emulated: by the JAX sort, the same arrays)."""
    ne = w.shape[2]
    triton = st.backend == "triton"
    if packing is None:
        block = MIN_PACK_BLOCK
        packing = packing_triton.pack(idx, ne, block, pack_method("triton", st.backend))
    else:
        block = st.pack[0]
    meta = dw_metadata_from_packing(packing, x.shape[1], st.k, block, st.tiles.dw_block, global_slots=triton)
    dw = (_dw_triton if triton else _dw_emulate)(st, x, dvals, meta, ne, triton)
    return dw.astype(w.dtype)


def _route_bwd(st: Static, res, cts):
    x, w, bias, idx = res[:4]
    dvals = cts[0].astype(jnp.float32)  # the other cotangents (indices, packing) are float0
    dx = (_dx_triton if st.backend == "triton" else _dx_emulate)(st, idx, dvals, transposed_weights(w), x.dtype)
    dw = router_dw(st, x, w, idx, res[4] if st.pack is not None else None, dvals)
    return dx, dw, jnp.zeros_like(bias), None  # the cast arrays: no cotangent from here


_route.defvjp(_route_fwd, _route_bwd)


def route_topk_triton(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int, *, backend: str = "triton",
                      pack: tuple[int, str] | None = None, cast: tuple[jax.Array, jax.Array] | None = None,
                      tiles: RouterTiles | None = None) -> tuple[jax.Array, ...]:
    """x: (N, H, dh) bf16 (or fp32: then fp32 dots); w_r: (H, dh, Ne) fp32; bias: (H, Ne) fp32 (no gradient).

    Returns values (N, H, k) fp32 (selected raw scores) and indices (N, H, k) int32, ordered by
    decreasing biased score, ties to the lower expert index. `backend="emulate"` swaps the kernels for pure-JAX
    stand-ins (CPU tests of the plumbing); `tiles` overrides kernels.tuning.router_tiles (tests, tile sweeps).

    pack = (row block, method): also return the experts' packing of the indices (`mhl_jax.moe.gpu.packing.pack`,
    a third output without gradient). The backward then takes the dW layout from it (`dw_metadata_from_packing`)
    instead of packing the indices a second time.

    cast = (a, b), two fp32 arrays of one size (the expert weights): also return (a, b) in x's dtype as the last
    output, without gradient. Where the forward runs on the Gluon kernel (with two consumers then), its caster
    warp group makes them beside the selection (the router reads little HBM; the cast's traffic still slows it by
    about a third of the cast's own time); else XLA casts them."""
    st = router_static(x, w_r, bias, k, backend=backend, pack=pack, cast=cast, tiles=tiles)
    return _route(st, x, w_r, bias, cast)


def router_static(x: jax.Array, w_r: jax.Array, bias: jax.Array, k: int, *, backend: str = "triton",
                  pack: tuple[int, str] | None = None, cast: tuple[jax.Array, jax.Array] | None = None,
                  tiles: RouterTiles | None = None) -> Static:
    """`route_topk_triton`'s arguments checked, as the Static its custom_vjp (or the fused MoE core's) runs with."""
    check_router_shapes(x, w_r, bias, k)
    n, h, dh = x.shape
    ne = w_r.shape[2]
    if backend not in ("triton", "emulate"):
        raise ValueError(f"route_topk_triton: backend={backend!r}, expected 'triton' or 'emulate'")
    tiles = tiles or router_tiles(ne, k)
    kr.check_router_args(n, h, dh, ne, k, tiles)
    if pack is not None:
        block, method = pack
        if block < MIN_PACK_BLOCK or block & (block - 1) or method not in packing_triton.PACK_METHODS:
            raise ValueError(f"route_topk_triton: pack={pack!r}, expected (row block: a power of 2 >= "
                             f"{MIN_PACK_BLOCK}, method in {packing_triton.PACK_METHODS})")
        pack = (int(block), pack_method(method, backend))
    if cast is not None:
        a, b = cast
        if a.size != b.size or a.dtype != jnp.float32 or b.dtype != jnp.float32 or x.dtype != jnp.bfloat16:
            raise ValueError(f"route_topk_triton: cast wants two fp32 arrays of one size and bf16 x, got "
                             f"{a.shape} {a.dtype}, {b.shape} {b.dtype}, x {x.dtype}")
    return Static(k, tiles, backend, pack)
