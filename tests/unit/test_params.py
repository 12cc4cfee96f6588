"""Parameter counts of the paper's configs against its 'active - total' column (Table 1); the LM head and its loss
(`mhl_jax.model.loss`) against the whole-logits cross-entropy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax.config import load_config
from mhl_jax.model.gpt import build_model
from mhl_jax.model.loss import LOSS_CHUNK_TOKENS, head_logits, head_loss, lm_head_loss, loss_chunk_len
from mhl_jax.model.params import count_params


def cross_entropy(logits, targets):
    """The reference: mean NLL of fp32 logits (B, T, V) over int targets (B, T), the whole logits at once."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0])


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


def test_head_loss_chunks_match_the_whole_logits_loss():
    """`head_loss` (the LM head's loss in chunks along T, the logits' gradient kept in the compute dtype) against
    `cross_entropy` of `head_logits`' whole logits: in fp32 the same loss and gradients to fp32 rounding at chunk
    lengths 1 (a chunk per position), 4 (several chunks of several positions) and T (one chunk; any other length runs
    the scan over chunks as 4 does); in bf16 the same loss to fp32 rounding (the logits are the same products) and
    gradients within bf16 rounding; a cotangent other than 1 scales both gradients."""
    k = jax.random.split(jax.random.key(1), 3)
    b, t, d, v = 3, 12, 32, 50
    x, w = jax.random.normal(k[0], (b, t, d)), 0.3 * jax.random.normal(k[1], (d, v))
    tgt = jax.random.randint(k[2], (b, t), 0, v)

    @functools.partial(jax.jit, static_argnums=2)
    def losses(x, w, tcs):  # the reference and head_loss at chunk lengths tcs in one program: one compilation
        plain = jax.value_and_grad(lambda x, w: cross_entropy(head_logits(x, w), tgt), (0, 1))(x, w)
        chunked = [jax.value_and_grad(lambda x, w, tc=tc: head_loss(x, w, tgt, tc), (0, 1))(x, w) for tc in tcs]
        primal = [head_loss(x, w, tgt, tc) for tc in tcs]
        g3 = jax.grad(lambda x, w: 3.0 * head_loss(x, w, tgt, tcs[0]), (0, 1))(x, w)
        return plain, chunked, primal, g3

    with jax.default_matmul_precision("highest"):  # fp32 products on a GPU too (not TF32)
        (v0, g0), chunked, primal, g3 = losses(x, w, (4, 1, 12))
    for (v1, g1), p1 in zip(chunked, primal, strict=True):
        np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
        # the primal (no gradient kept: evaluation) is the same sum; XLA may fuse it otherwise (GPU: last bits)
        np.testing.assert_allclose(float(p1), float(v1), rtol=1e-6)
        for a, r in zip(g1, g0):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(r))))
    for a, r in zip(g3, g0):  # 3 x the loss at chunk length 4
        np.testing.assert_allclose(np.asarray(a), 3.0 * np.asarray(r), rtol=1e-5,
                                   atol=1e-5 * float(jnp.max(jnp.abs(r))))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    (vb0, gb0), [(vb1, gb1)], _, _ = losses(xb, wb, (4,))
    np.testing.assert_allclose(float(vb1), float(vb0), rtol=1e-6)
    for a, r in zip(gb1, gb0):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(r, np.float32), rtol=0.02,
                                   atol=0.01 * float(jnp.max(jnp.abs(r.astype(jnp.float32)))))


def test_head_loss_keeps_no_logits_for_the_backward():
    """What the differentiated chunked loss keeps for its backward is dx (B, T, d) in the compute dtype and dW (d, V)
    in fp32, no array of B x T x V elements (the whole-logits form keeps its fp32 logits); its compiled temporaries
    stay below the whole form's by more than the fp32 logits (here ~7 vs 82 MiB on the CPU)."""
    b, t, d, v = 4, 256, 64, 8192
    args = (jnp.ones((b, t, d), jnp.bfloat16), jnp.ones((d, v), jnp.bfloat16), jnp.zeros((b, t), jnp.int32))
    chunked = lambda x, w, tg: head_loss(x, w, tg, 8)  # noqa: E731
    plain = lambda x, w, tg: cross_entropy(head_logits(x, w), tg)  # noqa: E731

    def kept(f):
        return sorted((leaf.shape, str(leaf.dtype)) for leaf in jax.tree_util.tree_leaves(jax.vjp(f, *args)[1]))

    assert kept(chunked) == sorted([((b, t, d), "bfloat16"), ((d, v), "float32")])
    assert ((b, t, v), "float32") in kept(plain)  # the check sees the whole form's logits

    def temp(f):
        return jax.jit(jax.value_and_grad(f, (0, 1))).lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp(chunked) < temp(plain) - b * t * v * 4, (temp(chunked), temp(plain))


def test_loss_chunk_len_and_the_model_loss():
    """`loss_chunk_len`: the largest divisor of T with B x length <= the chunk's tokens (at least 1). `GPT.loss` (one
    chunk here) and the loss in chunks of 4 positions (`lm_head_loss` over `GPT.hidden`) agree with `cross_entropy`
    of the model's logits, loss and every parameter's gradient. One layer (the dense stem): the head's loss sees only
    the last block's output, whatever the blocks; the three in one program (one compilation)."""
    assert [loss_chunk_len(*a) for a in [(8, 2048, 4096), (16, 2048, 4096), (3, 7, 4096), (5, 2048, 4096),
                                         (64, 2048, 16), (2, 12, 8)]] == [512, 256, 7, 512, 1, 4]
    assert LOSS_CHUNK_TOKENS == 4096
    cfg = load_config("configs/tiny_mh_latent_moe.yaml", ["model.n_layers=1", "model.context=16"])
    graphdef, state = nnx.split(build_model(cfg))
    tok = jax.random.randint(jax.random.key(0), (2, 17), 0, cfg.model.vocab_size)

    def whole(m):
        return cross_entropy(m(tok[:, :-1])[0], tok[:, 1:])

    def chunked(m):
        return lm_head_loss(m.hidden(tok[:, :-1])[0], m.head[...].astype(m.dtype), tok[:, 1:], chunk_tokens=8)

    def model_loss(m):
        return m.loss(tok[:, :-1], tok[:, 1:])[0]

    @jax.jit
    def losses_and_grads(s):
        return [jax.value_and_grad(lambda s_, f=f: f(nnx.merge(graphdef, s_)))(s) for f in (whole, chunked, model_loss)]

    with jax.default_matmul_precision("highest"):  # fp32 products on a GPU too (TF32 differs by ~1e-4 there)
        (v0, g0), (v1, g1), (v2, g2) = losses_and_grads(state)
    for v in (v1, v2):
        np.testing.assert_allclose(float(v), float(v0), rtol=1e-6)
    for g in (g1, g2):  # every parameter's gradient through the model
        for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5 * float(np.abs(r).max()))
