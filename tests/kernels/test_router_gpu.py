"""The router's JAX binding compiled on a GPU (marker gpu): against the reference on fresh inputs, gradients bitwise
deterministic, shard_map and the torch launch bitwise equal, the MoE core's one packing against the ops apart; and
(on the CPU too) inputs too wide for the kernel taking the reference.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels.torch.router as ktr  # noqa: E402
from tests.references.router import assert_close, check_topk  # noqa: E402


def _gpu_setup():

    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU JAX backend")
    from mhl_jax.moe.plan import import_jax_triton

    import_jax_triton()  # keeps TRITON_CACHE_DIR usable for the torch launches after it


def _gpu_inputs(seed, n, h, dh, ne, bias_scale=0.1):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (n, h, dh), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (h, dh, ne), jnp.float32) / np.sqrt(dh)
    b = bias_scale * jax.random.normal(ks[2], (h, ne), jnp.float32)
    return x, w, b


def test_wide_inputs_route_with_the_reference():
    """Inputs wider than MAX_TRITON_ROUTER_WIDTH (MoE at d_model 1024: the kernel's tiles asked for
    384 KB of shared memory) take the reference router under impl="triton" (the MoE core's dispatch): same values,
    indices and gradients (this runs on CPU because the Triton binding is never called for them)."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import route_topk
    from mhl_jax.moe.plan import MAX_TRITON_ROUTER_WIDTH
    from mhl_jax.moe.router import route_topk_reference

    d = 2 * MAX_TRITON_ROUTER_WIDTH
    ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(ks[0], (40, 1, d))
    w = jax.random.normal(ks[1], (1, d, 24)) * d ** -0.5
    b = jax.random.normal(ks[2], (1, 24)) * 0.1

    def f(route):
        return jax.value_and_grad(lambda x, w: jnp.sum(route(x, w, b, 4)[0] ** 2), argnums=(0, 1))(x, w)

    (v, g), (v_ref, g_ref) = f(lambda *a: route_topk(*a, impl="triton")), f(route_topk_reference)
    assert np.array_equal(np.asarray(route_topk(x, w, b, 4, impl="triton")[1]),
                          np.asarray(route_topk_reference(x, w, b, 4)[1]))
    assert float(v) == float(v_ref)
    for a, r in zip(g, g_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


@pytest.mark.gpu
@pytest.mark.parametrize("ne,k", [(1000, 6), (384, 2)])  # (384, 2): two row tiles per program in the Triton forward
def test_gpu_jax_triton_vs_reference(ne, k):
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.gpu import gluon as gluon_bridge
    from mhl_jax.moe.gpu.router import route_topk_triton, router_kind
    from mhl_jax.moe.router import route_topk_reference

    _gpu_setup()
    n, h, dh = 8191, 4, 128
    x, w, b = _gpu_inputs(ne + k, n, h, dh, ne)
    # on Hopper this test runs the warp-specialised Gluon forward, elsewhere the Triton one
    assert router_kind(dh, ne, k, x.dtype) == ("gluon-ws" if gluon_bridge.hopper_sms() else "triton")
    dv = jax.random.normal(jax.random.key(99), (n, h, k), jnp.float32)
    vals, idx = jax.jit(lambda x, w, b: route_topk_triton(x, w, b, k))(x, w, b)
    vr, ir = jax.jit(lambda x, w, b: route_topk_reference(x, w, b, k))(x, w, b)
    s64 = np.einsum("nhd,hde->nhe", np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w, np.float64))
    frac = check_topk(idx, vals, s64, np.asarray(b, np.float64), k, tol=2e-6, max_mismatch=1e-3)
    ref_frac = check_topk(ir, vr, s64, np.asarray(b, np.float64), k, tol=2e-6, max_mismatch=1e-3)
    agree = float((np.asarray(idx) == np.asarray(ir)).all(-1).mean())
    print(f"ne={ne} k={k}: rows != fp64 top-k: ours {frac:.2e}, reference {ref_frac:.2e}; "
          f"ours == reference {agree:.6f}")
    assert agree >= 0.999

    loss = lambda f: (lambda x, w: jnp.vdot(f(x, w, b, k)[0], dv))
    g = jax.jit(jax.grad(loss(route_topk_triton), argnums=(0, 1)))(x, w)
    # reference gradients for *our* selection (rows at near ties may select differently)
    sel = jax.nn.one_hot(idx, ne, dtype=jnp.float32)  # (N, H, k, Ne)
    dsc = jnp.einsum("nhke,nhk->nhe", sel, dv)
    hi = jax.lax.Precision.HIGHEST
    dx_ref = jnp.einsum("nhe,hde->nhd", dsc, w, precision=hi)
    dw_ref = jnp.einsum("nhd,nhe->hde", x.astype(jnp.float32), dsc, precision=hi)
    assert_close(g[1], dw_ref, rtol=1e-5)
    assert_close(g[0], dx_ref, rtol=1e-2)  # dx is bf16
    assert float(jnp.abs(g[0].astype(jnp.float32) - dx_ref).max()) <= float(jnp.abs(dx_ref).max()) * 2**-8


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True], ids=["random", "skew"])
def test_gpu_gradients_bitwise_deterministic(skew):
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.router import route_topk_triton

    _gpu_setup()
    n, h, dh, ne, k = 20000, 8, 128, 384, 4
    x, w, b = _gpu_inputs(5, n, h, dh, ne)
    if skew:  # a few hot experts: long groups over many dW blocks
        b = b.at[:, :4].add(40.0)
    dv = jax.random.normal(jax.random.key(6), (n, h, k), jnp.float32)
    f = jax.jit(jax.grad(lambda x, w: jnp.vdot(route_topk_triton(x, w, b, k)[0], dv), argnums=(0, 1)))
    g1 = jax.block_until_ready(f(x, w))
    g2 = jax.block_until_ready(f(x + jnp.zeros_like(x), w * 1.0))
    for a, c in zip(g1, g2):
        assert np.array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.gpu
