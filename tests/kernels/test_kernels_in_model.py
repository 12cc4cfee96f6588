"""The model's `kernels: triton` path, end to end on CPU.

Both Triton bindings have an `emulate` backend: the same jax.custom_vjp, metadata and packing, with
pure-JAX stand-ins for the kernel launches. Routing the model through it checks the plumbing the GPU
run depends on (custom_vjp under jit, lax.scan gradient accumulation, value_and_grad, shard_map
HP/EP) against the pure-JAX reference path: same loss, same gradients, same expert loads.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mhl_jax.moe.gpu.fused as moe_triton
import mhl_jax.moe.gpu.grouped as experts_grouped
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.context import build_step_context, expert_weight_leaf
from mhl_jax.model.gpt import build_model
from mhl_jax.moe.context import ExpertContext, StepContext
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh
from tests.models import loss_and_grads_each, small, tokens


def assert_close(a, b, name=""):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-6, err_msg=name)


MH = ("ffn.latent_dim=64", "ffn.head_dim=16")  # MH-LatentMoE heads of 16: the fused kernels


def _check_against_reference(cfg, parallel_cfg, t):
    """The model of `cfg` through the Triton path (emulated) on one device and through the executor of
    `parallel_cfg`'s mesh, against the reference path: same loss, expert loads and gradients. The three in one
    program (one compile; a parallel config changes the executor, not the parameters)."""
    executor = make_executor(parallel_cfg, make_mesh(parallel_cfg))
    executor.impl = "triton"  # what ffn.kernels=auto resolves to on a GPU
    ref, *tri = loss_and_grads_each([(cfg, LocalMoE("reference")), (cfg, LocalMoE("triton")),
                                     (parallel_cfg, executor)], t)
    for name, got in zip(("one device", repr(executor)), tri):
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, err_msg=name)
        for i in ref[1]:
            np.testing.assert_array_equal(got[1][i], ref[1][i], err_msg=name)
        assert_close(got[2], ref[2], name)


@pytest.mark.parametrize("kind, par", [("mh_latent_moe", "parallel.hp=2"), ("moe", "parallel.ep=2")])
def test_triton_path_matches_reference(emulated, kind, par):
    """On one device and under shard_map: Head Parallel (hp 2 x data 2) for MH-LatentMoE, Expert Parallel (ep 2 x
    data 2) for MoE at d_model 64 (the fused kernels)."""
    extra = MH if kind == "mh_latent_moe" else ()
    cfg = small(kind, *extra)
    _check_against_reference(cfg, small(kind, *extra, par, "parallel.devices=4", "ffn.kernels=reference"), tokens(cfg))


def test_wide_moe_triton_path_runs_grouped_experts(emulated, monkeypatch):
    """MoE with experts wider than the fused kernels take (d_model 288 > 256): `triton` runs the grouped-GEMM
    binding (and the reference router), on one device and under Expert Parallel (ep = 2, data = 2), with
    the same loss, loads and gradients as the reference path."""
    wide = ("model.d_model=288", "ffn.expert_hidden=32", "parallel.ep=2")
    cfg = small("moe", *wide, "parallel.devices=1")
    calls = []
    emulate = experts_grouped.expert_ffn_grouped

    def counting(*a, **kw):
        calls.append(a[0].shape)
        return emulate(*a, **kw)

    monkeypatch.setattr(moe_triton, "moe_heads_fused", functools.partial(moe_triton.moe_heads_fused, backend="emulate"))
    monkeypatch.setattr(experts_grouped, "expert_ffn_grouped", counting)
    _check_against_reference(cfg, small("moe", *wide, "parallel.devices=4"), tokens(cfg))
    assert len(calls) == 2 and all(shape[-1] == 288 for shape in calls)  # one device, and EP


def test_kernel_choice_and_expert_path(monkeypatch):
    """auto -> triton where jax-triton runs, reference elsewhere; triton's expert path by input width:
    the fused kernels up to 256 (MH-LatentMoE heads), grouped GEMM above (MoE at d_model 1024 failed to
    launch the fused kernels' tiles); triton without a GPU is refused."""
    import mhl_jax.moe.plan as ks

    monkeypatch.setattr(ks, "triton_available", lambda: True)
    assert ks.resolve_kernels("auto") == "triton" and ks.resolve_kernels("triton") == "triton"
    assert ks.resolve_kernels("reference") == "reference"
    assert ks.triton_expert_path(1024) == "grouped" and ks.triton_expert_path(256) == "grouped"
    assert ks.triton_expert_path(128) == "fused" and ks.triton_expert_path(32) == "fused"
    monkeypatch.setattr(ks, "triton_available", lambda: False)
    assert ks.resolve_kernels("auto") == "reference"
    with pytest.raises(ks.ConfigError, match="needs a GPU"):
        ks.resolve_kernels("triton")
    with pytest.raises(ValueError, match="kernels='fast'"):
        ks.resolve_kernels("fast")


def _weight_casts_in(jaxpr, shapes) -> int:
    """fp32 -> bf16 converts of an input of jaxpr (or of a reshape of one) shaped like an expert weight, in jaxpr and
    every sub-jaxpr: the weights' casts (the emulated backward also rounds fp32 arrays of a weight's shape that it
    computed: not counted)."""
    n = 0
    inputs = set(v for v in jaxpr.invars) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reshape" and eqn.invars[0] in inputs:
            inputs.add(eqn.outvars[0])
        if eqn.primitive.name == "convert_element_type" and eqn.invars[0] in inputs:
            a = eqn.invars[0].aval
            n += a.shape in shapes and a.dtype == jnp.float32 and eqn.outvars[0].aval.dtype == jnp.bfloat16
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _weight_casts_in(sub, shapes)
    return n


def _scan_bodies(jaxpr):
    """The bodies of the outermost scans (the step's micro-batch loop; not the scans inside it, such as the LM head
    loss's loop over chunks)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _scan_bodies(sub)


def _weight_adds_in(body, shapes) -> int:
    """fp32 adds shaped like a whole expert weight directly in the loop body: the loop's own gradient accumulation."""
    return sum(e.primitive.name == "add" and e.outvars[0].aval.shape in shapes
               and e.outvars[0].aval.dtype == jnp.float32 for e in body.eqns)


def _partial_context(part: str):
    """`build_step_context` keeping only its casts ("casts"), only its in-place layers ("sums") or nothing ("none"):
    the step then passes the model no context at all, as a plain call."""
    def build(model, accumulate=False):
        ctx = build_step_context(model, accumulate)
        if part == "none":
            return StepContext()
        return StepContext(casts=ctx.casts) if part == "casts" else StepContext(accumulating=ctx.accumulating)

    return build


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_train_step_expert_weight_casts_and_in_place_sums(emulated, monkeypatch, devices):
    """bf16 compute, fp32 masters, the fused Triton core (emulated), on one device, under Head Parallel (hp 2, data 1)
    and hp 2 x data 2. The step context (`build_step_context`) casts the expert weights before the micro-batch loop
    (the loop body then holds no cast of an expert weight; without the context it does), and hands the expert weights'
    running gradient sums to the MoE op, whose backward returns sum + gradient (the loop body then holds no add of an
    expert weight's shape; without it, or with data parallelism, where shard_map would sum the accumulators over
    `data`, it does). The context gives bitwise the new state and metrics of the step without one.
    Each part of the context alone (on one device) is checked in the step's program; their values, and the grouped
    experts' (MoE wider than the fused kernels take: the same step, context and executor), in the op's
    (test_moe_heads_grad_acc_returns_sum_plus_gradient)."""
    from jax.sharding import NamedSharding

    import mhl_jax.train.step as step_mod
    from mhl_jax.parallel.mesh import batch_spec, state_shardings
    from mhl_jax.train.optimizer import make_optimizer
    from mhl_jax.train.schedule import make_schedule

    cfg = small("mh_latent_moe", "ffn.latent_dim=64", "ffn.head_dim=16", "parallel.hp=2",
                "model.compute_dtype=bfloat16", "ffn.num_experts=12", "ffn.expert_hidden=32",
                f"parallel.devices={devices}", "ffn.kernels=reference")  # expert weight shapes no activation has
    mesh = make_mesh(cfg) if devices > 1 else None
    executor = LocalMoE("triton") if mesh is None else make_executor(cfg, mesh)
    executor.impl = "triton"  # what ffn.kernels=auto resolves to on a GPU
    graphdef, params, biases = nnx.split(build_model(cfg, executor=executor), nnx.Param, RouterBias)
    tx = make_optimizer(cfg)
    state = {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0)}
    batch = jnp.stack([tokens(cfg, 4), tokens(cfg, 4)[::-1]])  # 2 micro-batches
    weights = [w for path, w in jax.tree_util.tree_leaves_with_path(params) if expert_weight_leaf(path)]
    assert len(weights) == 2
    # whole or one hp shard's heads, and (H * Ne, ...) as the ops reshape them
    shapes = {s for w in weights for h in (w.shape[0], w.shape[0] // 2) for s in ((h, *w.shape[1:]),
                                                                                (h * w.shape[1], *w.shape[2:]))}
    in_place_possible = devices < 4
    parts = ["none", "all"] + (["casts", "sums"] if devices == 1 else [])
    outs = []
    for part in parts:
        monkeypatch.setattr(step_mod, "build_step_context",
                            build_step_context if part == "all" else _partial_context(part))
        sched = make_schedule(cfg.optimizer, cfg.schedule)
        if mesh is None:
            fn, args = jax.jit(step_mod.make_train_step(graphdef, tx, cfg.balance_gamma, sched)), (state, batch)
        else:
            sh, bsh = state_shardings(cfg, mesh, state), NamedSharding(mesh, batch_spec(mesh))
            fn = step_mod.jit_train_step(graphdef, tx, cfg.balance_gamma, sched, sh, bsh)
            args = (jax.device_put(state, sh), jax.device_put(batch, bsh))
        traced = fn.trace(*args)  # the program that is then compiled and run
        jaxpr = traced.jaxpr.jaxpr
        bodies = list(_scan_bodies(jaxpr))
        assert len(bodies) == 1
        once, in_place = part in ("all", "casts"), part in ("all", "sums")
        casts_in_loop = _weight_casts_in(bodies[0], shapes)
        assert (casts_in_loop == 0) if once else (casts_in_loop >= 2), (part, casts_in_loop)
        if once:
            assert _weight_casts_in(jaxpr, shapes) >= 2  # w1 and w2 of the MoE layer, outside the loop
        adds = _weight_adds_in(bodies[0], {w.shape for w in weights})
        assert adds == (0 if in_place and in_place_possible else 2), (part, adds)
        if part in ("none", "all"):
            outs.append(jax.device_get(traced.lower().compile()(*args)))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(a, b)


