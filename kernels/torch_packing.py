"""The Triton packing kernels (`kernels/packing.py`) launched on torch tensors: GPU, or CPU under
TRITON_INTERPRET=1 in the tests (the JAX binding, `mhl_jax/ops/packing_triton.py`, runs only on a GPU).
Both launchers run the same plan, `kernels.packing.pack_launches`."""

from __future__ import annotations

import torch

from kernels.packing import PACK_CHUNK, PACK_RESULT, pack_launches
from kernels.torch_experts import padded_rows


def pack_triton_torch(idx: torch.Tensor, num_experts: int, block: int, chunk: int = PACK_CHUNK):
    """idx: (N, H, k) int32 (-1 = empty slot) -> (row_slot (P,), slot_row (M,), block_group (P / block,),
    group_sizes (G,), num_blocks (1,)) int32: the arrays of `mhl_jax.ops.packing.pack`."""
    n, h, k = idx.shape
    p = padded_rows(n * h * k, h * num_experts, block)
    i32 = dict(dtype=torch.int32, device=idx.device)
    bufs = {"idx": idx.to(torch.int32).contiguous()}
    for launch in pack_launches(n, h, k, num_experts, block, p, chunk):
        shapes = dict(launch.outputs)
        bufs.update({name: torch.full(shapes[name], value, **i32) for name, value in launch.fill})
        filled = dict(launch.fill)
        outs = [bufs[name] if name in filled else torch.empty(shape, **i32) for name, shape in launch.outputs]
        launch.kernel[launch.grid](*[bufs[name] for name in launch.inputs], *outs, num_warps=launch.num_warps,
                                   **launch.meta)
        bufs.update(zip(shapes, outs))
    return tuple(bufs[name] for name in PACK_RESULT)