def test_gpu_shard_map_and_torch_launch_bitwise():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from mhl_jax.moe.gpu.router import route_topk_triton
    from mhl_jax.moe.plan import resolve_kernels

    _gpu_setup()
    assert resolve_kernels("auto") == "triton"
    n, h, dh, ne, k = 4096, 4, 128, 512, 4
    x, w, b = _gpu_inputs(8, n, h, dh, ne)
    dv = jax.random.normal(jax.random.key(3), (n, h, k), jnp.float32)
    fn = lambda x, w: route_topk_triton(x, w, b, k)
    devs = jax.devices()[:1]
    mesh = jax.make_mesh((1,), ("hp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devs)
    sm = jax.shard_map(lambda x, w, b: route_topk_triton(x, w, b, k), mesh=mesh,
                       in_specs=(P(None, "hp"), P("hp"), P("hp")), out_specs=(P(None, "hp"), P(None, "hp")))
    v1, i1 = jax.jit(fn)(x, w)
    v2, i2 = jax.jit(sm)(x, w, b)
    assert np.array_equal(v1, v2) and np.array_equal(i1, i2)
    g = jax.jit(jax.grad(lambda x, w: jnp.vdot(fn(x, w)[0], dv), argnums=(0, 1)))(x, w)

    dev = "cuda"
    tx = torch.tensor(np.asarray(x.astype(jnp.float32)), device=dev).bfloat16()
    tw, tb = torch.tensor(np.asarray(w), device=dev), torch.tensor(np.asarray(b), device=dev)
    tv, ti = ktr.router_fwd(tx, tw, tb, k)
    assert np.array_equal(tv.cpu().numpy(), np.asarray(v1)) and np.array_equal(ti.cpu().numpy(), np.asarray(i1))
    tdx, tdw = ktr.router_bwd(tx, tw, ti, torch.tensor(np.asarray(dv), device=dev))
    assert np.array_equal(tdw.cpu().numpy(), np.asarray(g[1]))
    assert np.array_equal(tdx.float().cpu().numpy(), np.asarray(g[0].astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True], ids=["random", "skew"])
def test_gpu_moe_heads_one_packing_vs_separate_ops(skew):
    """The model's Triton path (moe_heads: the router packs for the experts and cuts its dW_r blocks
    from that packing) against the router and expert ops called separately (each with its own packing):
    same output and every gradient to the bit (same packing, same dW blocks, same kernels), and bitwise
    repeatable. x_expert is a copy of x_route, so the two ops run apart with one packing (the fused core, whose dx
    comes from one combine kernel: tests/kernels/test_combine.py)."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import moe_heads
    from mhl_jax.moe.gpu.experts import expert_ffn_triton
    from mhl_jax.moe.gpu.router import route_topk_triton

    _gpu_setup()
    n, h, dh, ne, k, de = 8192, 8, 128, 384, 4, 256
    x, w, b = _gpu_inputs(17, n, h, dh, ne)
    if skew:
        b = b.at[:, :4].add(40.0)
    ks = jax.random.split(jax.random.key(18), 3)
    w1 = jax.random.normal(ks[0], (h, ne, dh, de), jnp.float32) * dh ** -0.5
    w2 = jax.random.normal(ks[1], (h, ne, de, dh), jnp.float32) * de ** -0.5
    wy = jax.random.normal(ks[2], (n, h, dh), jnp.float32)

    def separate(x, w, w1, w2):
        vals, idx = route_topk_triton(x, w, b, k)
        return expert_ffn_triton(x, idx, jax.nn.softmax(vals, axis=-1), w1, w2)

    def grads(fn):
        f = lambda x, w, w1, w2: jnp.vdot(fn(x, w, w1, w2)[0].astype(jnp.float32), wy)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))

    shared = grads(lambda x, w, w1, w2: moe_heads(x, x + jnp.zeros_like(x), w, b, w1, w2, k, "triton"))
    v1, g1 = shared(x, w, w1, w2)
    v2, g2 = grads(separate)(x, w, w1, w2)
    assert float(v1) == float(v2)
    for name, a, c in zip(("x", "w_r", "w1", "w2"), g1, g2):
        assert np.array_equal(np.asarray(a), np.asarray(c)), name
    v3, g3 = shared(x + jnp.zeros_like(x), w * 1.0, w1, w2)
    assert float(v3) == float(v1) and all(np.array_equal(np.asarray(a), np.asarray(c)) for a, c in zip(g1, g3))
