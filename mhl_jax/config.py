"""Typed configuration: one dataclass per concern, YAML files, `--set a.b=value` overrides.

Every field carries a comment (on its line, or on the lines just above it): `mhl_jax.config_reference` turns those
comments into docs/config.md, and a test keeps the two equal, so the comment is the one place a key is documented.
`load_config` reads a YAML file, applies overrides, checks types and cross-field consistency, and raises
`ConfigError` naming the offending key and value.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent with another."""


@dataclass
class ModelConfig:
    """The transformer around the FFNs: widths, depth, attention and the compute dtype."""

    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128
    d_model: int = 1024  # residual stream width d
    n_layers: int = 12  # transformer blocks L
    n_heads: int = 8  # attention heads
    head_dim: int = 128  # attention head dimension
    context: int = 2048  # training sequence length T
    rope_base: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    init_std: float = 0.02  # N(0, init_std) for every weight; residual-writing ones also / sqrt(2L)
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # matmul dtype (weights stay fp32)
    # auto: pallas on GPU (Pallas flash attention, bitwise repeatable), xla elsewhere; cudnn: ~5% faster per 2.2B step
    # on an H100, but its backward is not repeatable at 2048 tokens
    attention_impl: Literal["auto", "cudnn", "xla", "pallas"] = "auto"
    # activation checkpointing: "block" keeps only each block's input for the backward and recomputes the rest of
    # the block there (less activation memory, one more forward pass); "none" keeps what autodiff keeps
    remat: Literal["none", "block"] = "none"


@dataclass
class FFNConfig:
    """The feed-forward layers: a dense MLP, or one of the three MoE variants and its expert shapes."""

    kind: Literal["mlp", "moe", "latent_moe", "mh_latent_moe"] = "mh_latent_moe"  # FFN variant
    hidden: int = 4096  # hidden width of the dense MLP (kind=mlp)
    stem_layers: int = 2  # first layers that use a dense MLP in MoE models (DeepSeek-V3 practice)
    stem_hidden: int = 4096  # hidden width of those stem MLPs (4d)
    num_experts: int = 384  # experts Ne (per head for mh_latent_moe)
    top_k: int = 4  # experts activated per token (per sub-token for mh_latent_moe), k >= 2
    expert_hidden: int = 256  # hidden width de of each expert
    num_heads: int = 8  # sub-tokens per token Nh (mh_latent_moe)
    head_dim: int = 128  # sub-token width dh (mh_latent_moe)
    latent_dim: int = 1024  # latent width l: latent_moe's d -> l projection; mh_latent_moe's W_in output (= Nh*dh)
    balance_gamma: Optional[float] = None  # step of the aux-loss-free balancing bias; null: 50 x optimizer.lr
    # auto: the kernel plan (mhl_jax/moe/plan.py) picks each MoE op's implementation from the shapes, dtype and
    # device: Gluon on Hopper, Triton on other NVIDIA GPUs, grouped GEMMs for expert widths above 128, pure JAX on
    # CPU; triton: the same, and an error without a GPU; reference: pure JAX everywhere (the numerical reference)
    kernels: Literal["auto", "triton", "reference"] = "auto"


@dataclass
class ParallelConfig:
    """The device mesh: data x hp (MH-LatentMoE) or data x ep (MoE, LatentMoE)."""

    devices: int = -1  # devices to use: -1 all visible, N the first N
    data: int = -1  # data-parallel size; -1 fills the devices left after hp/ep
    hp: int = 1  # head-parallel size (mh_latent_moe only); must divide num_heads
    ep: int = 1  # expert-parallel size (moe, latent_moe only); must divide num_experts
    # EP exchange: auto = ragged on GPU, padded on CPU and where an ep group spans several processes
    ep_impl: Literal["auto", "ragged", "padded"] = "auto"
    # Split AdamW's moments (2/3 of the fp32 state) over the devices that hold copies of their parameter (ZeRO stage
    # 1): every device updates its slice, and XLA exchanges the gradients and updated parameters for it. Saves the
    # moments' bytes x (1 - 1 / copies) per device; mhl_jax/parallel/mesh.py (spread_over_copies).
    shard_optimizer: bool = False


@dataclass
class OptimizerConfig:
    """AdamW with global grad-norm clipping."""

    lr: float = 5e-4  # peak learning rate
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay, applied to matrices only (not norms)
    grad_clip: Optional[float] = 1.0  # global grad-norm clip; None disables it
    # dtype AdamW's moments are stored in between steps (the update itself runs in fp32): bfloat16 halves their
    # memory (8 -> 4 bytes per parameter for the two), rounding them to bf16 after every step
    moment_dtype: Literal["float32", "bfloat16"] = "float32"


