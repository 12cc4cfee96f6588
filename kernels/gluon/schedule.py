"""The schedule of the persistent Gluon dW / backward kernels (kernels/gluon/experts_bwd.py): which program takes
which (group, 128 de) tile, and which chunk of its row blocks. One builder (`tile_schedule`) in an array namespace:
numpy for the torch launchers (`tile_schedule_torch`), jax.numpy for the JAX binding
(`mhl_jax.moe.gpu.expert_kernels.tile_schedule`).

A tile's rows are summed by one program, in order, unless the tile is longer than a chunk: routing can send most of
a head's rows to a few experts (a model's first steps can), and one program would then run the step's longest tile
alone while the others wait. Such a tile's B row blocks are cut into nch = ceil(B / chunk) equal chunks (chunk c:
blocks [c B / nch, (c + 1) B / nch)), with chunk = ceil(total row blocks / E), so that the chunks after the first
number at most E = EXTRA_CHUNKS_PER_PROGRAM x programs. Chunk 0 goes with the dealt tile, the others to the programs
with the fewest dealt rows; each chunk of a split tile sums into a slot of its own (2 E slots: at most E later
chunks and each split tile's chunk 0), in dW's dtype (fp32 for the train step's fp32 masters; bf16 weights'
partials are rounded to bf16 once more). `kernels/triton/dw_chunks.py` then adds a split tile's slots in chunk
order, and then to the sum so far: dW = acc + ((p_0 + p_1) + ...), a fixed order and no atomics; dW with acc is
bitwise acc + the dW made without it. The chunks depend on the programs (the SM count) and the total rows: on a GPU
with another SM count a long tile's sum can round differently (docs/design.md, What is not bitwise).

The array (int32), P programs, T tiles, E = EXTRA_CHUNKS_PER_PROGRAM x P, M = T + E items at most; [a, + n) is n
entries from a:
    [0, P]             program p takes the items sched[p] to sched[p + 1] (its dealt tiles' first chunks, then its
                       share of the later chunks: the i-th later chunk goes to the program of rank i % P, programs
                       ranked by their dealt row blocks, fewest first)
    [P + 1, + 4 M)     the items, 4 entries each: tile t (group x tiles_per_group + its 128-de part), the chunk's first
                       packed row, its row blocks of block_m rows, its slot (-1: the tile is in one chunk)
    [P + 1 + 4 M, + 3 E) the split tiles in tile order, 3 entries each: tile, first slot, chunks (its nch chunks take
                       the nch slots from the first; 2 E slots in all); then tile -1
Everything a kernel needs of an item is in its 4 entries, so that the kernels' partitions only load them.
"""

from __future__ import annotations

import numpy as np

EXTRA_CHUNKS_PER_PROGRAM = 2  # chunks after the first per program; twice as many slots (DH x (DE + 128) each)


def partial_slots(programs: int) -> int:
    """The partial-sum slots of a schedule for `programs` programs."""
    return 2 * EXTRA_CHUNKS_PER_PROGRAM * programs


def check_schedule_args(num_groups: int, tiles_per_group: int, heads: int, programs: int, rows: int) -> None:
    """Raise a ValueError naming the values unless the groups split into `heads` equal heads, 1 <= programs <=
    num_groups * tiles_per_group (the launch grid a schedule is dealt for), and the packed rows' indexes fit an int32
    entry (an item's first row)."""
    tiles = num_groups * tiles_per_group
    if heads < 1 or num_groups % heads or not 1 <= programs <= tiles:
        raise ValueError(f"tile schedule: {num_groups} groups, heads={heads}, programs={programs}, tiles_per_group="
                         f"{tiles_per_group}; expected the groups to split into equal heads and 1 <= programs <= "
                         f"{tiles} (the tiles)")
    if rows >= 1 << 31:
        raise ValueError(f"tile schedule: {rows} packed rows; expected fewer than {1 << 31} (int32 row indexes)")


