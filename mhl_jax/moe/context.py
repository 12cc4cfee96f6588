"""The step context: work on the expert weights done once per step, outside the micro-batch loop.

A train step runs the model on several micro-batches with the same weights. Two things would otherwise be redone in
every micro-batch, and XLA does not move them out of the loop:

- the cast of the fp32 expert weights to the compute dtype, which the Triton experts read;
- the add of each micro-batch's expert-weight gradient to the running sum: the Triton backward kernels can add into
  the sum in place (the same fp32 add, so bitwise the same sums) instead of writing a gradient for XLA to add.

The context carries both, keyed by layer, through the model untouched: only `ExpertBank` (which picks its layer's
`ExpertContext`) and the MoE executors (which hand it to `moe_heads` as `weights_cast=` / `grad_acc=`) read it.
`mhl_jax.model.context.build_step_context` decides which layers get what.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

Pair = tuple[jax.Array, jax.Array]


class ExpertContext(NamedTuple):
    """One MoE layer's part of the step context, as its executor reads it."""

    weights_cast: Pair | None = None  # (w1, w2) already in the compute dtype
    grad_acc: Pair | None = None  # running gradient sums of (w1, w2), fp32: their gradients come back as sum + dW


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepContext:
    """A pytree: the arrays are data (they cross jit, scan and remat boundaries), the layer set is static."""

    casts: dict[int, Pair] = dataclasses.field(default_factory=dict)  # {layer: (w1, w2) in the compute dtype}
    grad_sums: dict[int, Pair] = dataclasses.field(default_factory=dict)  # {layer: (sum1, sum2)}
    # the layers whose expert backward adds into the sums in place: grad_sums is filled for exactly these
    accumulating: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))

    def expert(self, layer: int) -> ExpertContext | None:
        """What the executor of MoE layer `layer` reads, or None when the step context holds nothing for it."""
        cast, acc = self.casts.get(layer), self.grad_sums.get(layer)
        return None if cast is None and acc is None else ExpertContext(cast, acc)

    def with_grad_sums(self, sums: dict[int, Pair]) -> StepContext:
        """This context holding `sums` ({layer: (sum1, sum2)} for every layer of `accumulating`)."""
        if set(sums) != set(self.accumulating):
            raise ValueError(f"StepContext: sums for layers {sorted(sums)}, expected {list(self.accumulating)}")
        return dataclasses.replace(self, grad_sums=dict(sums))
