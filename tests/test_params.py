"""Parameter counts of the paper's configs against its 'active - total' column (Table 1)."""

import pytest

from mhl_jax.config import load_config
from mhl_jax.model.params import count_params


@pytest.mark.parametrize("name, total", [
    ("moe_ep_2.2b", 2.2e9), ("latent_moe_ep_2.2b", 2.2e9), ("mh_latent_moe_hp_2.2b", 2.2e9),
    ("mh_latent_moe_hp_g_2.2b", 2.2e9), ("moe_ep_4.2b", 4.2e9), ("latent_moe_ep_4.2b", 4.2e9),
    ("mh_latent_moe_hp_4.2b", 4.2e9), ("mh_latent_moe_hp_g_4.2b", 4.2e9), ("mlp_0.2b", 0.2e9),
])
def test_paper_counts(name, total):
    c = count_params(load_config(f"configs/{name}.yaml"))
    assert abs(c.total - total) / total < 0.05, c
    # "0.2B" active is a one-significant-digit figure: it rounds to 0.2B
    assert round(c.active / 1e9, 1) == 0.2, c
    if name.startswith("moe") or name.startswith("mlp"):
        assert abs(c.active - 0.2e9) / 0.2e9 < 0.05, c


def test_exact_count_formula_for_moe():
    c = count_params(load_config("configs/moe_ep_2.2b.yaml"))
    d, v, ne, de, k = 1024, 50304, 384, 256, 4
    attn = 4 * d * d
    norms = 2 * d
    dense = 2 * d * 4096
    experts = ne * 2 * d * de
    router = d * ne
    total = 2 * v * d + d + 12 * (attn + norms) + 2 * dense + 10 * (experts + router)
    active = total - 10 * experts * (ne - k) // ne
    assert (c.total, c.active) == (total, active)


def test_head_logits_backward_runs_in_the_compute_dtype():
    """The LM head's custom VJP: in fp32 exactly plain autodiff's gradients (the same dot_generals); in bf16 the
    backward matmuls take bf16 operands (plain autodiff multiplies the fp32 cotangent with bf16 operands: fp32 GEMMs
    on the GPU), the gradients within bf16 rounding of the fp32 ones, and the logits exactly the plain einsum's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mhl_jax.model.gpt import head_logits

    k = jax.random.split(jax.random.key(0), 3)
    x, w, t = (jax.random.normal(k[0], (2, 5, 32)), jax.random.normal(k[1], (32, 48)),
               jax.random.normal(k[2], (2, 5, 48)))
    plain = lambda x, w: jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)  # noqa: E731
    loss = lambda f: (lambda x, w: jnp.sum(f(x, w) * t))  # noqa: E731
    ref = jax.grad(loss(plain), (0, 1))(x, w)
    for a, b in zip(jax.grad(loss(head_logits), (0, 1))(x, w), ref):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(head_logits(xb, wb)), np.asarray(plain(xb, wb)))
    jaxpr = jax.make_jaxpr(jax.grad(loss(head_logits), (0, 1)))(xb, wb)
    # the backward's matmuls (the forward's sits inside the custom_vjp call; the backward's jax.vjp also traces an
    # unused forward, which XLA drops)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) >= 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    got = jax.grad(loss(head_logits), (0, 1))(xb, wb)
    for a, b in zip(got, ref):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=0.05, atol=0.05 * float(
            jnp.max(jnp.abs(b))))
