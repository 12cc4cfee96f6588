"""The train state (parameters, optimizer state, balancing biases, step, RNG key), created where it lives.

The state is built under jit with each leaf's sharding as the output sharding, so every device computes and holds
only its own shards: built eagerly, the whole model and its optimizer state would first sit on one device and then
be copied out (a 4.2B model's 51 GB of fp32 state on the first GPU, plus its shard). The values are bitwise those
of the eager build (`mhl_jax.model.init.normal_param`; tests/test_memory.py).
"""

from __future__ import annotations

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


def init_state(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation):
    """(graphdef, state, shardings): the model's graph, the step-0 state placed with `shardings`, and those."""
    graphdef, create, shardings = state_creator(cfg, mesh, tx)
    return graphdef, create(), shardings


def state_creator(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation):
    """(graphdef, create, shardings): `create()` (jitted, no arguments) returns the step-0 state in `shardings`."""
    executor = make_executor(cfg, mesh)
    graph = {}

    def create() -> dict:
        model = build_model(cfg, executor=executor, mesh=mesh)
        graph["def"], params, biases = nnx.split(model, nnx.Param, RouterBias)  # the graph is static: no tracers
        return {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0),
                "rng": jax.random.key_data(jax.random.key(cfg.train.seed))}

    shardings = state_shardings(cfg, mesh, jax.eval_shape(create))
    return graph["def"], jax.jit(create, out_shardings=shardings), shardings
