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


@pytest.mark.parametrize("override, needle", [
    ("ffn.bogus=1", "unknown config key 'ffn.bogus'"),
    ("nosuch.lr=1", "unknown config key 'nosuch'"),
    ("ffn.top_k=two", "ffn.top_k='two': expected an integer"),
    ("ffn.top_k=1.5", "ffn.top_k=1.5: expected an integer"),
    ("ffn.kind=dense", "ffn.kind='dense': expected one of"),
    ("logging.progress_bar=3", "expected a bool"),
    ("ffn.top_k=1", "ffn.top_k=1: k must be >= 2"),
    ("ffn.top_k=17", "ffn.top_k=17 > ffn.num_experts=16"),
    ("ffn.head_dim=16", "does not match the projection width ffn.latent_dim=128"),
    ("parallel.hp=3", "ffn.num_heads=4 is not divisible by parallel.hp=3"),
    ("parallel.ep=2", "parallel.ep=2 needs ffn.kind moe or latent_moe"),
    ("train.micro_batch=5", "train.global_batch=16 is not a multiple of train.micro_batch=5"),
    ("schedule.warmup_steps=290", "exceeds schedule.total_steps=300"),
    ("noequals", "expected the form key.sub=value"),
    ("model.d_model=[1", "override 'model.d_model=[1': the value '[1' is not valid YAML"),
    ("logging.peak_tflops=-1", "logging.peak_tflops=-1.0: must be positive"),
    ("checkpoint.every=-1", "checkpoint.every=-1: must be >= 0 (0: no checkpoints)"),
    ("data.eval_every=-5", "data.eval_every=-5: must be >= 0 (0: no validation)"),
    ("data.tokenizer=gpt2", "data.tokenizer='gpt2' with data.source='builtin': the built-in corpus is byte-level"),
    ("data.path=data/x", "data.path='data/x' / data.val_path='' with data.source='builtin', which reads the built-in"),
    ("data.path=data/x", "or empty them (--set data.path= --set data.val_path=) to train on the built-in corpus"),
    ("data.path=null", "data.path=None: expected a string; for none give the empty one (--set data.path=)"),
])
def test_bad_values_are_named(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny_mh_latent_moe.yaml", [override])
    assert needle in str(e.value)


def test_ep_divisibility_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="ffn.num_experts=16 is not divisible by parallel.ep=3"):
        load_config("configs/tiny_moe.yaml", ["parallel.ep=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="is a directory; expected a YAML file"):
        load_config(str(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="model: expected a mapping"):
        load_config(str(wrong))


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

