"""A split tile's partial weight gradients (`kernels.gluon.schedule`), added up and into dW1 / dW2.

The persistent dW / backward kernels (kernels/gluon/experts_bwd.py) sum a long (group, 128 de) tile's rows in chunks,
each into a slot of its own (in dW's dtype). One program per split tile here adds the tile's slots in chunk order
and writes dW = (p_0 + p_1) + ... or, accumulating, acc + ((p_0 + p_1) + ...): a fixed order, no atomics, bitwise
the sum so far plus the gradient without it. A tile in one chunk (almost every tile unless routing is skewed) was
written by the kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gluon.schedule import EXTRA_CHUNKS_PER_PROGRAM, partial_slots


@triton.jit
def dw_chunks_kernel(sched_ptr, part_ptr, dw1_in, dw2_in, dw1_ptr, dw2_ptr,
                     PROGRAMS: tl.constexpr, TILES: tl.constexpr, DH: tl.constexpr, DE: tl.constexpr,
                     EXTRA: tl.constexpr, ACCUM: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program i: the i-th split tile t (-1: none), (group t // (DE / 128), de [128 (t % (DE / 128)), + 128)), of
    TILES. sched: the schedule array dealt for PROGRAMS programs, whose split-tile list (after the items) gives the
    tile, its first slot and its chunks; part (S, DH * DE + 128 * DH) in dW's dtype: slot s's dW1 block (DH, DE), of
    which the tile's 128 columns, then its dW2 rows (128, DH); dw1 (G, DH, DE), dw2 (G, DE, DH) in place (dw*_in are
    the same buffers, aliased: never read through), holding the sum so far with ACCUM. BLOCK_R rows of the (DH, 128)
    block at a time."""
    SLOT: tl.constexpr = DH * DE + 128 * DH
    entry = sched_ptr + PROGRAMS + 1 + 4 * (TILES + EXTRA * PROGRAMS) + 3 * tl.program_id(0)
    t = tl.load(entry)
    if t >= 0:
        g = (t // (DE // 128)).to(tl.int64)
        e0 = (t % (DE // 128)) * 128
        first = tl.load(entry + 1).to(tl.int64)
        nch = tl.load(entry + 2)
        r = tl.arange(0, BLOCK_R)
        c = tl.arange(0, 128)
        for r0 in tl.static_range(0, DH, BLOCK_R):
            o1 = (r0 + r)[:, None] * DE + e0 + c[None, :]  # dW1[r, e0 + c] in a slot
            o2 = DH * DE + c[None, :] * DH + (r0 + r)[:, None]  # dW2 row c, column r
            a1 = tl.load(part_ptr + first * SLOT + o1).to(tl.float32)
            a2 = tl.load(part_ptr + first * SLOT + o2).to(tl.float32)
            for j in range(1, nch):
                a1 += tl.load(part_ptr + (first + j) * SLOT + o1).to(tl.float32)
                a2 += tl.load(part_ptr + (first + j) * SLOT + o2).to(tl.float32)
            p1 = dw1_ptr + g * (DH * DE) + (r0 + r)[:, None] * DE + e0 + c[None, :]  # dW1[g, r, e0 + c]
            p2 = dw2_ptr + g * (DE * DH) + (e0 + c)[None, :] * DH + (r0 + r)[:, None]  # dW2[g, e0 + c, r]
            if ACCUM:
                a1 = tl.load(p1).to(tl.float32) + a1
                a2 = tl.load(p2).to(tl.float32) + a2
            tl.store(p1, a1.to(dw1_ptr.dtype.element_ty))
            tl.store(p2, a2.to(dw2_ptr.dtype.element_ty))


def dw_chunks_constexprs(programs: int, tiles: int, dh: int, de: int, accum: bool) -> dict:
    """`dw_chunks_kernel`'s constexprs (torch and JAX launchers alike); its grid is (EXTRA_CHUNKS_PER_PROGRAM x
    programs,): a program per possible split tile (each has a chunk after its first)."""
    return dict(PROGRAMS=programs, TILES=tiles, DH=dh, DE=de, EXTRA=EXTRA_CHUNKS_PER_PROGRAM, ACCUM=bool(accum),
                BLOCK_R=32)


def partial_shape(programs: int, dh: int, de: int) -> tuple[int, int]:
    """The partial sums' buffer of a schedule for `programs` programs: a slot per chunk of a split tile, each dW1's
    (dh, de) block (the tile's 128 columns used: the kernels then store either destination at the same strides)
    and dW2's 128 rows."""
    return partial_slots(programs), dh * de + 128 * dh
