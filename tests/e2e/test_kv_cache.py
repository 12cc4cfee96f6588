"""`GPT.prefill` / `GPT.decode`: generation with a KV cache, against the model's own causal forward.

The forward over whole rows gives, at every position p, the logits of the token after p. A cache filled from the rows
cut at a different length each (the rest padded with id 0), then one decoding step per position, must give the same
logits at those positions: the rotary angle of each row's own position, the mask over the cache, the new key and
value written where they belong, and MoE layers that route one token per row alone (dropless). Here on random
weights through the reference experts and through the Triton path's emulation (its custom VJPs, packing and
metadata at 2 tokens a call and device; the kernels themselves run on a GPU: tests/e2e/test_infer.py's GPU test).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.context import build_step_context
from mhl_jax.model.gpt import build_model
from mhl_jax.model.loss import head_logits
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh
from tests.models import small


def _logits(model, x):
    return head_logits(x, model.head[...].astype(model.dtype))


# The dense layers; the reference experts (`LocalMoE`); the Triton path's router and experts apart (Expert Parallel,
# MoE) and its fused core (Head Parallel, MH-LatentMoE: each device runs `moe_heads`, the function `LocalMoE` runs on
# one device, so a Triton case on one device takes no branch of its own).
@pytest.mark.parametrize("kind, impl, devices", [
    ("mlp", "reference", 1), ("mh_latent_moe", "reference", 1), ("moe", "triton", 2), ("mh_latent_moe", "triton", 2)])
def test_decoding_steps_give_the_forwards_logits(emulated, kind, impl, devices):
    """On 2 devices: Expert Parallel (ep = 2) or Head Parallel (hp = 2), the rows split over the devices."""
    extra = (("ffn.latent_dim=64", "ffn.head_dim=16", f"parallel.hp={devices}") if kind == "mh_latent_moe" else
             (f"parallel.ep={devices}",) if kind == "moe" else ())
    if kind != "mlp":  # one MoE layer (the dense layers and the caches of several layers: the mlp case)
        extra += ("model.n_layers=1", "ffn.stem_layers=0")
    cfg = small(kind, *extra, f"parallel.devices={devices}", "model.compute_dtype=float32")
    if devices == 1:
        executor, mesh = LocalMoE(impl), None
    else:
        mesh = make_mesh(cfg)
        executor = make_executor(cfg, mesh)
        executor.impl = impl
    graphdef, params, biases = nnx.split(build_model(cfg, executor=executor, mesh=mesh), nnx.Param, RouterBias)
    biases = jax.tree.map(lambda b: b + jnp.linspace(-0.3, 0.3, b.shape[-1]), biases)  # bias in play
    t, b = cfg.model.context, 2 * devices
    rows = jnp.asarray(np.random.default_rng(1).integers(1, 257, (b, t)), jnp.int32)
    lengths = np.array([1, 7, 12, 5][:b])  # each row's prefix in the cache

    @jax.jit
    def forward(p, b, toks):
        model = nnx.merge(graphdef, p, b)
        return model(toks)[0]

    @jax.jit
    def prefill(p, b, toks):
        model = nnx.merge(graphdef, p, b)
        x, caches = model.prefill(toks)
        return _logits(model, x), caches

    @jax.jit
    def decode(p, b, caches, toks, pos):
        model = nnx.merge(graphdef, p, b)
        x, caches = model.decode(toks, pos, caches)
        return _logits(model, x[:, None])[:, 0], caches

    want = np.asarray(forward(params, biases, rows))  # (3, t, V)
    cut = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], rows, 0)
    got, caches = prefill(params, biases, cut)
    for r, n in enumerate(lengths):  # the prefill's own logits at each row's last real token
        np.testing.assert_allclose(np.asarray(got)[r, n - 1], want[r, n - 1], rtol=1e-5, atol=1e-5)
    assert caches[0][0].shape == (b, t, cfg.model.n_heads, cfg.model.head_dim)
    for step in range(t - lengths.max()):
        pos = lengths + step
        logits, caches = decode(params, biases, caches, rows[np.arange(b), pos], jnp.asarray(pos, jnp.int32))
        np.testing.assert_allclose(np.asarray(logits), want[np.arange(b), pos], rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {step}")


def test_decoding_with_the_expert_weights_cast_once(emulated):
    """bf16 compute on the Triton path: the expert weights cast once for all the steps (a step context of
    `build_step_context`, as generate passes it) give each step bitwise the logits of the layers casting their own.
    (Every MoE kind hands the step context to its `ExpertBank` alike: MH-LatentMoE's stands for them.)"""
    cfg = small("mh_latent_moe", "ffn.latent_dim=64", "ffn.head_dim=16", "parallel.devices=1",
                "model.compute_dtype=bfloat16")
    graphdef, params, biases = nnx.split(build_model(cfg, executor=LocalMoE("triton")), nnx.Param, RouterBias)
    casts = jax.jit(lambda p, b: build_step_context(nnx.merge(graphdef, p, b)))(params, biases)
    assert sorted(casts.casts) == [i for i in range(cfg.model.n_layers) if i >= cfg.ffn.stem_layers]
    assert casts.accumulating == ()
    rows = jnp.asarray(np.random.default_rng(2).integers(1, 257, (2, cfg.model.context)), jnp.int32)

    # one prefill (it casts its own weights) for the three runs of decoding steps below
    caches = jax.jit(lambda p, b: nnx.merge(graphdef, p, b).prefill(
        jnp.where(jnp.arange(rows.shape[1]) < 3, rows, 0))[1])(params, biases)

    @jax.jit
    def run(p, b, c, caches):
        model = nnx.merge(graphdef, p, b)
        out = []
        for pos in range(3, 5):  # two steps: the second reads the casts again
            x, caches = model.decode(rows[:, pos], jnp.full((2,), pos, jnp.int32), caches, c)
            out.append(x)
        return jnp.stack(out)

    a, b = np.asarray(run(params, biases, casts, caches)), np.asarray(run(params, biases, None, caches))
    np.testing.assert_array_equal(a, b)
    assert np.isfinite(a.astype(np.float32)).all()
    doubled = jax.tree.map(lambda w: w * 2, casts)  # the steps read the casts passed, not the weights
    assert not np.array_equal(np.asarray(run(params, biases, doubled, caches)), a)


def test_decoding_positions_out_of_the_cache_are_refused():
    """Known positions (an eager call) outside the caches, or not one per row, are an error naming them; under jit
    the caller keeps them in range. (GPT.decode checks them before any layer: one dense layer is enough, and its
    eager steps are quick.)"""
    cfg = small("mlp", "model.n_layers=1")
    model = build_model(cfg)
    t = cfg.model.context
    graphdef, state = nnx.split(model)
    _, caches = jax.jit(lambda s, toks: nnx.merge(graphdef, s).prefill(toks))(state, jnp.ones((2, t), jnp.int32))
    toks = jnp.ones((2,), jnp.int32)
    for pos, msg in ((jnp.asarray([3, t], jnp.int32), f"row 1 is {t} \\(1 of 2 rows.*must be in \\[0, {t}\\)"),
                     (jnp.asarray([-1, 0], jnp.int32), "row 0 is -1"),
                     (jnp.asarray([1, 2, 3], jnp.int32), "shape \\(2,\\)"),
                     (jnp.asarray([1.0, 2.0]), "expected integer positions")):
        with pytest.raises(ValueError, match=msg):
            model.decode(toks, pos, caches)
    x, _ = model.decode(toks, jnp.asarray([0, t - 1], jnp.int32), caches)  # the ends of the range are fine
    assert x.shape == (2, cfg.model.d_model)
