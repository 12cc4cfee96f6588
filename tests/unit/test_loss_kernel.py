"""The LM head loss's kernel path (`mhl_jax.model.loss.xent_impl` -> `mhl_jax.model.cross_entropy.KernelXent`) in the
model: the chunk step's kernel call per device under a mesh, and the loss and gradients as XLA's. The Triton kernel
needs a GPU, so an XLA stand-in for `xent_rows` runs here, recording the shapes it is called on; the kernel itself
against float64 and against XLA on a GPU: tests/kernels/test_cross_entropy_kernel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax.config import load_config
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.train.step import loss_fn


def _loss_and_grads(cfg, executor, mesh, tokens):
    graphdef, params, biases = nnx.split(build_model(cfg, seed=0, executor=executor, mesh=mesh), nnx.Param,
                                         RouterBias)
    return jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, biases, t)[0]))(params, tokens)


def test_xent_impl_choice(monkeypatch):
    """XLA's form without a GPU and jax-triton; the kernel with them, and then for a batch split over devices only
    under its mesh (without one, XLA would gather each chunk's logits to every device for the kernel call)."""
    pytest.importorskip("triton")
    import mhl_jax.model.loss as loss
    from mhl_jax.model.cross_entropy import KernelXent

    monkeypatch.setattr(loss, "triton_available", lambda: False)
    assert loss.xent_impl() is loss.xla_xent
    monkeypatch.setattr(loss, "triton_available", lambda: True)
    assert loss.xent_impl() == KernelXent(None)
    chosen = []
    monkeypatch.setattr(loss, "head_loss", lambda *a: chosen.append(a[5]))
    x, w, t = jnp.zeros((4, 8, 16)), jnp.zeros((16, 32)), jnp.zeros((4, 8), jnp.int32)
    loss.lm_head_loss(x, w, t, shards=2)  # split, no mesh
    loss.lm_head_loss(x, w, t, shards=3)  # 4 rows do not split over 3: taken as one shard
    loss.lm_head_loss(x, w, t)
    assert chosen == [loss.xla_xent, KernelXent(None), KernelXent(None)]


def test_kernel_loss_in_the_model_under_a_mesh(monkeypatch):
    """A model on 4 devices whose head loss runs the kernel path: each device's chunk step sees its own 2 sequences'
    rows (8 sequences / 4 devices x 16 positions, one chunk), and the loss and gradients equal the single-device
    model's XLA path."""
    pytest.importorskip("triton")
    import mhl_jax.model.cross_entropy as ce
    import mhl_jax.model.loss as loss

    seen = []

    def stand_in(logits, targets, scale, dtype):
        seen.append(logits.shape)
        return loss.xla_xent(logits, targets, scale, dtype)

    sets = ["model.vocab_size=64", "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.head_dim=32",
            "model.context=16", "model.compute_dtype=float32", "ffn.kind=mlp", "ffn.hidden=64", "ffn.stem_layers=0",
            "parallel.devices=4"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.int32)
    cfg = load_config(None, sets)
    ref = _loss_and_grads(cfg, LocalMoE("reference"), None, tokens)
    assert not seen
    monkeypatch.setattr(ce, "xent_rows", stand_in)
    monkeypatch.setattr(loss, "triton_available", lambda: True)
    mesh = make_mesh(cfg)
    got = _loss_and_grads(cfg, make_executor(cfg, mesh), mesh, tokens)
    assert seen and set(seen) == {(2 * 16, 64)}, seen
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
