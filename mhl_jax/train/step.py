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

# XLA options for the compiled train step. `while-loop-all-reduce-code-motion` moves the data-parallel
# all-reduce of a gradient out of the micro-batch loop and accumulates locally instead; on scatter-based
# accumulations it miscompiles (openxla/xla#49143, fixed after jaxlib 0.11.2). Our embedding gradient is
# no longer a scatter-add (mhl_jax/gather.py), and on 2 x H200 (2026-11-23, bench/train_2gpu.py) 1 vs
# 2 GPUs agreed to 1e-6 over 5 steps with the pass on or off; it stays off as a guard against that bug
# (cost: one all-reduce per micro-batch instead of one per step, bench/NOTES.md).
TRAIN_STEP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-all-reduce-code-motion"}
# XLA GPU lowers a float scatter-add with repeated indices to atomics (two runs of a step differed in the
# last bits, H100, 2026-11-23, bench/determinism.py). Every such gradient in our step has a scatter-free
# form instead (the embedding, the pure-JAX expert path's gathers: mhl_jax/gather.py; Triton kernels:
# no atomics). This option would make XLA replace any other one, but it is opt-in
# (train.xla_deterministic_ops): on 2 x H200 it changed the fp32 gradient norm of a small MH-LatentMoE
# by 1.8e-5 relative (to 9e-8 without it, against the CPU) and put 1 vs 2 GPUs 3e-4 apart after 5 steps;
# with cuDNN attention XLA failed to compile the 2.2B models under it (IndexError: raw_hash_map::at), so
# it is never added there. Ignored on CPU.
DETERMINISTIC_OPTIONS = {"xla_gpu_exclude_nondeterministic_ops": True}


def train_step_compiler_options(deterministic: bool = False, cudnn_attention: bool = False) -> dict:
    """XLA options `jit_train_step` compiles with (module comments above); deterministic:
    train.xla_deterministic_ops."""
    extra = DETERMINISTIC_OPTIONS if deterministic and not cudnn_attention else {}
    return {**TRAIN_STEP_COMPILER_OPTIONS, **extra}


# The train step casts the expert weights to the compute dtype once per step, before its micro-batch loop, where the
# MoE executor reads them cast (`GPT.expert_weight_casts`); False: every micro-batch's MoE op casts them again (XLA
# did not hoist those casts out of the loop). The gradients are bitwise the same either way (where the converting
# forward has a chunk width of its own, the GPU sums in the same order: `kernels.triton.experts.default_config`'s fwd_cast).
CAST_EXPERT_WEIGHTS_ONCE = True
# Where the expert backward adds into the gradient sums in place (`GPT.expert_grad_accumulation`: the fused Triton core,
# fp32 weights, no data parallelism in the MoE executor), the micro-batch loop hands it the running sums of those expert
# weights and takes what comes back as the new sums, instead of an XLA add of a new gradient (fp32 acc + dW either way:
# bitwise the same sums). False: every gradient is added by the loop.
ACCUMULATE_EXPERT_GRADS_IN_PLACE = True


def expert_weight_leaf(path) -> tuple[int, str] | None:
    """(layer, "w1" | "w2") for the params path of an MoE layer's expert weight (blocks/<layer>/ffn/experts/w1), else
    None."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if len(keys) >= 5 and keys[0] == "blocks" and keys[2:4] == ["ffn", "experts"] and keys[4] in ("w1", "w2"):
        return keys[1], keys[4]
    return None


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, biases: nnx.State, tokens: jax.Array,
            weights_cast: dict | None = None, grad_acc: dict | None = None):
    """tokens: (B, T + 1) int32 -> (mean NLL fp32, {layer: (H, Ne) int32 loads}). weights_cast: the model's
    `expert_weight_casts()` made outside (not differentiated: the fp32 weights in params get the gradients); grad_acc:
    {layer: (acc1, acc2)} running gradient sums of those layers' expert weights (`GPT.hidden`; not differentiated)."""
    model = nnx.merge(graphdef, params, biases)
    return model.loss(tokens[:, :-1], tokens[:, 1:], weights_cast, grad_acc)


def apply_balancing(biases: nnx.State, loads: dict[int, jax.Array], gamma: float) -> nnx.State:
    """Update each MoE layer's bias (path blocks/<layer>/ffn/experts/bias) from its global loads."""

    def upd(path, b):
        return update_bias(b, loads[path[1].key], gamma)

    return jax.tree_util.tree_map_with_path(upd, biases)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, gamma: float,
                    schedule: Callable) -> Callable:
    grad_fn = jax.value_and_grad(lambda p, b, t, c, a: loss_fn(graphdef, p, b, t, c, a), has_aux=True)

    def train_step(state: dict[str, Any], batch: jax.Array):
        params, biases = state["params"], state["biases"]
        model = nnx.merge(graphdef, params, biases)
        casts = model.expert_weight_casts() if CAST_EXPERT_WEIGHTS_ONCE else None
        # one micro-batch: nothing to add to (the kernels would read the zeros)
        in_place_on = ACCUMULATE_EXPERT_GRADS_IN_PLACE and batch.shape[0] > 1
        acc_layers = set(model.expert_grad_accumulation() if in_place_on else ())

        def in_place(path) -> bool:
            leaf = expert_weight_leaf(path)
            return leaf is not None and leaf[0] in acc_layers

        def micro(carry, tokens):
            gsum, lsum, loadsum = carry
            acc = None
            if acc_layers:  # the running sums of the in-place layers' expert weights
                sums = {expert_weight_leaf(p): g for p, g in jax.tree_util.tree_leaves_with_path(gsum) if in_place(p)}
                acc = {i: (sums[(i, "w1")], sums[(i, "w2")]) for i in acc_layers}
            (loss, loads), grads = grad_fn(params, biases, tokens, casts, acc)
            # the in-place layers' expert weights came back as sum + gradient already
            gsum = jax.tree_util.tree_map_with_path(lambda p, a, g: g if in_place(p) else a + g, gsum, grads)
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
                   state_shardings, batch_sharding, donate: bool = False, deterministic: bool = False,
                   cudnn_attention: bool = False, compiler_options: dict | None = None,
                   autotune_options: dict | None = None) -> Callable:
    """`make_train_step` under jit with the given shardings and `train_step_compiler_options`:
    the one way train.py and the benchmarks compile it. donate: donate the state (train.py; its buffers
    are reused for the new state). deterministic: train.xla_deterministic_ops. compiler_options: replaces
    those options (bench/train_2gpu.py and bench/determinism.py compare sets of them). autotune_options: added to
    them (`mhl_jax.runtime.autotune.AutotuneFile.compiler_options`: XLA's autotuning results loaded / written)."""
    options = train_step_compiler_options(deterministic, cudnn_attention) if compiler_options is None \
        else compiler_options
    return jax.jit(make_train_step(graphdef, tx, gamma, schedule), in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, None), donate_argnums=0 if donate else (),
                   compiler_options={**options, **(autotune_options or {})})


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
    def eval_step(params: nnx.State, biases: nnx.State, tokens: jax.Array) -> jax.Array:
        """tokens: (B, T + 1) -> summed NLL over the B*T predicted tokens (fp32)."""
        loss, _ = loss_fn(graphdef, params, biases, tokens)
        return loss * tokens.shape[0] * (tokens.shape[1] - 1)

    return eval_step
