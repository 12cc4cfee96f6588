"""Verified checkpoints (issue 53): checksums and finiteness from one device pass, a save that refuses a non-finite
state, a restore that skips a damaged latest checkpoint (moved aside, never deleted) or refuses it, and the config
refusing the settings that made non-finite states.

Small pytrees written with the Checkpointer directly, no training. A flipped bit is planted in the bytes Orbax wrote:
an incompressible uint32 leaf of 4 KB is stored verbatim (zstd keeps random bytes raw) in the OCDBT data files under
state/ocdbt.process_0/d/, and tensorstore reads it back without noticing (`test_a_flipped_bit_...` shows it).
"""

import json
import logging
import os
import shutil
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from mhl_jax.config import CheckpointConfig, load_config
from mhl_jax.runtime import checkpoint
from mhl_jax.runtime.checkpoint import Checkpointer, CheckpointError
from mhl_jax.runtime.checkpoint_integrity import leaf_sums
from mhl_jax.runtime.orbax_quiet import quiet_failed_reads

ROOT = Path(__file__).resolve().parents[2]
FP = {"model": {"d_model": 8}, "ffn": {"kind": "mlp"}}
SYNC = CheckpointConfig(keep=5, async_save=False)


def make_state(seed: int) -> dict:
    """A train-state-like pytree: fp32 and bf16 parameters, AdamW's moments, an int step, a typed PRNG key, and
    `noise`, 1024 random uint32 words whose bytes the checkpoint holds verbatim."""
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
              "emb": jnp.asarray(rng.standard_normal((6, 4)), jnp.bfloat16),
              "noise": jnp.asarray(rng.integers(0, 2**32, 1024, dtype=np.uint32))}
    opt_state = optax.adam(1e-3).init({k: v for k, v in params.items() if k != "noise"})
    opt_state = jax.tree.map(lambda x: x + jnp.asarray(rng.standard_normal(x.shape), x.dtype), opt_state)
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(seed), "key": jax.random.key(seed)}


def bits(state) -> list[bytes]:
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
            for x in jax.tree.leaves(state)]


def saved(directory: Path, steps, cfg=SYNC) -> Checkpointer:
    ck = Checkpointer(directory, cfg, FP)
    for s in steps:
        ck.save(s, make_state(s))
    return ck


def flip_one_bit(step_dir: Path, seed: int) -> Path:
    """Flip one bit of leaf params/noise (the state of `seed`) in the file that holds its bytes."""
    needle = np.asarray(make_state(seed)["params"]["noise"])[:64].tobytes()
    hits = [f for f in (step_dir / "state").rglob("*") if f.is_file() and needle in f.read_bytes()]
    assert len(hits) == 1, hits
    data = bytearray(hits[0].read_bytes())
    data[data.find(needle) + 401] ^= 0x08
    hits[0].write_bytes(bytes(data))
    return hits[0]


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ----------------------------------------------------------------------------- the checksums


def reference_sums(x: np.ndarray) -> tuple[int, int, int]:
    """The checksum as the module docstring defines it, in Python integers: words of the bytes (narrow types widened
    one element to one word), s1 = sum w_i, s2 = sum fmix32(w_i ^ (i * 0x9E3779B9)), mod 2^32; non-finite count."""
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize >= 4:
        words = [int(w) for w in x.reshape(-1).view(np.uint32)]
    else:
        words = [int(w) for w in x.reshape(-1).view(f"uint{8 * x.dtype.itemsize}")]
    m = 2**32

    def fmix(h):
        h ^= h >> 16
        h = h * 0x85EBCA6B % m
        h ^= h >> 13
        h = h * 0xC2B2AE35 % m
        return h ^ (h >> 16)

    s1 = sum(words) % m
    s2 = sum(fmix(w ^ (i * 0x9E3779B9 % m)) for i, w in enumerate(words)) % m
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    return s1, s2, int(np.count_nonzero(~np.isfinite(x.astype(np.float32)))) if floating else 0


