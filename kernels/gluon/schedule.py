"""The schedule of the persistent Gluon dW / backward kernels (kernels/gluon/experts_bwd.py): which program takes
which (group, 128 de) tile, and which chunk of its row blocks. numpy for the static deal, torch for the torch
launchers (`tile_schedule_torch`); the JAX binding builds the same array in
`mhl_jax.moe.gpu.expert_kernels.tile_schedule`.

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

The array (int32), P programs, T tiles, E = EXTRA_CHUNKS_PER_PROGRAM x P; [a, + n) is n entries from a:
    [0, P]              offsets of each program's dealt tiles, counted from the array's start (sched[P] = P + 1 + T)
    [P + 1, + T)        the dealt tiles, program by program (tile t = group x tiles_per_group + its 128-de part)
    [X = P + 1 + T]     n, the number of chunks after the first; [X + 1] the chunk length in row blocks
    [X + 2, + P)        each program's rank for those chunks: programs by their dealt row blocks, fewest first
    [X + 2 + P, + E)    the chunks after the first, tile by tile (t | c << CHUNK_SHIFT), n of them; the i-th goes to
                        the program of rank i % P (rounds in one direction: the chunks are of about one length)
    [X + 2 + P + E, + T) each split tile's first slot (its nch chunks take nch slots from there; 2 E slots in all)
    [X + 2 + P + E + T, + E) the split tiles, in tile order, then -1
"""

from __future__ import annotations

import functools

import numpy as np

EXTRA_CHUNKS_PER_PROGRAM = 2  # chunks after the first per program; twice as many slots (DH x (DE + 128) each)
CHUNK_SHIFT = 20  # a chunk's entry: tile | chunk << CHUNK_SHIFT (up to 2^20 tiles)


def partial_slots(programs: int) -> int:
    """The partial-sum slots of a schedule for `programs` programs."""
    return 2 * EXTRA_CHUNKS_PER_PROGRAM * programs


def check_schedule_args(num_groups: int, tiles_per_group: int, heads: int, programs: int) -> None:
    """Raise a ValueError naming the values unless the groups split into `heads` equal heads and 1 <= programs <=
    num_groups * tiles_per_group (the launch grid a schedule is dealt for), and a chunk's int32 entry (tile | chunk
    << CHUNK_SHIFT) holds every tile and chunk index (chunk < EXTRA_CHUNKS_PER_PROGRAM x programs)."""
    tiles = num_groups * tiles_per_group
    if heads < 1 or num_groups % heads or not 1 <= programs <= tiles:
        raise ValueError(f"tile schedule: {num_groups} groups, heads={heads}, programs={programs}, tiles_per_group="
                         f"{tiles_per_group}; expected the groups to split into equal heads and 1 <= programs <= "
                         f"{tiles} (the tiles)")
    if tiles >= 1 << CHUNK_SHIFT or EXTRA_CHUNKS_PER_PROGRAM * programs >= 1 << (31 - CHUNK_SHIFT):
        raise ValueError(f"tile schedule: {tiles} tiles on {programs} programs; expected fewer than "
                         f"{1 << CHUNK_SHIFT} tiles and {(1 << (31 - CHUNK_SHIFT)) // EXTRA_CHUNKS_PER_PROGRAM} "
                         "programs (a chunk's int32 entry)")


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


@functools.lru_cache(maxsize=64)
def _deal_schedule_torch(num_tiles: int, heads: int, programs: int, device: str, deal: bool):
    import torch

    perm, starts = deal_schedule(num_tiles, heads, programs, deal)
    return (torch.as_tensor(perm, device=device),
            torch.as_tensor((starts + programs + 1).astype(np.int32), device=device))


def tile_schedule_torch(group_sizes, group_nblocks, tiles_per_group: int, heads: int, programs: int,
                        block_m: int, deal: bool = True):
    """The schedule array the dW / backward kernels read (int32, torch; the layout above), equal to the JAX binding's
    `tile_schedule`. Groups are head-major (G = heads x experts); each head's sorted by row blocks, largest first
    (stable), a group's tiles side by side; deal=False: the tiles in group order, strided over the programs
    (comparisons)."""
    import torch

    check_schedule_args(group_nblocks.shape[0], tiles_per_group, heads, programs)
    dev = group_nblocks.device
    nb = group_nblocks.long().reshape(heads, -1)
    go = torch.argsort(-nb, dim=1, stable=True) if deal else torch.arange(nb.shape[1], device=dev).expand_as(nb)
    go = go + torch.arange(heads, device=dev)[:, None] * nb.shape[1]
    tiles = (go.reshape(-1, 1) * tiles_per_group + torch.arange(tiles_per_group, device=dev)).reshape(-1)
    perm, starts = _deal_schedule_torch(tiles.numel(), heads, programs, str(dev), deal)
    dealt = tiles[perm]
    blocks = torch.repeat_interleave((group_sizes.long() + block_m - 1) // block_m, tiles_per_group)
    cap = EXTRA_CHUNKS_PER_PROGRAM * programs
    chunk = torch.clamp(-(-blocks.sum() // cap), min=1)
    nch = torch.clamp(-(-blocks // chunk), min=1)
    ends = torch.cumsum(nch - 1, 0)  # the chunks after the first, tile by tile
    n_extra = ends[-1]
    i = torch.arange(cap, device=dev)
    t = torch.clamp(torch.searchsorted(ends, i, right=True), max=blocks.numel() - 1)
    extras = torch.where(i < n_extra, t | ((i - ends[t] + nch[t]) << CHUNK_SHIFT), 0)
    split = torch.where(nch > 1, nch, 0)
    split_base = torch.cumsum(split, 0) - split
    at = torch.where(nch > 1, torch.cumsum((nch > 1).long(), 0) - 1, cap)
    split_list = torch.full((cap + 1,), -1, dtype=torch.long, device=dev).scatter_(
        0, at, torch.arange(blocks.numel(), device=dev))[:cap]
    prog = torch.repeat_interleave(torch.arange(programs, device=dev), torch.diff(starts - programs - 1).long())
    loads = torch.zeros(programs, dtype=torch.long, device=dev).index_add_(0, prog, blocks[dealt] // nch[dealt])
    q = torch.arange(programs, device=dev)
    rank = ((loads[None, :] < loads[:, None]) | ((loads[None, :] == loads[:, None]) & (q[None, :] < q[:, None]))).sum(1)
    return torch.cat([starts.long(), dealt, torch.stack([n_extra, chunk]), rank, extras, split_base,
                      split_list]).to(torch.int32)
