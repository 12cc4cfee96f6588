"""Cross-field checks of a config: each refusal names the keys and values that disagree."""

from __future__ import annotations

import dataclasses
import math

from mhl_jax.config.schema import (
    Config,
    ConfigError,
    FFNConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _finite_numbers(cfg: Config) -> None:
    """Every float setting a finite number: NaN fails every comparison, so the range checks below would refuse it
    for the wrong reason, and inf is no setting anyone means (optimizer.lr=.inf makes the parameters non-finite in
    one step)."""
    for part in dataclasses.fields(cfg):
        section = getattr(cfg, part.name)
        if not dataclasses.is_dataclass(section):
            continue
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            _require(not isinstance(value, float) or math.isfinite(value),
                     f"{part.name}.{f.name}={value}: must be a finite number")


def validate(cfg: Config) -> None:
    """Cross-field checks. Raises ConfigError naming the keys and values that disagree."""
    _finite_numbers(cfg)
    _check_model(cfg.model)
    _check_ffn(cfg.ffn, cfg.model)
    _check_parallel(cfg.parallel, cfg.ffn)
    _check_chunks(cfg)
    _check_batch_and_schedule(cfg.train, cfg.schedule)
    _check_optimizer(cfg.optimizer)
    _check_data_and_logging(cfg)


def _check_model(m: ModelConfig) -> None:
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "context"):
        _require(getattr(m, name) > 0, f"model.{name}={getattr(m, name)}: must be positive")
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim}: RoPE needs an even head dim")
    _require(0 < m.init_std <= 1, f"model.init_std={m.init_std}: must be in (0, 1] (the weights' standard deviation; "
                                  "0.02 is usual)")
    _require(m.norm_eps > 0, f"model.norm_eps={m.norm_eps}: must be positive")
    _require(m.rope_base > 1, f"model.rope_base={m.rope_base}: must be > 1 (RoPE's frequencies base^(-2i/d) fall "
                              "with i)")


def _check_ffn(f: FFNConfig, m: ModelConfig) -> None:
    _require(f.balance_gamma is None or f.balance_gamma >= 0,
             f"ffn.balance_gamma={f.balance_gamma}: must be >= 0 (or null: 50 x optimizer.lr)")
    if f.kind == "mlp":
        _require(f.hidden > 0, f"ffn.hidden={f.hidden}: must be positive")
    else:
        _require(0 <= f.stem_layers <= m.n_layers,
                 f"ffn.stem_layers={f.stem_layers}: must be in [0, model.n_layers={m.n_layers}]")
        _require(f.stem_layers == 0 or f.stem_hidden > 0, f"ffn.stem_hidden={f.stem_hidden}: must be positive")
        _require(f.num_experts >= 2, f"ffn.num_experts={f.num_experts}: need at least 2 experts")
        _require(f.top_k >= 2, f"ffn.top_k={f.top_k}: k must be >= 2 (softmax over one score is constant)")
        _require(f.top_k <= f.num_experts,
                 f"ffn.top_k={f.top_k} > ffn.num_experts={f.num_experts}: k cannot exceed Ne")
        _require(f.expert_hidden > 0, f"ffn.expert_hidden={f.expert_hidden}: must be positive")
    _require(f.routing_tokens == "shared" or f.kind == "mh_latent_moe",
             f"ffn.routing_tokens={f.routing_tokens!r} with ffn.kind={f.kind!r}: separate routing sub-tokens are a "
             "Multi-Head LatentMoE option (ffn.kind=mh_latent_moe)")
    if f.kind == "latent_moe":
        _require(f.latent_dim > 0, f"ffn.latent_dim={f.latent_dim}: must be positive")
    if f.kind == "mh_latent_moe":
        _require(f.num_heads > 0 and f.head_dim > 0,
                 f"ffn.num_heads={f.num_heads}, ffn.head_dim={f.head_dim}: must be positive")
        _require(f.num_heads * f.head_dim == f.latent_dim,
                 f"ffn.num_heads={f.num_heads} x ffn.head_dim={f.head_dim} = {f.num_heads * f.head_dim} does not "
                 f"match the projection width ffn.latent_dim={f.latent_dim} (W_in: d -> Nh*dh)")


def _check_parallel(p: ParallelConfig, f: FFNConfig) -> None:
    _require(p.hp >= 1 and p.ep >= 1, f"parallel.hp={p.hp}, parallel.ep={p.ep}: must be >= 1")
    _require(p.data == -1 or p.data >= 1, f"parallel.data={p.data}: must be -1 (auto) or >= 1")
    _require(p.devices == -1 or p.devices >= 1, f"parallel.devices={p.devices}: must be -1 (all) or >= 1")
    if p.hp > 1:
        _require(f.kind == "mh_latent_moe",
                 f"parallel.hp={p.hp} needs ffn.kind=mh_latent_moe (got {f.kind!r}); use parallel.ep")
        _require(f.num_heads % p.hp == 0,
                 f"ffn.num_heads={f.num_heads} is not divisible by parallel.hp={p.hp}")
    if p.ep > 1:
        # mh_latent_moe: each head's experts split over ep inside its hp group (parallel/head_expert_parallel.py)
        _require(f.kind in ("moe", "latent_moe", "mh_latent_moe"),
                 f"parallel.ep={p.ep} needs ffn.kind moe, latent_moe or mh_latent_moe (got {f.kind!r})")
        _require(f.num_experts % p.ep == 0,
                 f"ffn.num_experts={f.num_experts} is not divisible by parallel.ep={p.ep}")


