"""The packing (`mhl_jax.moe.packing.pack`) as Triton kernels (`kernels/triton/packing.py`) bound through
jax-triton. Five launches (the plan `kernels.triton.packing.pack_launches`, which the torch launcher runs too),
integer-only (integer atomic adds for the chunk histograms at many bins: order-free counts), the same arrays as the
JAX sort (checked under the Triton interpreter in tests/kernels/test_packing.py; the binding itself needs a GPU).
The same launches cut a packing's groups into other blocks (`group_blocks_triton`, the router's dW blocks): two
launches in place of ~15 small XLA kernels of log-depth scans over the groups."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.triton.packing import PACK_RESULT, cut_launches, pack_launches
from mhl_jax.moe import packing as pk
from mhl_jax.moe.plan import import_jax_triton

PACK_METHODS = ("argsort", "triton")  # the JAX sort (any backend), the Triton kernels (jax-triton on a GPU)


def pack(idx: jax.Array, num_experts: int, block: int, method: str) -> pk.Packing:
    """`packing.pack(idx, num_experts, block)` by `method`: "argsort" the JAX sort, "triton" the Triton launches
    (the same arrays)."""
    if method == "triton":
        return pack_triton(idx, num_experts, block)
    if method != "argsort":
        raise ValueError(f"pack: method={method!r}, expected one of {PACK_METHODS}")
    return pk.pack(idx, num_experts, block)


def pack_triton(idx: jax.Array, num_experts: int, block: int) -> pk.Packing:
    """idx (N, H, k) int32 (-1 = empty slot) -> `Packing`, equal to `packing.pack(idx, num_experts, block)`.

    Integer in, integer out: nothing to differentiate, but under jax.grad the indices (outputs of the
    router's custom_vjp) carry zero tangents and jax-triton's call has no JVP rule ("triton_call does
    not support automatic differentiation"), so the launches sit in a custom_vjp whose backward returns no
    cotangent."""
    return _integer_launches(functools.partial(_launch, num_experts=num_experts, block=block), idx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _integer_launches(launch, ints: jax.Array):
    """launch(ints): integer launches on one integer array, under a custom_vjp whose backward gives no cotangent
    (jax-triton's call has no JVP rule: `pack_triton`)."""
    return launch(ints)


def _integer_launches_fwd(launch, ints):
    return launch(ints), None


def _integer_launches_bwd(launch, res, cts):
    return (None,)


_integer_launches.defvjp(_integer_launches_fwd, _integer_launches_bwd)


def _launch(idx: jax.Array, *, num_experts: int, block: int) -> pk.Packing:
    n, h, k = idx.shape
    p = pk.padded_rows(n * h * k, h * num_experts, block)
    bufs = run_launches(pack_launches(n, h, k, num_experts, block, p), {"idx": idx.astype(jnp.int32)})
    row_slot, slot_row, block_group, sizes, nblocks, gstart, gcount = (bufs[name] for name in PACK_RESULT)
    return pk.Packing(row_slot, slot_row, block_group, sizes, nblocks.reshape(()), gstart, gcount)


def run_launches(launches, bufs: dict) -> dict:
    """Run `kernels.triton.packing.Launch`es in order through jax-triton on the named int32 buffers `bufs` (inputs;
    each launch adds its outputs): the buffers at the end."""
    jt = import_jax_triton()
    bufs = dict(bufs)
    for launch in launches:
        names = [name for name, _ in launch.outputs]
        shapes = dict(launch.outputs)
        bufs.update({name: jnp.full(shapes[name], value, jnp.int32) for name, value in launch.fill})
        outs = jt.triton_call(
            *[bufs[name] for name in launch.inputs], kernel=launch.kernel,
            out_shape=[jax.ShapeDtypeStruct(shape, jnp.int32) for _, shape in launch.outputs], grid=launch.grid,
            num_warps=launch.num_warps,
            input_output_aliases={launch.inputs.index(name): names.index(name) for name, _ in launch.fill}
            | {launch.inputs.index(src): names.index(out) for out, src in launch.inplace} or None,
            **launch.meta)
        bufs.update(zip(names, outs))
        for _, src in launch.inplace:  # donated to the output: a later read of it fails loudly
            del bufs[src]
    return bufs


def group_blocks_triton(group_sizes: jax.Array, block: int, num_blocks: int):
    """group_sizes (G,) int32 cut into blocks of at most `block` rows, group after group, in two launches
    (`kernels.triton.packing.cut_launches`): (first block, block count, first row) of each group (G,) int32, as
    `packing.group_blocks` (and first block * block), and each block's group (num_blocks,: a static bound on the
    blocks), -1 past the used blocks. Integer only (no cotangent, as `pack_triton`)."""
    return _integer_launches(functools.partial(_cut_launch, block=block, num_blocks=num_blocks), group_sizes)


def _cut_launch(sizes: jax.Array, *, block: int, num_blocks: int):
    bufs = run_launches(cut_launches(sizes.shape[0], block, num_blocks), {"sizes": sizes.astype(jnp.int32)})
    return bufs["gstart"], bufs["gcount"], bufs["pstart"], bufs["block_group"]
