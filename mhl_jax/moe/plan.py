"""Resolve the `ffn.kernels` switch (auto | triton | reference) to a concrete implementation."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from types import ModuleType

import jax

from mhl_jax.config import ConfigError


def import_jax_triton() -> ModuleType:
    """Import jax_triton and undo its side effect: its import sets TRITON_CACHE_DIR="" for the whole
    process (DESIGN §6), which later breaks torch.compile / FlexAttention ("Could not create or
    locate cache dir"). Puts back the previous value, else $MHL_TRITON_CACHE, else a fresh folder."""
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


# Widest input the Triton router takes (it keeps x and W_r blocks on chip); wider inputs route with the reference.
MAX_TRITON_ROUTER_WIDTH = 256

# Widest expert input the fused IO-aware expert kernels (kernels/triton/experts.py) take: their tiles hold a
# (BLOCK_M, DH) X tile, a (BLOCK_M, DH) fp32 accumulator and (DH, BLOCK_E) weight tiles on chip: at
# DH = 1024 and BLOCK_M = 128 that is 256 KB + 512 KB of registers, beyond a Hopper SM. (The 384 KB
# shared-memory failure of MoE at d_model 1024 seen on 2026-11-22 came back on 2026-11-23 with these
# kernels out of the way: it was the Triton router's, see MAX_TRITON_ROUTER_WIDTH in ops/router.py.)
# Wider experts run the grouped-GEMM kernels (kernels/triton/grouped.py: the hidden pre-activation is written
# to HBM, tiles independent of the width). At dh = 256 the fused kernels fit (kernels.triton.experts picks
# 8-warp tiles there) but lose: fwd+bwd 1.29 vs 0.73 ms (32768 tokens, Ne 64, de 256) and 0.60 vs 0.51
# ms (16384 tokens, Ne 16, de 128) on H100 (bench/wide_experts.py, 2026-11-23); so the limit is 128.
MAX_TRITON_EXPERT_WIDTH = 128


def triton_expert_path(width: int) -> str:
    """'fused' (IO-aware, kernels/triton/experts.py) up to MAX_TRITON_EXPERT_WIDTH, else 'grouped'."""
    return "fused" if width <= MAX_TRITON_EXPERT_WIDTH else "grouped"


def resolve_kernels(choice: str) -> str:
    """'auto' -> 'triton' on a GPU with jax-triton, else 'reference'. 'triton' without one is an error.

    'triton' runs the fused expert kernels up to MAX_TRITON_EXPERT_WIDTH and the grouped-GEMM kernels
    above (`triton_expert_path`). The grouped ones pass their GPU test (H100, dh 1024) and train MoE and
    LatentMoE 2.2B on one H100 (0.44 / 0.46 s per step, 2026-11-23); the pure-JAX experts at that width
    copy the weights per 16-row block and ran out of memory at 2.2B, so `auto` takes them too."""
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


@dataclass(frozen=True)
class KernelPlan:
    """Which implementation runs each MoE op of a model, decided once from the config's shapes, the dtype and the
    device; printed at the start of a run and recorded in its metrics."""

    impl: str  # "triton" | "reference": the executor's implementation
    router: str  # "gluon" | "triton" | "reference"
    experts: str  # "gluon" | "triton" | "grouped" | "reference"

    def summary(self) -> str:
        return f"kernels: {self.impl} (router {self.router}, experts {self.experts})"

    def as_dict(self) -> dict[str, str]:
        return {"impl": self.impl, "router": self.router, "experts": self.experts}


def plan_for_config(cfg) -> KernelPlan:
    """The `KernelPlan` of a run's config (`mhl_jax.config.Config`) on this process's devices."""
    f = cfg.ffn
    impl = resolve_kernels(f.kernels)
    if f.kind == "mlp":
        return KernelPlan(impl, "none", "none")
    width = {"moe": cfg.model.d_model, "latent_moe": f.latent_dim, "mh_latent_moe": f.head_dim}[f.kind]
    if impl == "reference":
        return KernelPlan(impl, "reference", "reference")
    from mhl_jax.moe.gpu.gluon import hopper_sms  # needs the GPU stack

    hopper = bool(hopper_sms())
    router = "reference" if width > MAX_TRITON_ROUTER_WIDTH else ("gluon" if hopper else "triton")
    experts = "grouped" if triton_expert_path(width) == "grouped" else ("gluon" if hopper else "triton")
    return KernelPlan(impl, router, experts)
