"""Packing (mhl_jax/moe/packing.py and its Triton twin, mhl_jax/moe/gpu/packing.py): layout invariants, round trips,
the torch twin, extreme skew. The Triton kernels run under the interpreter without a GPU (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhl_jax.moe import packing as pk
from mhl_jax.moe.core import expert_ffn


def _random_idx(key, n, h, ne, k):
    return jnp.argsort(jax.random.uniform(key, (n, h, ne)), axis=-1)[..., :k].astype(jnp.int32)


# The CPU tests draw their inputs with numpy (JAX's generator compiles a program per shape) and run every JAX op
# under jit (one compile per shape, not one per eager op and shape).
def _np_idx(seed, n, h, ne, k):
    """idx (n, h, k): k distinct experts of ne per sub-token, at random."""
    return np.argsort(np.random.default_rng(seed).random((n, h, ne)), axis=-1)[..., :k].astype(np.int32)


def _np_normal(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def _np_gates(rng, n, h, k):
    z = rng.standard_normal((n, h, k))
    return jnp.asarray((np.exp(z) / np.exp(z).sum(-1, keepdims=True)).astype(np.float32))


_jit_pack = jax.jit(pk.pack, static_argnums=(1, 2))
_jit_group_blocks = jax.jit(pk.group_blocks, static_argnums=1)


def _case_idx(case: str, seed: int) -> tuple[jax.Array, int]:
    """(idx (N, H, k), Ne) of a packing-equality case: random, skew (every token on the same 3 experts),
    empty_slots (-1 slots as in an EP receive buffer), tiny (one slot), many_experts (Ne 40: the offsets
    kernel's expert columns span two blocks, the last one partial). Local slots per head: 33 (chunks of 16 and
    32 leave a partial last chunk) or 48 (chunks of 16 divide it); chunk 1024 is one chunk for the whole head.
    Few slots: the interpreter's cost is the chunks' in-register sorts."""
    n, h, k, ne = {"tiny": (1, 1, 1, 1), "many_experts": (24, 2, 2, 40)}.get(case, (11, 2, 3, 7))
    idx = _np_idx(seed, n, h, ne, k)
    if case == "skew":
        idx = np.broadcast_to(np.array([6, 0, 2], np.int32), (n, h, k))
    if case == "empty_slots":
        idx[::4, :, 1] = -1
        idx[n - 5:] = -1
    return jnp.asarray(idx), ne


def _dense_expert_ffn(x, idx, gates, w1, w2):
    """float64 numpy reference: every (token, head, choice) computed separately."""
    x, gates, w1, w2 = (np.asarray(a, np.float64) for a in (x, gates, w1, w2))
    idx = np.asarray(idx)
    n, h, k = idx.shape
    y = np.zeros_like(x)
    c = np.sqrt(2 / np.pi)
    for j in range(k):
        a1 = w1[np.arange(h)[None, :], idx[..., j]]  # (n, h, dh, de)
        a2 = w2[np.arange(h)[None, :], idx[..., j]]
        hid = np.einsum("nhd,nhde->nhe", x, a1)
        act = 0.5 * hid * (1 + np.tanh(c * (hid + 0.044715 * hid ** 3)))
        y += gates[..., j:j + 1] * np.einsum("nhe,nhed->nhd", act, a2)
    return y


def _check_layout(idx, num_experts, block):
    n, h, k = idx.shape
    m = n * h * k
    p = _jit_pack(idx, num_experts, block)
    row_slot, slot_row = np.asarray(p.row_slot), np.asarray(p.slot_row)
    bg, sizes, nb = np.asarray(p.block_group), np.asarray(p.group_sizes), int(p.num_blocks)
    assert row_slot.shape == (pk.padded_rows(m, h * num_experts, block),)
    # inverse permutation: every slot placed exactly once
    assert np.array_equal(row_slot[slot_row], np.arange(m))
    assert (row_slot >= 0).sum() == m
    group = (np.arange(h)[None, :, None] * num_experts + np.asarray(idx)).reshape(m)
    assert np.array_equal(sizes, np.bincount(group, minlength=h * num_experts))
    # each used block holds one group, groups ascending, slots ascending inside a group (stable)
    assert (bg[:nb] >= 0).all() and (bg[nb:] == -1).all() and (np.diff(bg[:nb]) >= 0).all()
    for b in range(len(bg)):
        s = row_slot[b * block:(b + 1) * block]
        real = s[s >= 0]
        if bg[b] < 0:
            assert real.size == 0
        else:
            assert (group[real] == bg[b]).all()
    real_rows = row_slot[row_slot >= 0]
    assert (np.diff(group[real_rows]) >= 0).all()
    same = np.diff(group[real_rows]) == 0
    assert (np.diff(real_rows)[same] > 0).all()
    start, count = (np.asarray(a) for a in _jit_group_blocks(p.group_sizes, block))
    for g in np.nonzero(sizes)[0]:
        assert (bg[start[g]:start[g] + count[g]] == g).all()
    return p


@pytest.mark.parametrize("block", [4, 16])
def test_pack_layout_random(block):
    _check_layout(jnp.asarray(_np_idx(1, 37, 3, 5, 2)), 5, block)


def test_pack_layout_extreme_skew():
    n, h, k, ne = 50, 2, 3, 8
    idx = jnp.asarray(np.broadcast_to(np.array([5, 0, 7], np.int32), (n, h, k)))  # every token: the same experts
    p = _check_layout(idx, ne, 8)
    sizes = np.asarray(p.group_sizes).reshape(h, ne)
    assert (sizes[:, [0, 5, 7]] == n).all() and sizes.sum() == n * h * k


@pytest.mark.parametrize("case", ["random", "skew", "empty_slots", "tiny", "many_experts"])
def test_triton_pack_kernels_equal_jax_pack(case):
    """kernels/triton/packing.py (under the Triton interpreter without a GPU) returns exactly `pack`'s arrays:
    chunks that do and do not divide N * k, one chunk for the whole head, empty slots, extreme skew. The chunk
    histograms by atomic adds and by tl.histogram: the same histogram buffer, and the launches after it read
    nothing else of that choice, so one of them runs them (the other would repeat the costly scatter sorts)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kernels.torch.packing import pack_triton_torch, run_launches_torch
    from kernels.triton.packing import launch_shapes, pack_launches
    from kernels.tuning import PACK_OFFSETS_EB

    idx, ne = _case_idx(case, 7)
    n, h, k = idx.shape
    if case == "many_experts":
        assert launch_shapes(n, h, k, ne)["NEP"] // PACK_OFFSETS_EB == 2 and ne % PACK_OFFSETS_EB
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tidx = torch.from_numpy(np.array(idx)).to(dev)
    for block, chunk in ((4, 16), (16, 32), (8, 1024)):
        ref = _jit_pack(idx, ne, block)
        got = pack_triton_torch(tidx, ne, block, chunk, 1)  # atomic histograms
        for name, a, b in zip(ref._fields, ref, got):
            assert np.array_equal(np.asarray(a).reshape(-1), b.cpu().numpy().reshape(-1)), (case, block, chunk, name)
        hists = [run_launches_torch(pack_launches(n, h, k, ne, block, got[0].shape[0], chunk, bins)[:1],
                                    {"idx": tidx.to(torch.int32)})["hist"] for bins in (1, 1 << 30)]
        assert torch.equal(hists[0], hists[1]), (case, block, chunk)


