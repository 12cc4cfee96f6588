"""Parameter counts, computed abstractly (shapes only, nothing allocated)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from flax import nnx

from mhl_jax.config import Config
from mhl_jax.model.gpt import build_model
from mhl_jax.model.moe import ExpertBank
from mhl_jax.moe.core import LocalMoE


class ParamCount(NamedTuple):
    total: int  # every trained parameter
    active: int  # parameters a token uses: all but the experts it was not routed to
    matmul_active: int  # active parameters that do a matmul per token (excludes the embedding lookup)


def count_params(cfg: Config) -> ParamCount:
    """The model's parameter counts, from its shapes alone."""
    abstract = nnx.eval_shape(lambda: build_model(cfg, executor=LocalMoE("reference")))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    inactive = 0
    for _, node in nnx.iter_graph(abstract):
        if isinstance(node, ExpertBank):
            experts = math.prod(node.w1.shape) + math.prod(node.w2.shape)
            ne = node.w1.shape[1]
            inactive += experts * (ne - node.k) // ne
    active = total - inactive
    embed = cfg.model.vocab_size * cfg.model.d_model
    return ParamCount(total, active, active - embed)


def train_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 x matmul-active params + causal attention scores/values.

    Attention: QK^T and AV cost 2 * 2 * T * d per token per layer forward; causal halves it; x3 for
    forward + backward -> 6 * L * T * d.
    """
    m = cfg.model
    return 6.0 * count_params(cfg).matmul_active + 6.0 * m.n_layers * m.context * m.n_heads * m.head_dim
