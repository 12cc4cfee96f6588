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

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.gluon.schedule import (  # noqa: E402
    CHUNK_SHIFT,
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


def walk(sched: np.ndarray, sizes: np.ndarray, nt: int, programs: int, block_m: int):
    """The kernels' reading of the array (`_items`, `_item`, `_dw_tile`), in numpy: per program its items as
    (tile, first block, blocks, slot or -1)."""
    tiles = sizes.size * nt
    x = programs + 1 + tiles
    n_extra, chunk = sched[x], sched[x + 1]
    items = []
    for p in range(programs):
        s0, ns, rank = sched[p], sched[p + 1] - sched[p], sched[x + 2 + p]
        mine = []
        for i in range(ns + n_extra // programs + int(rank < n_extra % programs)):
            r = i - ns
            entry = sched[s0 + i] if r < 0 else sched[x + 2 + programs + r * programs + rank]
            t, c = entry & ((1 << CHUNK_SHIFT) - 1), entry >> CHUNK_SHIFT
            blocks = -(-sizes[t // nt] // block_m)
            nch = max(-(-blocks // chunk), 1)
            first = sched[x + 2 + programs + EXTRA_CHUNKS_PER_PROGRAM * programs + t]
            b0, b1 = c * blocks // nch, (c + 1) * blocks // nch
            mine.append((t, b0, b1 - b0, first + c if nch > 1 else -1))
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


def test_schedule_refuses_what_its_int32_entries_cannot_hold():
    from kernels.gluon.schedule import check_schedule_args

    check_schedule_args(1 << 19, 1, 8, 1000)
    with pytest.raises(ValueError, match=f"{1 << 20} tiles on 4 programs; expected fewer than {1 << 20} tiles"):
        check_schedule_args(1 << 19, 2, 8, 4)
    with pytest.raises(ValueError, match="6144 tiles on 1024 programs; expected fewer than .* and 1024 programs"):
        check_schedule_args(3072, 2, 8, 1024)


@pytest.mark.parametrize("kind,nt,programs", [("lognormal", 2, 132), ("lognormal", 1, 132), ("lognormal", 2, 7),
                                              ("collapsed", 2, 132), ("collapsed", 1, 132), ("collapsed", 2, 13)])
def test_tile_schedule_covers_every_block_once_and_evens_out_the_programs(kind, nt, programs):
    """Every row block of every tile exactly once, chunk 0 of each tile with the dealt tiles (head by head, largest
    groups first), a split tile's chunks in distinct slots within partial_slots (the split tiles listed in order for
    the chunk sum), and the busiest program within two
    chunks of the mean; on collapsed routing over many programs below the longest tile (where the deal alone left
    it). JAX equals torch."""
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.expert_kernels import tile_schedule

    rng = np.random.default_rng(0)
    heads, ne, bm, pack = 8, 384, 32, 64
    sizes = _sizes(rng, heads, ne, kind)
    nblocks = -(-sizes // pack)
    sched = np.asarray(tile_schedule(jnp.asarray(sizes, jnp.int32), jnp.asarray(nblocks, jnp.int32), nt, heads,
                                     programs, bm))
    assert sched.dtype == np.int32
    assert np.array_equal(sched, tile_schedule_torch(torch.from_numpy(sizes).int(), torch.from_numpy(nblocks).int(),
                                                     nt, heads, programs, bm).numpy())
    tiles = sizes.size * nt
    dealt = sched[programs + 1:programs + 1 + tiles]
    assert sorted(dealt.tolist()) == list(range(tiles))
    items = walk(sched, sizes, nt, programs, bm)
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
    chunk = sched[programs + 1 + tiles + 1]
    split = sorted({t for mine in items for t, _, _, slot in mine if slot >= 0})
    listed = sched[-EXTRA_CHUNKS_PER_PROGRAM * programs:]
    assert listed[:len(split)].tolist() == split and (listed[len(split):] == -1).all()
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
    sched = tile_schedule_torch(torch.from_numpy(sizes).int(), torch.from_numpy(-(-sizes // 64)).int(), nt, heads,
                                programs, bm)
    items = [it for mine in walk(sched.numpy(), sizes, nt, programs, bm) for it in mine]
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
        sched, torch.from_numpy(sizes).int(), torch.from_numpy(part), got1, got2, got1, got2,
        **dwc.dw_chunks_constexprs(programs, tiles, dh, de, bm, accum))
    np.testing.assert_array_equal(got1.numpy(), want1)
    np.testing.assert_array_equal(got2.numpy(), want2)
