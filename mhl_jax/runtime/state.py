"""The train state (parameters, optimizer state, balancing biases, step, RNG key), created where it lives.

The state is built under jit with each leaf's sharding as the output sharding, so every device computes and holds
only its own shards: built eagerly, the whole model and its optimizer state would first sit on one device and then
be copied out (a 4.2B model's 51 GB of fp32 state on the first GPU, plus its shard). The values are bitwise those
of the eager build (`mhl_jax.model.init.normal_param`; tests/unit/test_memory.py).

Training and inference share this layout: a checkpoint is restored into the shapes and shardings `state_creator`
gives, and inference asks for the state without an optimizer (it reads only the parameters and biases).
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
    graphdef, create, abstract = state_creator(cfg, mesh, tx)
    return graphdef, create(), shardings_of(abstract)


def shardings_of(abstract):
    """The shardings of a state's leaves (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda a: a.sharding, abstract)


def state_creator(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation | None = None):
    """(graphdef, create, abstract): `create()` (jitted, no arguments) returns the step-0 state, whose leaves'
    shapes, dtypes and shardings `abstract` gives (ShapeDtypeStructs: to compile the step, or restore a checkpoint
    into, without creating the state). `tx` None: a state without `opt_state` (a model that is only read)."""
    executor = make_executor(cfg, mesh)
    graph = {}

    def create() -> dict:
        model = build_model(cfg, executor=executor, mesh=mesh)
        graph["def"], params, biases = nnx.split(model, nnx.Param, RouterBias)  # the graph is static: no tracers
        optimizer = {} if tx is None else {"opt_state": tx.init(params)}
        return {"params": params, **optimizer, "biases": biases, "step": jnp.int32(0),
                "rng": jax.random.key_data(jax.random.key(cfg.train.seed))}

    shapes = jax.eval_shape(create)
    shardings = state_shardings(cfg, mesh, shapes)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type),
                            shapes, shardings)
    return graph["def"], jax.jit(create, out_shardings=shardings), abstract
