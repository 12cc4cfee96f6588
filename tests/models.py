"""Small models the kernel-path tests share, and the Triton bindings' `emulate` backend switched on for them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mhl_jax.moe.gpu.experts as experts_triton
import mhl_jax.moe.gpu.fused as moe_triton
import mhl_jax.moe.gpu.grouped as experts_grouped
import mhl_jax.moe.gpu.router as router_triton
from mhl_jax.config import load_config
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.train.step import loss_fn


def emulate_kernels(monkeypatch) -> None:
    """Route the Triton bindings through their `emulate` backend: the same custom_vjp, metadata and packing, with
    pure-JAX stand-ins for the kernel launches (what the CPU can check of the GPU path)."""
    monkeypatch.setattr(router_triton, "route_topk_triton",
                        functools.partial(router_triton.route_topk_triton, backend="emulate"))
    monkeypatch.setattr(experts_triton, "expert_ffn_triton",
                        functools.partial(experts_triton.expert_ffn_triton, backend="emulate"))
    monkeypatch.setattr(moe_triton, "moe_heads_fused", functools.partial(moe_triton.moe_heads_fused, backend="emulate"))
    monkeypatch.setattr(experts_grouped, "expert_ffn_grouped",
                        functools.partial(experts_grouped.expert_ffn_grouped, backend="emulate"))


def small(kind, *extra):
    """configs/tiny_<kind>.yaml cut to 2 layers of width 64 and a context of 16: compiles in seconds."""
    return load_config(f"configs/tiny_{kind}.yaml", ["model.n_layers=2", "model.context=16", "model.d_model=64",
                                                     "ffn.stem_layers=1", *extra])


def tokens(cfg, batch=8):
    """A fixed batch of random byte tokens, one more than the context per row (inputs and targets)."""
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(0, 257, (batch, cfg.model.context + 1)), jnp.int32)



def jax_expert_inputs(seed: int, n: int, h: int, dh: int, ne: int, de: int, k: int):
    """JAX inputs of the expert op: bf16 x (n, h, dh), k distinct experts per sub-token at random, softmax gates,
    fp32 W1 (h, ne, dh, de) / W2 (h, ne, de, dh) at unit-variance scale."""
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (n, h, dh)).astype(jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(ks[1], (n, h, ne)), axis=-1)[..., :k].astype(jnp.int32)
    gates = jax.nn.softmax(jax.random.normal(ks[2], (n, h, k)), axis=-1)
    w1 = jax.random.normal(ks[3], (h, ne, dh, de)) * dh ** -0.5
    w2 = jax.random.normal(ks[4], (h, ne, de, dh)) * de ** -0.5
    return x, idx, gates, w1, w2


def np_expert_inputs(seed: int, n: int, h: int, dh: int, ne: int, de: int, k: int):
    """`jax_expert_inputs` drawn by numpy's generator: on the CPU, JAX's compiles a program for each shape it draws
    (seconds each), numpy's compiles nothing."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h, dh), dtype=np.float32).astype(jnp.bfloat16)
    idx = np.argsort(rng.random((n, h, ne)), axis=-1)[..., :k].astype(np.int32)
    z = rng.standard_normal((n, h, k))
    gates = (np.exp(z) / np.exp(z).sum(-1, keepdims=True)).astype(np.float32)
    w1 = rng.standard_normal((h, ne, dh, de), dtype=np.float32) * np.float32(dh ** -0.5)
    w2 = rng.standard_normal((h, ne, de, dh), dtype=np.float32) * np.float32(de ** -0.5)
    return tuple(jnp.asarray(a) for a in (x, idx, gates, w1, w2))



def loss_and_grads(cfg, executor, tokens):
    """(loss, expert loads, gradients) of the model of `cfg` through `executor`, the router biases spread so that
    they take part."""
    graphdef, params, biases = nnx.split(build_model(cfg, executor=executor), nnx.Param, RouterBias)
    biases = jax.tree.map(lambda b: b + jnp.linspace(-0.3, 0.3, b.shape[-1]), biases)  # bias in play

    @jax.jit
    def f(p, b, t):
        return jax.value_and_grad(lambda p_: loss_fn(graphdef, p_, b, t), has_aux=True)(p)

    (loss, loads), grads = f(params, biases, tokens)
    return loss, loads, grads



def loss_and_grads_each(models, tokens):
    """[(loss, expert loads, gradients)] of each model (cfg, executor) of `models`, as `loss_and_grads` gives them,
    computed in one jitted program on the first model's parameters (those of every model, checked equal): XLA then
    computes what does not depend on the executor once, and the program compiles in little more than the time of
    one model instead of once per executor."""
    splits = [nnx.split(build_model(cfg, executor=executor), nnx.Param, RouterBias) for cfg, executor in models]
    _, params, biases = splits[0]
    for _, p, b in splits[1:]:
        assert jax.tree.structure((p, b)) == jax.tree.structure((params, biases))
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves((p, b)), jax.tree.leaves((params, biases))))
    biases = jax.tree.map(lambda b: b + jnp.linspace(-0.3, 0.3, b.shape[-1]), biases)  # bias in play

    @jax.jit
    def f(p, b, t):
        return [jax.value_and_grad(lambda p_, g=g: loss_fn(g, p_, b, t), has_aux=True)(p) for g, _, _ in splits]

    return [(loss, loads, grads) for (loss, loads), grads in f(params, biases, tokens)]