def test_offsets_launch_writes_base_over_the_histogram(monkeypatch):
    """The offsets launch's base is written over its histogram input (`Launch.inplace`): the torch launcher passes the
    histogram's own tensor as the output and drops the name; the jax-triton launcher aliases that input to the output
    (as it aliases the filled outputs: the atomic histogram's zeroed buffer) and drops the name. At the launch shapes
    of 8 heads, Ne 2048 and 81920 tokens the histogram is 42 MB; without the alias base is a second 42 MB at peak."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kernels.torch.packing import run_launches_torch
    from kernels.triton.packing import pack_launches
    from mhl_jax.moe.gpu import packing as packing_triton

    n, h, k, ne, block = 9, 2, 3, 5, 4
    p = pk.padded_rows(n * h * k, h * ne, block)
    launches = pack_launches(n, h, k, ne, block, p, chunk=16, hist_atomic_min_bins=1)  # atomic: a filled output
    tidx = torch.from_numpy(_np_idx(3, n, h, ne, k))
    hist = run_launches_torch(launches[:1], {"idx": tidx})["hist"]
    after = run_launches_torch(launches[1:2], {"idx": tidx, "hist": hist})
    assert "hist" not in after and after["base"].data_ptr() == hist.data_ptr()

    seen = []

    class FakeJaxTriton:  # records each launch's aliases; outputs of the right shapes
        @staticmethod
        def triton_call(*args, kernel, out_shape, input_output_aliases=None, **kw):
            seen.append((kernel.fn.__name__, input_output_aliases))
            return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    monkeypatch.setattr(packing_triton, "import_jax_triton", lambda: FakeJaxTriton)
    bufs = packing_triton.run_launches(launches, {"idx": jnp.asarray(_np_idx(3, n, h, ne, k))})
    aliases = dict(seen)
    assert aliases["pack_hist_kernel"] == {1: 0} and aliases["pack_offsets_kernel"] == {0: 0}
    assert "hist" not in bufs and bufs["base"].shape == (h, -(-n * k // 16), 8)


@pytest.mark.gpu
def test_gpu_triton_pack_binding_equals_jax_pack():
    """The Triton packing through jax-triton equals the JAX packing, under jit: the layer's shape
    (8192 tokens x 8 heads, k 4, Ne 384; half the tokens on 4 experts, some empty slots), the widest
    table row (Ne 1536, k 8), and one slot."""
    from mhl_jax.moe.gpu.packing import pack

    jit_triton = jax.jit(pack, static_argnums=(1, 2, 3))
    cases = [(8192, 8, 4, 384, (64, 128)), (4096, 8, 8, 1536, (16,)), (1, 1, 1, 1, (16,))]
    for n, h, k, ne, blocks in cases:
        idx = _random_idx(jax.random.key(8), n, h, ne, k)
        if n > 1:
            idx = idx.at[: n // 2, :, :4].set(jnp.array([3, 1, 4, 2], jnp.int32)).at[::7, :, 3].set(-1)
        for block in blocks:
            ref = _jit_pack(idx, ne, block)
            got = jit_triton(idx, ne, block, "triton")
            for name, a, b in zip(ref._fields, ref, got):
                assert np.array_equal(np.asarray(a), np.asarray(b)), ((n, h, k, ne), block, name)


def test_gather_combine_round_trip():
    n, h, k, ne, dh = 29, 2, 3, 6, 8
    rng = np.random.default_rng(2)
    x, idx, gates = _np_normal(rng, n, h, dh), jnp.asarray(_np_idx(2, n, h, ne, k)), _np_gates(rng, n, h, k)

    @jax.jit
    def round_trip(x, idx, gates):
        p = pk.pack(idx, ne, 4)
        rows = pk.gather_rows(x, p, k)
        # identity experts: combine(gather(x)) = x * sum_j gate_j = x
        return p, rows, pk.combine_rows(rows, p, gates)

    p, rows, y = round_trip(x, idx, gates)
    assert np.all(np.asarray(rows)[np.asarray(p.row_slot) < 0] == 0)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)


def test_torch_pack_matches_jax():
    torch = pytest.importorskip("torch")
    from kernels.torch.experts import pack_torch

    idx = jnp.asarray(_np_idx(3, 41, 2, 7, 3))
    p = _jit_pack(idx, 7, 8)
    t = pack_torch(torch.from_numpy(np.array(idx)), 7, 8)
    start, count = _jit_group_blocks(p.group_sizes, 8)
    for a, b in ((p.row_slot, t.row_slot), (p.slot_row, t.slot_row), (p.block_group, t.block_group),
                 (p.group_sizes, t.group_sizes), (start, t.group_block_start), (count, t.group_nblocks)):
        assert np.array_equal(np.asarray(a), b.numpy())
    assert int(p.num_blocks) == t.num_blocks


@pytest.mark.parametrize("skew", [False, True])
def test_reference_expert_ffn_dropless(skew):
    """expert_ffn(reference) equals the float64 per-slot reference: every routed slot is computed."""
    n, h, k, ne, dh, de = 33, 2, 2, 5, 8, 16
    rng = np.random.default_rng(4)
    x = _np_normal(rng, n, h, dh)
    idx = jnp.asarray(np.broadcast_to(np.array([3, 1], np.int32), (n, h, k)) if skew else _np_idx(4, n, h, ne, k))
    gates = _np_gates(rng, n, h, k)
    w1, w2 = _np_normal(rng, h, ne, dh, de, scale=1 / 3), _np_normal(rng, h, ne, de, dh, scale=1 / 3)
    with jax.default_matmul_precision("highest"):
        y, load = jax.jit(expert_ffn, static_argnums=5)(x, idx, gates, w1, w2, "reference")
    ref = _dense_expert_ffn(x, idx, gates, w1, w2)
    assert np.linalg.norm(np.asarray(y) - ref) / np.linalg.norm(ref) < 1e-5
    assert int(load.sum()) == n * h * k


@pytest.mark.parametrize("skew,variant", [(False, "rows"), (True, "t"), (False, "tpack")])
def test_custom_vjp_plumbing_matches_reference(skew, variant):
    """The Triton path's custom_vjp (packing, fused gathers, combine, cotangents) with pure-JAX kernel
    stand-ins: value and all four gradients equal jax.grad of the float64 reference."""
    from kernels.tuning import ExpertsConfig, Tile
    from mhl_jax.moe.gpu.experts import expert_ffn_triton

    n, h, k, ne, dh, de = 40, 2, 3, 5, 16, 32
    rng = np.random.default_rng(5)
    x = _np_normal(rng, n, h, dh)
    idx = jnp.asarray(np.broadcast_to(np.array([4, 0, 2], np.int32), (n, h, k)) if skew else _np_idx(5, n, h, ne, k))
    gates = _np_gates(rng, n, h, k)
    w1, w2 = _np_normal(rng, h, ne, dh, de, scale=1 / 4), _np_normal(rng, h, ne, de, dh, scale=1 / 4)
    wy = _np_normal(rng, n, h, dh)
    cfg = ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 32))
    if variant == "t":  # the transposed dW kernel
        cfg = ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 16), dw_form="t")
    if variant == "tpack":  # the Triton packing's config: emulated, it packs with the JAX sort
        cfg = ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 32), pack_impl="triton")

    def loss_emulate(x, g, a, b):
        return jnp.sum(expert_ffn_triton(x, idx, g, a, b, cfg=cfg, backend="emulate")[0] * wy)

    jax.config.update("jax_enable_x64", True)
    try:
        def loss_ref(x, g, a, b):
            return jnp.sum(expert_ffn(x, idx, g, a, b, "reference")[0] * wy)

        g_ref = jax.jit(lambda *a: jax.grad(loss_ref, argnums=(0, 1, 2, 3))(*(b.astype(jnp.float64) for b in a)))(
            x, gates, w1, w2)
    finally:
        jax.config.update("jax_enable_x64", False)
    with jax.default_matmul_precision("highest"):
        g_emu = jax.jit(jax.grad(loss_emulate, argnums=(0, 1, 2, 3)))(x, gates, w1, w2)
    for name, a, b in zip(("x", "gates", "w1", "w2"), g_emu, g_ref):
        err = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert err < 1e-5, (name, err)
