"""Packing routed sub-tokens by (head, expert) on Triton: the layout of `mhl_jax.moe.packing.pack`
(module docstring there) in five launches instead of the dozen-plus small XLA kernels of the JAX
packing, which cost 0.2-0.5 ms on an H100 whatever the size.

Slots: per head h, local slot l = n * K + j (n token, j choice) holds expert e = idx[n, h, j] (-1:
empty); global slot s = (n * H + h) * K + j. The ML = N * K local slots of a head are cut into NC
chunks of C. Integer-only. The one atomic is the histogram's integer add (a count does not depend on
the order of its adds); every other output element is written by one program.

1. `pack_hist_kernel`     grid (NC, H): histogram of each chunk over the NEP >= NE + 1 bins (bin NE =
                          empty slots, out-of-range ids and chunk padding) -> hist (H, NC, NEP).
                          tl.histogram's ballot algorithm costs ~NEP / 32 instructions per slot; from
                          HIST_ATOMIC_MIN_BINS bins on, integer atomic adds into a zeroed buffer instead.
2. `pack_offsets_kernel`  grid (H, NEP / EB): per (head, expert column block), over chunks in order:
                          base[h, c, e] = slots of e in earlier chunks (written over hist); group sizes.
3. `group_blocks_kernel`  grid (1,): each group's R-row blocks: count (G,), first block (G,) and its row
                          pstart = first block * R (G,), end bend (G,), blocks in use. The same launch cuts
                          groups into blocks elsewhere (`cut_launches`: the router's dW blocks).
4. `pack_scatter_kernel`  grid (NC, H): sort the chunk's keys (e << LOG_C | i) in registers (stable by
                          expert); a slot's rank among its expert's slots in the chunk = its sorted
                          position - its run's first position (a segmented scan over the sorted
                          experts); its padded row is pstart[h * NE + e] + base[h, c, e] + rank; writes
                          slot_row[s] (-1 if empty) and row_slot[row] = s (row_slot arrives filled with -1).
5. `pack_block_group_kernel` grid (NB / BLOCK,): each row block's group by binary search in bend
                          (-1 past the blocks in use).
Parameters follow jax-triton's binding order: inputs, then one pointer per output, then constexprs.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from kernels.tuning import (
    BLOCK_GROUP_TILE,
    GROUP_SCAN_STEP,
    HIST_ATOMIC_MIN_BINS,
    PACK_CHUNK,
    PACK_OFFSETS_EB,
    PACK_SORT_WARPS,
)


@triton.jit
def _chunk_experts(idx_ptr, h, c, H: tl.constexpr, K: tl.constexpr, ML: tl.constexpr, NE: tl.constexpr,
                   C: tl.constexpr):
    """(C,) expert of local slots c * C + i of head h (NE for empty slots and past ML), and the slots."""
    i = tl.arange(0, C)
    loc = c * C + i
    inside = loc < ML
    s = (loc // K * H + h) * K + loc % K
    e = tl.load(idx_ptr + s, mask=inside, other=-1)
    # ids outside [0, NE) count as empty (tl.histogram bins by the low bits: an id >= NEP would alias)
    return tl.where((e >= 0) & (e < NE), e, NE), loc, inside, s


@triton.jit
def pack_hist_kernel(idx_ptr, hist_in_ptr, hist_ptr, H: tl.constexpr, K: tl.constexpr, ML: tl.constexpr,
                     NE: tl.constexpr, NEP: tl.constexpr, NC: tl.constexpr, C: tl.constexpr, ATOMIC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    e, _, _, _ = _chunk_experts(idx_ptr, h, c, H, K, ML, NE, C)
    row = hist_ptr + (h * NC + c) * NEP
    if ATOMIC:  # into the zeroed buffer
        tl.atomic_add(row + e, tl.full((C,), 1, tl.int32), sem="relaxed")
    else:
        tl.store(row + tl.arange(0, NEP), tl.histogram(e, NEP))


@triton.jit
def pack_offsets_kernel(hist_ptr, base_ptr, sizes_ptr, NE: tl.constexpr, NEP: tl.constexpr,
                        NC: tl.constexpr, CB: tl.constexpr, EB: tl.constexpr):
    h = tl.program_id(0)
    cols = tl.program_id(1) * EB + tl.arange(0, EB)
    running = tl.zeros((EB,), tl.int32)  # slots of each expert in the chunks done so far
    for c0 in range(0, NC, CB):
        rows = c0 + tl.arange(0, CB)
        ok = rows < NC
        off = (h * NC + rows[:, None]) * NEP + cols[None, :]
        t = tl.load(hist_ptr + off, mask=ok[:, None], other=0)  # (CB, EB)
        before = running[None, :] + tl.cumsum(t, 0) - t  # slots of e in earlier chunks
        tl.store(base_ptr + off, before, mask=ok[:, None])
        running += tl.sum(t, 0)
    tl.store(sizes_ptr + h * NE + cols, running, mask=cols < NE)


@triton.jit
def group_blocks_kernel(sizes_ptr, gstart_ptr, gcount_ptr, pstart_ptr, bend_ptr, nblocks_ptr, G: tl.constexpr,
                        R: tl.constexpr, GB: tl.constexpr):
    """Groups of sizes (G,) laid out one after another, each in whole blocks of R rows: per group its block count,
    first block, first row and end (in blocks), and the blocks in all. One program: G / GB steps of a scan."""
    total = tl.sum(tl.zeros((GB,), tl.int32), 0)
    for g0 in range(0, G, GB):
        g = g0 + tl.arange(0, GB)
        ok = g < G
        size = tl.load(sizes_ptr + g, mask=ok, other=0)
        count = (size + R - 1) // R
        end = total + tl.cumsum(count, 0)
        tl.store(gstart_ptr + g, end - count, mask=ok)
        tl.store(gcount_ptr + g, count, mask=ok)
        tl.store(pstart_ptr + g, (end - count) * R, mask=ok)
        tl.store(bend_ptr + g, end, mask=ok)
        total += tl.sum(count, 0)
    tl.store(nblocks_ptr, total)


@triton.jit
def _run_first(e_a, f_a, e_b, f_b):
    """Segmented scan over sorted experts: (expert, first position of its run so far). Associative because
    the experts are sorted: equal ends of two adjacent spans mean the right span is one run."""
    return e_b, tl.where(e_a == e_b, f_a, f_b)


@triton.jit
def pack_scatter_kernel(idx_ptr, base_ptr, pstart_ptr, row_slot_in_ptr, slot_row_ptr, row_slot_ptr,
                        H: tl.constexpr, K: tl.constexpr, ML: tl.constexpr, NE: tl.constexpr, NEP: tl.constexpr,
                        NC: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    e, _, _, _ = _chunk_experts(idx_ptr, h, c, H, K, ML, NE, C)
    i = tl.arange(0, C)
    key = tl.sort((e << LOG_C) | i)  # unique keys: the stable order by expert
    se = key >> LOG_C
    si = key & (C - 1)
    _, first = tl.associative_scan((se, i), 0, _run_first)  # first sorted position of each slot's expert
    loc = c * C + si
    inside = loc < ML
    valid = se < NE
    sec = tl.where(valid, se, 0)
    base = tl.load(base_ptr + (h * NC + c) * NEP + sec, mask=valid, other=0)
    start = tl.load(pstart_ptr + h * NE + sec, mask=valid, other=0)
    row = start + base + i - first  # i - first: the slot's rank among its expert's slots in the chunk
    s = (loc // K * H + h) * K + loc % K
    tl.store(slot_row_ptr + s, tl.where(valid, row, -1), mask=inside)
    tl.store(row_slot_ptr + row, s, mask=valid)


@triton.jit
def pack_block_group_kernel(bend_ptr, nblocks_ptr, block_group_ptr, G: tl.constexpr, NB: tl.constexpr,
                            BLOCK: tl.constexpr, STEPS: tl.constexpr):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros((BLOCK,), tl.int32)
    hi = tl.full((BLOCK,), G, tl.int32)
    for _ in range(STEPS):  # first group whose end (in blocks) is past b
        mid = (lo + hi) // 2
        v = tl.load(bend_ptr + tl.minimum(mid, G - 1))
        right = v > b
        hi = tl.where(right, mid, hi)
        lo = tl.where(right, lo, mid + 1)
        lo = tl.minimum(lo, hi)
    used = tl.load(nblocks_ptr)
    tl.store(block_group_ptr + b, tl.where(b < used, lo, -1), mask=b < NB)


def next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def launch_shapes(n: int, h: int, k: int, ne: int, chunk: int = PACK_CHUNK) -> dict:
    """Static sizes of the packing launches for idx (n, h, k) over ne experts."""
    ml = n * k
    c = min(next_pow2(chunk), next_pow2(max(ml, 16)))
    nep = next_pow2(ne + 1)
    eb = min(nep, PACK_OFFSETS_EB)
    return dict(ML=ml, C=c, LOG_C=c.bit_length() - 1, NC=-(-ml // c), NEP=nep, EB=eb, CB=4096 // eb,
                G=h * ne)


@dataclass(frozen=True)
class Launch:
    """One kernel launch of the packing, for either launcher (torch, jax-triton). Buffers are named; all
    int32. `fill`: outputs that exist before the launch, filled with a value and passed in as inputs too
    (an aliased input in JAX: the kernel writes only some of their elements). `inplace`: outputs written over an
    input that is dead after the launch (each element read before the same program writes it)."""

    kernel: object
    inputs: tuple
    outputs: tuple  # ((name, shape), ...)
    grid: tuple
    meta: dict
    num_warps: int = 4
    fill: tuple = ()  # ((name, value), ...)
    inplace: tuple = ()  # ((output name, input name), ...)


PACK_RESULT = ("row_slot", "slot_row", "block_group", "sizes", "nblocks", "gstart", "gcount")  # `Packing`'s, in order


def group_blocks_launch(g: int, block: int) -> Launch:
    """group_blocks_kernel over the G group sizes ("sizes") in blocks of `block`: "gstart", "gcount", "pstart",
    "bend" (G,) and "nblocks" (1,)."""
    outs = tuple((name, (g,)) for name in ("gstart", "gcount", "pstart", "bend")) + (("nblocks", (1,)),)
    return Launch(group_blocks_kernel, ("sizes",), outs, (1,), dict(G=g, R=block, GB=GROUP_SCAN_STEP))


def block_group_launch(g: int, nb: int) -> Launch:
    """pack_block_group_kernel: the group of each of nb blocks ("block_group", -1 past "nblocks") from the groups'
    ends in blocks ("bend")."""
    return Launch(pack_block_group_kernel, ("bend", "nblocks"), (("block_group", (nb,)),),
                  (-(-nb // BLOCK_GROUP_TILE),), dict(G=g, NB=nb, BLOCK=BLOCK_GROUP_TILE, STEPS=g.bit_length() + 1))


def cut_launches(g: int, block: int, nb: int) -> list[Launch]:
    """Groups of sizes "sizes" (G,) cut into blocks of at most `block` rows, numbered group after group (nb: a static
    bound on the blocks): group_blocks_launch's arrays and each block's group ("block_group", -1 past the used ones).
    The router's dW blocks (`mhl_jax.moe.gpu.router.dw_metadata_from_packing`)."""
    return [group_blocks_launch(g, block), block_group_launch(g, nb)]


