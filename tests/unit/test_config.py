"""Config loading: every shipped YAML loads; overrides are typed; bad values get named errors."""

from pathlib import Path

import pytest

from mhl_jax.config import Config, ConfigError, dump_config, load_config, parse_override

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
PAPER = ["mlp_0.2b", "moe_ep_2.2b", "latent_moe_ep_2.2b", "mh_latent_moe_hp_2.2b", "mh_latent_moe_hp_g_2.2b",
         "moe_ep_4.2b", "latent_moe_ep_4.2b", "mh_latent_moe_hp_4.2b", "mh_latent_moe_hp_g_4.2b"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_loads(path):
    assert isinstance(load_config(str(path)), Config)


def test_paper_configs_present_with_paper_hyperparameters():
    names = {p.stem for p in CONFIGS}
    assert set(PAPER) <= names
    for name in PAPER:
        cfg = load_config(f"configs/{name}.yaml")
        assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.head_dim) == (12, 1024, 8, 128)
        assert cfg.model.context == 2048 and cfg.model.vocab_size == 50304
        assert (cfg.optimizer.lr, cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.weight_decay) == (
            5e-4, 0.9, 0.95, 0.1)
        assert (cfg.schedule.warmup_steps, cfg.schedule.decay_steps) == (8000, 2000)
        assert cfg.train.global_batch * cfg.model.context == 655360  # 0.66M tokens
    g = load_config("configs/mh_latent_moe_hp_g_4.2b.yaml").ffn
    assert (g.num_experts, g.top_k, g.expert_hidden, g.num_heads, g.head_dim) == (1536, 8, 128, 8, 128)


def test_overrides_are_typed():
    cfg = load_config("configs/tiny_moe.yaml", ["optimizer.lr=1e-3", "ffn.top_k=3", "logging.progress_bar=false",
                                                 "optimizer.grad_clip=null", "name=x"])
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.ffn.top_k == 3 and cfg.logging.progress_bar is False and cfg.optimizer.grad_clip is None
    assert parse_override("a.b.c=5") == {"a": {"b": {"c": 5}}}


def test_micro_batch_that_does_not_divide_names_one_that_does():
    """The 2.2B configs' micro-batch 8 on 16 devices: 320 / (8 x 16) is not whole; the error names micro-batch 5
    (the largest <= 8 that divides 320 / 16), and 1, 2, 4 and 8 devices divide as they are."""
    from mhl_jax.train.loop import accumulation_steps

    cfg = load_config("configs/mh_latent_moe_hp_2.2b.yaml")
    assert cfg.train.micro_batch == 8
    assert [accumulation_steps(cfg, n) for n in (1, 2, 4, 8)] == [40, 20, 10, 5]
    with pytest.raises(ConfigError, match=r"micro_batch=8 x 16 devices = 128; e.g. --set train.micro_batch=5"):
        accumulation_steps(cfg, 16)
    tiny = load_config("configs/tiny_moe.yaml", ["train.global_batch=36", "train.micro_batch=4"])
    with pytest.raises(ConfigError, match=r"micro_batch=4 x 6 devices = 24; e.g. --set train.micro_batch=3$"):
        accumulation_steps(tiny, 6)
    with pytest.raises(ConfigError, match=r"micro_batch=4 x 5 devices = 20$"):  # no micro-batch fits 36 / 5
        accumulation_steps(tiny, 5)


def test_yaml_numbers_and_quoted_strings(tmp_path):
    """Unquoted 5e-4 / 1E3 are numbers (YAML 1.1 reads them as strings), in a file and in an override; a quoted
    number stays a string (the run's name "1.0")."""
    f = tmp_path / "c.yaml"
    f.write_text('name: "1.0"\noptimizer:\n  lr: 5E-4\n')
    cfg = load_config(str(f))
    assert cfg.name == "1.0" and cfg.optimizer.lr == 5e-4
    cfg = load_config(str(f), ['name="2.5e3"', "optimizer.lr=3e-4"])
    assert cfg.name == "2.5e3" and cfg.optimizer.lr == 3e-4
    saved = tmp_path / "saved.yaml"  # a run's config.yaml reads back the same
    saved.write_text(dump_config(cfg))
    assert load_config(str(saved)) == cfg

