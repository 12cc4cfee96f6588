"""The persistent dW / backward kernels' schedule (kernels/gluon/schedule.py, the JAX binding's `tile_schedule`) and
the sum of a split tile's chunks (kernels/triton/dw_chunks.py).

CPU: the deal (every tile once, head by head, largest groups first, rows even over the programs); the chunks of
long tiles, walked as the kernels walk the array (each program's dealt tiles, then its share of the later chunks):
every row block of every tile exactly once, each split tile's chunks in slots of their own, and the busiest program
near the mean where the deal alone leaves it at the longest tile; the JAX array equal to the torch launchers'; the
chunk sum under the Triton interpreter, bitwise numpy's sum in chunk order (and then the running sum).
GPU: the Gluon kernels on such schedules are tests/kernels/test_experts_gpu.py's (skewed routing: every token on the
same experts) and test_kernels_in_model.py's.
"""

from typing import NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.gluon.schedule import (  # noqa: E402
    EXTRA_CHUNKS_PER_PROGRAM,
    deal_schedule,
    partial_slots,
    tile_schedule_torch,
)
from kernels.torch.interpreter_patch import fix_interpreter_scalar_index  # noqa: E402
from tests.kernels.interpreted import interp, interpreted  # noqa: E402

fix_interpreter_scalar_index()  # the kernel's loop bound is loaded from memory
(dwc,) = interpreted("kernels.triton.dw_chunks")


def test_deal_schedule_alternates_rotated_rounds():
    for t, h, p in [(6144, 8, 132), (12, 1, 4), (8, 2, 4), (3, 1, 5), (132, 4, 132), (300, 3, 132)]:
        perm, starts = deal_schedule(t, h, p)
        assert sorted(perm.tolist()) == list(range(t)) and starts[0] == 0 and starts[-1] == t and len(starts) == p + 1
    for bad in [(10, 3, 4), (12, 0, 4), (12, 2, 0)]:
        with pytest.raises(ValueError, match=f"{bad[0]} tiles, heads={bad[1]}, programs={bad[2]}"):
            deal_schedule(*bad)
    # exact small deals: rounds of alternating direction, each head's first program rotated by programs / heads
    for (t, h, p), want in {(12, 1, 4): [[0, 7, 8], [1, 6, 9], [2, 5, 10], [3, 4, 11]],
                            (16, 2, 4): [[0, 7, 10, 13], [1, 6, 11, 12], [2, 5, 8, 15], [3, 4, 9, 14]]}.items():
        perm, starts = deal_schedule(t, h, p)
        assert [perm[starts[q]:starts[q + 1]].tolist() for q in range(p)] == want, (t, h, p)
    perm, starts = deal_schedule(12, 2, 4, deal=False)  # the comparisons' strided order
    assert [perm[starts[q]:starts[q + 1]].tolist() for q in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]


class _Packing(NamedTuple):  # the fields a schedule reads (of mhl_jax.moe.packing.Packing / TorchPacking)
    row_slot: object
    group_sizes: object
    group_nblocks: object
    group_block_start: object


