"""The persistent dW / backward kernels' reading of their schedule (`kernels.gluon.schedule` describes the array):
a program's work items, each as the schedule spells it out (tile, first row, row blocks, partial-sum slot), so that
the kernels' partitions only load them. Shared by every partition of kernels/gluon/experts_bwd.py and
kernels/gluon/experts_bwd_fused.py, which must walk the same items."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _items(sched_ptr):
    """This program's work items (its dealt tiles, then its share of the long tiles' later chunks) -> (their count,
    the address of the first one's entries)."""
    pid = gl.program_id(0)
    s0 = gl.load(sched_ptr + pid)
    return gl.load(sched_ptr + pid + 1) - s0, sched_ptr + gl.num_programs(0) + 1 + 4 * s0


@gluon.jit
def _work(items_ptr, i, DE: gl.constexpr):
    """Item i of this program (`_items`' address) -> (group as int64, first de, first packed row as int64, row blocks,
    partial-sum slot or -1). A tile's row blocks are those holding its group's rows (blocks made only of the padding
    after them are neither computed nor written); a split tile's chunk sums into its slot."""
    item = items_ptr + 4 * i
    t = gl.load(item)
    return ((t // (DE // 128)).to(gl.int64), (t % (DE // 128)) * 128, gl.load(item + 1).to(gl.int64),
            gl.load(item + 2), gl.load(item + 3))
