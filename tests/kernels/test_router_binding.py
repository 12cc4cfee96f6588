"""The router's JAX binding (mhl_jax/moe/gpu/router.py): which kernel runs (`router_kind`), the Gluon launch, the
dW metadata (cut from a packing, against the torch launcher's sort) driving the Triton kernels under the interpreter,
the custom_vjp with pure-JAX kernel stand-ins (backend="emulate") against the reference and float64, shard_map, the
expert-weight cast. On a GPU: tests/kernels/test_router_gpu.py.
"""

import functools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels.torch.router as ktr  # noqa: E402
from kernels.tuning import router_tiles  # noqa: E402
from mhl_jax.moe.gpu.router import MIN_PACK_BLOCK  # noqa: E402
from tests.references.router import assert_close, grads64, router_inputs  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="interpreter test (CPU)")


# ----------------------------------------------------------------------- CPU: dispatch, metadata, plumbing

def _jax_inputs(seed, n, h, dh, ne, bias_scale=0.1):
    x, w, b = router_inputs(seed, n, h, dh, ne, bias_scale)
    import jax.numpy as jnp

    return jnp.asarray(x.float().numpy().astype(jnp.bfloat16)), jnp.asarray(w.numpy()), jnp.asarray(b.numpy())


def test_router_kind_rule(monkeypatch):
    """Which router the JAX binding runs (`router_kind`): the Gluon forward on Hopper for bf16 x at the shapes it
    takes, the Triton one otherwise, the reference for inputs wider than MAX_TRITON_ROUTER_WIDTH; the Gluon launch
    gets the split W_r terms."""
    import jax.numpy as jnp

    from mhl_jax.moe.gpu import gluon as gluon_bridge
    from mhl_jax.moe.gpu import router as rt
    from mhl_jax.moe.plan import MAX_TRITON_ROUTER_WIDTH

    monkeypatch.setattr(gluon_bridge, "hopper_sms", lambda: 132)
    bf16 = jnp.bfloat16
    assert rt.router_kind(128, 384, 4, bf16) == rt.router_kind(128, 64, 1, bf16) == "gluon-ws"
    assert rt.router_kind(128, 768, 8, bf16) == "gluon-ws"
    for case, args in {"k > 8": (128, 2000, 9, bf16), "fp32 x": (128, 384, 4, jnp.float32),
                       "dh": (64, 384, 4, bf16), "Ne % 8": (128, 100, 4, bf16)}.items():
        assert rt.router_kind(*args) == "triton", case
    assert rt.router_kind(2 * MAX_TRITON_ROUTER_WIDTH, 384, 4, bf16) == "reference"
    calls = []

    def fake_gluon(static, x, wp, bias, cast=None):  # records the launch; returns the reference top-k for the plumbing
        calls.append(wp)
        return rt.route_topk_reference(x, w, bias, static.k)

    monkeypatch.setattr(rt, "_fwd_gluon", fake_gluon)
    x, w, b = _jax_inputs(3, 40, 2, 128, 64)
    vals, idx = rt._fwd_triton(_static(4, 64), x, w, b)
    assert len(calls) == 1 and calls[0].shape == (3, 2, 128, 64) and calls[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(calls[0]), np.asarray(rt.split_bf16(w, 3)))
    assert idx.shape == (40, 2, 4)
    monkeypatch.setattr(gluon_bridge, "hopper_sms", lambda: 0)
    assert rt.router_kind(128, 384, 4, bf16) == "triton"


def _static(k, ne):
    from mhl_jax.moe.gpu import router as rt

    return rt.Static(k, router_tiles(ne, k), "triton")


