"""The Triton packing kernels (`kernels/packing.py`) launched on torch tensors: GPU, or CPU under
TRITON_INTERPRET=1 in the tests (the JAX binding, `mhl_jax/ops/packing_triton.py`, runs only on a GPU)."""

from __future__ import annotations

import torch

from kernels.packing import (
    launch_shapes,
    pack_block_group_kernel,
    pack_groups_kernel,
    pack_hist_kernel,
    pack_offsets_kernel,
    pack_scatter_kernel,
)
from kernels.torch_experts import padded_rows


def pack_triton_torch(idx: torch.Tensor, num_experts: int, block: int, chunk: int | None = None):
    """idx: (N, H, k) int32 (-1 = empty slot) -> (row_slot (P,), slot_row (M,), block_group (P / block,),
    group_sizes (G,), num_blocks (1,)) int32: the arrays of `mhl_jax.ops.packing.pack`."""
    n, h, k = idx.shape
    ne = num_experts
    sh = launch_shapes(n, h, k, ne, **({} if chunk is None else {"chunk": chunk}))
    m, g = n * h * k, h * ne
    p = padded_rows(m, g, block)
    nb = p // block
    dev = idx.device
    i32 = dict(dtype=torch.int32, device=dev)
    idx = idx.to(torch.int32).contiguous()
    hist, lower = torch.empty(h, sh["NC"], sh["NEP"], **i32), torch.empty(h, sh["NC"], sh["NEP"], **i32)
    pack_hist_kernel[(sh["NC"], h)](idx, hist, lower, H=h, K=k, ML=sh["ML"], NE=ne, NEP=sh["NEP"], NC=sh["NC"],
                                    C=sh["C"])
    base = torch.empty_like(hist)
    sizes = torch.empty(g, **i32)
    pack_offsets_kernel[(h, sh["NEP"] // sh["EB"])](hist, lower, base, sizes, NE=ne, NEP=sh["NEP"], NC=sh["NC"],
                                                     CB=sh["CB"], EB=sh["EB"])
    pstart, bend, nblocks = torch.empty(g, **i32), torch.empty(g, **i32), torch.empty(1, **i32)
    pack_groups_kernel[(1,)](sizes, pstart, bend, nblocks, G=g, R=block, GB=sh["GB"])
    row_slot = torch.full((p,), -1, **i32)
    slot_row = torch.empty(m, **i32)
    pack_scatter_kernel[(sh["NC"], h)](idx, base, pstart, row_slot, slot_row, row_slot, H=h, K=k, ML=sh["ML"],
                                       NE=ne, NEP=sh["NEP"], NC=sh["NC"], C=sh["C"], LOG_C=sh["LOG_C"])
    block_group = torch.empty(nb, **i32)
    bb = 1024
    pack_block_group_kernel[(-(-nb // bb),)](bend, nblocks, block_group, G=g, NB=nb, BLOCK=bb,
                                             STEPS=g.bit_length() + 1)
    return row_slot, slot_row, block_group, sizes, nblocks