def deal_schedule(num_tiles: int, heads: int, programs: int, deal: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The persistent dW / backward kernels' static schedule. The tiles come in head-major order, each head's sorted by
    size, largest first (`tile_schedule`); position j of that sequence goes to one program. Within a head the positions
    are dealt like cards in rounds of alternating direction (program p gets the head's positions p, 2 P - 1 - p,
    2 P + p, ...), and each head's deal starts at another program (rotated by P / heads): the longest-first rule, so
    every program's sum of tile sizes comes out about even, while the programs stay in about the same head at a time
    (its gathered X / dy rows, 21 MB per head at 81920 tokens, stay in L2).
    Groups are as uneven as the router makes them: at 81920 tokens, Ne 384, the layer's first step has groups of 102
    to 2471 rows; strided in group order the busiest of 132 programs had 1544 row blocks against a mean of 1336,
    dealt like this 1356 (and 1360 dealt over all heads at once, which took the gathers out of L2: slower alone).
    -> (perm, starts): program p takes positions perm[starts[p]:starts[p + 1]], in order. deal=False: position j
    to program j % programs (strided in the given order: comparisons)."""
    if heads < 1 or num_tiles % heads or programs < 1:
        raise ValueError(f"deal_schedule: {num_tiles} tiles, heads={heads}, programs={programs}; expected the tiles to "
                         "split into equal heads and at least one program")
    j = np.arange(num_tiles)
    h, jh = j // (num_tiles // heads), j % (num_tiles // heads)
    r, i = jh // programs, jh % programs
    prog = (np.where(r % 2 == 1, programs - 1 - i, i) + h * programs // heads) % programs if deal else j % programs
    starts = np.concatenate([[0], np.cumsum(np.bincount(prog, minlength=programs))])
    return np.argsort(prog, kind="stable"), starts


def tile_schedule(xp, group_sizes, group_nblocks, group_block_start, tiles_per_group: int, heads: int,
                  programs: int, block_m: int, pack_block: int, deal: bool = True):
    """The schedule array the dW / backward kernels read (int32; the layout above), in array namespace `xp`: numpy
    for the torch launchers (`tile_schedule_torch`), jax.numpy for the JAX binding (traced: the group arrays are the
    packing's). Groups are head-major (G = heads x experts), each head's sorted by row blocks, largest first
    (stable), a group's tiles side by side, dealt by `deal_schedule`; then the other chunks of the tiles longer than
    a chunk, each program's share of them in the order of its dealt rows, fewest first. deal=False: the tiles in
    group order, strided over the programs (comparisons). `programs` must be the launch grid."""
    jax_np = xp is not np
    nb = group_nblocks.reshape(heads, -1)
    if not deal:
        go = xp.broadcast_to(xp.arange(nb.shape[1], dtype=xp.int32), nb.shape)
    else:  # numpy < 2 has no stable= keyword
        go = xp.argsort(-nb, axis=1, stable=True) if jax_np else np.argsort(-nb, axis=1, kind="stable")
    go = go.astype(xp.int32) + (xp.arange(heads, dtype=xp.int32) * nb.shape[1])[:, None]
    tiles = (go.reshape(-1, 1) * tiles_per_group + xp.arange(tiles_per_group, dtype=xp.int32)).reshape(-1)
    perm, starts = deal_schedule(tiles.shape[0], heads, programs, deal)
    n_tiles, cap = tiles.shape[0], EXTRA_CHUNKS_PER_PROGRAM * programs
    # chunks: a tile's row blocks in nch equal parts, the chunk such that the chunks after the first fit their list
    blocks = xp.repeat((group_sizes + block_m - 1) // block_m, tiles_per_group).astype(xp.int32)
    row0 = xp.repeat(group_block_start * pack_block, tiles_per_group).astype(xp.int32)
    chunk = xp.maximum(1, -(-xp.sum(blocks) // cap)).astype(xp.int32)
    nch = xp.maximum(1, -(-blocks // chunk)).astype(xp.int32)
    split = xp.where(nch > 1, nch, 0)
    base = (xp.cumsum(split) - split).astype(xp.int32)  # each split tile's first slot
    ends = xp.cumsum(nch - 1).astype(xp.int32)  # the chunks after the first, tile by tile
    n_extra = ends[-1]
    i = xp.arange(cap, dtype=xp.int32)
    t = xp.searchsorted(ends, i, side="right", **({"method": "compare_all"} if jax_np else {}))  # later chunk i's
    t = xp.minimum(t, n_tiles - 1).astype(xp.int32)
    it_t = xp.concatenate([tiles[perm], t])  # the dealt tiles (chunk 0), then the later chunks
    it_c = xp.concatenate([xp.zeros((n_tiles,), xp.int32), i - ends[t] + nch[t]])
    b, n = blocks[it_t], nch[it_t]
    b0 = it_c * (b // n) + it_c * (b % n) // n  # floor(c b / n), c b itself could pass int32
    b1 = (it_c + 1) * (b // n) + (it_c + 1) * (b % n) // n
    items = xp.stack([it_t, row0[it_t] + b0 * block_m, b1 - b0, xp.where(n > 1, base[it_t] + it_c, -1)],
                     axis=1).astype(xp.int32)
    # where each item goes: program p's dealt tiles, then its later chunks (rank r's: the chunks r, r + P, ...); the
    # later chunks go to the programs with the fewest dealt rows first (rank: a compare, not a sort)
    ndealt = np.diff(starts).astype(np.int32)
    prog = np.repeat(np.arange(programs, dtype=np.int32), ndealt)
    loads = _scatter(xp, xp.zeros((programs,), xp.int32), prog, items[:n_tiles, 2], add=True)
    q = xp.arange(programs, dtype=xp.int32)
    rank = xp.sum((loads[None, :] < loads[:, None]) | ((loads[None, :] == loads[:, None]) & (q[None, :] < q[:, None])),
                  axis=1).astype(xp.int32)
    count = ndealt + n_extra // programs + (rank < n_extra % programs).astype(xp.int32)
    off = xp.cumsum(count).astype(xp.int32) - count
    by_rank = _scatter(xp, xp.zeros((programs,), xp.int32), rank, q)[i % programs]  # the program of later chunk i
    later = xp.where(i < n_extra, off[by_rank] + xp.asarray(ndealt)[by_rank] + i // programs, n_tiles + cap)
    dest = xp.concatenate([off[prog] + np.arange(n_tiles, dtype=np.int32) - starts[prog], later])
    out = _scatter(xp, xp.zeros((n_tiles + cap, 4), xp.int32), dest, items)
    at = xp.where(nch > 1, xp.cumsum(nch > 1) - 1, cap)  # the split tiles listed (at most cap: each has a chunk)
    listed = _scatter(xp, xp.tile(xp.asarray([-1, 0, 0], xp.int32), (cap, 1)), at,
                      xp.stack([xp.arange(n_tiles, dtype=xp.int32), base, nch], axis=1))
    return xp.concatenate([off, off[-1:] + count[-1:], out.reshape(-1), listed.reshape(-1)]).astype(xp.int32)


def _scatter(xp, target, idx, values, add: bool = False):
    """target with values added (add) or set at idx along its first axis; set drops indexes past its end."""
    if xp is not np:
        return target.at[idx].add(values) if add else target.at[idx].set(values, mode="drop")
    target = target.copy()
    if add:
        np.add.at(target, idx, values)
    else:
        keep = idx < target.shape[0]
        target[idx[keep]] = values[keep]
    return target


def tile_schedule_torch(pk, tiles_per_group: int, heads: int, programs: int, block_m: int, pack_block: int,
                        deal: bool = True):
    """`tile_schedule` for the torch launchers: built in numpy from a packing `pk` (`kernels.torch.experts.
    TorchPacking`: its group sizes, row blocks of pack_block rows and first blocks; the torch paths may synchronise),
    returned as an int32 tensor on the packing's device."""
    import torch

    check_schedule_args(pk.group_nblocks.shape[0], tiles_per_group, heads, programs, pk.row_slot.shape[0])
    groups = (t.cpu().numpy().astype(np.int32) for t in (pk.group_sizes, pk.group_nblocks, pk.group_block_start))
    sched = tile_schedule(np, *groups, tiles_per_group, heads, programs, block_m, pack_block, deal)
    return torch.as_tensor(sched, device=pk.group_nblocks.device)
