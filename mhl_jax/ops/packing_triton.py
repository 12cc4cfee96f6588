"""The packing (`mhl_jax.ops.packing.pack`) as Triton kernels (`kernels/packing.py`) bound through
jax-triton: `pack(..., method="triton")`. Five launches (the plan `kernels.packing.pack_launches`, which
the torch launcher runs too), integer-only (integer atomic adds for the chunk histograms at >= 1024 bins:
order-free counts), the same arrays as the JAX methods (checked
under the Triton interpreter against them in tests/test_packing.py; the binding itself needs a GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.packing import PACK_CHUNK, PACK_RESULT, pack_launches
from mhl_jax.ops.kernels_select import import_jax_triton


def pack_triton(idx: jax.Array, num_experts: int, block: int, chunk: int = PACK_CHUNK):
    """idx (N, H, k) int32 (-1 = empty slot) -> `Packing` (row_slot, slot_row, block_group, group_sizes,
    num_blocks), equal to `pack(idx, num_experts, block)`.

    Integer in, integer out: nothing to differentiate, but under jax.grad the indices (outputs of the
    router's custom_vjp) carry zero tangents and jax-triton's call has no JVP rule ("triton_call does
    not support automatic differentiation", H100, 2026-11-23), so the launches sit in a custom_vjp
    whose backward returns no cotangent."""
    return _pack(num_experts, block, chunk, idx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pack(num_experts: int, block: int, chunk: int, idx: jax.Array):
    return _launch(idx, num_experts, block, chunk)


def _pack_fwd(num_experts, block, chunk, idx):
    return _launch(idx, num_experts, block, chunk), None


def _pack_bwd(num_experts, block, chunk, res, cts):
    return (None,)


_pack.defvjp(_pack_fwd, _pack_bwd)


def _launch(idx: jax.Array, num_experts: int, block: int, chunk: int):
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
