"""What the optimizer's share of the train state would weigh under other settings: the memory check's advice."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from mhl_jax.config import Config
from mhl_jax.parallel.mesh import state_shardings
from mhl_jax.runtime.memory import per_device_bytes
from mhl_jax.train.optimizer import adam_moments


def shard_optimizer_saving(cfg: Config, mesh: Mesh, abstract) -> int:
    """Bytes per device that parallel.shard_optimizer would save this state (the device holding the most of the
    optimizer state, before and after; 0 when it is on already)."""
    if cfg.parallel.shard_optimizer:
        return 0
    on = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, shard_optimizer=True))
    split = state_shardings(on, mesh, abstract)["opt_state"]
    moved = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract["opt_state"], split)
    return per_device_bytes(abstract["opt_state"]) - per_device_bytes(moved)


def moment_dtype_saving(cfg: Config, abstract) -> int:
    """Bytes per device that optimizer.moment_dtype=bfloat16 would save this state (half of AdamW's fp32 moments on
    the device holding the most of them; 0 when they are bf16 already)."""
    if cfg.optimizer.moment_dtype != "float32":
        return 0
    return per_device_bytes(adam_moments(abstract["opt_state"])) // 2
