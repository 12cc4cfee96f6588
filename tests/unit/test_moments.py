"""`optimizer.moment_dtype`: AdamW's moments stored in bf16 between steps.

The bf16 update must be optax's own AdamW applied to the widened moments (bitwise), the float32 setting must be
optax's AdamW itself, a run must repeat and resume bitwise, and the state's memory must fall by the moments' half.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mhl_jax.config import load_config
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.checkpoint import CheckpointError
from mhl_jax.runtime.memory import GIB, StepMemory, check_fits, per_device_bytes
from mhl_jax.runtime.state import state_creator
from mhl_jax.train.loop import train
from mhl_jax.train.optimizer import make_optimizer, stored_in
from mhl_jax.train.state import moment_dtype_saving
from tests.runs import tiny

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*extra):
    return load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), list(extra))


def _floats_as(tree, dtype):
    """Every floating-point leaf cast (our optimizer's only float leaves are the moments)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def test_only_the_moments_are_stored_in_bf16():
    tx = stored_in(optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=0.01), "bfloat16")
    params = {"w": jnp.ones((4, 3))}
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    inner = state.inner_state[0]
    assert inner.mu["w"].dtype == inner.nu["w"].dtype == jnp.bfloat16
    assert {jnp.dtype(v.dtype) for v in state.hyperparams.values()} == {jnp.dtype(jnp.float32)}  # left alone


def test_float32_moments_are_optax_adamw_itself():
    tx = optax.sgd(0.1)
    assert stored_in(tx, "float32") is tx
    assert stored_in(tx, jnp.float32) is tx


def test_bf16_update_is_adamw_on_the_widened_moments():
    ks = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(ks[0], (16, 8)), "norm": jax.random.normal(ks[1], (8,))}
    low, full = make_optimizer(_cfg("optimizer.moment_dtype=bfloat16")), make_optimizer(_cfg())
    state = low.init(params)
    assert {a.dtype for a in jax.tree.leaves(state) if a.ndim} == {jnp.dtype(jnp.bfloat16)}
    for i in range(3):
        grads = jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.fold_in(ks[2], i), p.shape) * (i + 1), params)
        upd, new = jax.jit(low.update)(grads, state, params)
        ref_upd, ref_new = jax.jit(full.update)(grads, _floats_as(state, jnp.float32), params)  # optax's AdamW
        for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(ref_upd)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(_floats_as(ref_new, jnp.bfloat16))):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert any(np.any(np.asarray(a, np.float32) != np.asarray(b)) for a, b in
                   zip(jax.tree.leaves(new), jax.tree.leaves(ref_new)) if a.ndim)  # the rounding is real
        state, params = new, jax.tree.map(lambda p, u: p + u, params, upd)


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _tiny(tmp_path, name, *extra):
    """tests.runs.tiny at one layer (the dense stem: the moments are stored alike for every parameter, and its steps
    compile in a fraction of a MoE layer's time), 16 steps, a checkpoint at 8."""
    return tiny(tmp_path, "model.n_layers=1", "schedule.total_steps=16", "data.eval_every=0", "checkpoint.every=8",
                "checkpoint.async_save=false", f"logging.run_dir={tmp_path / name}", *extra)


def test_bf16_moments_train_repeat_and_resume_bitwise(tmp_path):
    quiet = lambda *a, **k: None  # noqa: E731
    bf16 = ("optimizer.moment_dtype=bfloat16",)
    train(_tiny(tmp_path, "a", *bf16), log=quiet)
    train(_tiny(tmp_path, "b", *bf16), log=quiet, stop_after=8)
    train(_tiny(tmp_path, "b", *bf16), log=quiet)  # resumed from step 8
    train(_tiny(tmp_path, "f32"), log=quiet)
    a, b, f32 = _losses(tmp_path / "a"), _losses(tmp_path / "b"), _losses(tmp_path / "f32")
    assert len(a) == len(b) == 16 and a == b  # repeat and resume: bitwise
    assert a[-1] < a[0] - 1.0  # it trains
    assert a[:1] == f32[:1] and a != f32  # the first step's loss precedes any update; then the rounding shows
    np.testing.assert_allclose(a, f32, rtol=0.03)
    with pytest.raises(CheckpointError, match=r"bfloat16\(4, 32, 128\) \(the optimizer's moments: set optimizer."
                                              r"moment_dtype=float32 as the run that wrote it had\)"):
        train(_tiny(tmp_path, "f32", *bf16, "schedule.total_steps=20"), log=quiet)  # the other setting: named


@pytest.mark.parametrize("config, devices, sets", [
    ("mh_latent_moe_hp_2.2b.yaml", 1, ()),
    ("mh_latent_moe_hp_4.2b.yaml", 2, ("parallel.hp=2",)),
    ("mh_latent_moe_hp_2.2b.yaml", 2, ("parallel.hp=1", "parallel.shard_optimizer=true"))])
def test_bf16_moments_halve_the_moments_of_the_paper_state(config, devices, sets):
    def opt_bytes(*more):
        cfg = load_config(str(ROOT / "configs" / config), [*sets, f"parallel.devices={devices}",
                                                            "train.micro_batch=1", *more])
        mesh = make_mesh(cfg)
        _, _, abstract = state_creator(cfg, mesh, make_optimizer(cfg))
        return cfg, abstract, per_device_bytes(abstract["opt_state"])

    cfg32, abstract32, b32 = opt_bytes()
    cfg16, abstract16, b16 = opt_bytes("optimizer.moment_dtype=bfloat16")
    saving = moment_dtype_saving(cfg32, abstract32)
    assert saving > 0 and moment_dtype_saving(cfg16, abstract16) == 0
    assert abs((b32 - b16) - saving) <= 16  # the int32 step counters stay
    assert b16 == pytest.approx(b32 / 2, rel=1e-6)
    memory = StepMemory(arguments=int(60 * GIB), outputs=0, temporaries=int(10 * GIB), aliased=0)
    with pytest.raises(Exception, match=rf"optimizer.moment_dtype=bfloat16 \({saving / GIB:.2f} GiB less per"):
        check_fits(memory, (int(60 * GIB), "H100"), cfg32, devices, 0, saving)