def _moe_args(seed: int, n: int, h: int, dh: int, ne: int, de: int, scale: float):
    """(x bf16, W_r, w1, w2) of an MoE core and random running sums (acc1, acc2) shaped as w1 / w2 (numpy's
    generator: JAX's compiles a program per shape)."""
    rng = np.random.default_rng(seed)
    x, w_r, w1, w2, acc1, acc2 = (rng.standard_normal(s, dtype=np.float32) for s in (
        (n, h, dh), (h, dh, ne), (h, ne, dh, de), (h, ne, de, dh), (h, ne, dh, de), (h, ne, de, dh)))
    args = (jnp.asarray(x.astype(jnp.bfloat16)), jnp.asarray(w_r), jnp.asarray(scale * w1), jnp.asarray(scale * w2))
    return args, (jnp.asarray(acc1), jnp.asarray(acc2))


def _assert_sum_plus_gradient(run, args, acc):
    """run(x, w_r, w1, w2, grad_acc) -> y: with grad_acc the gradients of w1 / w2 are bitwise acc + those without, x's
    and W_r's the same."""
    def grads(grad_acc):
        loss = lambda *a: jnp.sum(run(*a, grad_acc).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    plain, summed = grads(None), grads(acc)
    for a, b in zip(plain[:2], summed[:2]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(summed[2], acc[0] + plain[2])
    np.testing.assert_array_equal(summed[3], acc[1] + plain[3])


@pytest.mark.parametrize("path", ["reference", "fused", "apart", "grouped"])
def test_moe_heads_grad_acc_returns_sum_plus_gradient(emulated, path):
    """`moe_heads(..., grad_acc=(a1, a2))`: the gradients of w1 / w2 come back as a + dW, bitwise the add of the plain
    gradients, on the reference path, the fused Triton core (added in its backward), the Triton ops apart (x_route
    not x_expert: `accumulate_grad`) and the grouped experts (dh > 256: added by the wgrad kernel); the other
    gradients unchanged. On the Triton paths the same with the expert weights handed in cast (`weights_cast`, as the
    train step's context makes them; the reference path refuses them), with and without grad_acc: the cast weights
    change no gradient. All variants in one program (one compile: XLA shares their forward)."""
    from mhl_jax.moe.core import moe_heads

    h, ne, k = 2, 8, 2
    args, acc = _moe_args(3, 32, h, 16 if path != "grouped" else 272, ne, 32, 0.2)
    impl = "reference" if path == "reference" else "triton"

    def grads(grad_acc, weights_cast, *a):
        def loss(x, w_r, w1, w2):
            xr = x if path != "apart" else x + jnp.bfloat16(0)  # another array: routed apart from the experts' input
            y = moe_heads(xr, x, w_r, jnp.zeros((h, ne)), w1, w2, k, impl, weights_cast=weights_cast,
                          grad_acc=grad_acc)[0]
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(*a)

    sums = [False, True]
    casts = [False] + ([True] if impl == "triton" else [])
    variants = [(s, c) for c in casts for s in sums]

    @jax.jit
    def every_variant(acc, x, w_r, w1, w2):
        cast = (w1.astype(x.dtype), w2.astype(x.dtype))  # made outside the differentiated function, as the step's
        return [grads(acc if s else None, cast if c else None, x, w_r, w1, w2) for s, c in variants]

    if impl == "triton":  # given the casts, the op casts no expert weight itself (the step's loop body: no cast)
        shapes = {t for w in args[2:] for t in (w.shape, (h * ne, *w.shape[2:]))}
        for c in casts:
            jaxpr = jax.make_jaxpr(lambda x, w_r, w1, w2, c1, c2, c=c: grads(acc, (c1, c2) if c else None,
                                                                             x, w_r, w1, w2))
            n = _weight_casts_in(jaxpr(*args, *(jax.ShapeDtypeStruct(w.shape, jnp.bfloat16) for w in args[2:])).jaxpr,
                                 shapes)
            assert (n == 0) if c else (n >= 2), (c, n)
    plain, *others = every_variant(acc, *args)
    for (s, c), got in zip(variants[1:], others):
        for a, b in zip(plain[:2], got[:2]):
            np.testing.assert_array_equal(a, b, err_msg=f"grad_acc {s}, weights_cast {c}")
        for i in (2, 3):
            np.testing.assert_array_equal(got[i], acc[i - 2] + plain[i] if s else plain[i],
                                          err_msg=f"grad_acc {s}, weights_cast {c}")


@pytest.mark.gpu
@pytest.mark.parametrize("de, kernel, collapsed", [(256, "bwd_ws", False), (256, "bwd_xw", False),
                                                   (256, "dw_ws", False), (128, "bwd_ws", False),
                                                   (128, "bwd_xw", False), (256, "bwd_ws", True),
                                                   (256, "bwd_xw", True), (256, "dw_ws", True)])
def test_gpu_expert_backward_adds_into_the_accumulators(de, kernel, collapsed):
    """On the GPU's kernels (the Gluon backward with and without its dX warp group, the Gluon dW kernel beside the
    Triton dX kernel): the fused core's w1 / w2 gradients with grad_acc (added in the kernel, the accumulators aliased
    to its outputs) are bitwise acc + the gradients without; x's and W_r's unchanged. Collapsed: the bias sends every
    token to the same k experts, whose tiles the kernels sum in chunks (`kernels.gluon.schedule`), and the other
    experts' tiles are empty (skipped while accumulating)."""
    from dataclasses import replace

    from mhl_jax.moe import plan
    from mhl_jax.moe.gpu import fused as moe_triton

    n, h, dh, ne, k = 8192, 2, 128, 16, 4
    cfg = plan.experts_config(n * h * k, h * ne, dh, de, None)
    cfg = replace(cfg, bwd_ws=kernel != "dw_ws", bwd_xw=kernel == "bwd_xw", dw_ws=True)
    want = {"bwd_ws": "gluon-ws", "bwd_xw": "gluon-ws-xw", "dw_ws": "triton-split-gluon-dw"}[kernel]
    assert plan.expert_bwd_kernel(cfg, jnp.bfloat16, dh, de, "triton") == want, (kernel, cfg)
    args, acc = _moe_args(4, n, h, dh, ne, de, 0.1)

    bias = jnp.zeros((h, ne)).at[:, :k].set(1e3 if collapsed else 0.0)

    def run(x, w_r, w1, w2, grad_acc):
        return moe_triton.moe_heads_fused(x, w_r, bias, w1, w2, k, cfg, grad_acc=grad_acc)[0]

    # the schedule's chunk (kernels.gluon.schedule): collapsed, the busy experts' tiles are split (with as few tiles
    # as programs here, random routing's may be too)
    load = np.asarray(moe_triton.moe_heads_fused(*args[:2], bias, *args[2:], k, cfg)[1])
    blocks = -(-load.reshape(-1) // 32)  # the kernels' 32-row blocks per group
    programs = min(plan.hopper_sms(), h * ne * (de // 128))
    assert (blocks > -(-blocks.sum() * (de // 128) // (2 * programs))).any() or not collapsed, load
    _assert_sum_plus_gradient(run, args, acc)


def test_weights_cast_and_grad_acc_errors(emulated):
    """Clear errors where the expert weights' copies or the running sums cannot be taken."""
    from mhl_jax.moe.core import moe_heads
    from mhl_jax.parallel.expert_parallel import ExpertParallelMoE
    from mhl_jax.parallel.head_parallel import HeadParallelMoE

    (x, w_r, w1, w2), acc = _moe_args(5, 16, 2, 16, 8, 32, 0.2)
    bias = jnp.zeros((2, 8))
    casts = (w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="weights_cast= is read only by the Triton experts.*impl 'reference'"):
        moe_heads(x, x, w_r, bias, w1, w2, 2, "reference", weights_cast=casts)
    with pytest.raises(ValueError, match="cast=True .* and weights_cast= .* exclude each other"):
        moe_triton.moe_heads_fused(x, w_r, bias, w1, w2, 2, cast=True, weights_cast=casts)
    with pytest.raises(ValueError, match="grad_acc .* must be shaped and typed as w1"):
        moe_triton.moe_heads_fused(x, w_r, bias, w1, w2, 2, grad_acc=casts)
    with pytest.raises(ValueError, match="grad_acc must be shaped and typed as fp32 w1"):  # traced: not run
        jax.eval_shape(lambda: experts_grouped.expert_ffn_grouped(x, jnp.zeros((16, 2, 2), jnp.int32),
                                                                  jnp.ones((16, 2, 2)), w1, w2, grad_acc=casts))
    mesh = make_mesh(small("mh_latent_moe", "ffn.latent_dim=64", "ffn.head_dim=16", "parallel.hp=2",
                           "parallel.devices=4"))
    with pytest.raises(ValueError, match="grad_acc= needs a mesh without data parallelism"):
        HeadParallelMoE(mesh, "triton")(x, x, w_r, bias, w1, w2, 2, ctx=ExpertContext(grad_acc=acc))
    assert not HeadParallelMoE(mesh, "triton").accumulates_in_place(jnp.bfloat16, jnp.float32, 16)
    ep_mesh = make_mesh(small("moe", "parallel.ep=2", "parallel.devices=2"))
    with pytest.raises(ValueError, match="ExpertParallelMoE: takes neither"):
        ExpertParallelMoE(ep_mesh, "triton")(x, x, w_r, bias, w1, w2, 2, ctx=ExpertContext(weights_cast=casts))
