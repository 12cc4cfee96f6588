"""The jitted train step: gradient accumulation, AdamW update, balancing-bias update, metrics.

State is a plain dict pytree {params, opt_state, biases, step} so that it checkpoints as is.
`batch` is (accum, micro_global, T + 1) int32: `accum` micro-batches, each split over the data axis.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mhl_jax.model.balancing import load_stats, update_bias
from mhl_jax.model.gpt import cross_entropy

# XLA options for the compiled train step. `while-loop-all-reduce-code-motion` moves the data-parallel
# all-reduce of a gradient out of the micro-batch loop and accumulates locally instead; on scatter-based
# accumulations (the embedding's gradient is a scatter-add) it miscompiles: contributions of some
# micro-batches on some devices are dropped (openxla/xla#49143, fixed after jaxlib 0.11.2). CPU XLA
# does not run the pass (our 8-host-device tests agree); the GPU pipeline does, and 1 vs 2 H200s
# drifted 0.1% after one step of bench/train_2gpu.py with only the `embed` leaf off (bench/NOTES.md):
# the pattern of that bug (fix not yet confirmed on a GPU: `bench/train_2gpu.py --with-code-motion`).
# Disabled, the all-reduce stays in the loop: one per micro-batch, as without gradient accumulation.
TRAIN_STEP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-all-reduce-code-motion"}
# train.deterministic (default): XLA GPU lowers a float scatter-add with repeated indices to atomics, so
# two runs of the same step differed in the last bits by step 2 (H100, 2026-11-23, bench/determinism.py).
# The embedding and the pure-JAX expert path's gathers have their own scatter-free backward
# (mhl_jax/ops/embed.py); this option makes XLA use deterministic forms for anything else (a sorted
# scatter), keeping autotuning: bitwise-equal losses within and across processes there. It is left
# off with cuDNN attention: XLA then failed to compile the 2.2B models (IndexError: raw_hash_map::at,
# H100, 2026-11-23; the error of the earlier multi-GPU runs under --xla_gpu_deterministic_ops).
# Ignored on CPU.
DETERMINISTIC_OPTIONS = {"xla_gpu_exclude_nondeterministic_ops": True}


def train_step_compiler_options(deterministic: bool = True, cudnn_attention: bool = False) -> dict:
    """XLA options `jit_train_step` compiles with (module comments above)."""
    extra = DETERMINISTIC_OPTIONS if deterministic and not cudnn_attention else {}
    return {**TRAIN_STEP_COMPILER_OPTIONS, **extra}


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, biases: nnx.State, tokens: jax.Array):
    """tokens: (B, T + 1) int32 -> (mean NLL fp32, {layer: (H, Ne) int32 loads})."""
    model = nnx.merge(graphdef, params, biases)
    logits, loads = model(tokens[:, :-1])
    return cross_entropy(logits, tokens[:, 1:]), loads


def apply_balancing(biases: nnx.State, loads: dict[int, jax.Array], gamma: float) -> nnx.State:
    """Update each MoE layer's bias (path blocks/<layer>/ffn/experts/bias) from its global loads."""

    def upd(path, b):
        return update_bias(b, loads[path[1].key], gamma)

    return jax.tree_util.tree_map_with_path(upd, biases)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, gamma: float,
                    schedule: Callable) -> Callable:
    grad_fn = jax.value_and_grad(lambda p, b, t: loss_fn(graphdef, p, b, t), has_aux=True)

    def train_step(state: dict[str, Any], batch: jax.Array):
        params, biases = state["params"], state["biases"]

        def micro(carry, tokens):
            gsum, lsum, loadsum = carry
            (loss, loads), grads = grad_fn(params, biases, tokens)
            gsum = jax.tree.map(jnp.add, gsum, grads)
            loadsum = {i: loadsum[i] + loads[i] for i in loadsum}
            return (gsum, lsum + loss, loadsum), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        _, load_shapes = jax.eval_shape(lambda: loss_fn(graphdef, params, biases, batch[0]))
        load0 = {i: jnp.zeros(s.shape, s.dtype) for i, s in load_shapes.items()}
        (gsum, lsum, loads), _ = jax.lax.scan(micro, (zeros, jnp.float32(0.0), load0), batch)
        accum = batch.shape[0]
        grads = jax.tree.map(lambda g: g / accum, gsum)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {
            **state,  # carried unchanged: the rng key data
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "biases": apply_balancing(biases, loads, gamma),
            "step": state["step"] + 1,
        }
        metrics = {"loss": lsum / accum, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        for i, counts in loads.items():
            metrics[f"load_max/{i}"], metrics[f"load_min/{i}"] = load_stats(counts)
        return new_state, metrics

    return train_step


def jit_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, gamma: float, schedule: Callable,
                   state_shardings, batch_sharding, donate: bool = False, deterministic: bool = True,
                   cudnn_attention: bool = False, compiler_options: dict | None = None) -> Callable:
    """`make_train_step` under jit with the given shardings and `train_step_compiler_options`:
    the one way train.py and the benchmarks compile it. donate: donate the state (train.py; its buffers
    are reused for the new state). compiler_options: replaces those options (bench/train_2gpu.py passes {}
    to show the miscompile)."""
    return jax.jit(make_train_step(graphdef, tx, gamma, schedule), in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, None), donate_argnums=0 if donate else (),
                   compiler_options=train_step_compiler_options(deterministic, cudnn_attention)
                   if compiler_options is None
                   else compiler_options)


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    def eval_step(params: nnx.State, biases: nnx.State, tokens: jax.Array) -> jax.Array:
        """tokens: (B, T + 1) -> summed NLL over the B*T predicted tokens (fp32)."""
        loss, _ = loss_fn(graphdef, params, biases, tokens)
        return loss * tokens.shape[0] * (tokens.shape[1] - 1)

    return eval_step
