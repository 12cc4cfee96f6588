"""The static schedule of the persistent Gluon dW / backward kernels (kernels/gluon/experts_bwd.py): which program
takes which (group, 128 de) tile. Pure numpy (and torch for the torch launchers); the JAX binding builds the same
array in `mhl_jax.moe.gpu.expert_kernels.tile_schedule`."""

from __future__ import annotations

import functools

import numpy as np


def check_schedule_args(num_groups: int, tiles_per_group: int, heads: int, programs: int) -> None:
    """Raise a ValueError naming the values unless the groups split into `heads` equal heads and 1 <= programs <=
    num_groups * tiles_per_group (the launch grid a schedule is dealt for)."""
    if heads < 1 or num_groups % heads or not 1 <= programs <= num_groups * tiles_per_group:
        raise ValueError(f"tile schedule: {num_groups} groups, heads={heads}, programs={programs}, tiles_per_group="
                         f"{tiles_per_group}; expected the groups to split into equal heads and 1 <= programs <= "
                         f"{num_groups * tiles_per_group} (the tiles)")


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


def tile_schedule_torch(group_nblocks, tiles_per_group: int, heads: int, programs: int, deal: bool = True):
    """The schedule array the dW / backward kernels read (int32, torch): `deal_schedule`'s program offsets (counted
    from the array's start: program p's tiles are sched[sched[p]:sched[p + 1]]), then the (group, 128 de) tiles
    program by program. Groups are head-major (G = heads x experts); each head's sorted by row
    blocks, largest first (stable), a group's tiles side by side; deal=False: the tiles in group order, strided over the
    programs (comparisons)."""
    import torch

    check_schedule_args(group_nblocks.shape[0], tiles_per_group, heads, programs)
    nb = group_nblocks.long().reshape(heads, -1)
    go = torch.argsort(-nb, dim=1, stable=True) if deal else torch.arange(nb.shape[1], device=nb.device).expand_as(nb)
    go = go + torch.arange(heads, device=nb.device)[:, None] * nb.shape[1]
    tiles = (go.reshape(-1, 1) * tiles_per_group + torch.arange(tiles_per_group, device=nb.device)).reshape(-1)
    perm, starts = _deal_schedule_torch(tiles.numel(), heads, programs, str(nb.device), deal)
    return torch.cat([starts, tiles[perm].to(torch.int32)])
