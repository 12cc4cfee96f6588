"""Which implementation runs each MoE op, decided in one place from shapes, dtypes and the device.

`ffn.kernels` (auto | triton | reference) picks the family; within "triton" the expert ops take, per shape:

    experts  (dh <= MAX_TRITON_EXPERT_WIDTH)  the fused IO-aware kernels (kernels/triton/experts.py), whose forward
             and backward run as warp-specialised Gluon kernels (kernels/gluon/) in bf16 on Hopper where they take
             the shape; wider experts run the grouped-GEMM kernels (kernels/triton/grouped.py)
    router   (width <= MAX_TRITON_ROUTER_WIDTH) the Triton router (Gluon on Hopper); wider inputs route in JAX, on bf16
             GEMMs over a split W_r (`mhl_jax.moe.wide_router`)
    core     sub-tokens routed on themselves (MH-LatentMoE) on the fused experts: router, gates and experts under one
             custom_vjp whose backward sums the expert and router dX in one kernel (`mhl_jax.moe.gpu.fused`)

The bindings in `mhl_jax.moe.gpu` ask the functions below (`expert_fwd_kernel`, `expert_bwd_kernel`,
`router_casts_weights`, ...) instead of deciding themselves; `plan_for_config` reports the same choices for a run's
config, printed at its start and recorded in its metrics. The tiles each kernel runs with: `kernels.tuning`.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import asdict, dataclass
from types import ModuleType

import jax
import jax.numpy as jnp

from kernels.tuning import (
    ROUTER_CAST_MIN_TOKENS_PER_WEIGHT,
    ExpertsConfig,
    GroupedConfig,
    default_config,
    default_grouped_config,
    dgates_in_kernels,
    gluon_bwd_supported,
    gluon_dw_supported,
)
from mhl_jax.config import ConfigError


def import_jax_triton() -> ModuleType:
    """Import jax_triton and undo its side effect: its import sets TRITON_CACHE_DIR="" for the whole process, which
    later breaks torch.compile / FlexAttention ("Could not create or locate cache dir"). Puts back the previous
    value, else $MHL_TRITON_CACHE, else a fresh folder."""
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = before or os.environ.get("MHL_TRITON_CACHE") or tempfile.mkdtemp(
            prefix="triton-cache-")
    return jax_triton


def triton_available() -> bool:
    """True when JAX runs on a GPU and jax-triton imports."""
    if jax.default_backend() != "gpu":
        return False
    try:
        import_jax_triton()
    except Exception:  # jax-triton raises at import without a GPU jaxlib
        return False
    return True


@functools.cache
def hopper_sms() -> int:
    """The SM count of the first JAX device if it is a Hopper GPU (compute capability 9.x), else 0: the Gluon kernels
    run there only (and their persistent grids take one program per SM)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu" or not str(getattr(dev, "compute_capability", "")).startswith("9"):
        return 0
    return device_sms()


