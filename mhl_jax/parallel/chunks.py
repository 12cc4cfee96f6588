"""Overlap an MoE layer's exchange with its compute: each device's tokens in chunks (`parallel.hp_chunks`).

Inside `jax.shard_map` an executor's per-device body is exchange -> router and experts -> reverse exchange, each step
waiting for the one before. Split the device's tokens into C equal chunks and run the body on each:

    chunk 0:  send | experts | back
    chunk 1:         send    | experts | back
    chunk 2:                   send    | experts | back

The C bodies share no data, so nothing orders chunk i + 1's all_to_all after chunk i's experts: XLA's latency-hiding
scheduler (GPU, where collectives run asynchronously) starts the next chunk's send while the current chunk computes,
and the backward, which transposes each chunk on its own, overlaps alike. What stays exposed is one chunk's send and
one chunk's return, plus whatever part of the exchange is longer than the compute beside it (docs/parallel.md).

The results do not change. Routing is per sub-token and every expert output row depends on its own input row only, so
each token's output is the unchunked one (bitwise on the reference ops; kernels that pick their tiles by the row count
may sum in another fp32 order); the loads are integer sums. A weight's gradient is the sum of C
chunks' gradients instead of one sum over all rows: equal up to fp32 summation order.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


def checked_chunks(chunks: int, owner: str) -> int:
    """`chunks` if it is a valid chunk count (>= 1), else a ValueError naming `owner` (the executor it configures)."""
    if chunks < 1:
        raise ValueError(f"{owner}: chunks={chunks}, expected >= 1")
    return chunks


def chunk_count(chunks: int, tokens: int) -> int:
    """The chunks to run for `tokens` local tokens: `chunks`, or where it does not divide them (a decode step of
    generation holds a few tokens), the largest count dividing both: the same results, with less overlap."""
    if chunks < 1:
        raise ValueError(f"chunks={chunks}: must be >= 1")
    return math.gcd(chunks, tokens)


def over_chunks(body: Callable[..., tuple[jax.Array, jax.Array]], xs: tuple[jax.Array, ...], chunks: int,
                axis: int) -> tuple[jax.Array, jax.Array]:
    """body(i, *xs_i) -> (y_i, load_i) on chunk i of the tokens of each of `xs` (split along `axis`, equal and
    contiguous) -> (y, load): the y_i concatenated along `axis`, the loads summed. `chunks` as `chunk_count` takes it;
    body sees the chunk index so that what one chunk alone may take (a gradient accumulator) goes to one."""
    count = chunk_count(chunks, xs[0].shape[axis])
    if count == 1:
        return body(0, *xs)
    size = xs[0].shape[axis] // count
    # a Python loop, not a scan: a scan would run the chunks one after another, and nothing could overlap
    outs = [body(i, *(lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis) for x in xs)) for i in range(count)]
    y = jnp.concatenate([o[0] for o in outs], axis=axis)
    load = outs[0][1]
    for o in outs[1:]:
        load = load + o[1]
    return y, load