@dataclass
class ScheduleConfig:
    """The learning-rate schedule: linear warmup, a constant peak, a decay over the last steps."""

    # linear warmup from 0 to the peak LR; null: 8/15 of total_steps (the paper's 8000 of 15000), less if an explicit
    # decay_steps leaves fewer
    warmup_steps: Optional[int] = None
    # decay to final_lr_ratio x the peak over the last steps; null: 2/15 of total_steps (the paper's 2000 of 15000),
    # less if an explicit warmup_steps leaves fewer
    decay_steps: Optional[int] = None
    total_steps: int = 15000  # optimizer steps in the run (10B tokens / 0.66M per step ~ 15k)
    # the decay's shape (linear: the paper's trapezoid); a classic cosine schedule is decay=cosine with
    # decay_steps = total_steps - warmup_steps
    decay: Literal["linear", "cosine"] = "linear"
    # where the decay heads, as a fraction of the peak: the LR at step total_steps (the last step trains at
    # final + (1 - final) / decay_steps of the peak, as the trapezoid's last step at 1 / decay_steps)
    final_lr_ratio: float = 0.0


@dataclass
class TrainConfig:
    """Batch sizes, the seed, and how the train step is compiled."""

    seed: int = 0  # seed for init, data order and everything else
    global_batch: int = 320  # sequences per optimizer step (320 x 2048 = 0.66M tokens)
    micro_batch: int = 8  # sequences per device per forward/backward (grad accumulation fills the rest)
    # GPU: also compile the step with XLA's xla_gpu_exclude_nondeterministic_ops. Off by default: the step has no
    # float atomics without it (docs/design.md, Determinism), and the switch changes XLA's fusions, which moved the
    # fp32 gradients of a small MH-LatentMoE by 1.8e-5 relative on an H200; it cannot combine with cuDNN attention
    xla_deterministic_ops: bool = False
    # GPU: XLA's autotuning results kept with the run, so a resumed process compiles the kernels the first one
    # picked and the losses continue bitwise ("auto": <run_dir>/xla_autotune.txt, and a cache shared by fresh runs
    # of one config on one GPU model, so they too give equal losses; "": off, every process tunes afresh; else a
    # file path). mhl_jax/runtime/autotune.py.
    xla_autotune_file: str = "auto"


@dataclass
class DataConfig:
    """Where tokens come from, how validation is held out, and the input pipeline's workers."""

    source: Literal["builtin", "bin", "hf"] = "builtin"  # builtin corpus, .bin shards, or HF datasets
    path: str = ""  # bin: directory or glob of train shards; hf: dataset name or local data files
    val_path: str = ""  # bin: validation shard(s); hf: empty means hold out from the train split
    tokenizer: Literal["byte", "gpt2"] = "byte"  # byte-level (always there) or GPT-2 via tiktoken
    text_column: str = "text"  # hf: column holding the text
    hf_split: str = "train"  # hf: split to read
    val_sequences: int = 64  # fixed held-out sequences used for validation perplexity
    eval_every: int = 200  # validation every this many steps (and at the end); 0 disables
    worker_count: int = 0  # Grain worker processes (0: in-process)
    prefetch: int = 4  # batches to prefetch
    hf_config: str = ""  # hf: dataset configuration name (e.g. "sample-10BT"); empty for none
    val_fraction: float = 0.05  # builtin, and hf without val_path: tail fraction of tokens held out
    verify_tokens: bool = True  # bin: check every shard's max token id < model.vocab_size when opened
    read_threads: int = 4  # threads reading sequences in each process (Grain ReadOptions.num_threads)


@dataclass
class CheckpointConfig:
    """Orbax checkpoints in <run_dir>/checkpoints."""

    every: int = 500  # save every this many steps (and at the end); 0 disables saving
    keep: int = 3  # keep the last N checkpoints
    async_save: bool = True  # write checkpoints in the background
    resume: str = ""  # explicit checkpoint to resume from; empty: latest in the run directory
    # a resume whose latest checkpoint is damaged (unreadable, incomplete, failing its checksums or not finite):
    # fallback moves it aside (renamed STEP.damaged, never deleted) and resumes the newest intact one, with a warning;
    # stop refuses it (status 2). A damaged checkpoint named by --resume / checkpoint.resume is always refused
    on_damage: Literal["fallback", "stop"] = "fallback"


