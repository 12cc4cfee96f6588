"""The Pallas flash attention (`model.attention_impl: pallas`, the GPU default) against XLA's attention: outputs and
gradients, alone and in the model under a device mesh (shard_map over the batch), on CPU through the Pallas
interpreter. Its run-to-run repeatability on the GPU is measured by bench/attention.py and bench/train_scale.py
--repeat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax.config import ConfigError, load_config
from mhl_jax.model.attention import attention_impl, pallas_attention, sharded_pallas_attention
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.train.step import loss_fn


def _xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _check_against_xla(fn, t, rtol, atol, grad_tol):
    ks = jax.random.split(jax.random.key(t), 4)
    q, k, v, g = (jax.random.normal(x, (2, t, 2, 32)) for x in ks)
    np.testing.assert_allclose(fn(q, k, v), _xla(q, k, v), rtol=rtol, atol=atol)
    got = jax.grad(lambda *a: jnp.sum(fn(*a) * g), (0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(_xla(*a) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=grad_tol, atol=grad_tol / 10)


# 64: one whole tile; 100: padded to two tiles of 64 (a T short of one tile takes the same padding branch; the GPU
# test below checks such T where the compiled kernel's tiles matter)
@pytest.mark.parametrize("t", [64, 100])
def test_pallas_attention_matches_xla_with_gradients(t):
    for fn in (pallas_attention, lambda q, k, v: sharded_pallas_attention(q, k, v, None)):
        _check_against_xla(fn, t, 1e-5, 2e-6, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4, 16, 100, 128])
def test_gpu_pallas_attention_matches_xla_at_any_length(t):
    """The compiled Triton kernel, fp32 inputs (its dots in TF32): short and ragged lengths too."""
    _check_against_xla(jax.jit(pallas_attention), t, 2e-2, 2e-2, 5e-2)


def test_attention_impl_choice():
    assert attention_impl("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert attention_impl("pallas") == "pallas" and attention_impl("xla") == "xla"
    if jax.default_backend() == "gpu":
        assert attention_impl("cudnn") == "cudnn"
    else:  # a config error before anything is traced, not cuDNN's own failure deep in XLA
        with pytest.raises(ConfigError, match="model.attention_impl='cudnn' needs a GPU JAX backend"):
            attention_impl("cudnn")


def _model_loss_and_grads(cfg, executor, mesh, tokens):
    graphdef, params, biases = nnx.split(build_model(cfg, seed=0, executor=executor, mesh=mesh), nnx.Param,
                                         RouterBias)
    f = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, biases, t)[0]))
    return f(params, tokens)


def test_pallas_attention_in_the_model_under_a_mesh():
    """A model on 4 devices with Pallas attention (each device attends over its own sequences: shard_map over every
    mesh axis): the loss and gradients of the single-device model with XLA attention; the batch must split over the
    devices (a clear error otherwise). A dense model, on a data-parallel mesh: the attention's part is the same under
    any FFN and mesh, and the reference experts would double the compile time (MH-LatentMoE under Head Parallel with
    Pallas attention against one device: tests/e2e/test_gpu_train.py, on 2 GPUs)."""
    sets = ["model.vocab_size=64", "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.head_dim=32",
            "model.context=16", "model.compute_dtype=float32", "ffn.kind=mlp", "ffn.hidden=64", "ffn.stem_layers=0",
            "parallel.devices=4"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.int32)
    ref = _model_loss_and_grads(load_config(None, [*sets, "model.attention_impl=xla"]), LocalMoE("reference"), None,
                                tokens)
    cfg = load_config(None, [*sets, "model.attention_impl=pallas"])
    mesh = make_mesh(cfg)
    assert mesh.size == 4
    got = _model_loss_and_grads(cfg, make_executor(cfg, mesh), mesh, tokens)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    with pytest.raises(ValueError, match="a batch of 6 sequences does not split over the 4 devices"):
        _model_loss_and_grads(cfg, make_executor(cfg, mesh), mesh, tokens[:6])


def test_bench_split_pallas_attention_matches_xla():
    """bench/attention.py --sweep times the forward and the backward with their own settings through the Pallas
    module's `_mha_backward` (a private function): interpreted, its outputs and gradients equal XLA's attention."""
    from bench.tools.attention_tiles import pallas_split

    ks = jax.random.split(jax.random.key(1), 4)
    q, k, v, g = (jax.random.normal(x, (1, 128, 2, 32)) for x in ks)
    fn = pallas_split({"blocks": (64, 32), "warps": 4, "stages": 3}, {"blocks": (32, 64, 32), "warps": 4},
                      interpret=True)
    np.testing.assert_allclose(fn(q, k, v), _xla(q, k, v), rtol=1e-5, atol=2e-6)
    got = jax.grad(lambda *a: jnp.sum(fn(*a) * g), (0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(_xla(*a) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
