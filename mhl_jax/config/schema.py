"""The configuration's schema: one dataclass per concern, every field with its default and a comment.

Every field carries a comment (on its line, or on the lines just above it): `mhl_jax.config_reference` turns those
comments into docs/config.md, and a test keeps the two equal, so the comment is the one place a key is documented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


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
    # auto: triton on a GPU in bf16 (our flash attention kernels, bitwise repeatable), xla elsewhere (CPU, float32);
    # cudnn: its flash attention, ~3% faster fwd+bwd at the 2.2B shape on an H200, but its backward is not repeatable
    attention_impl: Literal["auto", "cudnn", "xla", "triton"] = "auto"
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
    # mh_latent_moe: each head routes on its own sub-token (shared, the paper's design), or on a second sub-token
    # projected for routing alone (separate: W_in gives 2 x Nh sub-tokens; the paper's ablation; Head Parallel then
    # exchanges both, twice the bytes)
    routing_tokens: Literal["shared", "separate"] = "shared"
    balance_gamma: Optional[float] = None  # step of the aux-loss-free balancing bias; null: 50 x optimizer.lr
    # auto: the kernel plan (mhl_jax/moe/plan.py) picks each MoE op's implementation from the shapes, dtype and
    # device: Gluon on Hopper, Triton on other NVIDIA GPUs, grouped GEMMs for expert widths above 128, pure JAX on
    # CPU; triton: the same, and an error without a GPU; reference: pure JAX everywhere (the numerical reference)
    kernels: Literal["auto", "triton", "reference"] = "auto"


@dataclass
class ParallelConfig:
    """The device mesh: data x hp (MH-LatentMoE), data x hp x ep (MH-LatentMoE with ep > 1) or data x ep (MoE,
    LatentMoE)."""

    devices: int = -1  # devices to use: -1 all visible, N the first N
    data: int = -1  # data-parallel size; -1 fills the devices left after hp/ep
    hp: int = 1  # head-parallel size (mh_latent_moe only); must divide num_heads
    # expert-parallel size; must divide num_experts. mh_latent_moe: each head's experts split over ep inside its hp
    # group (the mesh is data x hp x ep)
    ep: int = 1
    # EP exchange: auto = ragged on GPU, padded on CPU and where an ep group spans several processes
    ep_impl: Literal["auto", "ragged", "padded"] = "auto"
    # Run each MoE layer's exchange and experts in this many chunks of each device's tokens, so that XLA can send
    # chunk i + 1 while the router and experts work on chunk i (and return chunk i while chunk i + 1 computes). The
    # same results (to fp32 rounding); HP, HP x EP and EP meshes (ignored where hp = ep = 1); must divide
    # train.micro_batch x model.context. Each extra chunk moves the device's expert weights again: on 2 NVLink GPUs
    # C = 2 made the 2.2B step slower, hence 1; docs/parallel.md says when it is predicted to pay
    hp_chunks: int = 1
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
    # byte-level (always there), GPT-2 via tiktoken, or bpe: a byte-level BPE from data.tokenizer_file (e.g. one
    # `prepare --train-tokenizer` learned; its vocabulary is the file's ranks + 1, for end-of-text)
    tokenizer: Literal["byte", "gpt2", "bpe"] = "byte"
    # a .tiktoken rank file. gpt2: tiktoken's r50k_base.tiktoken, read instead of its download (empty: download);
    # bpe: required
    tokenizer_file: str = ""
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
    # write every MoE layer's per-(head, expert) routed-slot counts to run_dir/loads.jsonl every this many steps (and
    # at the last): what `python -m mhl_jax.compare --plot-load RUN` draws; 0: never
    loads_every: int = 100
    progress_bar: bool = True  # show a tqdm bar (when stderr is a terminal)
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
