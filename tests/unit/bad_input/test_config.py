"""Bad configs: overrides and values that load_config refuses, and config files it cannot read."""

from __future__ import annotations

from functools import partial

import pytest

from mhl_jax.config import ConfigError, load_config
from tests.unit.bad_input.catalogue import TINY, TINY_MOE, Section, calls, check_refused

# ============================================================================= config: load_config and its checks

CONFIG = Section("config")
for _id, _override, _fragment in [
    # the form of an override
    ("no-equals", "noequals", "override 'noequals': expected the form key.sub=value"),
    ("empty-key", "=1", "override '=1': bad key ''"),
    ("empty-key-part", "model..d_model=1", "bad key 'model..d_model'"),
    ("bad-yaml-value", "model.d_model=[1", "override 'model.d_model=[1': the value '[1' is not valid YAML"),
    # unknown keys
    ("unknown-key", "ffn.bogus=1", "unknown config key 'ffn.bogus'; known keys here: ["),
    ("unknown-section", "nosuch.lr=1", "unknown config key 'nosuch'"),
    ("misspelt-key", "optimizer.learning_rate=1", "unknown config key 'optimizer.learning_rate'"),
    # wrong types
    ("int-as-word", "ffn.top_k=two", "ffn.top_k='two': expected an integer"),
    ("int-as-float", "ffn.top_k=1.5", "ffn.top_k=1.5: expected an integer"),
    ("int-as-bool", "model.n_layers=true", "model.n_layers=true: expected an integer"),
    ("number-as-word", "optimizer.lr=fast", "optimizer.lr='fast': expected a number"),
    ("choice", "ffn.kind=dense", "ffn.kind='dense': expected one of ['mlp', 'moe', 'latent_moe', 'mh_latent_moe']"),
    ("bool", "logging.progress_bar=3", "logging.progress_bar=3: expected a bool (true/false)"),
    ("string-null", "data.path=null", "data.path=null: expected a string; for none give the empty one (--set "
     "data.path=)"),
    ("string-as-number", "name=3", "name=3: expected a string"),
    ("section-as-value", "model=3", "model: expected a mapping, got 3"),
    # values out of range
    ("width-zero", "model.d_model=0", "model.d_model=0: must be positive"),
    ("odd-head-dim", "model.head_dim=31", "model.head_dim=31: RoPE needs an even head dim"),
    ("init-std", "model.init_std=0", "model.init_std=0.0: must be in (0, 1]"),
    ("stem-layers", "ffn.stem_layers=5", "ffn.stem_layers=5: must be in [0, model.n_layers=4]"),
    ("stem-hidden", "ffn.stem_hidden=0", "ffn.stem_hidden=0: must be positive"),
    ("one-expert", "ffn.num_experts=1", "ffn.num_experts=1: need at least 2 experts"),
    ("top-k-one", "ffn.top_k=1", "ffn.top_k=1: k must be >= 2"),
    ("top-k-over-experts", "ffn.top_k=17", "ffn.top_k=17 > ffn.num_experts=16: k cannot exceed Ne"),
    ("expert-hidden", "ffn.expert_hidden=0", "ffn.expert_hidden=0: must be positive"),
    ("heads-zero", "ffn.num_heads=0", "ffn.num_heads=0, ffn.head_dim=32: must be positive"),
    ("heads-x-dim", "ffn.head_dim=16", "ffn.num_heads=4 x ffn.head_dim=16 = 64 does not match the projection width "
     "ffn.latent_dim=128"),
    ("hp-zero", "parallel.hp=0", "parallel.hp=0, parallel.ep=1: must be >= 1"),
    ("data-zero", "parallel.data=0", "parallel.data=0: must be -1 (auto) or >= 1"),
    ("devices-zero", "parallel.devices=0", "parallel.devices=0: must be -1 (all) or >= 1"),
    ("hp-not-dividing-heads", "parallel.hp=3", "ffn.num_heads=4 is not divisible by parallel.hp=3"),
    ("hp-chunks-zero", "parallel.hp_chunks=0", "parallel.hp_chunks=0: must be >= 1"),
    ("hp-chunks-not-dividing", "parallel.hp_chunks=3", "parallel.hp_chunks=3 does not divide the 2048 tokens of a "
     "device's micro-batch (train.micro_batch=16 x model.context=128)"),
    ("batch-zero", "train.global_batch=0", "train.global_batch=0, train.micro_batch=16: must be positive"),
    ("micro-not-dividing", "train.micro_batch=5", "train.global_batch=16 is not a multiple of train.micro_batch=5"),
    ("total-steps", "schedule.total_steps=0", "schedule.total_steps=0: must be positive"),
    ("warmup-negative", "schedule.warmup_steps=-1", "schedule.warmup_steps=-1, decay_steps=60: must be >= 0"),
    ("warmup-past-total", "schedule.warmup_steps=290", "schedule.warmup_steps=290 + decay_steps=60 exceeds "
     "schedule.total_steps=300"),
    ("final-lr-ratio", "schedule.final_lr_ratio=2", "schedule.final_lr_ratio=2.0: must be in [0, 1]"),
    ("lr-zero", "optimizer.lr=0", "optimizer.lr=0.0: must be positive"),
    ("lr-nan", "optimizer.lr=.nan", "optimizer.lr=nan: must be a finite number"),
    ("grad-clip", "optimizer.grad_clip=0", "optimizer.grad_clip=0.0: must be positive or null"),
    ("val-sequences", "data.val_sequences=-1", "data.val_sequences=-1: must be >= 0"),
    ("eval-every", "data.eval_every=-5", "data.eval_every=-5: must be >= 0 (0: no validation)"),
    ("checkpoint-every", "checkpoint.every=-1", "checkpoint.every=-1: must be >= 0 (0: no checkpoints)"),
    ("checkpoint-keep", "checkpoint.keep=0", "checkpoint.keep=0: must be >= 1"),
    ("log-every", "logging.log_every=0", "logging.log_every=0: must be >= 1"),
    ("loads-every", "logging.loads_every=-1", "logging.loads_every=-1: must be >= 0 (0: never)"),
    ("profile-start", "logging.profile_start=400", "logging.profile_start=400: must be a step of the run, 1 to "
     "schedule.total_steps=300"),
    ("profile-steps", "logging.profile_steps=0", "logging.profile_steps=0: must be >= 1"),
    ("peak-tflops", "logging.peak_tflops=-1", "logging.peak_tflops=-1.0: must be positive"),
    ("builtin-with-path", "data.path=data/x", "data.path='data/x' / data.val_path='' with data.source='builtin', which "
     "reads the built-in corpus and no files: set data.source=bin (prepared .bin shards) or hf (text), or empty them "
     "(--set data.path= --set data.val_path=) to train on the built-in corpus"),
    ("tokenizer-file-with-byte", "data.tokenizer_file=r50k_base.tiktoken", "data.tokenizer_file='r50k_base.tiktoken' "
     "with data.tokenizer='byte', which reads no file: the file is GPT-2's vocabulary (set data.tokenizer=gpt2)"),
    ("builtin-with-gpt2", "data.tokenizer=gpt2", "data.tokenizer='gpt2' with data.source='builtin': the built-in "
     "corpus is byte-level"),
    # settings that would poison the state: not finite, or out of their range
    ("lr-inf", "optimizer.lr=.inf", "optimizer.lr=inf: must be a finite number"),
    ("lr-negative", "optimizer.lr=-1e-3", "optimizer.lr=-0.001: must be positive"),
    ("init-std-nan", "model.init_std=.nan", "model.init_std=nan: must be a finite number"),
    ("final-lr-ratio-nan", "schedule.final_lr_ratio=.nan", "schedule.final_lr_ratio=nan: must be a finite number"),
    ("peak-tflops-inf", "logging.peak_tflops=-.inf", "logging.peak_tflops=-inf: must be a finite number"),
    ("beta1-one", "optimizer.beta1=1", "optimizer.beta1=1.0: must be in [0, 1)"),
    ("beta2-negative", "optimizer.beta2=-0.5", "optimizer.beta2=-0.5: must be in [0, 1)"),
    ("eps-zero", "optimizer.eps=0", "optimizer.eps=0.0: must be positive"),
    ("weight-decay-negative", "optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1: must be >= 0"),
    ("grad-clip-zero", "optimizer.grad_clip=0", "optimizer.grad_clip=0.0: must be positive or null"),
    ("init-std-large", "model.init_std=3", "model.init_std=3.0: must be in (0, 1]"),
    ("norm-eps-zero", "model.norm_eps=0", "model.norm_eps=0.0: must be positive"),
    ("rope-base-below-one", "model.rope_base=0.5", "model.rope_base=0.5: must be > 1"),
    ("balance-gamma-negative", "ffn.balance_gamma=-1", "ffn.balance_gamma=-1.0: must be >= 0"),
    ("on-damage", "checkpoint.on_damage=ignore", "checkpoint.on_damage='ignore': expected one of ['fallback', "
     "'stop']"),
]:
    CONFIG.add(_id, ConfigError, _fragment, calls(load_config, str(TINY), [_override]))