def _check_chunks(cfg: Config) -> None:
    """parallel.hp_chunks splits each device's micro-batch tokens (train.micro_batch x model.context) into equal
    chunks, in the MoE layers' exchange."""
    chunks, tokens = cfg.parallel.hp_chunks, cfg.train.micro_batch * cfg.model.context
    _require(chunks >= 1, f"parallel.hp_chunks={chunks}: must be >= 1")
    if chunks > 1:
        _require(cfg.ffn.kind != "mlp", f"parallel.hp_chunks={chunks} needs an MoE ffn.kind (got 'mlp', which "
                 "exchanges nothing)")
        _require(tokens % chunks == 0, f"parallel.hp_chunks={chunks} does not divide the {tokens} tokens of a "
                 f"device's micro-batch (train.micro_batch={cfg.train.micro_batch} x model.context="
                 f"{cfg.model.context})")


def _check_batch_and_schedule(t: TrainConfig, s: ScheduleConfig) -> None:
    _require(t.global_batch > 0 and t.micro_batch > 0,
             f"train.global_batch={t.global_batch}, train.micro_batch={t.micro_batch}: must be positive")
    _require(t.global_batch % t.micro_batch == 0,
             f"train.global_batch={t.global_batch} is not a multiple of train.micro_batch={t.micro_batch}")
    _require(s.total_steps > 0, f"schedule.total_steps={s.total_steps}: must be positive")
    _require(s.warmup_steps >= 0 and s.decay_steps >= 0,
             f"schedule.warmup_steps={s.warmup_steps}, decay_steps={s.decay_steps}: must be >= 0")
    _require(s.warmup_steps + s.decay_steps <= s.total_steps,
             f"schedule.warmup_steps={s.warmup_steps} + decay_steps={s.decay_steps} "
             f"exceeds schedule.total_steps={s.total_steps}; lower them, or set them to null to take 8/15 and 2/15 of "
             "total_steps")
    _require(0.0 <= s.final_lr_ratio <= 1.0, f"schedule.final_lr_ratio={s.final_lr_ratio}: must be in [0, 1]")
    _require(s.decay_steps > 0 or (s.final_lr_ratio == 0.0 and s.decay == "linear"),
             f"schedule.decay={s.decay!r}, final_lr_ratio={s.final_lr_ratio} shape the decay, and "
             "schedule.decay_steps=0 has none; set decay_steps > 0 (or leave them at linear / 0)")


def _check_optimizer(o: OptimizerConfig) -> None:
    _require(o.lr > 0, f"optimizer.lr={o.lr}: must be positive")
    for name in ("beta1", "beta2"):
        _require(0 <= getattr(o, name) < 1, f"optimizer.{name}={getattr(o, name)}: must be in [0, 1)")
    _require(o.eps > 0, f"optimizer.eps={o.eps}: must be positive (Adam divides by sqrt(nu) + eps, and nu is 0 for "
                        "a parameter that never had a gradient)")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay}: must be >= 0")
    _require(o.grad_clip is None or o.grad_clip > 0, f"optimizer.grad_clip={o.grad_clip}: must be positive or null")


def _check_data_and_logging(cfg: Config) -> None:
    if cfg.data.source in ("bin", "hf"):
        _require(bool(cfg.data.path), f"data.source={cfg.data.source!r} needs data.path")
    _require(cfg.data.val_sequences >= 0, f"data.val_sequences={cfg.data.val_sequences}: must be >= 0")
    _require(cfg.data.eval_every >= 0, f"data.eval_every={cfg.data.eval_every}: must be >= 0 (0: no validation)")
    _require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0 (0: no checkpoints)")
    _require(cfg.data.source != "builtin" or not (cfg.data.path or cfg.data.val_path),
             f"data.path={cfg.data.path!r} / data.val_path={cfg.data.val_path!r} with data.source='builtin', which "
             "reads the built-in corpus and no files: set data.source=bin (prepared .bin shards) or hf (text), or "
             "empty them (--set data.path= --set data.val_path=) to train on the built-in corpus")
    _require(cfg.data.source != "builtin" or cfg.data.tokenizer == "byte",
             f"data.tokenizer={cfg.data.tokenizer!r} with data.source='builtin': the built-in corpus is byte-level "
             "(data.tokenizer: byte); gpt2 and bpe tokenize data.source='hf' text (and name how .bin shards were "
             "prepared)")
    _require(not cfg.data.tokenizer_file or cfg.data.tokenizer != "byte",
             f"data.tokenizer_file={cfg.data.tokenizer_file!r} with data.tokenizer={cfg.data.tokenizer!r}, which reads "
             "no file: the file is GPT-2's vocabulary (set data.tokenizer=gpt2) or another BPE's (data.tokenizer=bpe), "
             "or leave data.tokenizer_file empty")
    _require(cfg.data.tokenizer != "bpe" or cfg.data.tokenizer_file,
             "data.tokenizer='bpe' needs data.tokenizer_file=PATH, its .tiktoken rank file (e.g. the "
             "tokenizer.tiktoken `python -m mhl_jax.data.prepare --train-tokenizer` writes beside its shards)")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    _require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every}: must be >= 1")
    _require(cfg.logging.loads_every >= 0, f"logging.loads_every={cfg.logging.loads_every}: must be >= 0 (0: never)")
    _require(0 <= cfg.logging.profile_start <= cfg.schedule.total_steps,
             f"logging.profile_start={cfg.logging.profile_start}: must be a step of the run, 1 to schedule.total_steps="
             f"{cfg.schedule.total_steps} (or 0: no profile)")
    _require(cfg.logging.profile_steps >= 1, f"logging.profile_steps={cfg.logging.profile_steps}: must be >= 1")
    _require(cfg.logging.peak_tflops is None or cfg.logging.peak_tflops > 0,
             f"logging.peak_tflops={cfg.logging.peak_tflops}: must be positive (or null: the GPU's datasheet figure)")