def pack_launches(n: int, h: int, k: int, ne: int, block: int, p: int, chunk: int = PACK_CHUNK,
                  hist_atomic_min_bins: int = HIST_ATOMIC_MIN_BINS) -> list[Launch]:
    """The five launches packing idx (n, h, k) (input buffer "idx") over ne experts into p padded rows
    (`padded_rows(n * h * k, h * ne, block)`); the results are the buffers named in PACK_RESULT. chunk and
    hist_atomic_min_bins: the tuning's, other values for tests (several chunks, both histogram forms)."""
    sh = launch_shapes(n, h, k, ne, chunk)
    nc, nep, g, nb = sh["NC"], sh["NEP"], sh["G"], p // block
    chunked = dict(H=h, K=k, ML=sh["ML"], NE=ne, NEP=nep, NC=nc, C=sh["C"])
    atomic = nep >= hist_atomic_min_bins
    return [
        # the atomic histogram adds into a zeroed buffer (input and output); tl.histogram's writes every bin (the
        # input pointer then unused: idx again)
        Launch(pack_hist_kernel, ("idx", "hist" if atomic else "idx"), (("hist", (h, nc, nep)),), (nc, h),
               dict(chunked, ATOMIC=atomic), fill=(("hist", 0),) if atomic else ()),
        # base over hist: each is 42 MB at 81920 tokens x 8 heads, k 4, Ne 2048 (320 chunks x 4096 bins per head)
        Launch(pack_offsets_kernel, ("hist",), (("base", (h, nc, nep)), ("sizes", (g,))),
               (h, nep // sh["EB"]), dict(NE=ne, NEP=nep, NC=nc, CB=sh["CB"], EB=sh["EB"]),
               inplace=(("base", "hist"),)),
        group_blocks_launch(g, block),
        Launch(pack_scatter_kernel, ("idx", "base", "pstart", "row_slot"),
               (("slot_row", (n * h * k,)), ("row_slot", (p,))), (nc, h), dict(chunked, LOG_C=sh["LOG_C"]),
               num_warps=PACK_SORT_WARPS, fill=(("row_slot", -1),)),
        block_group_launch(g, nb),
    ]
