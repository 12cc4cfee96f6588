"""Packing routed sub-tokens into expert-contiguous, block-padded rows (and back).

Each (token n, head h, choice j) is a *slot*: M = N * H * k slots, slot id s = (n * H + h) * k + j.
Its *group* is g = h * Ne + e (e = chosen expert). Slots are stably sorted by group; every group's
segment is padded up to a multiple of the row block R, so each block of R rows belongs to exactly
one (head, expert). Shapes stay static under jit: the padded row count is the worst case

    P = round_up(M + min(G, M) * (R - 1), R),   G = H * Ne groups

(every non-empty group wastes at most R - 1 rows). Blocks past the used ones are all padding and
carry block_group = -1, so kernels can skip them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Packing(NamedTuple):
    row_slot: jax.Array  # (P,) int32: slot held by each padded row, -1 for padding
    slot_row: jax.Array  # (M,) int32: padded row of each slot (inverse of row_slot), -1 for empty slots
    block_group: jax.Array  # (P // R,) int32: group h * Ne + e of each row block, -1 if all padding
    group_sizes: jax.Array  # (G,) int32: routed slots per group (the expert load, per head)
    num_blocks: jax.Array  # () int32: blocks in use (the rest are all padding)


def padded_rows(num_slots: int, num_groups: int, block: int) -> int:
    """Static upper bound on packed rows for `num_slots` slots in `num_groups` groups."""
    rows = num_slots + min(num_groups, num_slots) * (block - 1)
    return -(-rows // block) * block


def pack(idx: jax.Array, num_experts: int, block: int) -> Packing:
    """idx: (N, H, k) int32 expert indices in [0, Ne), or -1 for an empty slot (no row, output 0).

    Returns the Packing (no data moved)."""
    n, h, k = idx.shape
    m = n * h * k
    g_count = h * num_experts
    p = padded_rows(m, g_count, block)
    idx = idx.astype(jnp.int32)
    # empty slots (idx < 0, e.g. the unused tail of an expert-parallel receive buffer) sort last
    # into a sentinel group g_count that gets no rows
    group = jnp.where(idx >= 0, jnp.arange(h, dtype=jnp.int32)[None, :, None] * num_experts + idx, g_count)
    group = group.reshape(m)
    order = jnp.argsort(group, stable=True).astype(jnp.int32)  # sorted position -> slot
    sizes = jnp.bincount(group, length=g_count + 1).astype(jnp.int32)[:g_count]
    padded = (sizes + block - 1) // block * block
    starts = jnp.concatenate([jnp.cumsum(sizes) - sizes, jnp.zeros((1,), sizes.dtype)])
    pstarts = jnp.concatenate([jnp.cumsum(padded) - padded, jnp.full((1,), p, padded.dtype)])
    sorted_group = group[order]
    rank = jnp.arange(m, dtype=jnp.int32) - starts[sorted_group]
    valid = sorted_group < g_count
    # padded row of each sorted position; empty slots point past the end (dropped by the scatter)
    dest = jnp.where(valid, pstarts[sorted_group] + rank, p).astype(jnp.int32)
    row_slot = jnp.full((p,), -1, jnp.int32).at[dest].set(order, mode="drop")
    slot_row = jnp.zeros((m,), jnp.int32).at[order].set(jnp.where(valid, dest, -1))
    num_blocks = (jnp.sum(padded) // block).astype(jnp.int32)
    block_start = jnp.arange(p // block, dtype=jnp.int32) * block
    # group of a block = last group whose padded start is <= block start (empty groups share starts)
    bg = jnp.searchsorted(pstarts[:g_count] + padded, block_start, side="right").astype(jnp.int32)
    block_group = jnp.where(jnp.arange(p // block) < num_blocks, bg, -1).astype(jnp.int32)
    return Packing(row_slot, slot_row, block_group, sizes, num_blocks)


def gather_rows(x: jax.Array, packing: Packing, k: int) -> jax.Array:
    """x: (N, H, dh) -> packed rows (P, dh); padding rows are zero. Slot s reads x[s // k]."""
    n, h, dh = x.shape
    flat = x.reshape(n * h, dh)
    src = jnp.maximum(packing.row_slot, 0) // k
    rows = jnp.take(flat, src, axis=0)
    return jnp.where((packing.row_slot >= 0)[:, None], rows, jnp.zeros_like(rows))


def combine_rows(rows: jax.Array, packing: Packing, gates: jax.Array) -> jax.Array:
    """rows: (P, dh) expert outputs; gates: (N, H, k) fp32 -> (N, H, dh) = sum_j gate_j * row(slot j).

    The sum over the k choices is a fixed-order reduction (deterministic).
    """
    n, h, k = gates.shape
    per_slot = jnp.take(rows, jnp.maximum(packing.slot_row, 0), axis=0)
    per_slot = jnp.where((packing.slot_row >= 0)[:, None], per_slot, 0).reshape(n, h, k, rows.shape[-1])
    out = jnp.einsum("nhkd,nhk->nhd", per_slot.astype(jnp.float32), gates.astype(jnp.float32))
    return out.astype(rows.dtype)


def group_blocks(group_sizes: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """group_sizes: (G,) int32 -> (first row block, row-block count) of each group, both (G,) int32.

    Matches `pack`: group g's rows start at padded row `start[g] * block` and fill `count[g]` blocks
    (zero for an empty group). The dW kernel walks each group's blocks with these.
    """
    count = ((group_sizes + block - 1) // block).astype(jnp.int32)
    start = (jnp.cumsum(count) - count).astype(jnp.int32)
    return start, count
