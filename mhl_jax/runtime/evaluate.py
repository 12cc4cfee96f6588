"""The validation loss: the train loop's evaluation and `python -m mhl_jax.infer evaluate` compute it alike (the
same sequences, batches and step), so a checkpoint evaluated afterwards gives the `val_loss` its run recorded."""

from __future__ import annotations

import math
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mhl_jax.config import ConfigError
from mhl_jax.data import load_val_sequences
from mhl_jax.parallel.mesh import batch_spec
from mhl_jax.runtime.distributed import global_array
from mhl_jax.runtime.restore import Loaded


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    def eval_step(params: nnx.State, biases: nnx.State, tokens: jax.Array) -> jax.Array:
        """tokens: (B, T + 1) -> summed NLL over the B*T predicted tokens (fp32)."""
        loss, _ = nnx.merge(graphdef, params, biases).loss(tokens[:, :-1], tokens[:, 1:])
        return loss * tokens.shape[0] * (tokens.shape[1] - 1)

    return eval_step


def eval_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """An evaluation batch's sharding: a train batch's without its micro-batch axis."""
    return NamedSharding(mesh, P(*batch_spec(mesh)[1:]))


def evaluate(eval_fn, state: dict, val: np.ndarray, batch: int, sharding) -> float:
    """Mean NLL over the fixed validation sequences (the last partial batch is dropped; `train` has refused fewer
    sequences than one batch)."""
    total, count = 0.0, 0
    for i in range(0, len(val) - batch + 1, batch):
        tokens = global_array(val[i:i + batch], sharding)
        total += float(eval_fn(state["params"], state["biases"], tokens))
        count += batch * (val.shape[1] - 1)
    return total / count


def evaluate_run(loaded: Loaded) -> dict:
    """The validation loss of `loaded` over its config's validation sequences, as the train loop computes it."""
    cfg, mesh = loaded.cfg, loaded.mesh
    t = cfg.model.context
    if cfg.data.val_sequences <= 0:
        raise ConfigError(f"data.val_sequences={cfg.data.val_sequences}: nothing to evaluate; set it > 0")
    val = load_val_sequences(cfg.data, seq_len=t, vocab_size=cfg.model.vocab_size)
    batch = cfg.train.micro_batch * mesh.size  # the train loop's evaluation batch
    if len(val) < batch:  # (the train loop refuses this; here a smaller batch does, and the result says so)
        batch = len(val) // mesh.size * mesh.size
        if batch == 0:
            raise ConfigError(f"data.val_sequences={len(val)} is fewer than the {mesh.size} devices of the mesh")
    used = len(val) // batch * batch
    eval_fn = jax.jit(make_eval_step(loaded.graphdef), compiler_options=loaded.compiler_options or None)
    nll = evaluate(eval_fn, {"params": loaded.params, "biases": loaded.biases}, val, batch, eval_sharding(mesh))
    return {"step": loaded.step, "val_loss": nll, "val_ppl": math.exp(nll), "sequences": used,
            "sequences_left_out": len(val) - used, "tokens": used * t, "context": t, "batch": batch}
