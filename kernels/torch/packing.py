"""The Triton packing kernels (`kernels/triton/packing.py`) launched on torch tensors: GPU, or CPU under
TRITON_INTERPRET=1 in the tests (the JAX binding, `mhl_jax/moe/gpu/packing.py`, runs only on a GPU).
Both launchers run the same plan, `kernels.triton.packing.pack_launches`."""

from __future__ import annotations

import torch

from kernels.torch.experts import padded_rows
from kernels.triton.packing import PACK_RESULT, cut_launches, pack_launches
from kernels.tuning import HIST_ATOMIC_MIN_BINS, PACK_CHUNK


def pack_triton_torch(idx: torch.Tensor, num_experts: int, block: int, chunk: int = PACK_CHUNK,
                      hist_atomic_min_bins: int = HIST_ATOMIC_MIN_BINS):
    """idx: (N, H, k) int32 (-1 = empty slot) -> (row_slot (P,), slot_row (M,), block_group (P / block,),
    group_sizes (G,), num_blocks (1,), group_block_start (G,), group_nblocks (G,)) int32: the arrays of
    `mhl_jax.moe.packing.pack`. chunk and hist_atomic_min_bins: `pack_launches`' (tests reach several chunks and both
    histogram forms at small sizes)."""
    n, h, k = idx.shape
    p = padded_rows(n * h * k, h * num_experts, block)
    bufs = run_launches_torch(pack_launches(n, h, k, num_experts, block, p, chunk, hist_atomic_min_bins),
                              {"idx": idx.to(torch.int32).contiguous()})
    return tuple(bufs[name] for name in PACK_RESULT)


def run_launches_torch(launches, bufs: dict) -> dict:
    """Run `kernels.triton.packing.Launch`es in order on the named int32 tensors `bufs` (one device): the buffers at the
    end (each launch adds its outputs)."""
    dev = next(iter(bufs.values())).device
    i32 = dict(dtype=torch.int32, device=dev)
    bufs = dict(bufs)
    for launch in launches:
        shapes = dict(launch.outputs)
        bufs.update({name: torch.full(shapes[name], value, **i32) for name, value in launch.fill})
        given = {name: bufs[name] for name, _ in launch.fill} | {out: bufs[src] for out, src in launch.inplace}
        outs = [given[name] if name in given else torch.empty(shape, **i32) for name, shape in launch.outputs]
        launch.kernel[launch.grid](*[bufs[name] for name in launch.inputs], *outs, num_warps=launch.num_warps,
                                   **launch.meta)
        bufs.update(zip(shapes, outs))
        for _, src in launch.inplace:  # overwritten: a later read of it fails loudly
            del bufs[src]
    return bufs


def cut_blocks_torch(group_sizes: torch.Tensor, block: int, num_blocks: int):
    """`mhl_jax.moe.gpu.packing.group_blocks_triton` on torch: (first block, block count, first row) of each
    group and each of num_blocks blocks' group (-1 past the used ones), int32."""
    bufs = run_launches_torch(cut_launches(group_sizes.shape[0], block, num_blocks),
                              {"sizes": group_sizes.to(torch.int32).contiguous()})
    return tuple(bufs[name] for name in ("gstart", "gcount", "pstart", "block_group"))