def test_checksums_equal_a_reference_on_any_sharding_and_on_the_host():
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shard = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa: E731
    w = rng.standard_normal((16, 6)).astype(np.float32)
    w[3, 1], w[7, 5] = np.nan, -np.inf
    e = rng.standard_normal(9).astype(jnp.bfloat16)
    e[4] = np.inf
    host = [w, e, np.arange(-5, 7, dtype=np.int32).reshape(4, 3), rng.integers(0, 255, 10, dtype=np.uint8),
            np.array([True, False, True]), np.asarray(jax.random.key_data(jax.random.key(7))), np.float32(2.5)]
    device = [jax.device_put(w, shard("x", "y")), jax.device_put(e, shard()), jax.device_put(host[2], shard("x")),
              jnp.asarray(host[3]), jnp.asarray(host[4]), jax.random.key(7), jnp.float32(2.5)]
    want = [reference_sums(x) for x in host]
    assert [tuple(r) for r in leaf_sums(device).tolist()] == want
    assert [tuple(r) for r in leaf_sums(host).tolist()] == want
    assert [r[2] for r in want] == [2, 1, 0, 0, 0, 0, 0]


def test_any_single_bit_and_swapped_words_change_the_checksum():
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    base = leaf_sums([jnp.asarray(x)])[0, :2].tolist()
    words = x.view(np.uint32)
    for i, bit in [(0, 0), (5, 31), (63, 17), (30, 23)]:
        y = words.copy()
        y[i] ^= np.uint32(1 << bit)
        assert leaf_sums([jnp.asarray(y.view(np.float32))])[0, :2].tolist() != base
    swapped = x.copy()
    swapped[[2, 9]] = swapped[[9, 2]]
    s1, s2 = leaf_sums([jnp.asarray(swapped)])[0, :2].tolist()
    assert s1 == base[0] and s2 != base[1]  # the plain sum cannot see a swap; the position-keyed one does


# ----------------------------------------------------------------------------- saving


def test_a_non_finite_state_is_not_saved_and_names_its_first_leaf(tmp_path):
    ck = saved(tmp_path / "ck", [1])
    bad = make_state(2)
    bad["opt_state"][0].mu["w"] = bad["opt_state"][0].mu["w"].at[3, 4].set(jnp.nan)
    bad["params"]["emb"] = bad["params"]["emb"].at[0, 0].set(jnp.inf)
    with pytest.raises(FloatingPointError, match=r"^the state of step 2 is not finite: leaf params/emb holds 1 NaN/inf "
                                                 r"values \(2 of 10 leaves hold some\); its checkpoint is not written "
                                                 r"\(the last checkpoint, step 1, is kept\)$"):
        ck.save(2, bad)
    assert ck.all_steps() == [1] and listing(tmp_path / "ck") == ["1"]
    ck.save(2, make_state(2))  # the same step, finite, saves
    assert ck.all_steps() == [1, 2]
    meta = json.loads((tmp_path / "ck" / "2" / "meta" / "metadata").read_text())
    assert set(meta["checksums"]["leaves"]) == {"/".join(n) for n, _, _ in meta["leaves"]}
    ck.close()


# ----------------------------------------------------------------------------- restoring a damaged checkpoint


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # Orbax's, for the plain read below
def test_a_flipped_bit_falls_back_to_the_previous_step(tmp_path):
    d = tmp_path / "ck"
    saved(d, [1, 2]).close()
    flip_one_bit(d / "2", seed=2)
    # Orbax alone reads the flipped bit back without a word: only the checksum catches it
    raw = ocp.PyTreeCheckpointer().restore(d / "2" / "state")["params"]["noise"]
    diff = np.asarray(raw) ^ np.asarray(make_state(2)["params"]["noise"])
    assert np.count_nonzero(diff) == 1 and int(diff.sum()).bit_count() == 1
    ck = Checkpointer(d, SYNC, FP)
    warnings = []
    step, got = ck.restore(make_state(0), warn=warnings.append)
    assert step == 1 and bits(got) == bits(make_state(1))
    assert warnings == [f"checkpoint {d}/2: leaf params/noise does not match its checksum (its array data changed "
                        "after it was written); moved aside to 2.damaged and step 1 restored instead "
                        "(checkpoint.on_damage=fallback)"]
    assert listing(d) == ["1", "2.damaged"] and ck.all_steps() == [1]
    ck.save(2, make_state(2))  # Orbax saves step 2 again: the damaged one no longer counts as a step
    ck.close()
    again = Checkpointer(d, SYNC, FP)  # nor is it cleaned up as a leftover
    assert listing(d) == ["1", "2", "2.damaged"] and again.all_steps() == [1, 2]
    assert bits(again.restore(make_state(0), warn=warnings.append)[1]) == bits(make_state(2))
    again.close()


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), MemoryError(),
                                   OSError(116, "Stale file handle")])
