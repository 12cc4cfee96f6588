"""The packing (`mhl_jax.ops.packing.pack`) as Triton kernels (`kernels/packing.py`) bound through
jax-triton: `pack(..., method="triton")`. Five launches (the plan `kernels.packing.pack_launches`, which
the torch launcher runs too), integer-only, no atomics, the same arrays as the JAX methods (checked
under the Triton interpreter against them in tests/test_packing.py; the binding itself needs a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.packing import PACK_CHUNK, PACK_RESULT, pack_launches
from mhl_jax.ops.kernels_select import import_jax_triton


def pack_triton(idx: jax.Array, num_experts: int, block: int, chunk: int = PACK_CHUNK):
    """idx (N, H, k) int32 (-1 = empty slot) -> `Packing` (row_slot, slot_row, block_group, group_sizes,
    num_blocks), equal to `pack(idx, num_experts, block)`."""
    from mhl_jax.ops.packing import Packing, padded_rows

    jt = import_jax_triton()
    n, h, k = idx.shape
    p = padded_rows(n * h * k, h * num_experts, block)
    bufs = {"idx": idx.astype(jnp.int32)}
    for launch in pack_launches(n, h, k, num_experts, block, p, chunk):
        names = [name for name, _ in launch.outputs]
        shapes = dict(launch.outputs)
        bufs.update({name: jnp.full(shapes[name], value, jnp.int32) for name, value in launch.fill})
        outs = jt.triton_call(
            *[bufs[name] for name in launch.inputs], kernel=launch.kernel,
            out_shape=[jax.ShapeDtypeStruct(shape, jnp.int32) for _, shape in launch.outputs], grid=launch.grid,
            num_warps=launch.num_warps,
            input_output_aliases={launch.inputs.index(name): names.index(name) for name, _ in launch.fill} or None,
            **launch.meta)
        bufs.update(zip(names, outs))
    row_slot, slot_row, block_group, sizes, nblocks = (bufs[name] for name in PACK_RESULT)
    return Packing(row_slot, slot_row, block_group, sizes, nblocks.reshape(()))
