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