def test_a_read_the_machine_failed_moves_nothing_aside(tmp_path, monkeypatch, error):
    """Out of memory, no permission, a file system gone: the checkpoint is not at fault, so the error is raised as it
    is and no checkpoint is moved aside for an older one (the fallback would lose training)."""
    d = tmp_path / "ck"
    saved(d, [1, 2]).close()
    ck = Checkpointer(d, SYNC, FP)
    real = ck._manager.restore
    monkeypatch.setattr(ck._manager, "restore", lambda step, **kw: (_ for _ in ()).throw(error) if "state" in str(
        kw.get("args")) else real(step, **kw))
    with pytest.raises(type(error)):
        ck.restore(make_state(0), warn=pytest.fail)
    assert listing(d) == ["1", "2"]
    ck.close()


def test_on_damage_stop_an_explicit_checkpoint_and_a_reader_refuse(tmp_path):
    d = tmp_path / "ck"
    saved(d, [1, 2]).close()
    flip_one_bit(d / "2", seed=2)
    stop = Checkpointer(d, CheckpointConfig(async_save=False, on_damage="stop"), FP)
    with pytest.raises(CheckpointError, match=r"2: leaf params/noise does not match its checksum .*; other steps "
                                              r"there: \[1\]; delete .* or set checkpoint.on_damage=fallback to skip "
                                              r"it$"):
        stop.restore(make_state(0))
    stop.close()
    ck = Checkpointer(tmp_path / "elsewhere", SYNC, FP)  # fallback, but the checkpoint is named
    for kwargs in ({"path": d / "2"}, {"path": d}):
        with pytest.raises(CheckpointError, match=r"does not match its checksum .*asked for by name \(--resume / "
                                                  r"checkpoint.resume\), so no other checkpoint stands in for it"):
            ck.restore(make_state(0), **kwargs)
    ck.close()
    same = Checkpointer(d, SYNC, FP)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        same.restore(make_state(0), step=2)
    same.close()
    reader = Checkpointer(d, SYNC, FP, read_only=True)  # inference reads the parameters only, verified too
    with pytest.raises(CheckpointError, match=r"2: leaf params/noise does not match its checksum .*; steps there: "
                                              r"\[1\]; pick another one$"):
        reader.restore_parts({"params": make_state(0)["params"]})
    step, parts = reader.restore_parts({"params": make_state(0)["params"]}, step=1)
    assert step == 1 and bits(parts) == bits({"params": make_state(1)["params"]})
    reader.close()
    assert listing(d) == ["1", "2"]  # nothing moved


def test_unreadable_items_fall_back_past_several_steps_and_none_intact_moves_nothing(tmp_path):
    d = tmp_path / "ck"
    saved(d, [1, 2, 3]).close()
    (d / "3" / "state" / "manifest.ocdbt").unlink()
    (d / "2" / "meta" / "metadata").unlink()
    warnings = []
    ck = Checkpointer(d, SYNC, FP)
    step, got = ck.restore(make_state(0), warn=warnings.append)
    assert step == 1 and bits(got) == bits(make_state(1))
    assert len(warnings) == 2
    assert warnings[0].startswith(f"checkpoint {d}/3: its state cannot be read (ValueError: NOT_FOUND")
    assert warnings[1].startswith(f"checkpoint {d}/2: its meta cannot be read (FileNotFoundError")
    assert all(w.endswith("step 1 restored instead (checkpoint.on_damage=fallback)") for w in warnings)
    assert listing(d) == ["1", "2.damaged", "3.damaged"]
    ck.close()
    shutil.rmtree(d / "1" / "state" / "d")  # the last one damaged too
    ck = Checkpointer(d, SYNC, FP)
    with pytest.raises(CheckpointError, match=r"^no intact checkpoint in .* \(checkpoint .*/1: its state cannot be "
                                              r"read .*\); nothing was moved: move those step directories away"):
        ck.restore(make_state(0), warn=warnings.append)
    ck.close()
    assert listing(d) == ["1", "2.damaged", "3.damaged"] and len(warnings) == 2


