"""The jitted train step: gradient accumulation, AdamW update, balancing-bias update, metrics.

State is a plain dict pytree {params, opt_state, biases, step} so that it checkpoints as is.
`batch` is (accum, micro_global, T + 1) int32: `accum` micro-batches, each split over the data axis.
Its parts run under `jax.named_scope`s (grad_accum, optimizer, balancing; the expert weights' casts under experts),
as the model's do: names in the compiled program only, for `bench/step_profile.py`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mhl_jax.model.balancing import load_stats, update_bias
from mhl_jax.model.context import build_step_context, expert_grad_sums, summed_in_place
from mhl_jax.moe.context import StepContext

# XLA options for the compiled train step. `while-loop-all-reduce-code-motion` moves the data-parallel
# all-reduce of a gradient out of the micro-batch loop and accumulates locally instead; on scatter-based
# accumulations it miscompiles (openxla/xla#49143, fixed after jaxlib 0.11.2). Our embedding gradient is
# no longer a scatter-add (mhl_jax/gather.py), and on 2 x H200 1 vs 2 GPUs agreed to 1e-6 over 5 steps with the
# pass on or off; it stays off as a guard against that bug (cost: one all-reduce per micro-batch instead of one per
# step).
TRAIN_STEP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-all-reduce-code-motion"}
# XLA GPU lowers a float scatter-add with repeated indices to atomics (two runs of a step differed in the
# last bits on an H100). Every such gradient in our step has a scatter-free form instead (the embedding, the
# pure-JAX expert path's gathers: mhl_jax/gather.py; Triton kernels: no atomics). This option would make XLA
# replace any other one, but it is opt-in (train.xla_deterministic_ops): on 2 x H200 it changed the fp32 gradient
# norm of a small MH-LatentMoE by 1.8e-5 relative (to 9e-8 without it, against the CPU) and put 1 vs 2 GPUs 3e-4
# apart after 5 steps; with cuDNN attention XLA failed to compile the 2.2B models under it (IndexError:
# raw_hash_map::at), so it is never added there. Ignored on CPU.
DETERMINISTIC_OPTIONS = {"xla_gpu_exclude_nondeterministic_ops": True}


def train_step_compiler_options(deterministic: bool = False, cudnn_attention: bool = False) -> dict:
    """XLA options `jit_train_step` compiles with (module comments above); deterministic:
    train.xla_deterministic_ops."""
    extra = DETERMINISTIC_OPTIONS if deterministic and not cudnn_attention else {}
    return {**TRAIN_STEP_COMPILER_OPTIONS, **extra}


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, biases: nnx.State, tokens: jax.Array,
            ctx: StepContext | None = None):
    """tokens: (B, T + 1) int32 -> (mean NLL fp32, {layer: (H, Ne) int32 loads}). ctx: the step context
    (`mhl_jax.model.context.build_step_context`; not differentiated: the fp32 weights in params get the gradients)."""
    model = nnx.merge(graphdef, params, biases)
    return model.loss(tokens[:, :-1], tokens[:, 1:], ctx)


def apply_balancing(biases: nnx.State, loads: dict[int, jax.Array], gamma: float) -> nnx.State:
    """Update each MoE layer's bias (path blocks/<layer>/ffn/experts/bias) from its global loads."""

    def upd(path, b):
        return update_bias(b, loads[path[1].key], gamma)

    return jax.tree_util.tree_map_with_path(upd, biases)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, gamma: float,
                    schedule: Callable) -> Callable:
    """train_step(state, batch) -> (new state, metrics): the gradients of the micro-batches summed in a scan, their
    mean applied by `tx`, the balancing biases updated from the summed loads."""
    grad_fn = jax.value_and_grad(lambda p, b, t, c: loss_fn(graphdef, p, b, t, c), has_aux=True)

    def train_step(state: dict[str, Any], batch: jax.Array):
        params, biases = state["params"], state["biases"]
        # the expert weights cast once for every micro-batch (XLA leaves casts inside the loop); running sums handed
        # to the in-place layers only from two micro-batches on (with one, the kernels would add to zeros)
        with jax.named_scope("experts"):  # the expert weights' casts
            ctx = build_step_context(nnx.merge(graphdef, params, biases), accumulate=batch.shape[0] > 1)

        def micro(carry, tokens):
            gsum, lsum, loadsum = carry
            (loss, loads), grads = grad_fn(params, biases, tokens, expert_grad_sums(ctx, gsum))
            with jax.named_scope("grad_accum"):
                # the in-place layers' expert weights came back as sum + gradient already: the same fp32 add
                gsum = jax.tree_util.tree_map_with_path(lambda p, a, g: g if summed_in_place(ctx, p) else a + g,
                                                        gsum, grads)
                loadsum = {i: loadsum[i] + loads[i] for i in loadsum}
                return (gsum, lsum + loss, loadsum), None

        with jax.named_scope("grad_accum"):
            zeros = jax.tree.map(jnp.zeros_like, params)
            _, load_shapes = jax.eval_shape(lambda: loss_fn(graphdef, params, biases, batch[0]))
            load0 = {i: jnp.zeros(s.shape, s.dtype) for i, s in load_shapes.items()}
        (gsum, lsum, loads), _ = jax.lax.scan(micro, (zeros, jnp.float32(0.0), load0), batch)
        accum = batch.shape[0]
        with jax.named_scope("optimizer"):  # the mean gradient, its norm, AdamW
            grads = jax.tree.map(lambda g: g / accum, gsum)
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
            grad_norm = optax.tree.norm(grads)
        with jax.named_scope("balancing"):
            new_biases = apply_balancing(biases, loads, gamma)
            load_metrics = {}
            for i, counts in loads.items():
                load_metrics[f"load_max/{i}"], load_metrics[f"load_min/{i}"] = load_stats(counts)
                load_metrics[f"loads/{i}"] = counts  # (H, Ne): what the load maps draw (loads.jsonl)
        new_state = {
            **state,  # carried unchanged: the rng key data
            "params": new_params,
            "opt_state": opt_state,
            "biases": new_biases,
            "step": state["step"] + 1,
        }
        metrics = {"loss": lsum / accum, "grad_norm": grad_norm, "lr": schedule(state["step"]), **load_metrics}
        return new_state, metrics

    return train_step


def jit_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, gamma: float, schedule: Callable,
                   state_shardings, batch_sharding, donate: bool = False, deterministic: bool = False,
                   cudnn_attention: bool = False, compiler_options: dict | None = None,
                   autotune_options: dict | None = None) -> Callable:
    """`make_train_step` under jit with the given shardings and `train_step_compiler_options`:
    the one way train.py and the benchmarks compile it. donate: donate the state (train.py; its buffers
    are reused for the new state). deterministic: train.xla_deterministic_ops. compiler_options: replaces
    those options (benchmarks compare sets of them). autotune_options: added to
    them (`mhl_jax.runtime.autotune.AutotuneFile.compiler_options`: XLA's autotuning results loaded / written)."""
    options = train_step_compiler_options(deterministic, cudnn_attention) if compiler_options is None \
        else compiler_options
    # the metrics whole on every device: each process reads them (the loads of Head Parallel's heads included)
    metrics_sharding = None if batch_sharding is None else NamedSharding(batch_sharding.mesh, P())
    return jax.jit(make_train_step(graphdef, tx, gamma, schedule), in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, metrics_sharding), donate_argnums=0 if donate else (),
                   compiler_options={**options, **(autotune_options or {})})

