"""The persistent dW / backward kernels' reading of their schedule (`kernels.gluon.schedule` describes the array):
a program's work items, and an item's rows and partial-sum slot. Shared by every partition of
kernels/gluon/experts_bwd.py and kernels/gluon/experts_bwd_fused.py, which must walk the same items."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.gluon.schedule import CHUNK_SHIFT, EXTRA_CHUNKS_PER_PROGRAM

CHUNK_SHIFT_C = gl.constexpr(CHUNK_SHIFT)
EXTRA_C = gl.constexpr(EXTRA_CHUNKS_PER_PROGRAM)


@gluon.jit
def _items(sched_ptr):
    """This program's work items (`kernels.gluon.schedule`: its dealt tiles, then its share of the long tiles' later
    chunks) -> (their count, the walk `_work` reads them with: offset of its first dealt tile, dealt tiles, X (the
    header's offset), its rank, the chunk length in row blocks)."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    s0 = gl.load(sched_ptr + pid)
    ns = gl.load(sched_ptr + pid + 1) - s0
    X = gl.load(sched_ptr + P)
    n_extra = gl.load(sched_ptr + X)
    rank = gl.load(sched_ptr + X + 2 + pid)
    return ns + n_extra // P + (rank < n_extra % P).to(gl.int32), (s0, ns, X, rank, gl.load(sched_ptr + X + 1))


@gluon.jit
def _work(sched_ptr, walk, i, group_block_start_ptr, group_size_ptr, DE: gl.constexpr, PACK_BLOCK: gl.constexpr,
          BLOCK_M: gl.constexpr):
    """Item i of this program (`_items`' walk): a dealt tile (chunk 0), or a later chunk (round r = i - ns: the list's
    entry r P + rank) -> `_dw_tile`'s (group, first de, first packed row, row blocks, slot). Every partition walks
    its items through here, so all of them take the same items."""
    s0, ns, X, rank, chunk = walk
    P = gl.num_programs(0)
    r = i - ns
    entry = gl.load(sched_ptr + gl.where(r >= 0, X + 2 + P + r * P + rank, s0 + i))
    return _dw_tile(entry, chunk, sched_ptr, X, group_block_start_ptr, group_size_ptr, DE, PACK_BLOCK, BLOCK_M)


@gluon.jit
def _dw_tile(entry, chunk, sched_ptr, X, group_block_start_ptr, group_size_ptr, DE: gl.constexpr,
             PACK_BLOCK: gl.constexpr, BLOCK_M: gl.constexpr):
    """Entry (tile t = (group, 128 de), chunk c) -> (group as int64, first de, first packed row, row blocks of
    BLOCK_M, partial-sum slot or -1). The tile's row blocks are those holding the group's rows (its size rounded up to
    BLOCK_M: blocks made only of the padding after them, up to PACK_BLOCK - BLOCK_M rows, are neither computed nor
    written), in nch = ceil(blocks / chunk) equal chunks, chunk c [c blocks / nch, (c + 1) blocks / nch); a split
    tile's (nch > 1) chunk c sums into slot first + c, the tile's first slot from the schedule."""
    t = entry & ((1 << CHUNK_SHIFT_C) - 1)
    c = entry >> CHUNK_SHIFT_C
    gi = t // (DE // 128)
    start = gl.load(group_block_start_ptr + gi)
    blocks = (gl.load(group_size_ptr + gi) + BLOCK_M - 1) // BLOCK_M
    nch = gl.maximum((blocks + chunk - 1) // chunk, 1)
    b0 = c * blocks // nch
    P = gl.num_programs(0)
    first = gl.load(sched_ptr + X + 2 + P + EXTRA_C * P + t, mask=nch > 1, other=0)
    return (gi.to(gl.int64), (t % (DE // 128)) * 128, start.to(gl.int64) * PACK_BLOCK + b0 * BLOCK_M,
            (c + 1) * blocks // nch - b0, gl.where(nch > 1, first + c, -1))
