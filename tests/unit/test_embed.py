"""The embedding lookup's deterministic gradient (mhl_jax/gather.py) against numpy's add.at in
float64, with heavy repeats, absent ids, under jit, and sharded over 8 host devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mhl_jax.gather import embed_lookup, embedding_grad


def _case(seed, shape, vocab, d, hot=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, shape).astype(np.int32)
    if hot:  # one id fills half of the positions (a long run), others absent
        tokens[rng.random(shape) < 0.5] = 3
    g = rng.standard_normal(shape + (d,)).astype(np.float32)
    want = np.zeros((vocab, d))
    np.add.at(want, tokens.reshape(-1), g.reshape(-1, d).astype(np.float64))
    return tokens, g, want


@pytest.mark.parametrize("seed,shape,vocab,hot", [(0, (4, 33), 50, False), (1, (2, 64), 7, True),
                                                  (2, (1, 1), 5, False), (3, (3, 17), 1000, False)])
def test_gradient_vs_float64_add_at(seed, shape, vocab, hot):
    tokens, g, want = _case(seed, shape, vocab, 8, hot)
    got = np.asarray(jax.jit(embedding_grad, static_argnums=2)(jnp.asarray(tokens), jnp.asarray(g), vocab))
    absent = np.setdiff1d(np.arange(vocab), tokens)
    assert np.all(got[absent] == 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_custom_vjp_matches_take_and_its_gradient():
    tokens, g, _ = _case(4, (4, 25), 30, 16)
    table = jax.random.normal(jax.random.key(0), (30, 16))
    np.testing.assert_array_equal(np.asarray(embed_lookup(table, tokens)), np.asarray(jnp.take(table, tokens, axis=0)))

    def loss(f):
        return jax.grad(lambda t: jnp.sum(f(t, tokens) * g))(table)

    got = jax.jit(lambda t: loss(embed_lookup))(table)
    ref = loss(lambda t, i: jnp.take(t, i, axis=0))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_sharded_batch_gives_the_same_bits():
    """Tokens and gradient rows split over 8 host devices: the same gradient, bit for bit, as one device."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py)")
    tokens, g, want = _case(5, (8, 40), 64, 8, hot=True)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    f = jax.jit(embedding_grad, static_argnums=2)
    one = np.asarray(f(jnp.asarray(tokens), jnp.asarray(g), 64))
    ts = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    gs = jax.device_put(g, NamedSharding(mesh, P("data")))
    many = np.asarray(f(ts, gs, 64))
    np.testing.assert_array_equal(many, one)
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5)


def test_take_rows_of_a_3d_table_and_out_of_range_ids():
    """take_rows on (G, a, b) tables (the reference experts' per-block weight copies): value and
    gradient equal jnp.take's; ids outside [0, V) contribute nothing to the gradient."""
    from mhl_jax.gather import take_rows

    w = jax.random.normal(jax.random.key(1), (6, 3, 5))
    idx = jnp.array([0, 0, 2, 2, 2, 5, 1, 0], jnp.int32)
    cot = jax.random.normal(jax.random.key(2), (8, 3, 5))
    np.testing.assert_array_equal(np.asarray(take_rows(w, idx)), np.asarray(jnp.take(w, idx, axis=0)))
    # jitted: op by op, the gradient's associative scan compiles dozens of small programs
    got = jax.jit(jax.grad(lambda w: jnp.sum(take_rows(w, idx) * cot)))(w)
    ref = jax.grad(lambda w: jnp.sum(jnp.take(w, idx, axis=0) * cot))(w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
    rows = jax.jit(embedding_grad, static_argnums=2)(jnp.array([1, -1, 7, 1]), jnp.ones((4, 2)), 4)
    np.testing.assert_array_equal(np.asarray(rows), [[0, 0], [2, 2], [0, 0], [0, 0]])
