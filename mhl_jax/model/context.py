"""Building a model's step context (`mhl_jax.moe.context`): which MoE layers get their expert weights cast once, and
which add their expert-weight gradients into running sums in place.

Both are questions for each layer's executor (`reads_weights_cast`, `accumulates_in_place`): the Triton experts with
fp32 master weights and activations of another dtype say yes; the reference path and Expert Parallel say no (they
have no such methods); Head Parallel accumulates only without data parallelism, where shard_map would otherwise sum
the accumulators over `data` as it sums the weights' cotangents.
"""

from __future__ import annotations

from typing import Iterator

import jax
from flax import nnx

from mhl_jax.model.moe import ExpertBank
from mhl_jax.moe.context import StepContext
from mhl_jax.moe.core import MoEExecutor


def build_step_context(model: nnx.Module, accumulate: bool = False) -> StepContext:
    """The step context of `model` (a GPT) at its compute dtype: the expert weights (w1, w2) cast, for the layers
    whose executor reads them cast; with accumulate, the layers whose executor adds gradients in place, to be given
    the running sums (`StepContext.with_grad_sums`, `expert_grad_sums`). Call it outside the micro-batch loop: the
    casts it makes are what the loop's micro-batches then share."""
    casts, accumulating = {}, []
    for bank, executor in _expert_banks(model):
        w1, w2 = bank.w1[...], bank.w2[...]
        shape = (model.dtype, w1.dtype, w1.shape[2])
        if executor_says(executor, "reads_weights_cast", shape):
            casts[bank.layer] = (w1.astype(model.dtype), w2.astype(model.dtype))
        if accumulate and executor_says(executor, "accumulates_in_place", shape):
            accumulating.append(bank.layer)
    return StepContext(casts=casts, accumulating=tuple(accumulating))


def expert_weight_leaf(path) -> tuple[int, str] | None:
    """(layer, "w1" | "w2") for the params path of an MoE layer's expert weight (blocks/<layer>/ffn/experts/w1), else
    None."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if len(keys) >= 5 and keys[0] == "blocks" and keys[2:4] == ["ffn", "experts"] and keys[4] in ("w1", "w2"):
        return keys[1], keys[4]
    return None


def summed_in_place(ctx: StepContext, path) -> bool:
    """Whether the params leaf at `path` is an expert weight whose gradient comes back as the running sum plus the
    new gradient (a layer of ctx.accumulating), not as a gradient alone."""
    leaf = expert_weight_leaf(path)
    return leaf is not None and leaf[0] in ctx.accumulating


def expert_grad_sums(ctx: StepContext, grad_sums) -> StepContext:
    """ctx holding, for each of its accumulating layers, the (w1, w2) entries of `grad_sums` (a params-shaped pytree
    of running gradient sums)."""
    if not ctx.accumulating:
        return ctx
    leaves = {expert_weight_leaf(p): g for p, g in jax.tree_util.tree_leaves_with_path(grad_sums)
              if summed_in_place(ctx, p)}
    return ctx.with_grad_sums({i: (leaves[(i, "w1")], leaves[(i, "w2")]) for i in ctx.accumulating})


def _expert_banks(model: nnx.Module) -> Iterator[tuple[ExpertBank, MoEExecutor]]:
    """(ExpertBank, its layer's executor) of every MoE layer."""
    for block in model.blocks:
        bank = getattr(block.ffn, "experts", None)
        if isinstance(bank, ExpertBank):
            yield bank, block.ffn.executor


def executor_says(executor: MoEExecutor, question: str, shape: tuple) -> bool:
    """executor.<question>(x_dtype, w_dtype, dh), False for an executor without that method."""
    fn = getattr(executor, question, None)
    return fn is not None and fn(*shape)
