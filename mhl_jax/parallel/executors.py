"""Pick the MoE executor for a mesh: local on one device, else Head / Expert Parallel (or both) via shard_map."""

from __future__ import annotations

from jax.sharding import Mesh

from mhl_jax.config import Config
from mhl_jax.moe.core import LocalMoE, MoEExecutor
from mhl_jax.moe.plan import resolve_kernels
from mhl_jax.parallel.expert_parallel import ExpertParallelMoE
from mhl_jax.parallel.head_expert_parallel import HeadExpertParallelMoE
from mhl_jax.parallel.head_parallel import HeadParallelMoE


def make_executor(cfg: Config, mesh: Mesh) -> MoEExecutor:
    """The executor the model's MoE layers run through: Head Parallel for MH-LatentMoE (its heads split over `hp`),
    with Expert Parallel inside on a mesh with an `ep` axis, Expert Parallel for MoE / LatentMoE (experts over `ep`);
    on one device, or for the dense model, `LocalMoE`."""
    impl = resolve_kernels(cfg.ffn.kernels)
    if mesh.size == 1 or cfg.ffn.kind == "mlp":
        return LocalMoE(impl)
    # chunks overlap the hp / ep exchange; on a mesh where both are 1 (data parallelism only) they would only cost
    exchanges = any(mesh.shape.get(axis, 1) > 1 for axis in ("hp", "ep"))
    chunks = cfg.parallel.hp_chunks if exchanges else 1
    if cfg.ffn.kind == "mh_latent_moe" and "ep" in mesh.axis_names:
        return HeadExpertParallelMoE(mesh, impl, cfg.parallel.ep_impl, chunks=chunks)
    if cfg.ffn.kind == "mh_latent_moe":
        return HeadParallelMoE(mesh, impl, chunks=chunks)
    return ExpertParallelMoE(mesh, impl, cfg.parallel.ep_impl, chunks=chunks)