for _id, _overrides, _fragment in [
    ("hp-with-moe", ["parallel.hp=2"], "parallel.hp=2 needs ffn.kind=mh_latent_moe (got 'moe'); use parallel.ep"),
    ("ep-not-dividing-experts", ["parallel.ep=3"], "ffn.num_experts=16 is not divisible by parallel.ep=3"),
    ("hp-chunks-with-mlp", ["ffn.kind=mlp", "parallel.hp_chunks=2"], "parallel.hp_chunks=2 needs an MoE ffn.kind "
     "(got 'mlp', which exchanges nothing)"),
    ("dense-hidden", ["ffn.kind=mlp", "ffn.hidden=0"], "ffn.hidden=0: must be positive"),
    ("latent-dim", ["ffn.kind=latent_moe", "ffn.latent_dim=0"], "ffn.latent_dim=0: must be positive"),
    ("decay-shape-without-decay", ["schedule.decay_steps=0", "schedule.decay=cosine"],
     "schedule.decay='cosine', final_lr_ratio=0.0 shape the decay, and schedule.decay_steps=0 has none"),
    ("bin-without-path", ["data.source=bin"], "data.source='bin' needs data.path"),
    ("routing-tokens-kind", ["ffn.routing_tokens=separate"], "ffn.routing_tokens='separate' with ffn.kind='moe': "
     "separate routing sub-tokens are a Multi-Head LatentMoE option (ffn.kind=mh_latent_moe)"),
]:
    CONFIG.add(_id, ConfigError, _fragment, calls(load_config, str(TINY_MOE), _overrides))


