"""The wide router (`mhl_jax.moe.wide_router`: bf16 GEMMs over a three-term split of W_r) against the fp32 reference
router at HIGHEST precision: the split is exact, the selection and the selected scores agree, and so do the
gradients (dW_r to fp32 rounding, dx to bf16's); on a GPU the same, compiled, and repeatable to the bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhl_jax.moe import core
from mhl_jax.moe.router import route_topk_reference
from mhl_jax.moe.wide_router import route_topk_wide, split3


def inputs(n=96, h=2, dh=320, ne=48, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, h, dh)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((h, dh, ne)) / np.sqrt(dh), jnp.float32)
    b = jnp.asarray(0.1 * rng.standard_normal((h, ne)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((n, h, 4)), jnp.float32)
    return x, w, b, cot


def loss_and_grads(route, x, w, b, cot):
    def f(x, w):
        vals, idx = route(x, w, b, 4)
        return jnp.sum(vals * cot), idx

    (loss, idx), (dx, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)
    return loss, idx, dx, dw


def test_split_is_exact():
    rng = np.random.default_rng(1)
    edges = np.float32(2.0 ** -103) * (1 + rng.integers(0, 2 ** 23, 64) / 2 ** 23)  # the smallest exact magnitudes
    w = np.concatenate([rng.standard_normal(4096) * 10.0 ** np.linspace(-20, 20, 4096), edges, -edges,
                        [0.0, np.finfo(np.float32).max, -np.finfo(np.float32).max]])
    w = jnp.asarray(w, jnp.float32)
    parts = split3(w)
    assert all(p.dtype == jnp.bfloat16 for p in parts)
    total = (parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32)) + parts[2].astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(w))
    # two terms would not do: the third carries bits
    assert np.any(np.asarray(parts[2].astype(jnp.float32)) != 0)


def test_wide_router_matches_the_fp32_reference():
    x, w, b, cot = inputs()
    ref = loss_and_grads(route_topk_reference, x, w, b, cot)
    got = jax.jit(lambda *a: loss_and_grads(route_topk_wide, *a))(x, w, b, cot)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))  # the same experts, in the same order
    vals_ref, _ = route_topk_reference(x, w, b, 4)
    vals, _ = route_topk_wide(x, w, b, 4)
    np.testing.assert_allclose(np.asarray(vals), np.asarray(vals_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(ref[3]), rtol=1e-5, atol=1e-5)  # dW_r
    assert got[2].dtype == jnp.bfloat16
    dx, dx_ref = np.asarray(got[2], np.float32), np.asarray(ref[2], np.float32)
    # bf16 rounding of nearly the same sum (to ~2^-22 of the largest term: atol for results near zero)
    np.testing.assert_allclose(dx, dx_ref, rtol=2 ** -7, atol=1e-5)
    assert np.mean(dx == dx_ref) > 0.999
    # the gradient only touches the selected experts: a cotangent of zeros gives zero dW_r and dx
    zero = loss_and_grads(route_topk_wide, x, w, b, jnp.zeros_like(cot))
    assert not np.any(np.asarray(zero[3])) and not np.any(np.asarray(zero[2], np.float32))


def test_core_takes_it_for_wide_bf16_inputs_only(monkeypatch):
    """`route_topk` on the triton implementation: the wide router past the kernels' width for bf16 x, the reference for
    fp32 x; the reference implementation never takes it."""
    calls = []
    monkeypatch.setattr(core, "route_topk_wide", lambda *a: calls.append("wide") or route_topk_wide(*a))
    x, w, b, _ = inputs(n=8, h=1, dh=core.MAX_TRITON_ROUTER_WIDTH + 64, ne=16)
    core.route_topk(x, w, b, 4, "triton")
    core.route_topk(x.astype(jnp.float32), w, b, 4, "triton")
    core.route_topk(x, w, b, 4, "reference")
    assert calls == ["wide"]


@pytest.mark.gpu
def test_wide_router_on_gpu_matches_and_repeats():
    """MoE's shape (one head of 1024, Ne 384, k 4) compiled on a GPU, where the bf16 GEMMs run (the CPU widens their
    operands): the selection equals the reference's but for near-ties, the selected scores and dW_r to fp32 rounding
    (rows whose selection differs get no cotangent in either), and two runs are equal to the bit."""
    x, w, b, cot = inputs(n=8192, h=1, dh=1024, ne=384, seed=3)
    vals, idx = jax.jit(route_topk_wide, static_argnums=3)(x, w, b, 4)
    vals_ref, idx_ref = jax.jit(route_topk_reference, static_argnums=3)(x, w, b, 4)
    same = np.all(np.asarray(idx) == np.asarray(idx_ref), axis=(1, 2))
    assert same.mean() > 0.99, same.mean()
    # two fp32 sums of 1024 products (scores ~1) in different orders: ~sqrt(1024) fp32 ulps apart
    np.testing.assert_allclose(np.asarray(vals)[same], np.asarray(vals_ref)[same], rtol=1e-5, atol=2e-5)
    cot = jnp.where(jnp.asarray(same)[:, None, None], cot, 0.0)
    fn = jax.jit(lambda *a: loss_and_grads(route_topk_wide, *a))
    got, again = fn(x, w, b, cot), fn(x, w, b, cot)
    ref = jax.jit(lambda *a: loss_and_grads(route_topk_reference, *a))(x, w, b, cot)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    np.testing.assert_allclose(np.asarray(got[2], np.float32)[same], np.asarray(ref[2], np.float32)[same],
                               rtol=2 ** -7, atol=1e-5)
    # fp32 sums over 8192 rows in another order: the error scales with the largest sums
    dw_ref = np.asarray(ref[3])
    np.testing.assert_allclose(np.asarray(got[3]), dw_ref, rtol=1e-5, atol=4e-6 * np.abs(dw_ref).max())