def packing(sizes: np.ndarray, pack: int, lib: str = "torch") -> _Packing:
    """Groups of `sizes` rows packed in blocks of `pack` rows, one after another."""
    nblocks = -(-sizes // pack)
    fields = np.zeros(int(nblocks.sum()) * pack), sizes, nblocks, np.cumsum(nblocks) - nblocks
    if lib == "torch":
        return _Packing(*(torch.from_numpy(f).int() for f in fields))
    import jax.numpy as jnp

    return _Packing(*(jnp.asarray(f, jnp.int32) for f in fields))


def walk(sched: np.ndarray, sizes: np.ndarray, nt: int, programs: int, bm: int, pack: int):
    """The kernels' reading of the array (`_items`, `_work`), in numpy: per program its items as (tile, first row
    block of the tile, row blocks, slot or -1), the first row block found from the item's first packed row."""
    nblocks = -(-sizes // pack)
    start = (np.cumsum(nblocks) - nblocks) * pack
    m = sizes.size * nt + EXTRA_CHUNKS_PER_PROGRAM * programs  # the items' room
    entries = sched[programs + 1:programs + 1 + 4 * m].reshape(m, 4)
    items = []
    for p in range(programs):
        mine = []
        for t, row, n, slot in entries[sched[p]:sched[p + 1]].tolist():
            b0, rem = divmod(row - start[t // nt], bm)
            assert rem == 0 and 0 <= b0 and n >= 0 and b0 + n <= -(-sizes[t // nt] // bm), (t, row, n)
            mine.append((t, b0, n, slot))
        items.append(mine)
    return items


def _sizes(rng, heads: int, ne: int, kind: str) -> np.ndarray:
    if kind == "lognormal":
        sizes = (rng.lognormal(2.0, 0.6, heads * ne) * 32).astype(np.int64)
        sizes[::97] = 0  # empty groups: last in their head
    else:  # collapsed routing: every head's rows on 4 experts (a model's first steps), a few stragglers elsewhere
        sizes = np.zeros(heads * ne, np.int64)
        for h in range(heads):
            sizes[h * ne + rng.choice(ne, 4, replace=False)] = 16384
            sizes[h * ne + rng.choice(ne, 20, replace=False)] += rng.integers(1, 300, 20)
    return sizes


def test_schedule_refuses_bad_heads_programs_and_rows():
    from kernels.gluon.schedule import check_schedule_args

    check_schedule_args(3072, 2, 8, 132, 1 << 30)
    for bad, want in [((3072, 2, 7, 132, 10), "3072 groups, heads=7, programs=132"),
                      ((3072, 2, 8, 6145, 10), "programs=6145, tiles_per_group=2; .* <= 6144"),
                      ((3072, 2, 8, 132, 1 << 31), f"{1 << 31} packed rows; expected fewer than {1 << 31}")]:
        with pytest.raises(ValueError, match=want):
            check_schedule_args(*bad)


@pytest.mark.parametrize("kind,nt,programs", [("lognormal", 2, 132), ("lognormal", 1, 132), ("lognormal", 2, 7),
                                              ("collapsed", 2, 132), ("collapsed", 1, 132), ("collapsed", 2, 13)])
def test_tile_schedule_covers_every_block_once_and_evens_out_the_programs(kind, nt, programs):
    """Every row block of every tile exactly once, chunk 0 of each tile with the dealt tiles (head by head, largest
    groups first), a split tile's chunks in distinct slots within partial_slots (the split tiles listed in order for
    the chunk sum), and the busiest program within two
    chunks of the mean; on collapsed routing over many programs below the longest tile (where the deal alone left
    it). JAX equals torch."""
    from mhl_jax.moe.gpu.expert_kernels import tile_schedule

    rng = np.random.default_rng(0)
    heads, ne, bm, pack = 8, 384, 32, 64
    sizes = _sizes(rng, heads, ne, kind)
    sched = np.asarray(tile_schedule(packing(sizes, pack, "jax"), nt, heads, programs, bm, pack))
    assert sched.dtype == np.int32
    assert np.array_equal(sched, tile_schedule_torch(packing(sizes, pack), nt, heads, programs, bm, pack).numpy())
    tiles = sizes.size * nt
    items = walk(sched, sizes, nt, programs, bm, pack)
    blocks = np.repeat(-(-sizes // bm), nt)
    covered = [np.zeros(b, int) for b in blocks]
    slots = []
    for mine in items:
        for t, b0, n, slot in mine:
            covered[t][b0:b0 + n] += 1
            if slot >= 0:
                slots.append(slot)
        firsts = [t for t, b0, _, _ in mine if b0 == 0]
        heads_of = [t // nt // ne for t in firsts]
        assert heads_of == sorted(heads_of)  # the dealt tiles head by head
    assert all((c == 1).all() for c in covered)
    assert len(slots) == len(set(slots)) and all(0 <= s < partial_slots(programs) for s in slots)
    assert sorted(t for mine in items for t, b0, _, _ in mine if b0 == 0) == list(range(tiles))  # each dealt once
    extra = EXTRA_CHUNKS_PER_PROGRAM * programs
    chunk = max(1, -(-blocks.sum() // extra))
    split = {}
    for mine in items:
        for t, b0, _, slot in mine:
            if slot >= 0:
                split.setdefault(t, []).append((b0, slot))
    listed = sched[-3 * extra:].reshape(-1, 3)
    want = [[t, min(s for _, s in split[t]), len(split[t])] for t in sorted(split)]
    assert listed[:len(split)].tolist() == want and (listed[len(split):, 0] == -1).all()
    for chunks in split.values():  # a split tile's slots: consecutive, in chunk order
        order = [s for _, s in sorted(chunks)]
        assert order == list(range(order[0], order[0] + len(order)))
    loads = np.array([sum(n for _, _, n, _ in mine) for mine in items])
    assert loads.max() <= loads.mean() + 2 * chunk, (loads.max(), loads.mean(), chunk)
    if kind == "collapsed" and programs > 100:  # the deal alone: the longest tile's program at least that long
        assert len(slots) > 0 and loads.max() < 0.6 * blocks.max(), (loads.max(), blocks.max())


@interp
@pytest.mark.parametrize("accum", [False, True])
def test_dw_chunks_kernel_sums_slots_in_chunk_order(accum):
    """dw_chunks_kernel (interpreter): a split tile's dW1 columns / dW2 rows = its slots summed in chunk order (then
    added to the running sum with accum), bitwise numpy's float32 adds in that order; tiles in one chunk untouched."""
    rng = np.random.default_rng(1)
    heads, ne, nt, programs, bm, dh = 2, 4, 2, 3, 32, 128
    de = 128 * nt
    sizes = np.array([700, 0, 5, 40, 900, 64, 3, 1], np.int64)
    sched = tile_schedule_torch(packing(sizes, 64), nt, heads, programs, bm, 64)
    items = [it for mine in walk(sched.numpy(), sizes, nt, programs, bm, 64) for it in mine]
    part = rng.standard_normal(dwc.partial_shape(programs, dh, de), dtype=np.float32)
    p1 = part[:, :dh * de].reshape(-1, dh, de)
    p2 = part[:, dh * de:].reshape(-1, 128, dh)
    dw1 = rng.standard_normal((heads * ne, dh, de), dtype=np.float32)
    dw2 = rng.standard_normal((heads * ne, de, dh), dtype=np.float32)
    want1, want2 = dw1.copy(), dw2.copy()
    split = {}
    for t, b0, _, slot in items:
        if slot >= 0:
            split.setdefault(t, []).append((b0, slot))
    assert len(split) >= 2
    for t, chunks in split.items():
        order = [s for _, s in sorted(chunks)]
        g, e0 = t // nt, t % nt * 128
        s1, s2 = p1[order[0], :, e0:e0 + 128].copy(), p2[order[0]].copy()
        for s in order[1:]:
            s1, s2 = s1 + p1[s, :, e0:e0 + 128], s2 + p2[s]
        want1[g, :, e0:e0 + 128] = dw1[g, :, e0:e0 + 128] + s1 if accum else s1
        want2[g, e0:e0 + 128, :] = dw2[g, e0:e0 + 128, :] + s2 if accum else s2
    got1, got2 = torch.from_numpy(dw1.copy()), torch.from_numpy(dw2.copy())
    tiles = heads * ne * nt
    dwc.dw_chunks_kernel[(EXTRA_CHUNKS_PER_PROGRAM * programs,)](
        sched, torch.from_numpy(part), got1, got2, got1, got2,
        **dwc.dw_chunks_constexprs(programs, tiles, dh, de, accum))
    np.testing.assert_array_equal(got1.numpy(), want1)
    np.testing.assert_array_equal(got2.numpy(), want2)
