"""AdamW (decoupled weight decay on matrices only) with global grad-norm clipping."""

from __future__ import annotations

import jax
import optax

from mhl_jax.config import Config
from mhl_jax.train.schedule import make_schedule


def decay_mask(params):
    """Weight decay on matrices (ndim >= 2: projections, experts, routers, embeddings), not on norms."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optimizer
    adamw = optax.adamw(make_schedule(o, cfg.schedule), b1=o.beta1, b2=o.beta2, eps=o.eps,
                        weight_decay=o.weight_decay, mask=decay_mask)
    if o.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw)
