"""The train state (parameters, optimizer state, balancing biases, step, RNG key), created where it lives.

The state is built under jit with each leaf's sharding as the output sharding, so every device computes and holds
only its own shards: built eagerly, the whole model and its optimizer state would first sit on one device and then
be copied out (a 4.2B model's 51 GB of fp32 state on the first GPU, plus its shard). The values are bitwise those
of the eager build (`mhl_jax.model.init.normal_param`; tests/unit/test_memory.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from mhl_jax.config import Config
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import state_shardings
from mhl_jax.runtime.memory import per_device_bytes
from mhl_jax.train.optimizer import adam_moments


def init_state(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation):
    """(graphdef, state, shardings): the model's graph, the step-0 state placed with `shardings`, and those."""
    graphdef, create, abstract = state_creator(cfg, mesh, tx)
    return graphdef, create(), shardings_of(abstract)


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


def shardings_of(abstract):
    """The shardings of a state's leaves (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda a: a.sharding, abstract)


def state_creator(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation):
    """(graphdef, create, abstract): `create()` (jitted, no arguments) returns the step-0 state, whose leaves'
    shapes, dtypes and shardings `abstract` gives (ShapeDtypeStructs: to compile the step, or restore a checkpoint
    into, without creating the state)."""
    executor = make_executor(cfg, mesh)
    graph = {}

    def create() -> dict:
        model = build_model(cfg, executor=executor, mesh=mesh)
        graph["def"], params, biases = nnx.split(model, nnx.Param, RouterBias)  # the graph is static: no tracers
        return {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0),
                "rng": jax.random.key_data(jax.random.key(cfg.train.seed))}

    shapes = jax.eval_shape(create)
    shardings = state_shardings(cfg, mesh, shapes)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type),
                            shapes, shardings)
    return graph["def"], jax.jit(create, out_shardings=shardings), abstract
