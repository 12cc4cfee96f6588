"""The LM head's cross-entropy kernel (`kernels/triton/cross_entropy.py`) launched on torch tensors: GPU, or CPU under
TRITON_INTERPRET=1 in the tests (the JAX binding, `mhl_jax/model/cross_entropy.py`, runs only on a GPU). Same grid and
arguments as the binding."""

from __future__ import annotations

import torch

from kernels.torch.interpreter_patch import fix_interpreter_scalar_index
from kernels.triton import cross_entropy as kx
from kernels.tuning import XENT_TILES, XentTiles

fix_interpreter_scalar_index()  # the row loop's bounds come from the program id


def xent_torch(logits: torch.Tensor, targets: torch.Tensor, scale: float, d_dtype: torch.dtype = torch.bfloat16,
               tiles: XentTiles = XENT_TILES, sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, V) fp32 logits, (R,) int32 targets -> (d (R, V) in d_dtype, nll (R,) fp32). sms: the persistent grid's
    SM count (default: the GPU's; under the interpreter pass one)."""
    rows, v = logits.shape
    if sms is None:
        sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
    grid, kw = kx.xent_launch(rows, v, scale, tiles, sms)
    d = torch.empty((rows, v), dtype=d_dtype, device=logits.device)
    nll = torch.empty((rows,), dtype=torch.float32, device=logits.device)
    kx.xent_kernel[grid](logits.contiguous(), targets.to(torch.int32).contiguous(), d, nll, **kw)
    return d, nll
