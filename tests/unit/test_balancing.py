"""Aux-loss-free balancing: the update rule, and a skewed router driven toward uniform load."""

import jax
import jax.numpy as jnp
import numpy as np

from mhl_jax.model.balancing import load_stats, update_bias
from mhl_jax.moe.router import route_topk_reference as route_topk


def test_update_rule_against_numpy():
    rng = np.random.default_rng(0)
    bias = rng.standard_normal((3, 8)).astype(np.float32)
    counts = rng.integers(0, 50, (3, 8))
    got = update_bias(jnp.asarray(bias), jnp.asarray(counts), 0.01)
    load = counts / counts.sum(-1, keepdims=True)
    u = np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(got, bias + 0.01 * (u - u.mean(-1, keepdims=True)), rtol=1e-6)
    # overloaded experts go down, underloaded ones go up
    over = load > load.mean(-1, keepdims=True)
    assert np.all((np.asarray(got) - bias)[over] < 0)


def test_skewed_router_is_driven_to_uniform_load():
    rng = np.random.default_rng(1)
    n, h, dh, ne, k = 512, 2, 16, 8, 2
    x = jnp.asarray(rng.standard_normal((n, h, dh)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h, dh, ne)) * 0.1, jnp.float32)
    skew = jnp.zeros((h, ne)).at[:, :2].set(1.0)  # a skewed router: experts 0 and 1 score +1 on every token
    route = jax.jit(lambda b: route_topk(x, w, b + skew, k)[1])

    def counts(b):
        idx = route(b)
        return jnp.stack([jnp.bincount(idx[:, i].ravel(), length=ne) for i in range(h)])

    bias = jnp.zeros((h, ne), jnp.float32)
    start_max, start_min = load_stats(counts(bias))
    assert start_max > 3.5 and start_min < 0.3
    for _ in range(300):
        bias = update_bias(bias, counts(bias), 0.01)
    end_max, end_min = load_stats(counts(bias))
    assert end_max < 1.25 and end_min > 0.75, (float(end_max), float(end_min))