@dataclass
class LoggingConfig:
    """The run directory, the progress line, TensorBoard and profiler traces."""

    run_dir: str = "runs/default"  # metrics.jsonl, checkpoints and config copy go here
    log_every: int = 10  # print a progress line every this many steps
    progress_bar: bool = True  # show a tqdm bar
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None: known GPUs' bf16 datasheet figure
    profile_start: int = 0  # > 0: a JAX profiler trace of steps profile_start .. + profile_steps - 1 in run_dir/profile
    profile_steps: int = 3  # how many steps the trace covers (TensorBoard's profile plugin or Perfetto reads it)
    tensorboard: bool = False  # also write every step's metrics as TensorBoard scalars to run_dir/tensorboard


@dataclass
class Config:
    """A whole run: one section per concern, and the run's name."""

    name: str = "default"  # run name (free text)
    model: ModelConfig = field(default_factory=ModelConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def balance_gamma(self) -> float:
        g = self.ffn.balance_gamma
        return 50.0 * self.optimizer.lr if g is None else g


# ----------------------------------------------------------------------------- parsing


def _check_type(path: str, value: Any, tp: Any) -> Any:
    """Return `value` converted to `tp` where that is lossless, else raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}={value!r}: expected one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(path, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}={value!r}: wrong type")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected a bool (true/false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:  # YAML's null (e.g. --set data.path=null): the empty string is this field's "none"
            raise ConfigError(f"{path}=None: expected a string; for none give the empty one (--set {path}=)")
        raise ConfigError(f"{path}={value!r}: expected a string")
    raise ConfigError(f"{path}: unsupported field type {tp}")


def _merge(obj: Any, data: dict, prefix: str) -> Any:
    """Return a copy of dataclass `obj` with the (nested) dict `data` applied, type-checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    updates = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {path!r}; known keys here: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            updates[key] = _merge(current, value, path + ".")
        else:
            updates[key] = _check_type(path, value, hints[key])
    return dataclasses.replace(obj, **updates)


def parse_override(text: str) -> dict:
    """'a.b=value' -> {'a': {'b': value}} with value parsed as YAML (so 1e-3, true, null work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected the form key.sub=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key {key!r}")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError as e:
        reason = str(e).splitlines()[0]
        raise ConfigError(f"override {text!r}: the value {raw!r} is not valid YAML ({reason}); quote it or fix the "
                          "brackets") from e
    out: dict = {}
    cur = out
    parts = key.split(".")
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value
    return out


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's floats: an unquoted 5e-4 or 1E3 is a number (YAML 1.1, PyYAML's default, reads them as
    strings); a quoted "1.0" stays a string."""


class _Dumper(yaml.SafeDumper):
    """Writes what `_Loader` reads back the same: a string such as "1e3" is quoted."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."))


# The repository's configs/ folder, where a config named without a path is looked up (an editable install keeps
# the package inside the repository).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def find_config(spec: str) -> Path:
    """The YAML file `spec` names: a path (from the working directory), else a config of CONFIG_DIR by name, with or
    without `.yaml` and `configs/` (`tiny_moe`, `tiny_moe.yaml`, `configs/tiny_moe.yaml`) from any directory."""
    p = Path(spec).expanduser()
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; expected a YAML file such as "
                          "configs/tiny_mh_latent_moe.yaml")
    if p.is_file():
        return p
    if not p.is_absolute() and p.parent in (Path("."), Path("configs")):
        named = CONFIG_DIR / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
        if named.is_file():
            return named
        names = sorted(f.stem for f in CONFIG_DIR.glob("*.yaml"))
        have = f"configs: {', '.join(names)}" if names else "none there"
        raise ConfigError(f"config {spec!r}: no such file here, and no config of that name in {CONFIG_DIR} ({have})")
    raise ConfigError(f"config file {str(p)!r} does not exist")


def scale_schedule(s: ScheduleConfig) -> ScheduleConfig:
    """`s` with warmup_steps and decay_steps that are null set from total_steps: 8/15 and 2/15 of it (the paper's
    8000 and 2000 of 15000), each at most what an explicit other leaves. Explicit values stay as they are (`validate`
    refuses them if they do not fit)."""
    warmup, decay, total = s.warmup_steps, s.decay_steps, s.total_steps
    if warmup is None:
        warmup = max(0, min(total * 8 // 15, total - (decay or 0)))
    if decay is None:
        decay = max(0, min(total * 2 // 15, total - warmup))
    return dataclasses.replace(s, warmup_steps=warmup, decay_steps=decay)


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Build a Config: defaults, then the YAML file at `path` (`find_config`), then each `a.b=value` override; a null
    warmup or decay scales with total_steps (`scale_schedule`)."""
    cfg = Config()
    if path is not None:
        p = find_config(path)
        try:
            data = yaml.load(p.read_text(), Loader=_Loader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        cfg = _merge(cfg, data, "")
    for text in overrides:
        cfg = _merge(cfg, parse_override(text), "")
    cfg = dataclasses.replace(cfg, schedule=scale_schedule(cfg.schedule))
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    """The config as YAML that `load_config` reads back to the same Config (a run's config.yaml)."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False)


# ----------------------------------------------------------------------------- validation


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
    m, f, p, t, s = cfg.model, cfg.ffn, cfg.parallel, cfg.train, cfg.schedule
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "context"):
        _require(getattr(m, name) > 0, f"model.{name}={getattr(m, name)}: must be positive")
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim}: RoPE needs an even head dim")
    _require(0 < m.init_std <= 1, f"model.init_std={m.init_std}: must be in (0, 1] (the weights' standard deviation; "
                                  "0.02 is usual)")
    _require(m.norm_eps > 0, f"model.norm_eps={m.norm_eps}: must be positive")
    _require(m.rope_base > 1, f"model.rope_base={m.rope_base}: must be > 1 (RoPE's frequencies base^(-2i/d) fall "
                              "with i)")
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
    if f.kind == "latent_moe":
        _require(f.latent_dim > 0, f"ffn.latent_dim={f.latent_dim}: must be positive")
    if f.kind == "mh_latent_moe":
        _require(f.num_heads > 0 and f.head_dim > 0,
                 f"ffn.num_heads={f.num_heads}, ffn.head_dim={f.head_dim}: must be positive")
        _require(f.num_heads * f.head_dim == f.latent_dim,
                 f"ffn.num_heads={f.num_heads} x ffn.head_dim={f.head_dim} = {f.num_heads * f.head_dim} does not "
                 f"match the projection width ffn.latent_dim={f.latent_dim} (W_in: d -> Nh*dh)")
    _require(p.hp >= 1 and p.ep >= 1, f"parallel.hp={p.hp}, parallel.ep={p.ep}: must be >= 1")
    _require(p.data == -1 or p.data >= 1, f"parallel.data={p.data}: must be -1 (auto) or >= 1")
    _require(p.devices == -1 or p.devices >= 1, f"parallel.devices={p.devices}: must be -1 (all) or >= 1")
    if p.hp > 1:
        _require(f.kind == "mh_latent_moe",
                 f"parallel.hp={p.hp} needs ffn.kind=mh_latent_moe (got {f.kind!r}); use parallel.ep")
        _require(f.num_heads % p.hp == 0,
                 f"ffn.num_heads={f.num_heads} is not divisible by parallel.hp={p.hp}")
    if p.ep > 1:
        _require(f.kind in ("moe", "latent_moe"),
                 f"parallel.ep={p.ep} needs ffn.kind moe or latent_moe (got {f.kind!r})")
        _require(f.num_experts % p.ep == 0,
                 f"ffn.num_experts={f.num_experts} is not divisible by parallel.ep={p.ep}")
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
    o = cfg.optimizer
    _require(o.lr > 0, f"optimizer.lr={o.lr}: must be positive")
    for name in ("beta1", "beta2"):
        _require(0 <= getattr(o, name) < 1, f"optimizer.{name}={getattr(o, name)}: must be in [0, 1)")
    _require(o.eps > 0, f"optimizer.eps={o.eps}: must be positive (Adam divides by sqrt(nu) + eps, and nu is 0 for "
                        "a parameter that never had a gradient)")
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay}: must be >= 0")
    _require(o.grad_clip is None or o.grad_clip > 0, f"optimizer.grad_clip={o.grad_clip}: must be positive or null")
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
             "(data.tokenizer: byte); gpt2 tokenizes data.source='hf' text (and names how .bin shards were prepared)")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    _require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every}: must be >= 1")
    _require(0 <= cfg.logging.profile_start <= cfg.schedule.total_steps,
             f"logging.profile_start={cfg.logging.profile_start}: must be a step of the run, 1 to schedule.total_steps="
             f"{cfg.schedule.total_steps} (or 0: no profile)")
    _require(cfg.logging.profile_steps >= 1, f"logging.profile_steps={cfg.logging.profile_steps}: must be >= 1")
    _require(cfg.logging.peak_tflops is None or cfg.logging.peak_tflops > 0,
             f"logging.peak_tflops={cfg.logging.peak_tflops}: must be positive (or null: the GPU's datasheet figure)")