@pytest.mark.parametrize("k,nc", [(4, 3), (8, 2)])
def test_ws_router_launch_pairs_kernel_object_and_consumers(monkeypatch, k, nc):
    """The JAX launch of the Gluon forward: the kernel object compiled at the launch limit of its consumer count
    (jax-triton takes maxnreg from the object), the constexprs of that count, one program per SM at most one per
    item, the split W_r terms and bias as inputs."""
    import jax.numpy as jnp

    import kernels.gluon.router as gr
    from kernels.tuning import WS_ROUTER_MAXNREG
    from mhl_jax.moe.gpu import gluon as gluon_bridge
    from mhl_jax.moe.gpu import router as rt

    monkeypatch.setattr(gluon_bridge, "hopper_sms", lambda: 132)
    seen = {}

    def fake_call(*args, kernel, out_shape, programs, **consts):
        seen.update(args=args, kernel=kernel, programs=programs, consts=consts)
        return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    monkeypatch.setattr(gluon_bridge, "gluon_call", fake_call)
    x, w, b = _jax_inputs(5, 1000, 8, 128, 768)
    st = _static(k, 768)
    vals, idx = rt._fwd_triton(st, x, w, b)
    assert vals.shape == idx.shape == (1000, 8, k)
    c = seen["consts"]
    assert (c["NC"], c["K"], c["NE"], c["N"], c["PARTS"]) == (nc, k, 768, 1000, 3)
    assert seen["kernel"] is gr.ws_router_kernel(nc)
    assert seen["kernel"].mhl_compile_options["maxnreg"] == WS_ROUTER_MAXNREG[nc]
    assert seen["programs"] == min(132, 8 * -(-1000 // (64 * nc)))
    xs, wp, bias, c1, c2 = seen["args"]  # c1, c2: the caster's (unused) one-element inputs
    assert xs is x and bias is b and wp.shape == (3, 8, 128, 768) and c1.shape == c2.shape == (1,)
    assert c["CAST_N"] == 0
    # with a cast: two consumers beside the caster warp group at every k, the kernel object of that launch (any two
    # fp32 arrays of one size: the launch reads their size; small ones, not the 0.8 GB of an (8, 768, 128, 256) W1)
    a = jnp.zeros((8, 768, 16, 16), jnp.float32)
    vals, idx, casts = rt._fwd_triton(st, x, w, b, cast=(a, a))
    c = seen["consts"]
    assert (c["NC"], c["CAST_N"]) == (2, a.size) and seen["kernel"] is gr.ws_router_kernel(2, True)
    assert all(o.shape == a.shape and o.dtype == jnp.bfloat16 for o in casts)


@interp
@pytest.mark.parametrize("pack_block,dw_block,n", [(16, 16, 41), (64, 16, 7), (16, 64, 41), (MIN_PACK_BLOCK, 512, 41)])
def test_dw_layout_from_the_experts_packing_drives_the_kernels(pack_block, dw_block, n):
    """The dW layout cut from a packing (padding rows never read: the experts' packing, or the one the router alone
    makes in rows of MIN_PACK_BLOCK) has the same blocks as the torch launcher's sort-based layout (an independent
    construction), gives the float64 gradient through the Triton kernels, and the same dW_r to the bit as the
    sort-based layout; with a hot expert over several blocks and, at n = 7, most groups empty."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe import packing as pk
    from mhl_jax.moe.gpu.router import dw_metadata_from_packing

    h, dh, ne, k = 3, 16, 24, 3
    x, w, b = router_inputs(12, n, h, dh, ne)
    b[:, 5] = 50.0
    tiles = router_tiles(ne, k, block_n=16, block_e=16, dx_block_n=16, red_block_e=16, dw_block=dw_block,
                            dw_sub=16)
    _, idx = ktr.router_fwd(x, w, b, k, tiles)

    @jax.jit
    def layouts(idx):  # the JAX side in one program: one compile, not one per eager op
        packing = pk.pack(idx, ne, pack_block)
        return packing, dw_metadata_from_packing(packing, h, k, pack_block, dw_block)

    packing, from_pack = layouts(jnp.asarray(idx.numpy()))
    sorted_ = ktr.dw_metadata(idx, ne, dw_block)
    for name in ("block_group", "group_bstart", "group_size", "group_nblk"):
        assert np.array_equal(getattr(from_pack, name), getattr(sorted_, name).numpy()), name
    metas = [ktr.DwMeta(*[torch.from_numpy(np.array(a)) for a in from_pack]), sorted_]
    if n == 41 and dw_block < n:
        assert int(metas[0].group_nblk.max()) >= 2  # the hot expert's group spans blocks
    dv = torch.from_numpy(np.random.default_rng(6).standard_normal((n, h, k), dtype=np.float32))
    dws = [ktr.router_bwd(x, w, idx, dv, tiles, dx_dtype=torch.float32, meta=m)[1] for m in metas]
    assert_close(dws[0], grads64(x, w, idx, dv)[1])
    assert torch.equal(dws[0], dws[1])
    # the GPU path's form (dw_metadata_from_packing(global_slots=True)): the blocks cut by the Triton launches and
    # the packing's row_slot read as global slots: the same arrays and the same dW_r to the bit
    from kernels.torch.packing import cut_blocks_torch

    sizes = torch.from_numpy(np.array(packing.group_sizes))
    _, _, start, _ = cut_blocks_torch(sizes, pack_block, 1)
    bstart, nblk, _, bg = cut_blocks_torch(sizes, dw_block, from_pack.block_group.shape[0])
    for name, got in (("group_start", start), ("group_bstart", bstart), ("group_nblk", nblk), ("block_group", bg)):
        assert np.array_equal(got.numpy(), np.asarray(getattr(from_pack, name))), name
    glob = ktr.DwMeta(torch.from_numpy(np.array(packing.row_slot)), bg, start, bstart, sizes, nblk)
    dw_glob = ktr.router_bwd(x, w, idx, dv, tiles, dx_dtype=torch.float32, meta=glob, global_slots=True)[1]
    assert torch.equal(dw_glob, dws[1])


@interp
@pytest.mark.parametrize("block,nb_extra", [(16, 3), (512, 1)])
def test_group_blocks_launches_match_the_jax_scans(block, nb_extra):
    """kernels.triton.packing.cut_launches (the Triton scans that cut groups into blocks, the GPU path of the expert
    op's and the router's block arrays) against packing.group_blocks and the router binding's _cut_groups: over more
    groups than one scan step (GROUP_SCAN_STEP), empty groups, a group over many blocks, and a block bound past the
    blocks in use (-1 there)."""
    import jax
    import jax.numpy as jnp

    from kernels.torch.packing import cut_blocks_torch
    from kernels.tuning import GROUP_SCAN_STEP
    from mhl_jax.moe import packing as pk
    from mhl_jax.moe.gpu.router import _cut_groups

    rng = np.random.default_rng(block)
    g = 2 * GROUP_SCAN_STEP + 37
    sizes = np.where(rng.random(g) < 0.3, 0, rng.integers(1, 3 * block + 2, g)).astype(np.int32)
    sizes[5] = 40 * block + 1
    nb = int(((sizes + block - 1) // block).sum()) + nb_extra
    gstart, gcount, pstart, bg = (t.numpy() for t in cut_blocks_torch(torch.from_numpy(sizes), block, nb))
    jax_scans = jax.jit(lambda s: (pk.group_blocks(s, block), _cut_groups(jnp.zeros((1,), jnp.int32),
                                                                           jnp.zeros((g,), jnp.int32), s, block, nb)))
    (start, count), ref = jax_scans(jnp.asarray(sizes))
    start, count = np.asarray(start), np.asarray(count)
    assert np.array_equal(gstart, start) and np.array_equal(gcount, count)
    assert np.array_equal(pstart, start * block)
    assert np.array_equal(gstart, np.asarray(ref.group_bstart)) and np.array_equal(bg, np.asarray(ref.block_group))
    assert (bg[nb - nb_extra:] == -1).all() and (bg[:nb - nb_extra] >= 0).all()


def test_jax_route_with_packing_emulate():
    """route_topk_triton(pack=...) returns the experts' packing of its indices (asked with the Triton packing, made
    by the JAX sort when emulated: the same arrays), and its dW_r (taken from that packing) equals the router alone's
    (from the packing it makes itself, in rows of MIN_PACK_BLOCK) and the float64 gradient."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe import packing as pk
    from mhl_jax.moe.gpu.router import route_topk_triton

    n, h, dh, ne, k, block = 96, 4, 32, 40, 4, 32
    x, w, b = _jax_inputs(21, n, h, dh, ne)
    b = b.at[:, 3].set(20.0)  # skew: a group over several row blocks
    dv = jnp.asarray(np.random.default_rng(4).standard_normal((n, h, k), dtype=np.float32))
    tiles = router_tiles(ne, k, dw_block=64, dw_sub=16)  # dW blocks unlike both packings' row blocks
    plain = lambda x, w: route_topk_triton(x, w, b, k, tiles=tiles, backend="emulate")
    packed = lambda x, w: route_topk_triton(x, w, b, k, tiles=tiles, backend="emulate", pack=(block, "triton"))

    @jax.jit
    def run(x, w):  # one program: one compile, not one per eager op and gradient
        v1, i1 = plain(x, w)
        grads = [jax.grad(lambda x, w, f=f: jnp.vdot(f(x, w)[0], dv), argnums=(0, 1))(x, w) for f in (plain, packed)]
        return (v1, i1), packed(x, w), pk.pack(i1, ne, block), grads

    (v1, i1), (v2, i2, packing), want, (g1, g2) = run(x, w)
    assert np.array_equal(i1, i2) and np.array_equal(v1, v2)
    for name, a, c in zip(want._fields, packing, want):
        assert np.array_equal(a, c), name
    assert np.array_equal(g1[0], g2[0])  # dx: same kernel, same inputs
    dw64 = grads64(torch.from_numpy(np.asarray(x).astype(np.float32)), torch.from_numpy(np.array(w)),
                   np.asarray(i1), dv)[1]
    assert_close(g2[1], dw64)
    assert np.array_equal(g2[1], g1[1])  # same dW blocks, same partial sums
    with pytest.raises(ValueError, match="pack="):
        route_topk_triton(x, w, b, k, backend="emulate", pack=(24, "argsort"))
    with pytest.raises(ValueError, match="pack="):
        route_topk_triton(x, w, b, k, backend="emulate", pack=(32, "bogus"))


def _check_router_casts(backend, n, h, dh, ne, k, de, gluon=False, one_program=False):
    """moe_core.moe_heads_triton with the router casting the expert weights (`router_casts_weights` forced on) and
    without: the cast asked for only when on (gluon: and handed to the Gluon kernel's caster), the same loss and every
    gradient bitwise. one_program: both traced (in turn) into one jitted program (on the CPU: one compile)."""
    import jax
    import jax.numpy as jnp

    import mhl_jax.moe.core as mc
    from mhl_jax.moe.gpu import router as router_triton

    x, w, b = _jax_inputs(31, n, h, dh, ne)
    rng = np.random.default_rng(7)
    w1 = jnp.asarray(rng.standard_normal((h, ne, dh, de), dtype=np.float32) * 0.1)
    w2 = jnp.asarray(rng.standard_normal((h, ne, de, dh), dtype=np.float32) * 0.1)

    def loss(x, w, w1, w2):
        y, _ = mc.moe_heads_triton(x, x, w, b, w1, w2, k, backend=backend)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    casts_asked, kernel_casts = [], []
    saved = mc.router_casts_weights
    real, real_gluon = router_triton.router_static, router_triton._fwd_gluon
    try:
        # both the fused core and route_topk_triton take the router's arguments through router_static
        router_triton.router_static = lambda *a, **kw: casts_asked.append(kw["cast"] is not None) or real(*a, **kw)
        router_triton._fwd_gluon = lambda *a: kernel_casts.append(a[4] is not None) or real_gluon(*a)
        def grads(on, *args):
            mc.router_casts_weights = lambda *a: on  # the rule's token count (tested below) aside
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(*args)

        if one_program:
            got = jax.jit(lambda *args: [grads(on, *args) for on in (False, True)])(x, w, w1, w2)
        else:
            got = [jax.jit(functools.partial(grads, on))(x, w, w1, w2) for on in (False, True)]
    finally:
        mc.router_casts_weights = saved
        router_triton.router_static, router_triton._fwd_gluon = real, real_gluon
    assert casts_asked == [False, True]
    assert kernel_casts == ([False, True] if gluon else [])
    assert float(got[0][0]) == float(got[1][0]) and float(got[0][0]) > 0
    for a, c in zip(got[0][1], got[1][1]):
        assert a.dtype == c.dtype and np.array_equal(a, c)
    assert got[1][1][2].dtype == jnp.float32  # the fp32 weights still get fp32 gradients


def test_router_casts_weights_emulate():
    """route_topk_triton(cast=(a, b)) also returns a, b in x's dtype, without gradient, and the MoE core with the
    router casting the expert weights gives the same loss and every gradient bitwise (the emulated path: XLA
    casts)."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.router import route_topk_triton

    n, h, dh, ne, k, de = 48, 2, 32, 12, 6, 16
    x, w, b = _jax_inputs(31, n, h, dh, ne)
    rng = np.random.default_rng(7)
    w1 = jnp.asarray(rng.standard_normal((h, ne, dh, de), dtype=np.float32) * 0.1)
    w2 = jnp.asarray(rng.standard_normal((h, ne, de, dh), dtype=np.float32) * 0.1)
    (v, i, casts), (v0, i0) = jax.jit(lambda x, w, b, w1, w2: (  # one program: one compile
        route_topk_triton(x, w, b, k, backend="emulate", cast=(w1, w2)),
        route_topk_triton(x, w, b, k, backend="emulate")))(x, w, b, w1, w2)
    assert np.array_equal(v, v0) and np.array_equal(i, i0)
    assert all(c.dtype == jnp.bfloat16 and np.array_equal(c, a.astype(jnp.bfloat16)) for c, a in zip(casts, (w1, w2)))
    with pytest.raises(ValueError, match="cast wants two fp32 arrays of one size"):
        route_topk_triton(x, w, b, k, backend="emulate", cast=(w1, w2.astype(jnp.bfloat16)))
    _check_router_casts("emulate", n, h, dh, ne, k, de, one_program=True)


@pytest.mark.gpu
@pytest.mark.parametrize("k,de", [(6, 128), (4, 256)])
def test_gpu_router_casts_weights(k, de):
    """The same on the GPU's kernels: at Ne 64, dh 128 the router forward is the Gluon kernel (two consumers with the
    caster; at k 4 three without it), so its caster warp group makes the bf16 weights the expert kernels read."""
    _check_router_casts(None, 512, 2, 128, 64, k, de, gluon=True)


def test_router_casts_weights_rule():
    """The caster runs from ROUTER_CAST_MIN_TOKENS_PER_WEIGHT x dh x de tokens on, with bf16 activations and fp32
    weights only (shapes only: jax.ShapeDtypeStruct)."""
    import jax
    import jax.numpy as jnp

    from kernels import tuning
    from mhl_jax.moe import plan as mc

    def args(n, de=128, xdt=jnp.bfloat16, wdt=jnp.float32):
        x = jax.ShapeDtypeStruct((n, 8, 128), xdt)
        return x, x, jax.ShapeDtypeStruct((8, 768, 128, de), wdt), jax.ShapeDtypeStruct((8, 768, de, 128), wdt)

    assert tuning.ROUTER_CAST_MIN_TOKENS_PER_WEIGHT == 2
    assert mc.router_casts_weights(*args(81920)) and mc.router_casts_weights(*args(32768))
    assert not mc.router_casts_weights(*args(32767)) and not mc.router_casts_weights(*args(8192))
    assert mc.router_casts_weights(*args(81920, de=256))  # from 65536 tokens on at de 256
    assert not mc.router_casts_weights(*args(65535, de=256)) and not mc.router_casts_weights(*args(16384, de=256))
    assert mc.router_casts_weights(*args(131072, de=256))
    assert not mc.router_casts_weights(*args(81920, xdt=jnp.float32))
    assert not mc.router_casts_weights(*args(81920, wdt=jnp.bfloat16))


@interp
def test_jax_split_bf16_matches_torch():
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.router import split_bf16

    w = np.random.default_rng(1).standard_normal((3, 32, 40), dtype=np.float32)
    a = np.asarray(jax.jit(lambda w: split_bf16(w, 3).astype(jnp.float32))(jnp.asarray(w)))
    assert np.array_equal(a, ktr.split_bf16(torch.from_numpy(w), 3).float().numpy())


@interp
def test_jax_custom_vjp_emulate_vs_reference():
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.router import route_topk_triton
    from mhl_jax.moe.router import route_topk_reference

    n, h, dh, ne, k = 64, 4, 32, 40, 4
    x, w, b = _jax_inputs(9, n, h, dh, ne)
    dv = jnp.asarray(np.random.default_rng(3).standard_normal((n, h, k), dtype=np.float32))
    tiles = router_tiles(ne, k, dw_block=16, dw_sub=16)

    def loss(fn):
        return lambda x, w, b: jnp.vdot(fn(x, w, b)[0], dv)

    ours = lambda x, w, b: route_topk_triton(x, w, b, k, tiles=tiles, backend="emulate")
    ref = lambda x, w, b: route_topk_reference(x, w, b, k)
    # one program: one compile, not one per eager op
    (v1, i1), (v2, i2), g1, g2 = jax.jit(lambda *a: (ours(*a), ref(*a), jax.grad(loss(ours), argnums=(0, 1, 2))(*a),
                                                     jax.grad(loss(ref), argnums=(0, 1, 2))(*a)))(x, w, b)
    assert np.array_equal(i1, i2) and np.allclose(v1, v2, rtol=1e-6, atol=1e-6)
    assert g1[0].dtype == jnp.bfloat16 and g1[1].dtype == jnp.float32
    dx64, dw64 = grads64(torch.from_numpy(np.asarray(x).astype(np.float32)), torch.from_numpy(np.array(w)),
                         np.asarray(i1), dv)
    assert_close(g1[1], dw64)
    assert_close(g1[0], dx64, rtol=1e-2)
    assert np.array_equal(g1[0], g2[0])
    assert not np.asarray(g1[2]).any()  # bias: no gradient


@interp
def test_jax_shard_map_over_heads_emulate():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from mhl_jax.moe.gpu.router import route_topk_triton

    n, h, dh, ne, k = 32, 4, 16, 24, 2
    x, w, b = _jax_inputs(12, n, h, dh, ne)
    mesh = jax.make_mesh((2,), ("hp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    tiles = router_tiles(ne, k, dw_block=16, dw_sub=16)
    fn = lambda x, w, b: route_topk_triton(x, w, b, k, tiles=tiles, backend="emulate")
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "hp"), P("hp"), P("hp")),
                       out_specs=(P(None, "hp"), P(None, "hp")))
    dv = jnp.asarray(np.random.default_rng(4).standard_normal((n, h, k), dtype=np.float32))

    @jax.jit
    def run(x, w):  # one program: one compile
        return [(f(x, w, b), jax.grad(lambda x, w, f=f: jnp.vdot(f(x, w, b)[0], dv), argnums=(0, 1))(x, w))
                for f in (fn, sm)]

    (out0, g0), (out1, g1) = run(x, w)
    assert np.array_equal(out0[1], out1[1]) and np.array_equal(out0[0], out1[0])
    for a, c in zip(g0, g1):
        assert np.array_equal(a, c)
