"""Token embedding lookup whose gradient is deterministic on every backend.

The gradient of `jnp.take(table, tokens)` is a scatter-add with repeated indices (a token id occurs
many times in a batch); XLA on GPU lowers it to float atomics, so two runs of the same train step
differed in the last bits (H100, 2026-11-23, bench/determinism.py). Here the backward sorts the
token positions by id (stable), sums each id's run of rows with a segmented associative scan (a
fixed tree of additions) and writes one row per distinct id (a scatter with unique indices): no
atomics, the same bits every run, on CPU and GPU alike. Under data parallelism XLA gathers the
sort's operands to every device (compiled on 8 host devices: an all-gather of the token ids and an
all-reduce of the (N_global, d) rows) and each computes the whole (V, d) gradient; the scatter-add
form all-reduces (V, d) instead: 32768 x 1024 vs 50304 x 1024 for the 2.2B configs on 4 GPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def embedding_grad(tokens: jax.Array, g: jax.Array, vocab_size: int) -> jax.Array:
    """tokens: (...,) int; g: (..., d) -> (vocab_size, d) fp32 with row v = sum of g where tokens == v."""
    d = g.shape[-1]
    t = jnp.asarray(tokens).reshape(-1).astype(jnp.int32)
    rows = jnp.asarray(g).reshape(-1, d).astype(jnp.float32)
    order = jnp.argsort(t, stable=True)
    st = t[order]
    sg = jnp.take(rows, order, axis=0)
    boundary = st[1:] != st[:-1]
    first = jnp.concatenate([jnp.ones((1,), bool), boundary])  # a run of equal ids starts here

    def segmented_add(a, b):
        (fa, va), (fb, vb) = a, b
        return fa | fb, jnp.where(fb[..., None], vb, va + vb)

    _, run_sums = jax.lax.associative_scan(segmented_add, (first, sg))
    last = jnp.concatenate([boundary, jnp.ones((1,), bool)])  # the run's total sits at its last row
    dest = jnp.where(last, st, vocab_size)  # other rows aim past the end and are dropped
    return jnp.zeros((vocab_size, d), jnp.float32).at[dest].set(run_sums, mode="drop")


@jax.custom_vjp
def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """table: (V, d); tokens: (...,) int -> (..., d) = table[tokens]."""
    return jnp.take(table, tokens, axis=0)


def _fwd(table, tokens):
    return jnp.take(table, tokens, axis=0), (tokens, table)  # the table is a live parameter: no extra memory


def _bwd(res, g):
    tokens, table = res
    return embedding_grad(tokens, g, table.shape[0]).astype(table.dtype), None


embed_lookup.defvjp(_fwd, _bwd)
