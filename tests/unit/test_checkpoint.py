"""Checkpoints (issue 3): bitwise save/restore of a training-state pytree and the Grain iterator,
keep-last-N, explicit paths, fingerprint and layout errors, and atomicity under SIGKILL."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mhl_jax.config import CheckpointConfig, ConfigError, DataConfig, load_config
from mhl_jax.data import make_train_loader
from mhl_jax.model.gpt import GPT
from mhl_jax.runtime.checkpoint import Checkpointer, CheckpointError
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.runtime.orbax_quiet import quiet_failed_reads

ROOT = Path(__file__).resolve().parents[2]
FP = {"model": {"d_model": 64, "n_layers": 2}, "ffn": {"kind": "mh_latent_moe", "num_experts": 16, "top_k": 2}}
DATA = DataConfig(prefetch=2, read_threads=2)  # the built-in corpus


def make_state(seed: int, big: int = 0, sharding=None) -> dict:
    """A training-state-like pytree whose every value depends on `seed` (optax state included)."""
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
              "emb": jnp.asarray(rng.standard_normal((5, 2)), jnp.bfloat16),
              "layers": [{"scale": jnp.asarray(rng.standard_normal(4), jnp.float32)} for _ in range(2)]}
    if big:
        params["big"] = jnp.asarray(rng.standard_normal(big), jnp.float32)
    if sharding is not None:
        params["w"] = jax.device_put(params["w"], sharding)
    opt_state = optax.adamw(1e-3).init(params)
    opt_state = jax.tree.map(lambda x: x + jnp.asarray(rng.standard_normal(x.shape), x.dtype), opt_state)
    return {"params": params, "opt_state": opt_state, "biases": rng.standard_normal((2, 3)).astype(np.float32),
            "step": jnp.int32(seed), "rng": jax.random.key_data(jax.random.key(seed)),
            "key": jax.random.key(seed + 1)}


def leaves(state) -> list[np.ndarray]:
    out = []
    for x in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def assert_bitwise(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bitwise, NaN payloads and -0.0 included


def loader():
    return make_train_loader(DATA, seq_len=16, batch_size=4, seed=0, vocab_size=320)


def test_save_restore_bitwise_with_iterator_async(tmp_path):
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    ck = Checkpointer(tmp_path / "ck", CheckpointConfig(keep=3, async_save=True), FP)
    it = loader()
    for _ in range(5):
        next(it)
    state = make_state(1, sharding=sharded)
    expected = jax.tree.map(lambda x: x.copy() if isinstance(x, np.ndarray) else x, jax.device_get(state))
    ck.save(7, state, it)
    for x in jax.tree.leaves(state):  # the train step donates the state right after save
        if isinstance(x, jax.Array):
            x.delete()
    after_save = [next(it) for _ in range(3)]  # the iterator moves on while the save is in flight
    ck.wait()
    assert ck.latest_step() == 7
    fresh = loader()
    step, got = ck.restore(make_state(2, sharding=sharded), fresh)
    assert step == 7
    assert_bitwise(got, expected)
    assert got["params"]["w"].sharding == sharded  # the template's sharding
    assert isinstance(got["biases"], np.ndarray)  # numpy leaves come back as numpy
    assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
    assert all(np.array_equal(a, next(fresh)) for a in after_save)
    # an abstract template (jax.eval_shape, no arrays allocated) restores the same values
    abstract = jax.eval_shape(lambda: make_state(2))
    abstract["biases"] = np.zeros((2, 3), np.float32)
    _, again = ck.restore(abstract, None)
    assert_bitwise(again, expected)
    ck.close()


def test_keep_last_n_steps_and_explicit_paths(tmp_path):
    d = tmp_path / "ck"
    ck = Checkpointer(d, CheckpointConfig(keep=2, async_save=False), FP)
    assert ck.latest_step() is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ck.restore(make_state(0), None)
    for s in range(1, 5):
        ck.save(s, make_state(s), None)
    assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
    with pytest.raises(CheckpointError, match="cannot save step 2 .* newer than the latest"):
        ck.save(2, make_state(2), None)
    assert sorted(p.name for p in d.iterdir() if p.name.isdigit()) == ["3", "4"]
    step, got = ck.restore(make_state(0), None, step=3)
    assert step == 3
    assert_bitwise(got, make_state(3))
    other = Checkpointer(tmp_path / "elsewhere", CheckpointConfig(), FP)  # --resume PATH from another run
    for path, want in ((d / "3", 3), (d, 4), (str(d / "4"), 4)):
        step, got = other.restore(make_state(0), None, path=path)
        assert step == want
        assert_bitwise(got, make_state(want))
    with pytest.raises(CheckpointError, match="no checkpoint of step 1 .* steps there: \\[3, 4\\]"):
        ck.restore(make_state(0), None, step=1)
    with pytest.raises(CheckpointError, match="missing.*does not exist"):
        other.restore(make_state(0), None, path=tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match="plain.*is not a checkpoint"):
        other.restore(make_state(0), None, path=tmp_path / "plain")
    with pytest.raises(CheckpointError, match="holds no data-iterator state"):
        ck.restore(make_state(0), loader())
    ck.close()
    other.close()


def test_fingerprint_is_compared_on_the_restoring_runs_keys(tmp_path):
    """A checkpoint whose fingerprint holds a key this run's leaves out (an FFN key of no use to its kind) restores;
    one that differs on a key the run holds, or lacks it, is refused naming the key."""
    extra = {"model": FP["model"], "ffn": {**FP["ffn"], "head_dim": 128}}
    with Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False), extra) as ck:
        ck.save(1, make_state(1), None)
    with Checkpointer(tmp_path / "ck", CheckpointConfig(), FP) as ck:
        assert_bitwise(ck.restore(make_state(0), None)[1], make_state(1))
        assert ck.check_restorable(make_state(0)) == 1
    for other, named in (({"model": FP["model"], "ffn": {**FP["ffn"], "top_k": 4}}, "ffn.top_k: checkpoint 2, "
                          "this run 4"), ({**FP, "new": {"key": 1}}, "new.key: checkpoint '<absent>', this run 1")):
        with Checkpointer(tmp_path / "ck", CheckpointConfig(), other) as ck:
            for call in (lambda: ck.restore(make_state(0), None), lambda: ck.check_restorable(make_state(0))):
                with pytest.raises(CheckpointError, match=f"different model config \\({named}\\)"):
                    call()


def test_check_restorable_chooses_the_step_restore_restores(tmp_path):
    """With the latest checkpoint's meta damaged, `check_restorable` (train.py --check) names the older step that the
    fallback restores, and refuses it where restoring would: by name, or with checkpoint.on_damage=stop."""
    with Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False), FP) as ck:
        for step in (1, 2):
            ck.save(step, make_state(step), None)
    for f in (tmp_path / "ck" / "2" / "meta").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0" * 7)
    with Checkpointer(tmp_path / "ck", CheckpointConfig(), FP, read_only=True) as ck:
        assert ck.check_restorable(make_state(0)) == 1
        with pytest.raises(CheckpointError, match="its meta cannot be read .*; steps there: \\[1\\]"):
            ck.check_restorable(make_state(0), path=tmp_path / "ck" / "2")
    with Checkpointer(tmp_path / "ck", CheckpointConfig(on_damage="stop"), FP, read_only=True) as ck:
        with pytest.raises(CheckpointError, match="ck/2: its meta cannot be read"):
            ck.check_restorable(make_state(0))


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_moe", "tiny_latent_moe", "tiny_mh_latent_moe"])
def test_fingerprint_leaves_out_only_ffn_keys_the_kind_ignores(name):
    """Each FFN key the fingerprint of a kind leaves out (its kernels and balance_gamma aside) changes neither the
    fingerprint nor the model (its parameters' shapes and its logits, same init); each key it holds that the config
    lets change changes the model. (A key dropped from the kind's keys, or one held that the kind ignores, fails.)"""
    path = str(ROOT / "configs" / f"{name}.yaml")
    tokens = jnp.arange(8, dtype=jnp.int32)[None] * 7

    def build(*sets):
        cfg = load_config(path, ["model.n_layers=2", "model.context=8", "parallel.devices=1", *sets])
        shapes = jax.eval_shape(lambda: nnx.state(GPT(cfg, nnx.Rngs(0)), nnx.Param))
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
        return model_fingerprint(cfg), shapes, lambda: np.asarray(GPT(cfg, nnx.Rngs(0))(tokens)[0])  # shapes agree

    base = build()
    base_logits = base[2]()
    ffn = dataclasses.asdict(load_config(path).ffn)
    held, left_out = set(base[0]["ffn"]) - {"kind"}, set(ffn) - set(base[0]["ffn"]) - {"kernels", "balance_gamma"}
    assert left_out and held | left_out | {"kind", "kernels", "balance_gamma"} == set(ffn)
    tried = set()
    for key in sorted(held | left_out):
        value = ffn[key]
        changed = {"shared": "separate", "separate": "shared"}.get(value) if isinstance(value, str) else value * 2
        if key == "stem_layers":
            changed = 1 if value != 1 else 2
        try:
            fp, shapes, logits = build(f"ffn.{key}={changed}")
        except ConfigError:  # a value the config refuses (latent_dim != Nh x dh; separate routing outside MH)
            continue
        tried.add(key)
        same_model = shapes == base[1] and np.array_equal(logits(), base_logits)
        assert fp == base[0] if key in left_out else fp != base[0], key
        assert same_model == (key in left_out), key
    # (each of mh_latent_moe's num_heads, head_dim, latent_dim alone breaks Nh x dh = latent_dim: refused)
    assert left_out & tried and held <= tried | {"latent_dim", "routing_tokens", "num_heads", "head_dim"}


CHILD_STUCK = """
import sys, time
from mhl_jax.config import CheckpointConfig
from mhl_jax.runtime.checkpoint import Checkpointer
from tests.unit.test_checkpoint import FP, loader, make_state

class StuckIterator:  # blocks inside the save, after Orbax has created the temporary directory
    def get_state(self):
        print("saving", flush=True)
        time.sleep(600)

ck = Checkpointer(sys.argv[1], CheckpointConfig(keep=3, async_save=False), FP)
it = loader()
next(it), next(it)
ck.save(1, make_state(1), it)
print("saved", flush=True)
ck.save(2, make_state(2), StuckIterator())
"""

CHILD_LOOP = """
import sys
from mhl_jax.config import CheckpointConfig
from mhl_jax.runtime.checkpoint import Checkpointer
from tests.unit.test_checkpoint import FP, make_state

ck = Checkpointer(sys.argv[1], CheckpointConfig(keep=2, async_save=True), FP)
for step in range(1, 1000):
    ck.save(step, make_state(step, big=1 << 20), None)
    print(step, flush=True)
"""


def spawn(code: str, directory: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    return subprocess.Popen([sys.executable, "-c", code, str(directory)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def wait_for(proc: subprocess.Popen, line: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"child never printed {line!r} (exit code {proc.poll()})")


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    d = tmp_path / "ck"
    proc = spawn(CHILD_STUCK, d)
    wait_for(proc, "saved")
    wait_for(proc, "saving")
    temporary = [p.name for p in d.iterdir() if not p.name.isdigit()]
    assert any("tmp" in name for name in temporary), temporary  # the kill lands inside save 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ck = Checkpointer(d, CheckpointConfig(keep=3, async_save=False), FP)
    assert ck.latest_step() == 1 and ck.all_steps() == [1]  # the half-written save does not count
    it = loader()
    step, got = ck.restore(make_state(0), it)
    assert step == 1
    assert_bitwise(got, make_state(1))
    reference = loader()
    for _ in range(2):
        next(reference)
    assert all(np.array_equal(next(it), next(reference)) for _ in range(3))
    ck.save(2, make_state(2), it)  # and the run goes on saving
    assert ck.all_steps() == [1, 2]
    assert sorted(p.name for p in d.iterdir()) == ["1", "2"]  # the half-written save was removed
    assert_bitwise(ck.restore(make_state(0), None)[1], make_state(2))
    ck.close()


def test_kill_at_an_arbitrary_moment_of_async_saves(tmp_path):
    d = tmp_path / "ck"
    proc = spawn(CHILD_LOOP, d)
    wait_for(proc, "3")
    time.sleep(0.13)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ck = Checkpointer(d, CheckpointConfig(keep=2), FP)
    step = ck.latest_step()
    assert step is not None and step >= 2
    got_step, got = ck.restore(make_state(0, big=1 << 20), None)
    assert got_step == step
    assert_bitwise(got, make_state(step, big=1 << 20))
    ck.close()


def test_close_waits_for_the_cleanup_of_leftover_temporary_directories(tmp_path):
    """A step directory a killed save left unfinished (Orbax's temporary name) is gone once the Checkpointer that
    opened the directory is closed: close waits for Orbax's background cleanup, which would otherwise still run at
    interpreter exit (and print its thread's traceback there) in a run that stops at once."""
    (tmp_path / "ck").mkdir()
    left = tmp_path / "ck" / "7.orbax-checkpoint-tmp-123"
    (left / "state").mkdir(parents=True)
    (left / "state" / "x").write_bytes(b"partial")
    for _ in range(3):
        ck = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=True), FP)
        ck.close()
        assert not left.exists()
        (left / "state").mkdir(parents=True)  # again for the next round


def test_closed_loop_callbacks_are_dropped_after_a_failed_restore(monkeypatch):
    """After a failed restore only RuntimeError('Event loop is closed') from tensorstore's late callbacks is dropped
    from sys.unraisablehook; any other unraisable exception still reaches the hook that was there before (once, even
    if the filter is installed twice)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    quiet_failed_reads()
    quiet_failed_reads()
    closed, other, loop_other = (RuntimeError("Event loop is closed"), ValueError("x"),
                                 RuntimeError("Event loop is running"))
    for exc in (closed, other, loop_other):
        sys.unraisablehook(types.SimpleNamespace(exc_value=exc))
    assert seen == [other, loop_other]
