"""Packing routed sub-tokens into expert-contiguous, block-padded rows (and back).

Each (token n, head h, choice j) is a *slot*: M = N * H * k slots, slot id s = (n * H + h) * k + j.
Its *group* is g = h * Ne + e (e = chosen expert). Slots are stably sorted by group; every group's
segment is padded up to a multiple of the row block R, so each block of R rows belongs to exactly
one (head, expert). Shapes stay static under jit: the padded row count is the worst case

    P = round_up(M + min(G, M) * (R - 1), R),   G = H * Ne groups

(every non-empty group wastes at most R - 1 rows). Blocks past the used ones are all padding and
carry block_group = -1, so kernels can skip them.

Two ways to compute the same layout (`pack(..., method=)`):
- "argsort": one stable argsort of the M group ids (XLA sort of M key/index pairs).
- "count": a counting sort, no sort at all. Within a head, slot order is local order l = n * k + j,
  so a stable sort by group is, per head, a stable sort of l by expert. Cut each head's slots into
  chunks of C; a slot's rank in its group = (slots of that expert in earlier chunks: an exclusive
  cumsum over chunks of the per-chunk histogram) + (earlier slots of that expert in its own chunk: a
  C-wide compare-and-count); the histogram is written by each expert's last slot in the chunk (count =
  its rank + 1), a scatter with unique indices. The first version built it with an int scatter-add of
  duplicate indices and FAILED its GPU test under skew (2026-11-22; CPU equal): this one is unverified
  on a GPU as yet. slot_row is then computed directly and row_slot is
  one scatter with unique indices. Integer-only, deterministic, O(M C) cheap elementwise work.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mhl_jax.ops.embed import take_rows


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


COUNT_CHUNK = 128  # slots per chunk of the counting sort


def pack(idx: jax.Array, num_experts: int, block: int, method: str = "argsort",
         chunk: int = COUNT_CHUNK) -> Packing:
    """idx: (N, H, k) int32 expert indices in [0, Ne), or -1 for an empty slot (no row, output 0).

    Returns the Packing (no data moved). method "argsort" | "count" (identical results)."""
    if method == "count":
        return _pack_count(idx, num_experts, block, chunk)
    if method != "argsort":
        raise ValueError(f"pack: method={method!r}, expected 'argsort' or 'count'")
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


def _block_groups(padded: jax.Array, num_blocks: jax.Array, p: int, block: int) -> jax.Array:
    """Group of each row block (-1 past the used blocks), from the padded group sizes (G,)."""
    block_start = jnp.arange(p // block, dtype=jnp.int32) * block
    # group of a block = last group whose padded start is <= block start (empty groups share starts)
    bg = jnp.searchsorted(jnp.cumsum(padded), block_start, side="right").astype(jnp.int32)
    return jnp.where(jnp.arange(p // block) < num_blocks, bg, -1).astype(jnp.int32)


def _pack_count(idx: jax.Array, num_experts: int, block: int, chunk: int) -> Packing:
    """The counting-sort packing (module docstring); same arrays as the argsort path."""
    n, h, k = idx.shape
    m, g_count, ml = n * h * k, h * num_experts, n * k
    p = padded_rows(m, g_count, block)
    c = max(1, min(chunk, ml))
    nc = -(-ml // c)
    e = jnp.swapaxes(idx.astype(jnp.int32), 0, 1).reshape(h, ml)  # (H, N*k): local slot l = n * k + j
    e = jnp.where(e >= 0, e, num_experts)  # empty slots: sentinel expert, no rows
    ec = jnp.pad(e, ((0, 0), (0, nc * c - ml)), constant_values=num_experts).reshape(h, nc, c)
    lower = jnp.arange(c)[None, :] < jnp.arange(c)[:, None]  # [i, j]: j before i
    same = ec[..., :, None] == ec[..., None, :]
    rank_in = jnp.sum(same & lower, axis=-1, dtype=jnp.int32)  # earlier slots of my expert in my chunk
    last = ~jnp.any(same & lower.T, axis=-1)  # no later slot of my expert in my chunk
    hs = jnp.arange(h, dtype=jnp.int32)[:, None, None]
    cs = jnp.arange(nc, dtype=jnp.int32)[None, :, None]
    # chunk histogram: each expert's last slot in the chunk holds its count (rank + 1); one scatter with
    # unique indices (the other slots aim past the end and are dropped), no scatter-add of duplicates
    hist = jnp.zeros((h, nc, num_experts + 1), jnp.int32).at[hs, cs, jnp.where(last, ec, num_experts + 1)].set(
        rank_in + 1, mode="drop")
    incl = jnp.cumsum(hist, axis=1, dtype=jnp.int32)  # (H, nc, Ne + 1)
    rank = jnp.take_along_axis(incl - hist, ec, axis=2) + rank_in  # rank of each slot in its group
    sizes = incl[:, -1, :num_experts].reshape(g_count)
    padded = (sizes + block - 1) // block * block
    pstarts = (jnp.cumsum(padded) - padded).astype(jnp.int32)
    valid = ec < num_experts
    gid = jnp.minimum(hs * num_experts + ec, g_count - 1)
    dest = jnp.where(valid, pstarts[gid] + rank, -1)  # (H, nc, C): padded row of each slot
    dest = jnp.swapaxes(dest.reshape(h, nc * c)[:, :ml].reshape(h, n, k), 0, 1)  # back to slot order
    slot_row = dest.reshape(m).astype(jnp.int32)
    row_slot = jnp.full((p,), -1, jnp.int32).at[jnp.where(slot_row >= 0, slot_row, p)].set(
        jnp.arange(m, dtype=jnp.int32), mode="drop")
    num_blocks = (jnp.sum(padded) // block).astype(jnp.int32)
    return Packing(row_slot, slot_row, _block_groups(padded, num_blocks, p, block), sizes.astype(jnp.int32),
                   num_blocks)


def gather_rows(x: jax.Array, packing: Packing, k: int) -> jax.Array:
    """x: (N, H, dh) -> packed rows (P, dh); padding rows are zero. Slot s reads x[s // k]."""
    n, h, dh = x.shape
    flat = x.reshape(n * h, dh)
    src = jnp.maximum(packing.row_slot, 0) // k
    rows = take_rows(flat, src)  # each source row is read k times: its gradient sums them without atomics
    return jnp.where((packing.row_slot >= 0)[:, None], rows, jnp.zeros_like(rows))


def combine_rows(rows: jax.Array, packing: Packing, gates: jax.Array) -> jax.Array:
    """rows: (P, dh) expert outputs; gates: (N, H, k) fp32 -> (N, H, dh) = sum_j gate_j * row(slot j).

    The sum over the k choices is a fixed-order reduction (deterministic).
    """
    n, h, k = gates.shape
    per_slot = jnp.take(rows, jnp.maximum(packing.slot_row, 0), axis=0)
    per_slot = jnp.where((packing.slot_row >= 0)[:, None], per_slot, 0).reshape(n, h, k, rows.shape[-1])
    out = jnp.sum(per_slot.astype(jnp.float32) * gates.astype(jnp.float32)[..., None], axis=2)  # fused, fixed order
    return out.astype(rows.dtype)


def group_blocks(group_sizes: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """group_sizes: (G,) int32 -> (first row block, row-block count) of each group, both (G,) int32.

    Matches `pack`: group g's rows start at padded row `start[g] * block` and fill `count[g]` blocks
    (zero for an empty group). The dW kernel walks each group's blocks with these.
    """
    count = ((group_sizes + block - 1) // block).astype(jnp.int32)
    start = (jnp.cumsum(count) - count).astype(jnp.int32)
    return start, count
