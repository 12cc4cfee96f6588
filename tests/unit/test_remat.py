"""`model.remat`: activation checkpointing per block.

"block" must give the step of "none" (the same new state and metrics; the backward recomputes each block's forward
from its input, so only the order of some fp32 sums may differ) on the paths the GPU runs: the fused Triton MoE
core (emulated on the CPU: the same custom_vjp, packing and in-place gradient sums), under Head and Expert Parallel,
dense and MoE blocks. The step's program must hold one rematerialised region per block, the forward must keep
only the blocks' inputs, and a checkpoint must restore across the switch.

The models here have 2 layers: the dense stem (ffn.stem_layers=1: the MLP that a dense model's every block is) and
one MoE layer, so each case checks a dense block and a MoE block; a dense model is no path of its own.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import mhl_jax.train.step as step_mod
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.moe.core import LocalMoE
from mhl_jax.moe.plan import resolve_kernels
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import batch_spec, make_mesh, state_shardings
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.schedule import make_schedule
from tests.models import loss_and_grads, small, tokens


def _remat_regions(jaxpr) -> int:
    """Rematerialised regions (jax.checkpoint) in a jaxpr, nested ones included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in ("remat", "checkpoint", "remat2")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _remat_regions(sub)
    return n


def _step(cfg, triton: bool):
    """(new state, metrics) of one train step of 2 micro-batches, and the step's jaxpr (the trace it compiles)."""
    mesh = make_mesh(cfg) if cfg.parallel.devices > 1 else None
    executor = LocalMoE(resolve_kernels(cfg.ffn.kernels)) if mesh is None else make_executor(cfg, mesh)
    if triton:
        executor.impl = "triton"  # what ffn.kernels=auto resolves to on a GPU (emulated on the CPU)
    graphdef, params, biases = nnx.split(build_model(cfg, executor=executor), nnx.Param, RouterBias)
    tx = make_optimizer(cfg)
    state = {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0)}
    batch = jnp.stack([tokens(cfg, 4), tokens(cfg, 4)[::-1]])
    schedule = make_schedule(cfg.optimizer, cfg.schedule)
    if mesh is None:
        step = jax.jit(step_mod.make_train_step(graphdef, tx, cfg.balance_gamma, schedule))
    else:
        sh, bsh = state_shardings(cfg, mesh, state), NamedSharding(mesh, batch_spec(mesh))
        step = step_mod.jit_train_step(graphdef, tx, cfg.balance_gamma, schedule, sh, bsh)
        state, batch = jax.device_put(state, sh), jax.device_put(batch, bsh)
    traced = step.trace(state, batch)
    return jax.device_get(traced.lower().compile()(state, batch)), traced.jaxpr.jaxpr


@pytest.mark.parametrize("kind, axis", [("mh_latent_moe", "hp"), ("moe", "ep")])
def test_block_remat_gives_the_same_step(emulated, kind, axis):
    extra = ("ffn.latent_dim=64", "ffn.head_dim=16") if kind == "mh_latent_moe" else ()
    base = small(kind, *extra, "model.compute_dtype=bfloat16", "ffn.num_experts=12", "ffn.expert_hidden=32",
                 f"parallel.{axis}=2", "parallel.devices=2")
    outs = {}
    for remat in ("none", "block"):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, remat=remat))
        outs[remat], jaxpr = _step(cfg, triton=True)
        assert _remat_regions(jaxpr) == (0 if remat == "none" else cfg.model.n_layers), remat
    (s0, m0), (s1, m1) = outs["none"], outs["block"]
    assert float(m0["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
    for a, b in zip(jax.tree.leaves((s0, m0)), jax.tree.leaves((s1, m1))):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "iub":  # step counter, expert loads: exact
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_block_remat_keeps_only_the_blocks_inputs():
    """What autodiff keeps for the backward (the residuals of jax.vjp of the loss): with "block", the parameters, each
    block's fp32 input (B x T x d) and a few arrays of that size for the LM head's loss; with "none", every block's
    activations too (attention scores, MoE packing, ...). Of a dense block (the stem) and two MoE blocks."""
    from mhl_jax.train.step import loss_fn

    kept = {}
    for remat in ("none", "block"):
        cfg = small("mh_latent_moe", f"model.remat={remat}", "model.context=128", "model.n_layers=3",
                    "parallel.devices=1")
        graphdef, params, biases = nnx.split(build_model(cfg), nnx.Param, RouterBias)
        toks = tokens(cfg, 8)
        vjp = jax.jit(lambda p, g=graphdef, b=biases, t=toks: jax.vjp(lambda q: loss_fn(g, q, b, t)[0], p)[1])(
            params)  # the backward's closure: its leaves are what the forward kept
        kept[remat] = sum(x.nbytes for x in jax.tree.leaves(vjp))
    block_input = 8 * 128 * cfg.model.d_model * 4
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert kept["block"] <= params_bytes + (cfg.model.n_layers + 4) * block_input, kept
    assert kept["none"] >= 5 * kept["block"], kept


def test_remat_is_not_part_of_the_checkpoint_fingerprint():
    a = small("mh_latent_moe")
    b = dataclasses.replace(a, model=dataclasses.replace(a.model, remat="block"))
    assert model_fingerprint(a) == model_fingerprint(b)  # a run resumes with remat switched
    c = dataclasses.replace(a, model=dataclasses.replace(a.model, d_model=32))
    assert model_fingerprint(a) != model_fingerprint(c)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mh_latent_moe", "moe"])
def test_gpu_block_remat_gives_the_same_gradients(kind):
    """On a GPU with the real Triton kernels (ffn.kernels=auto), bf16 compute: the same loss and expert loads, and
    gradients equal up to bf16 rounding. Here XLA may compile the recomputed forward with other fusions or GEMM
    algorithms than the first one, so a bf16 activation can differ by an ulp (on an H100, 48 of 24576 expert-weight
    entries were off by up to 2.8e-4 after one Adam step, whose first update is about lr * sign(g), so near-zero
    gradients flip it): compared here are the gradients themselves, by relative norm per leaf."""


    extra = ("ffn.latent_dim=64", "ffn.head_dim=16") if kind == "mh_latent_moe" else ()
    base = small(kind, *extra, "model.compute_dtype=bfloat16", "ffn.num_experts=12", "ffn.expert_hidden=32",
                 "parallel.devices=1", "model.n_layers=3", "model.context=128", "ffn.kernels=auto")
    t = tokens(base, 4)
    outs = []
    for remat in ("none", "block"):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, remat=remat))
        outs.append(loss_and_grads(cfg, LocalMoE(resolve_kernels(cfg.ffn.kernels)), t))
    (l0, loads0, g0), (l1, loads1, g1) = outs
    assert float(l0) == pytest.approx(float(l1), rel=1e-5)
    for i in loads0:
        np.testing.assert_array_equal(np.asarray(loads0[i]), np.asarray(loads1[i]))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a) > 0, path
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(a), (jax.tree_util.keystr(path),
                                                                   np.linalg.norm(a - b) / np.linalg.norm(a))