@functools.cache
def device_sms() -> int:
    """The SM count of the first JAX device (GPU; 132, an H100's or H200's, where JAX does not say): persistent grids
    take a few programs per SM."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def on_hopper() -> bool:
    return bool(hopper_sms())


# Widest input the Triton router takes (it keeps x and W_r blocks on chip); wider inputs route in JAX.
MAX_TRITON_ROUTER_WIDTH = 256

# Widest expert input the fused IO-aware expert kernels take: their tiles hold a (BLOCK_M, DH) X tile, a (BLOCK_M, DH)
# fp32 accumulator and (DH, BLOCK_E) weight tiles on chip, beyond a Hopper SM at DH = 1024. At dh = 256 they fit
# (8-warp tiles, `kernels.tuning.wide_config`) but the grouped-GEMM kernels, which write the hidden pre-activation to
# HBM with tiles independent of the width, are faster there; so the limit is 128.
MAX_TRITON_EXPERT_WIDTH = 128


def triton_expert_path(width: int) -> str:
    """'fused' (IO-aware, kernels/triton/experts.py) up to MAX_TRITON_EXPERT_WIDTH, else 'grouped'."""
    return "fused" if width <= MAX_TRITON_EXPERT_WIDTH else "grouped"


def resolve_kernels(choice: str) -> str:
    """'auto' -> 'triton' on a GPU with jax-triton, else 'reference'. 'triton' without one is an error.

    The pure-JAX experts copy the weights per 16-row block and run out of memory at wide experts of large models, so
    'auto' takes the Triton kernels wherever they run."""
    if choice == "reference":
        return "reference"
    if choice == "triton":
        if not triton_available():
            raise ConfigError("ffn.kernels='triton' needs a GPU JAX backend and jax-triton; "
                              f"backend is {jax.default_backend()!r}. Use ffn.kernels=auto or reference.")
        return "triton"
    if choice == "auto":
        return "triton" if triton_available() else "reference"
    raise ValueError(f"ffn.kernels={choice!r}: expected auto, triton or reference")


# ------------------------------------------------------------------------------------------- the MoE core

def fused_core(impl: str, x_route: jax.Array, x_expert: jax.Array) -> bool:
    """Whether `moe_heads` runs the fused Triton core (`mhl_jax.moe.gpu.fused`): sub-tokens routed on themselves,
    on the Triton router and the fused expert kernels."""
    return (impl == "triton" and x_route is x_expert and x_route.shape[2] <= MAX_TRITON_ROUTER_WIDTH
            and triton_expert_path(x_expert.shape[2]) == "fused")


def router_casts_weights(x_route: jax.Array, x_expert: jax.Array, w1: jax.Array, w2: jax.Array) -> bool:
    """Whether the router's kernel casts the fp32 expert weights to bf16 beside its selection, instead of a separate
    XLA cast (bf16 activations, fp32 weights, fused expert widths, and enough tokens to hide the cast:
    `kernels.tuning.ROUTER_CAST_MIN_TOKENS_PER_WEIGHT`). The gradients are bitwise the same either way. The router's
    binding decides the rest (its Gluon kernel casts; else XLA)."""
    n, _, dh = x_expert.shape
    return (x_expert.dtype == x_route.dtype == jnp.bfloat16 and w1.dtype == w2.dtype == jnp.float32
            and dh <= MAX_TRITON_EXPERT_WIDTH and n >= ROUTER_CAST_MIN_TOKENS_PER_WEIGHT * dh * w1.shape[-1])


# ------------------------------------------------------------------------------------------- expert kernels

def experts_config(num_slots: int, num_groups: int, dh: int, de: int, cfg: ExpertsConfig | None) -> ExpertsConfig:
    """The config the fused expert op runs: `cfg` or the tuned default, fitted to de."""
    return (cfg or default_config(num_slots, num_groups, dh, de)).fit(de)


def grouped_config(num_slots: int, num_groups: int, dh: int, de: int, cfg: GroupedConfig | None) -> GroupedConfig:
    """The config the grouped expert op runs: `cfg` or the tuned default, fitted to dh, de."""
    return (cfg or default_grouped_config(num_slots, num_groups, dh, de)).fit(dh, de)


def pack_method(pack_impl: str, backend: str) -> str:
    """The packing method of a config under a backend: the Triton packing needs jax-triton, so the emulated (CPU)
    path packs with the JAX sort instead (the same arrays)."""
    return "argsort" if pack_impl == "triton" and backend != "triton" else pack_impl


def packing_spec(x_shape: tuple[int, ...], k: int, w1_shape: tuple[int, ...], cfg=None,
                 backend: str = "triton") -> tuple[int, str]:
    """(row block, packing method) the Triton expert op packs with, for x (N, H, dh) and w1 (H, Ne, dh, de): the
    router then makes that packing once for both (`route_topk_triton(..., pack=)`)."""
    n, h, dh = x_shape
    _, ne, _, de = w1_shape
    if triton_expert_path(dh) == "grouped":
        c = grouped_config(n * h * k, h * ne, dh, de, cfg)
    else:
        c = experts_config(n * h * k, h * ne, dh, de, cfg)
    return c.pack_block, pack_method(c.pack_impl, backend)


def expert_fwd_kernel(cfg: ExpertsConfig, x_dtype, w_dtype, backend: str, cast_given: bool) -> str:
    """The fused experts' forward: "gluon-ws" (cfg.fwd_ws: the shapes it takes; bf16 on Hopper), "triton-cast" (the
    Triton forward converting fp32 weights as it loads them and storing them once per group for the backward, where
    no cast was made before: the router's or the train step's), "triton", or "emulate" (pure JAX, CPU tests)."""
    if backend != "triton":
        return "emulate"
    if cfg.fwd_ws and x_dtype == jnp.bfloat16 and on_hopper():
        return "gluon-ws"
    if not cast_given and w_dtype == jnp.float32 and x_dtype == jnp.bfloat16:
        return "triton-cast"
    return "triton"


def expert_bwd_kernel(cfg: ExpertsConfig, x_dtype, dh: int, de: int, backend: str) -> str:
    """The fused experts' backward: "gluon-ws" / "gluon-ws-xw" (the one warp-specialised kernel, xw: with its dX warp
    group; cfg.bwd_ws, bf16 on Hopper, gate gradients made in the kernels), "triton-fused" (dX fused into the dW
    kernel: dw.block_e == de), "triton-split-gluon-dw" (the Triton dX kernel, the Gluon dW kernel: cfg.dw_ws, bf16 on
    Hopper), "triton-split", or "emulate"."""
    if backend != "triton":
        return "emulate"
    gluon = x_dtype == jnp.bfloat16 and on_hopper()
    if gluon and cfg.bwd_ws and dgates_in_kernels(cfg, de) and gluon_bwd_supported(dh, de, cfg.pack_block):
        return "gluon-ws-xw" if cfg.bwd_xw else "gluon-ws"
    if cfg.dw.block_e == de:
        return "triton-fused"
    if gluon and cfg.dw_ws and gluon_dw_supported(dh, de, cfg.pack_block):
        return "triton-split-gluon-dw"
    return "triton-split"


def out_combine(backend: str, path: str) -> str:
    """The forward's combine of the expert output rows: the Triton kernel (`kernels.triton.combine`, a fixed-order
    sum) behind the fused kernels, XLA's gather-reduce behind the grouped ones (d_model-wide rows, where the kernel
    measured slower) and under emulation."""
    return "triton" if backend == "triton" and path == "fused" else "xla"


# ------------------------------------------------------------------------------------------- the run's plan

@dataclass(frozen=True)
class KernelPlan:
    """Which implementation runs each MoE op of a model, decided once from the config's shapes, the dtype and the
    device; printed at the start of a run and recorded in its metrics. `tokens`: the per-device micro-batch token
    count the choices were made for (they depend on it: packing block, tiles, the Gluon dX warp group)."""

    impl: str  # "triton" | "reference": the executor's implementation
    router: str  # "gluon" | "triton" | "split-bf16" (wider than the kernels take, bf16) | "reference"
    experts: str  # "fused" | "grouped" | "reference"
    experts_fwd: str = "none"  # `expert_fwd_kernel`'s names, "grouped", "reference"
    experts_bwd: str = "none"  # `expert_bwd_kernel`'s names, "grouped", "reference"
    combine: str = "none"  # forward combine "triton" | "xla"; "+dx-kernel": the fused core's dX combine
    packing: str = "none"  # "triton" | "argsort", "/" the packing block
    tokens: int = 0

    def summary(self) -> str:
        if self.impl != "triton":
            return f"kernels: {self.impl} (router {self.router}, experts {self.experts})"
        return (f"kernels: {self.impl} at {self.tokens} tokens per device (router {self.router}, experts "
                f"{self.experts}: fwd {self.experts_fwd}, bwd {self.experts_bwd}, combine {self.combine}, packing "
                f"{self.packing})")

    def as_dict(self) -> dict[str, str]:
        return {key: str(v) for key, v in asdict(self).items()}


def expert_width(cfg) -> int:
    """The width the experts of a config's MoE layers take (and route on): d_model (MoE), the latent (LatentMoE), the
    sub-token (MH-LatentMoE)."""
    f = cfg.ffn
    return {"moe": cfg.model.d_model, "latent_moe": f.latent_dim, "mh_latent_moe": f.head_dim}[f.kind]


def plan_for_config(cfg) -> KernelPlan:
    """The `KernelPlan` of a run's config (`mhl_jax.config.Config`) on this process's devices, for the per-device
    micro-batch: train.micro_batch x model.context tokens (each device's sequences; expert parallelism receives
    about as many routed slots as it sends, so that is roughly the slot count of its expert groups too), the heads a
    device holds (ffn.num_heads / parallel.hp) and its experts (ffn.num_experts / parallel.ep)."""
    f = cfg.ffn
    impl = resolve_kernels(f.kernels)
    if f.kind == "mlp":
        return KernelPlan(impl, "none", "none")
    if impl == "reference":
        return KernelPlan(impl, "reference", "reference", "reference", "reference", "xla", "jax")
    mh = f.kind == "mh_latent_moe"
    width = expert_width(cfg)
    heads = f.num_heads // cfg.parallel.hp if mh else 1
    ne, de, k = f.num_experts // cfg.parallel.ep, f.expert_hidden, f.top_k
    tokens = cfg.train.micro_batch * cfg.model.context
    hopper = on_hopper()
    x_dtype = jnp.dtype(cfg.model.compute_dtype)
    wide = "split-bf16" if x_dtype == jnp.bfloat16 else "reference"  # `mhl_jax.moe.wide_router`, or fp32's reference
    router = wide if width > MAX_TRITON_ROUTER_WIDTH else ("gluon" if hopper else "triton")
    slots, groups = tokens * heads * k, heads * ne
    path = triton_expert_path(width)
    if path == "grouped":
        c = grouped_config(slots, groups, width, de, None)
        return KernelPlan(impl, router, "grouped", "grouped", "grouped", out_combine("triton", path),
                          f"{c.pack_impl}/{c.pack_block}", tokens)
    c = experts_config(slots, groups, width, de, None)
    # the train step casts the fp32 expert weights once per step for bf16 compute (`moe_heads`' weights_cast), so
    # neither the router's kernel nor the converting forward casts them in a training step
    fwd = expert_fwd_kernel(c, x_dtype, jnp.float32, "triton", cast_given=x_dtype != jnp.float32)
    bwd = expert_bwd_kernel(c, x_dtype, width, de, "triton")
    combine = out_combine("triton", path) + ("+dx-kernel" if mh and width <= MAX_TRITON_ROUTER_WIDTH else "")
    return KernelPlan(impl, router, "fused", fwd, bwd, combine, f"{pack_method(c.pack_impl, 'triton')}/{c.pack_block}",
                      tokens)
