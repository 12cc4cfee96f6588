"""The attention's choice of implementation, and a kernel attention (`model.attention_impl: triton`, the GPU default) in
the model under a device mesh (shard_map over the batch). The Triton kernels themselves: tests/kernels/
test_attention_kernel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax.config import ConfigError, load_config
from mhl_jax.model.attention import attention_impl
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.train.step import loss_fn


def _xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def test_attention_impl_choice():
    gpu = jax.default_backend() == "gpu"
    assert attention_impl("auto") == ("triton" if gpu else "xla")
    assert attention_impl("auto", "float32") == "xla"  # the bf16 kernels would round a float32 model's attention
    assert attention_impl("xla") == "xla" and attention_impl("xla", "float32") == "xla"
    for choice in ("triton", "cudnn"):
        if gpu:
            assert attention_impl(choice) == choice
        else:  # a config error before anything is traced, not a kernel's own failure deep in XLA
            with pytest.raises(ConfigError, match=f"model.attention_impl='{choice}' needs a GPU JAX backend"):
                attention_impl(choice)
    if gpu:
        with pytest.raises(ConfigError, match="attention_impl='triton' runs bf16 kernels; model.compute_dtype is "
                                              "'float32'"):
            attention_impl("triton", "float32")


def _model_loss_and_grads(cfg, executor, mesh, tokens):
    graphdef, params, biases = nnx.split(build_model(cfg, seed=0, executor=executor, mesh=mesh), nnx.Param,
                                         RouterBias)
    f = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, biases, t)[0]))
    return f(params, tokens)


def test_kernel_attention_in_the_model_under_a_mesh(monkeypatch):
    """A model on 4 devices whose attention runs as a kernel (`attention_impl: triton`; here XLA's attention stands in
    for the Triton kernels, which need a GPU, and records the shapes it is called on): each device attends over its
    own 2 sequences (shard_map over every mesh axis), and the loss and gradients are the single-device model's with XLA
    attention; the batch must split over the devices (a clear error otherwise). A dense model on a data-parallel mesh:
    the attention's part is the same under any FFN and mesh (MH-LatentMoE under Head Parallel with the real kernels
    against one device: tests/e2e/test_gpu_train.py, on 2 GPUs)."""
    pytest.importorskip("triton")
    import mhl_jax.model.attention as att
    import mhl_jax.model.flash_attention as fa

    seen = []
    monkeypatch.setattr(fa, "flash_attention", lambda q, k, v: seen.append(q.shape) or _xla(q, k, v))
    monkeypatch.setattr(att, "attention_impl", lambda choice, dtype: "triton" if choice == "triton" else "xla")
    sets = ["model.vocab_size=64", "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.head_dim=32",
            "model.context=16", "model.compute_dtype=float32", "ffn.kind=mlp", "ffn.hidden=64", "ffn.stem_layers=0",
            "parallel.devices=4"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.int32)
    ref = _model_loss_and_grads(load_config(None, [*sets, "model.attention_impl=xla"]), LocalMoE("reference"), None,
                                tokens)
    assert not seen
    cfg = load_config(None, [*sets, "model.attention_impl=triton"])
    mesh = make_mesh(cfg)
    assert mesh.size == 4
    got = _model_loss_and_grads(cfg, make_executor(cfg, mesh), mesh, tokens)
    assert seen and set(seen) == {(2, 16, 2, 32)}  # per device: 8 sequences / 4 devices
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    with pytest.raises(ValueError, match="a batch of 6 sequences does not split over the 4 devices"):
        _model_loss_and_grads(cfg, make_executor(cfg, mesh), mesh, tokens[:6])
