"""The packing (`mhl_jax.ops.packing.pack`) as Triton kernels (`kernels/packing.py`) bound through
jax-triton: `pack(..., method="triton")`. Five launches, integer-only, no atomics, the same arrays as
the JAX methods (checked under the Triton interpreter against them in tests/test_packing.py; the
binding itself needs a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.packing import (
    PACK_CHUNK,
    launch_shapes,
    pack_block_group_kernel,
    pack_groups_kernel,
    pack_hist_kernel,
    pack_offsets_kernel,
    pack_scatter_kernel,
)
from mhl_jax.ops.kernels_select import import_jax_triton

BLOCK_GROUP_TILE = 1024


def pack_triton(idx: jax.Array, num_experts: int, block: int, chunk: int = PACK_CHUNK):
    """idx (N, H, k) int32 (-1 = empty slot) -> `Packing` (row_slot, slot_row, block_group, group_sizes,
    num_blocks), equal to `pack(idx, num_experts, block)`."""
    from mhl_jax.ops.packing import Packing, padded_rows

    jt = import_jax_triton()
    n, h, k = idx.shape
    ne = num_experts
    sh = launch_shapes(n, h, k, ne, chunk)
    m, g = n * h * k, h * ne
    p = padded_rows(m, g, block)
    nb = p // block
    i32 = jnp.int32
    idx = idx.astype(i32)

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, i32)

    common = dict(H=h, K=k, ML=sh["ML"], NE=ne, NEP=sh["NEP"], NC=sh["NC"], C=sh["C"])
    per_chunk = shape(h, sh["NC"], sh["NEP"])
    hist, lower = jt.triton_call(idx, kernel=pack_hist_kernel, out_shape=[per_chunk, per_chunk],
                                 grid=(sh["NC"], h), num_warps=4, **common)
    base, sizes = jt.triton_call(hist, lower, kernel=pack_offsets_kernel, out_shape=[per_chunk, shape(g)],
                                 grid=(h, sh["NEP"] // sh["EB"]), num_warps=4, NE=ne, NEP=sh["NEP"], NC=sh["NC"],
                                 CB=sh["CB"], EB=sh["EB"])
    pstart, bend, nblocks = jt.triton_call(sizes, kernel=pack_groups_kernel, out_shape=[shape(g), shape(g), shape(1)],
                                           grid=(1,), num_warps=4, G=g, R=block, GB=sh["GB"])
    slot_row, row_slot = jt.triton_call(
        idx, base, pstart, jnp.full((p,), -1, i32), kernel=pack_scatter_kernel, out_shape=[shape(m), shape(p)],
        grid=(sh["NC"], h), num_warps=4, input_output_aliases={3: 1}, LOG_C=sh["LOG_C"], **common)
    block_group = jt.triton_call(bend, nblocks, kernel=pack_block_group_kernel, out_shape=shape(nb),
                                 grid=(-(-nb // BLOCK_GROUP_TILE),), num_warps=4, G=g, NB=nb,
                                 BLOCK=BLOCK_GROUP_TILE, STEPS=g.bit_length() + 1)
    return Packing(row_slot, slot_row, block_group, sizes, nblocks.reshape(()))
