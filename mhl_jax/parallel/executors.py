"""Pick the MoE executor for a mesh: local on one device, else Head/Expert Parallel via shard_map."""

from __future__ import annotations

from jax.sharding import Mesh

from mhl_jax.config import Config
from mhl_jax.moe.core import LocalMoE, MoEExecutor
from mhl_jax.moe.plan import resolve_kernels


def make_executor(cfg: Config, mesh: Mesh) -> MoEExecutor:
    impl = resolve_kernels(cfg.ffn.kernels)
    if mesh.size == 1 or cfg.ffn.kind == "mlp":
        return LocalMoE(impl)
    if cfg.ffn.kind == "mh_latent_moe":
        from mhl_jax.parallel.head_parallel import HeadParallelMoE

        return HeadParallelMoE(mesh, impl)
    from mhl_jax.parallel.expert_parallel import ExpertParallelMoE

    return ExpertParallelMoE(mesh, impl, cfg.parallel.ep_impl)
