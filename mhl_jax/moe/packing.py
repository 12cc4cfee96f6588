"""Packing routed sub-tokens into expert-contiguous, block-padded rows (and back).

Each (token n, head h, choice j) is a *slot*: M = N * H * k slots, slot id s = (n * H + h) * k + j.
Its *group* is g = h * Ne + e (e = chosen expert). Slots are stably sorted by group; every group's
segment is padded up to a multiple of the row block R, so each block of R rows belongs to exactly
one (head, expert). Shapes stay static under jit: the padded row count is the worst case

    P = round_up(M + min(G, M) * (R - 1), R),   G = H * Ne groups

(every non-empty group wastes at most R - 1 rows). Blocks past the used ones are all padding and
carry block_group = -1, so kernels can skip them.

The layout comes from one sort of unique 32-bit keys ((head, expert) << bits | local slot), i.e. each head's
stable sort by expert; expert runs are located by a scatter of run starts and a running min. The GPU path computes
the same arrays with Triton kernels (`mhl_jax.moe.gpu.packing`). Prefix scans (`prefix_scan`) throughout, never
jnp.cumsum or jnp.searchsorted.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mhl_jax.gather import take_rows


class Packing(NamedTuple):
    row_slot: jax.Array  # (P,) int32: slot held by each padded row, -1 for padding
    slot_row: jax.Array  # (M,) int32: padded row of each slot (inverse of row_slot), -1 for empty slots
    block_group: jax.Array  # (P // R,) int32: group h * Ne + e of each row block, -1 if all padding
    group_sizes: jax.Array  # (G,) int32: routed slots per group (the expert load, per head)
    num_blocks: jax.Array  # () int32: blocks in use (the rest are all padding)
    group_block_start: jax.Array  # (G,) int32: each group's first row block (its first row: that times R)
    group_nblocks: jax.Array  # (G,) int32: each group's row blocks (0 if empty)


def padded_rows(num_slots: int, num_groups: int, block: int) -> int:
    """Static upper bound on packed rows for `num_slots` slots in `num_groups` groups."""
    rows = num_slots + min(num_groups, num_slots) * (block - 1)
    return -(-rows // block) * block


def prefix_scan(op, x: jax.Array, axis: int = 0, reverse: bool = False) -> jax.Array:
    """Inclusive prefix `op` as a log-depth associative scan. XLA on GPU may lower jnp.cumsum to a
    reduce-window that is quadratic in the axis length, and jnp.searchsorted to a while loop with a
    host round trip per step: together they made the packing cost ~0.6 ms at any size on an H100."""
    return jax.lax.associative_scan(op, x, reverse=reverse, axis=axis)


def _local_slots(idx: jax.Array, num_experts: int) -> jax.Array:
    """(N, H, k) -> (H, N*k) expert of each local slot l = n * k + j; empty slots get the sentinel Ne."""
    h = idx.shape[1]
    e = jnp.swapaxes(idx.astype(jnp.int32), 0, 1).reshape(h, -1)
    return jnp.where(e >= 0, e, num_experts)


def pack(idx: jax.Array, num_experts: int, block: int) -> Packing:
    """idx: (N, H, k) int32 expert indices in [0, Ne), or -1 for an empty slot (no row, output 0).

    Returns the Packing (no data moved): one flat sort of unique 32-bit keys ((head, expert) << bits | local slot)
    over all heads, i.e. each head's stable sort by expert, heads in order (if that key does not fit 32 bits: per
    head (expert << bits | local slot), else a stable argsort per head; a batched per-head sort is 2x slower); run
    starts scattered by expert and prefix scans give sizes, ranks and padded starts."""
    n, h, k = idx.shape
    ml, ne = n * k, num_experts
    e = _local_slots(idx, ne)  # experts 0..Ne (Ne = empty)
    heads = jnp.arange(h, dtype=jnp.int32)[:, None]
    bits_m, bits_g, bits_e = max(1, (ml - 1).bit_length()), (h * (ne + 1) - 1).bit_length(), ne.bit_length()
    local = jnp.arange(ml, dtype=jnp.uint32)[None]
    if bits_m + bits_g <= 32:
        he = (heads * (ne + 1) + e).astype(jnp.uint32)
        sk = jnp.sort(((he << bits_m) | local).reshape(h * ml)).reshape(h, ml)
        order = (sk & jnp.uint32((1 << bits_m) - 1)).astype(jnp.int32)  # sorted position -> local slot
        se = (sk >> bits_m).astype(jnp.int32) - heads * (ne + 1)
    elif bits_m + bits_e <= 32:  # per head (a batched sort: slower, but still one key per slot)
        sk = jnp.sort((e.astype(jnp.uint32) << bits_m) | local, axis=-1)
        order = (sk & jnp.uint32((1 << bits_m) - 1)).astype(jnp.int32)
        se = (sk >> bits_m).astype(jnp.int32)
    else:
        order = jnp.argsort(e, axis=-1, stable=True).astype(jnp.int32)
        se = jnp.take_along_axis(e, order, axis=-1)
    pos = jnp.arange(ml, dtype=jnp.int32)[None]
    # first sorted position of each expert's run (unique indices: one start per run; other positions
    # are dropped), then a reverse running min gives an absent expert the next run's start
    is_start = jnp.concatenate([jnp.ones((h, 1), bool), se[:, 1:] != se[:, :-1]], axis=1)
    first = jnp.full((h, ne + 1), ml, jnp.int32).at[heads, jnp.where(is_start, se, ne + 1)].set(
        jnp.broadcast_to(pos, (h, ml)), mode="drop")
    run0 = prefix_scan(jnp.minimum, first, axis=1, reverse=True)  # (H, Ne + 1); column Ne: empty slots
    sizes = (run0[:, 1:] - run0[:, :-1]).reshape(h * ne)
    valid = se < ne
    sec = jnp.minimum(se, ne - 1)
    rank = pos - jnp.take_along_axis(run0, sec, axis=1)
    return _finish(n, h, k, ne, block, sizes, order, heads * ne + sec, rank, valid)


def _finish(n: int, h: int, k: int, ne: int, block: int, sizes, local, gid, rank, valid) -> Packing:
    """The packing from the sorted slots. sizes (G,) slots per group; for every sorted position of head h
    (arrays (H, L)): `local` its local slot n * k + j (any value where not valid), `gid` its group, `rank` its rank
    in the group, `valid` whether it is routed."""
    m, g_count = n * h * k, h * ne
    p = padded_rows(m, g_count, block)
    nb = p // block
    first, nblk = group_blocks(sizes, block)
    pstarts = first * block
    dest = jnp.where(valid, pstarts[gid] + rank, -1)  # padded row of each slot
    heads = jnp.arange(h, dtype=jnp.int32)[:, None]
    slot = (local // k * h + heads) * k + local % k  # global slot id (n * H + h) * k + j
    slot = jnp.where(valid, slot, m)  # empty slots are dropped: slot_row stays -1
    slot_row = jnp.full((m,), -1, jnp.int32).at[slot.reshape(-1)].set(dest.reshape(-1), mode="drop")
    row_slot = jnp.full((p,), -1, jnp.int32).at[jnp.where(valid, dest, p).reshape(-1)].set(
        slot.reshape(-1), mode="drop")
    num_blocks = first[-1] + nblk[-1]
    # group of each row block: mark each non-empty group's first block with the group (unique indices),
    # carry the mark forward with a running max
    marks = jnp.full((nb,), -1, jnp.int32).at[jnp.where(nblk > 0, first, nb)].set(
        jnp.arange(g_count, dtype=jnp.int32), mode="drop")
    bg = prefix_scan(jnp.maximum, marks)
    block_group = jnp.where(jnp.arange(nb) < num_blocks, bg, -1).astype(jnp.int32)
    return Packing(row_slot, slot_row, block_group, sizes.astype(jnp.int32), num_blocks, first, nblk)


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
    start = (prefix_scan(jnp.add, count) - count).astype(jnp.int32)
    return start, count