# ============================================================================= config files

CONFIG_FILES = Section("config-file")
CONFIG_FILES.add("missing", ConfigError, "nope.yaml' does not exist", lambda tmp, mp: partial(load_config,
                                                                                             str(tmp / "nope.yaml")))
CONFIG_FILES.add("a-directory", ConfigError, "is a directory; expected a YAML file such as configs/",
                 lambda tmp, mp: partial(load_config, str(tmp)))


def _config_file(text: str | bytes):
    def provoke(tmp, mp):
        path = tmp / "c.yaml"
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
        return partial(load_config, str(path))
    return provoke


CONFIG_FILES.add("section-not-a-mapping", ConfigError, "model: expected a mapping, got 3", _config_file("model: 3\n"))
CONFIG_FILES.add("top-level-list", ConfigError, "config: expected a mapping, got ['a']", _config_file("- a\n"))
CONFIG_FILES.add("unknown-key", ConfigError, "unknown config key 'model.widht'", _config_file("model:\n  widht: 3\n"))
CONFIG_FILES.add("wrong-type", ConfigError, "train.seed='zero': expected an integer",
                 _config_file("train:\n  seed: zero\n"))
CONFIG_FILES.add("not-yaml", ConfigError, "c.yaml' is not valid YAML at line 2, column 1: expected ',' or ']', but "
                 "got '<stream end>'", _config_file("model: [1, 2\n"))
CONFIG_FILES.add("not-utf8", ConfigError, "c.yaml' is not UTF-8 text (byte 0: invalid start byte)",
                 _config_file(b"\xff\xfe"))
CONFIG_FILES.add("unknown-name", ConfigError, "config 'tiny_mo': no such file here, and no config of that name in ",
                 calls(load_config, "tiny_mo"))


# ============================================================================= every row, checked alike (catalogue.py)

@pytest.mark.parametrize("provoke, error, fragment", [*CONFIG, *CONFIG_FILES])
def test_refused_in_one_line_leaving_nothing_behind(provoke, error, fragment, tmp_path, monkeypatch):
    check_refused(provoke, error, fragment, tmp_path, monkeypatch)
