"""AdamW (decoupled weight decay on matrices only) with global grad-norm clipping; its moments optionally stored in
bf16 between steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mhl_jax.config import Config
from mhl_jax.train.schedule import make_schedule


def decay_mask(params):
    """Weight decay on matrices (ndim >= 2: projections, experts, routers, embeddings), not on norms."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _moments_as(state, dtype):
    """`state` with the moments (mu, nu) of every Adam state in it cast to `dtype`; nothing else changes."""
    def cast(node):
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(mu=jax.tree.map(lambda x: x.astype(dtype), node.mu),
                                 nu=jax.tree.map(lambda x: x.astype(dtype), node.nu))
        return node

    return jax.tree.map(cast, state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))


def adam_moments(state) -> list:
    """The moment arrays (mu, nu) of every Adam state in an optimizer state (arrays or ShapeDtypeStructs)."""
    found = [n for n in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
             if isinstance(n, optax.ScaleByAdamState)]
    return jax.tree.leaves([(n.mu, n.nu) for n in found])


def stored_in(tx: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`tx` whose Adam moments are kept in `dtype` between updates: each update widens them to fp32, runs `tx`'s own
    update, and rounds the new moments to `dtype` (to nearest even); the rest of the state is left as `tx` keeps it.
    `tx` itself for float32."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return tx

    def init(params):
        return _moments_as(tx.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = tx.update(updates, _moments_as(state, jnp.float32), params)
        return updates, _moments_as(state, dtype)

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optimizer
    adamw = optax.adamw(make_schedule(o, cfg.schedule), b1=o.beta1, b2=o.beta2, eps=o.eps,
                        weight_decay=o.weight_decay, mask=decay_mask)
    tx = adamw if o.grad_clip is None else optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw)
    return stored_in(tx, o.moment_dtype)
