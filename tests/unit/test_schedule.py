"""The trapezoidal schedule at its boundary steps, and the optimizer's weight-decay mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from mhl_jax.train.optimizer import decay_mask
from mhl_jax.train.schedule import trapezoidal


@pytest.mark.parametrize("step, want", [
    (0, 5e-4 / 8000), (3999, 5e-4 * 4000 / 8000), (7999, 5e-4), (8000, 5e-4), (12999, 5e-4),
    (13000, 5e-4), (13001, 5e-4 * 1999 / 2000), (14000, 5e-4 * 1000 / 2000), (14999, 5e-4 / 2000), (15000, 0.0),
])
def test_paper_schedule_boundaries(step, want):
    assert float(trapezoidal(step, 5e-4, 8000, 2000, 15000)) == pytest.approx(want, rel=1e-5, abs=1e-12)


def test_no_warmup_no_decay_is_constant():
    assert [float(trapezoidal(s, 1.0, 0, 0, 10)) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]


def test_monotone_pieces():
    lr = np.array([float(trapezoidal(s, 1.0, 10, 20, 100)) for s in range(100)])
    assert np.all(np.diff(lr[:10]) > 0) and np.all(lr[9:80] == 1.0) and np.all(np.diff(lr[80:]) < 0)


def test_decay_mask_skips_norms():
    params = {"norm": {"scale": jnp.ones(4)}, "w": jnp.ones((4, 4)), "experts": jnp.ones((2, 3, 4, 4))}
    assert decay_mask(params) == {"norm": {"scale": False}, "w": True, "experts": True}


def _reference(step, peak, warmup, decay, total, shape, r):
    """The schedule in float64, written from its definition."""
    up = min(1.0, (step + 1) / warmup) if warmup else 1.0
    d = min(1.0, max(0.0, (total - step) / decay)) if decay else 1.0
    f = d if shape == "linear" else (1 - np.cos(np.pi * d)) / 2
    return peak * min(up, r + (1 - r) * f if decay else 1.0)


@pytest.mark.parametrize("shape, r", [("linear", 0.0), ("linear", 0.1), ("cosine", 0.0), ("cosine", 0.1)])
def test_decay_shapes_and_final_ratio(shape, r):
    warmup, decay, total = 10, 40, 100
    lr = np.array([float(trapezoidal(s, 2.0, warmup, decay, total, shape, r)) for s in range(total + 1)])
    ref = np.array([_reference(s, 2.0, warmup, decay, total, shape, r) for s in range(total + 1)])
    np.testing.assert_allclose(lr, ref, rtol=1e-6, atol=1e-7)
    assert np.all(lr[9:61] == 2.0) and np.all(np.diff(lr[60:]) < 0)  # constant until total - decay, then falls
    assert lr[-1] == pytest.approx(2.0 * r, abs=1e-7)
    if shape == "cosine":  # half way down the decay: half way to the final LR; flat at both ends
        assert lr[80] == pytest.approx(2.0 * (r + (1 - r) / 2), rel=1e-6)
        assert lr[60] - lr[61] < lr[80] - lr[81] and lr[99] - lr[100] < lr[80] - lr[81]


def test_linear_decay_to_zero_is_the_paper_trapezoid_bitwise():
    import jax

    old = jax.jit(lambda s: 5e-4 * jnp.minimum(jnp.minimum(1.0, (s + 1.0) / 8000),
                                              jnp.clip((15000 - s) / 2000, 0.0, 1.0)))
    new = jax.jit(lambda s: trapezoidal(s, 5e-4, 8000, 2000, 15000))
    steps = jnp.arange(0, 15001, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.vmap(old)(steps)), np.asarray(jax.vmap(new)(steps)))


def test_final_ratio_is_checked():
    from mhl_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"schedule.final_lr_ratio=1.5: must be in \[0, 1\]"):
        load_config(None, ["schedule.final_lr_ratio=1.5"])
    with pytest.raises(ConfigError, match="schedule.decay"):
        load_config(None, ["schedule.decay=exponential"])
    for shaped in ("schedule.final_lr_ratio=0.1", "schedule.decay=cosine"):  # no decay to shape: refused, not ignored
        with pytest.raises(ConfigError, match="schedule.decay_steps=0 has none"):
            load_config(None, ["schedule.decay_steps=0", shaped])
    load_config(None, ["schedule.decay_steps=0"])
