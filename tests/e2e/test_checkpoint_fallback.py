"""Verified checkpoints end to end (issue 53), through train() on the smallest model: a relaunch whose latest
checkpoint is damaged resumes the one before it and trains the losses the run trained; a state that turned
non-finite is never saved."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from mhl_jax.config import load_config
from mhl_jax.train import loop
from mhl_jax.train.loop import train

ROOT = Path(__file__).resolve().parents[2]


def smallest(tmp_path, *extra):
    return load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "model.n_layers=1", "ffn.stem_layers=0", "model.context=32", "train.global_batch=4", "train.micro_batch=4",
        "schedule.total_steps=4", "schedule.warmup_steps=1", "schedule.decay_steps=1", "data.val_sequences=0",
        "checkpoint.every=2", "checkpoint.async_save=false", "logging.progress_bar=false",
        f"logging.run_dir={tmp_path / 'run'}", "parallel.devices=1", *extra])


def test_a_damaged_latest_checkpoint_is_moved_aside_and_the_run_trains_the_same_losses(tmp_path, capsys):
    cfg = smallest(tmp_path)
    first = train(cfg)  # steps 1-4, checkpoints 2 and 4
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["2", "4"]
    # one bit flipped in the middle of step 4's array data: zstd-compressed, without a checksum of its own, it reads
    # back as other values (a leaf then fails its checksum), or fails to read
    data = max((f for f in (ckpts / "4" / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    again = train(cfg)  # the relaunch
    out = capsys.readouterr()
    assert [m["step"] for m in again] == [3, 4]
    assert [m["loss"] for m in again] == [m["loss"] for m in first[2:]]  # bitwise
    assert out.err.count("\n") == 1 and out.err.startswith(f"warning: checkpoint {ckpts}/4: "), out.err
    assert "moved aside to 4.damaged and step 2 restored instead (checkpoint.on_damage=fallback)" in out.err
    assert "resumed from step 2" in out.out
    assert sorted(p.name for p in ckpts.iterdir()) == ["2", "4", "4.damaged"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(m["step"], m["loss"]) for m in first]


def test_a_state_that_turned_non_finite_is_not_saved(tmp_path, monkeypatch):
    """Step 1's loss and gradient are finite, its update makes the parameters inf or NaN (as a step that diverges:
    here its new parameters times inf, on the compiled step of the test above; Checkpointer's own check is
    tests/unit/test_checkpoint_integrity.py's). Its checkpoint is refused (FloatingPointError: train.py's status 1)
    naming a parameter, and nothing is written."""
    real = loop.jit_train_step
    blow_up = jax.jit(lambda params: jax.tree.map(lambda p: p * jnp.inf, params))

    def diverging(*args, **kwargs):
        step_fn = real(*args, **kwargs)

        def wrapped(state, batch):
            new, m = step_fn(state, batch)
            return {**new, "params": blow_up(new["params"])}, m
        wrapped.lower = step_fn.lower  # the loop's memory check compiles the step ahead (the same program)
        return wrapped

    monkeypatch.setattr(loop, "jit_train_step", diverging)
    cfg = smallest(tmp_path, "checkpoint.every=1")
    with pytest.raises(FloatingPointError, match=r"^the state of step 1 is not finite: leaf params/\S+ holds \d+ "
                                                 r"NaN/inf values \(\d+ of \d+ leaves hold some\); its checkpoint is "
                                                 r"not written \(there is no earlier one\)$"):
        train(cfg)
    assert not any((tmp_path / "run" / "checkpoints").iterdir())
