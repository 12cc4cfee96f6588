"""Every FFN variant against an independent float64 per-token, per-expert loop; routing properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax.model.mlp import MLP
from mhl_jax.model.moe import LatentMoE, MHLatentMoE, MoE
from mhl_jax.moe.core import moe_heads
from mhl_jax.moe.router import route_topk_reference
from tests.references import numpy_moe as ref

route_topk = jax.jit(route_topk_reference, static_argnums=3)  # one compile per shape, not one per eager op

B, T, D = 2, 5, 16


def randomize(module, seed, scale=0.3):
    """Replace every parameter with fresh N(0, scale) values and every bias with a random one."""
    rng = np.random.default_rng(seed)
    for _path, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable):
            var.set_value(jnp.asarray(scale * rng.standard_normal(var.get_value().shape), jnp.float32))


def build(cls, *args, seed):
    """cls(*args, rngs) with random parameters (`randomize`; seed None: left abstract, for the caller to set): its
    own initialisers never run (eagerly, each parameter shape would compile a random-number program)."""
    m = nnx.eval_shape(lambda: cls(*args, nnx.Rngs(0)))
    if seed is not None:
        randomize(m, seed)
    return m


@nnx.jit
def call(m, x):
    """m(x) under one jit: eagerly, every op of the layer compiles on its own."""
    return m(x)


def tokens(seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)), jnp.float32)


def test_mlp():
    m = build(MLP, D, 24, 0.02, 0.02, seed=1)
    x = tokens(2)
    y, _ = call(m, x)
    np.testing.assert_allclose(y.reshape(-1, D), ref.mlp_ref(x.reshape(-1, D), m.w1[...], m.w2[...]), atol=1e-5)


def test_moe():
    m = build(MoE, D, 6, 8, 2, 0.02, 0.02, seed=3)
    x = tokens(4)
    y, load = call(m, x)
    e = m.experts
    want = ref.moe_ref(x.reshape(-1, D), e.w_router[...], e.bias[...], e.w1[...], e.w2[...], 2)
    np.testing.assert_allclose(y.reshape(-1, D), want, atol=1e-5)
    assert load.shape == (1, 6) and int(load.sum()) == B * T * 2


def test_latent_moe():
    m = build(LatentMoE, D, 12, 6, 8, 3, 0.02, 0.02, seed=5)
    x = tokens(6)
    y, _ = call(m, x)
    e = m.experts
    want = ref.latent_moe_ref(x.reshape(-1, D), m.w_down[...], m.w_up[...], e.w_router[...], e.bias[...],
                              e.w1[...], e.w2[...], 3)
    np.testing.assert_allclose(y.reshape(-1, D), want, atol=1e-5)


def test_mh_latent_moe():
    m = build(MHLatentMoE, D, 4, 6, 5, 8, 2, 0.02, 0.02, seed=7)
    x = tokens(8)
    y, load = call(m, x)
    e = m.experts
    want = ref.mh_latent_moe_ref(x.reshape(-1, D), m.w_in[...], m.w_out[...], e.w_router[...], e.bias[...],
                                 e.w1[...], e.w2[...], 2)
    np.testing.assert_allclose(y.reshape(-1, D), want, atol=1e-5)
    assert load.shape == (4, 5) and np.all(np.asarray(load.sum(-1)) == B * T * 2)


def test_one_head_with_identity_projections_equals_moe():
    moe = build(MoE, D, 6, 8, 2, 0.02, 0.02, seed=9)
    mh = build(MHLatentMoE, D, 1, D, 6, 8, 2, 0.02, 0.02, seed=None)  # every parameter set here
    for name in ("w_router", "bias", "w1", "w2"):
        getattr(mh.experts, name).set_value(getattr(moe.experts, name).get_value())
    mh.w_in.set_value(jnp.eye(D).reshape(D, 1, D))
    mh.w_out.set_value(jnp.eye(D).reshape(1, D, D))
    x = tokens(10)
    np.testing.assert_allclose(call(mh, x)[0], call(moe, x)[0], atol=1e-6)


def _router_inputs(seed, n=40, h=3, dh=8, ne=7):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32),
            jnp.asarray(rng.standard_normal((h, dh, ne)), jnp.float32),
            jnp.asarray(rng.standard_normal((h, ne)), jnp.float32))


def test_router_matches_float64_topk_and_gates_sum_to_one():
    x, w, b = _router_inputs(11)
    vals, idx = route_topk(x, w, b, 3)
    s = np.einsum("nhd,hde->nhe", ref.f64(x), ref.f64(w))
    want_idx = np.argsort(-(s + ref.f64(b)[None]), axis=-1, kind="stable")[..., :3]
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(vals, np.take_along_axis(s, want_idx, -1), rtol=1e-5, atol=1e-5)
    gates = jax.nn.softmax(vals, axis=-1)
    np.testing.assert_allclose(gates.sum(-1), 1.0, atol=1e-6)


def test_bias_changes_selection_not_gate_values():
    x, w, _ = _router_inputs(12)
    zero = jnp.zeros((3, 7), jnp.float32)
    v0, i0 = route_topk(x, w, zero, 2)
    big = zero.at[:, 0].set(100.0)  # expert 0 now always selected
    v1, i1 = route_topk(x, w, big, 2)
    assert np.all(np.asarray(i1) == 0, axis=-1).sum() == 0 and np.all(np.any(np.asarray(i1) == 0, axis=-1))
    assert not np.array_equal(i0, i1)
    s = np.einsum("nhd,hde->nhe", ref.f64(x), ref.f64(w))
    # values are the raw scores of the selected experts: no bias in them
    np.testing.assert_allclose(v1, np.take_along_axis(s, np.asarray(i1), -1), rtol=1e-5, atol=1e-5)
    # where the selection did not change, the gates did not change either
    same = np.all(np.sort(np.asarray(i0), -1) == np.sort(np.asarray(i1), -1), -1)
    np.testing.assert_allclose(np.sort(jax.nn.softmax(v0)[same], -1), np.sort(jax.nn.softmax(v1)[same], -1), atol=1e-6)


def test_gradient_reaches_only_selected_scores():
    x, w, b = _router_inputs(13)
    scores = jnp.einsum("nhd,hde->nhe", x, w)

    def f(s):
        _, idx = jax.lax.top_k(s + b[None], 2)
        v = jnp.take_along_axis(s, idx, -1)
        return jnp.sum(jax.nn.softmax(v, -1) * jnp.arange(1.0, 3.0))

    g = np.asarray(jax.jit(jax.grad(f))(scores))
    _, idx = route_topk(x, w, b, 2)
    mask = np.zeros(g.shape, bool)
    np.put_along_axis(mask, np.asarray(idx), True, -1)
    assert np.all(g[~mask] == 0.0) and np.count_nonzero(g[mask]) > 0.9 * mask.sum()
    # the same through the router op and w_r: dW_r columns of never-selected experts are zero
    def loss(w_r):
        v, _ = route_topk(x, w_r, b, 2)
        return jnp.sum(jax.nn.softmax(v, -1) * jnp.arange(1.0, 3.0))

    gw = np.asarray(jax.jit(jax.grad(loss))(w))
    chosen = np.zeros((3, 7), bool)
    for h in range(3):
        chosen[h, np.unique(np.asarray(idx)[:, h])] = True
    assert np.all(gw.transpose(0, 2, 1)[~chosen] == 0.0)


def test_moe_heads_gradients_match_float64_finite_differences():
    """k 2 of 5 experts: the gradient sums over several chosen experts and leaves others out (a larger k takes the
    same code)."""
    rng = np.random.default_rng(14)
    n, h, dh, ne, de, k = 6, 2, 4, 5, 3, 2
    x = jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32)
    w_r = jnp.asarray(rng.standard_normal((h, dh, ne)), jnp.float32)
    bias = jnp.zeros((h, ne), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((h, ne, dh, de)) * 0.5, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((h, ne, de, dh)) * 0.5, jnp.float32)
    proj = jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32)

    def loss(w1_, w2_):
        y, _ = moe_heads(x, x, w_r, bias, w1_, w2_, k, "reference")
        return jnp.sum(y * proj)

    g1, g2 = (np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(w1, w2))
    x64, w_r64, proj64 = ref.f64(x), ref.f64(w_r), ref.f64(proj)  # numpy: the loop below indexes them often

    def loss64(w1_, w2_):
        out = 0.0
        for t in range(n):
            for hh in range(h):
                y, _, _ = ref.moe_token(x64[t, hh], x64[t, hh], w_r64[hh], np.zeros(ne), w1_[hh], w2_[hh], k)
                out += y @ proj64[t, hh]
        return out

    a1, a2 = ref.f64(w1), ref.f64(w2)
    eps = 1e-6
    for (arr, grad, which) in ((a1, g1, 0), (a2, g2, 1)):
        for flat in rng.choice(arr.size, 12, replace=False):
            i = np.unravel_index(flat, arr.shape)
            plus, minus = arr.copy(), arr.copy()
            plus[i] += eps
            minus[i] -= eps
            args_p = (plus, a2) if which == 0 else (a1, plus)
            args_m = (minus, a2) if which == 0 else (a1, minus)
            fd = (loss64(*args_p) - loss64(*args_m)) / (2 * eps)
            assert abs(float(grad[i]) - fd) < 1e-4 * max(1.0, abs(fd)), (which, i, float(grad[i]), fd)


@pytest.mark.parametrize("dh,n,ne,k", [(144, 40, 12, 3), (16, 200, 4, 2)], ids=["grouped", "fused-block64"])
def test_moe_heads_triton_shares_one_packing(dh, n, ne, k):
    """The Triton path of moe_heads (router packs once for the experts; its dW_r layout comes from that
    packing), with pure-JAX kernel stand-ins, against the reference path: same loads, same output and
    gradients (fp32), and one sort fewer in the compiled gradient than the router and expert ops called
    separately. dh 144 runs the grouped expert op, dh 16 the fused one; there 100 slots per group make the
    default config pack 64-row blocks (not the router's dW block) with the Triton packing (emulated: the JAX
    sort). The fused op at the default config of smaller shapes (the rows dW form, the JAX sort's packing) goes
    through the same sharing in the models of tests/kernels/test_kernels_in_model.py, against the reference."""
    from mhl_jax.moe.core import expert_ffn, moe_heads_triton
    from mhl_jax.moe.gpu.router import route_topk_triton
    from mhl_jax.moe.plan import packing_spec as triton_packing_spec

    rng = np.random.default_rng(31)
    h, de = 2, 32
    x = jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32)
    w_r = jnp.asarray(rng.standard_normal((h, dh, ne)) / np.sqrt(dh), jnp.float32)
    bias = np.zeros((h, ne), np.float32)
    bias[:, 2] = 5.0  # a hot expert over several row blocks
    bias = jnp.asarray(bias)
    w1 = jnp.asarray(rng.standard_normal((h, ne, dh, de)) / np.sqrt(dh), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((h, ne, de, dh)) / np.sqrt(de), jnp.float32)
    proj = jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32)

    def loss(fn):
        def f(x_, w_r_, w1_, w2_):
            y, load = fn(x_, x_, w_r_, bias, w1_, w2_, k)
            return jnp.sum(y * proj), load
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    def separate(x_, _, w_r_, b_, w1_, w2_, k_):
        vals, idx = route_topk_triton(x_, w_r_, b_, k_, backend="emulate")
        return expert_ffn(x_, idx, jax.nn.softmax(vals, axis=-1), w1_, w2_, "triton", backend="emulate")

    shared = loss(lambda *a: moe_heads_triton(*a, backend="emulate"))
    (l_ref, load_ref), g_ref = loss(lambda *a: moe_heads(*a, "reference"))(x, w_r, w1, w2)
    (l_tri, load_tri), g_tri = shared(x, w_r, w1, w2)
    assert np.array_equal(load_ref, load_tri) and int(load_ref[:, 2].min()) == n
    if n == 200:
        assert triton_packing_spec(x.shape, k, w1.shape) == (64, "triton")
    sorts = [f.lower(x, w_r, w1, w2).as_text().count("stablehlo.sort") for f in (shared, loss(separate))]
    assert sorts[0] == sorts[1] - 1, sorts
    np.testing.assert_allclose(l_tri, l_ref, rtol=1e-5)
    for name, a, b in zip(("x", "w_r", "w1", "w2"), g_tri, g_ref):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 * float(np.abs(b).max()), err_msg=name)
    # a packing made with another row block is refused with the sizes it has and wants
    from mhl_jax.moe import packing as pk

    idx = route_topk(x, w_r, bias, k)[1]
    gates = jnp.full((n, h, k), 1.0 / k)
    with pytest.raises(ValueError, match="given packing"):  # a check of shapes: traced, not run
        jax.eval_shape(lambda i: expert_ffn(x, i, gates, w1, w2, "triton", packing=pk.pack(i, ne, 256),
                                            backend="emulate"), idx)
