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
