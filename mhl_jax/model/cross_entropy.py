"""The LM head's loss and logits' gradient for a chunk of tokens by the Triton kernel of
kernels/triton/cross_entropy.py, bound through jax-triton (GPU only; the CPU tests run the same kernel under the
Triton interpreter through the torch launcher, kernels/torch/cross_entropy.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kernels.triton import cross_entropy as kx
from kernels.tuning import XENT_TILES, XentTiles
from mhl_jax.model.batch_split import batch_sharded
from mhl_jax.moe.plan import device_sms, import_jax_triton


def xent_rows(logits: jax.Array, targets: jax.Array, scale: float, dtype,
              tiles: XentTiles = XENT_TILES) -> tuple[jax.Array, jax.Array]:
    """(R, V) fp32 logits, (R,) int targets -> (d = (softmax - onehot) * scale (R, V) in dtype, nll (R,) fp32)."""
    rows, v = logits.shape
    grid, kw = kx.xent_launch(rows, v, scale, tiles, device_sms())
    return import_jax_triton().triton_call(
        logits, targets.astype(jnp.int32), kernel=kx.xent_kernel, grid=grid,
        out_shape=[jax.ShapeDtypeStruct((rows, v), dtype), jax.ShapeDtypeStruct((rows,), jnp.float32)], **kw)


@dataclasses.dataclass(frozen=True)
class KernelXent:
    """`mhl_jax.model.loss.head_loss`'s chunk step by the kernel: (B, tc, V) fp32 logits and (B, tc) targets -> (d
    (B, tc, V) in dtype, nll (B, tc)), the batch split over `mesh` (None: one device). Hashable: head_loss takes it
    as a static argument."""

    mesh: Mesh | None = None

    def __call__(self, logits: jax.Array, targets: jax.Array, scale: float, dtype) -> tuple[jax.Array, jax.Array]:
        def local(lg, tg):
            b, t, v = lg.shape
            d, nll = xent_rows(lg.reshape(b * t, v), tg.reshape(b * t), scale, dtype)
            return d.reshape(b, t, v), nll.reshape(b, t)

        return batch_sharded(local, self.mesh, logits, targets, what="LM head loss")