def test_a_checkpoint_without_checksums_restores_unverified_unless_it_is_not_finite(tmp_path, monkeypatch):
    """Checkpoints written before checksums existed: restored with one warning; one holding non-finite values (a
    diverged state those versions saved) is damaged and skipped."""
    d = tmp_path / "ck"
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "seal", lambda stored, step, kept: {})  # what older versions wrote
        old = saved(d, [1])
        poisoned = make_state(2)
        poisoned["params"]["w"] = poisoned["params"]["w"] * jnp.inf
        old.save(2, poisoned)
        old.close()
    assert "checksums" not in json.loads((d / "1" / "meta" / "metadata").read_text())
    warnings = []
    ck = Checkpointer(d, SYNC, FP)
    step, got = ck.restore(make_state(0), warn=warnings.append)
    assert step == 1 and bits(got) == bits(make_state(1))
    assert warnings == [f"checkpoint {d}/1 has no checksums (written before they existed): restored without "
                        "verifying its arrays",
                        f"checkpoint {d}/2: leaf params/w holds 128 NaN/inf values (it was saved from a diverged "
                        "state); moved aside to 2.damaged and step 1 restored instead (checkpoint.on_damage=fallback)"]
    ck.close()


def test_the_leftovers_of_failed_reads_are_kept_off_stderr(monkeypatch, caplog):
    """Orbax's read coroutines that failed beside the one whose error stopped the restore (0-14 seen for one damaged
    step, by timing, each printing a TensorStore spec at exit) and asyncio's reports of their futures are dropped;
    another coroutine's error and another asyncio error still come through."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    quiet_failed_reads()
    scope: dict = {}
    reader = os.path.join(os.path.dirname(ocp.__file__), "_src", "serialization", "serialization.py")
    exec(compile("async def _read_array_index_and_device_put(): pass", reader, "exec"), scope)

    async def elsewhere():
        pass

    errors = [Exception("Encountered error while reading array index"), ValueError("x")]
    for coroutine, error in zip((scope["_read_array_index_and_device_put"](), elsewhere()), errors):
        sys.unraisablehook(types.SimpleNamespace(exc_value=error, object=coroutine))
        coroutine.close()
    assert seen == errors[1:]
    orphan = ("Future exception was never retrieved\nfuture: <Future finished exception=ValueError('NOT_FOUND: Error "
              "opening \"zarr\" driver [tensorstore_spec=\\'{}\\']')>")
    other = "Future exception was never retrieved\nfuture: <Future finished exception=ValueError('x')>"
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logging.getLogger("asyncio").error(orphan)
        logging.getLogger("asyncio").error(other)
    assert [r.getMessage() for r in caplog.records] == [other]


# ----------------------------------------------------------------------------- settings that poison a state
# (those refused are rows of tests/unit/bad_input/test_config.py)


def test_edge_settings_that_are_meant_still_load():
    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "optimizer.beta1=0", "optimizer.weight_decay=0", "optimizer.grad_clip=null", "model.init_std=1",
        "ffn.balance_gamma=0", "optimizer.lr=1e30", "checkpoint.on_damage=stop"])
    assert (cfg.optimizer.beta1, cfg.model.init_std, cfg.optimizer.lr, cfg.checkpoint.on_damage) == (0.0, 1.0, 1e30,
                                                                                                     "stop")
