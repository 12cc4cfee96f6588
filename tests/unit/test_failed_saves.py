"""Checkpoints that cannot be saved: refused before writing when the disk has too little free (the free-space probe
made to report too little), and a write that fails (an OSError injected into Orbax's array writer), in the
foreground and in the background; each is one CheckpointSaveError naming the checkpoint, why, and the checkpoint
that is intact. End to end: a run whose background save fails stops with one line and status 1."""

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.serialization import serialization

from mhl_jax.config import CheckpointConfig
from mhl_jax.runtime import disk
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.errors import EXIT_FAILED, CheckpointSaveError

ROOT = Path(__file__).resolve().parents[2]
FP = {"model": {"d_model": 8}}
NBYTES = 4 * 1000 + 4 * 10 + 4  # the state below: 1000 + 10 float32, one int32


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal(1000), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(10), jnp.float32), "step": jnp.int32(seed)}


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    with Checkpointer(d, CheckpointConfig(async_save=False), FP) as ck:
        ck.save(1, state(1))
        probed = []

        def free(directory):
            probed.append(directory)
            return 100 * 2**10

        monkeypatch.setattr(disk, "free_bytes", free)
        with pytest.raises(CheckpointSaveError) as e:
            ck.save(2, state(2))
        assert probed == [d.absolute()]
        assert str(e.value) == (f"checkpoint step 2 not saved: it needs about 1.0 MiB (the state's 3.9 KiB plus a "
                                f"margin) and the file system of {str(d.absolute())!r} has 100.0 KiB free; free some "
                                "space there (or move logging.run_dir); the checkpoint of step 1 is intact: the same "
                                "command resumes from it")
        assert entries(d) == ["1"]  # nothing of step 2 written
        need = disk.needed_bytes(NBYTES)
        assert NBYTES == 4044 and need == 4044 + 2**20  # the state's bytes and the margin's
        monkeypatch.setattr(disk, "free_bytes", lambda directory: need - 1)
        with pytest.raises(CheckpointSaveError, match="checkpoint step 2 not saved"):
            ck.save(2, state(2))
        monkeypatch.setattr(disk, "free_bytes", lambda directory: need)  # just enough
        ck.save(2, state(2))
    assert entries(d) == ["1", "2"]


def test_free_space_probe_and_sizes(tmp_path):
    assert disk.free_bytes(tmp_path / "not" / "yet") == disk.free_bytes(tmp_path) > 0
    assert [disk.size(n) for n in (512, 4044, 3 * 2**20 + 2**19, 41.7 * 2**30, 2.5 * 2**40)] == [
        "512 B", "3.9 KiB", "3.5 MiB", "41.70 GiB", "2.50 TiB"]
    assert disk.needed_bytes(100 * 2**30) == 105 * 2**30  # 5% above 20 MiB of state
    assert disk.state_bytes([([2, 3], "float32"), ([], "int32"), ([4], "bfloat16")]) == 24 + 4 + 8


def test_write_failure_reasons():
    assert disk.write_failure(OSError(errno.ENOSPC, "No space left on device")) == "No space left on device (ENOSPC)"
    # how tensorstore's failure reaches Orbax's caller (a 2 MB tmpfs, measured)
    ts = ValueError("RESOURCE_EXHAUSTED: Error writing \"w/0\" in OCDBT database at local file \"/x/\": Failed "
                    "writing: \"/x/d/b9\": Failed to write 798798 bytes to file 5: No space left on device "
                    "[os_error_code='28']\nmore")
    assert disk.write_failure(ts) == "No space left on device (ENOSPC)"
    assert disk.write_failure(RuntimeError("boom\nsecond line")) == "RuntimeError: boom"


def test_a_failed_write_names_the_checkpoint_and_the_intact_one(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    with Checkpointer(d, CheckpointConfig(async_save=False), FP) as ck:
        with monkeypatch.context() as m:
            m.setattr(serialization, "async_serialize_from_host", _disk_full)
            with pytest.raises(CheckpointSaveError) as e:
                ck.save(1, state(1))
        assert str(e.value) == (f"checkpoint step 1 could not be written to {str(d.absolute())!r}: No space left on "
                                "device (ENOSPC); no earlier checkpoint was written: the same command starts the run "
                                "again")
        ck.save(2, state(2))  # the disk has room again: the next save works
        assert ck.all_steps() == [2]


def test_a_failed_background_write_is_raised_by_check(tmp_path, monkeypatch):
    """The background save of step 2 fails: `save` returns, `check` raises once the write has failed (never while it
    still runs), and the Checkpointer closes without raising again; step 1 is intact."""
    d = tmp_path / "ckpt"
    ck = Checkpointer(d, CheckpointConfig(async_save=True), FP)
    ck.save(1, state(1))
    ck.wait()
    monkeypatch.setattr(serialization, "async_serialize_from_host", _disk_full)
    ck.save(2, state(2))
    deadline = time.time() + 60
    with pytest.raises(CheckpointSaveError) as e:
        while time.time() < deadline:
            ck.check()
            time.sleep(0.01)
    assert str(e.value) == (f"checkpoint step 2 could not be written to {str(d.absolute())!r}: No space left on device "
                            "(ENOSPC); the checkpoint of step 1 is intact: the same command resumes from it")
    ck.check()
    ck.close()
    assert [p for p in entries(d) if p.isdigit()] == ["1"] and ck.all_steps() == [1]


def test_a_failure_while_the_run_already_fails_is_kept_as_a_note(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    monkeypatch.setattr(serialization, "async_serialize_from_host", _disk_full)
    with pytest.raises(FloatingPointError) as e:
        with Checkpointer(d, CheckpointConfig(async_save=True), FP) as ck:
            ck.save(1, state(1))
            raise FloatingPointError("loss is nan at step 2")
    assert e.value.__notes__ == [f"checkpoint step 1 could not be written to {str(d.absolute())!r}: No space left on "
                                 "device (ENOSPC); no earlier checkpoint was written: the same command starts the run "
                                 "again"]


def test_a_run_whose_background_save_fails_stops_with_one_line(tmp_path):
    """train.py with the array writer failing from the second checkpoint on (as a disk that fills up): the run stops
    within steps of the failure, with one line on stderr (no traceback, none of Orbax's thread logs, no noise at exit)
    and status 1; the first checkpoint is intact."""
    run = tmp_path / "run"
    inject = ("import errno, sys\n"
              "from orbax.checkpoint._src.serialization import serialization\n"
              "real = serialization.async_serialize_from_host\n"
              "calls = []\n"
              "async def write(*args, **kwargs):\n"
              "    calls.append(1)\n"
              "    if len(calls) > LEAVES:\n"
              "        raise OSError(errno.ENOSPC, 'No space left on device')\n"
              "    return await real(*args, **kwargs)\n"
              "serialization.async_serialize_from_host = write\n"
              "import train\n"
              "sys.exit(train.main(sys.argv[1:]))\n")
    leaves = 31  # the arrays of the one-layer tiny model's state: each checkpoint writes each once
    # the model, batch and schedule of tests/e2e/test_preemption.py's runs: in the suite, one compiles the programs and
    # the other reads them from the persistent compilation cache
    args = ["--set", "schedule.total_steps=60", "--set", "schedule.warmup_steps=2", "--set", "schedule.decay_steps=2",
            "--set", "model.n_layers=1", "--set", "model.context=32", "--set", "train.global_batch=8",
            "--set", "train.micro_batch=4", "--set", "data.val_sequences=0", "--set", "checkpoint.every=2",
            "--set", "checkpoint.async_save=true", "--set", "logging.progress_bar=false",
            "--set", f"logging.run_dir={run}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-c", inject.replace("LEAVES", str(leaves)), *args], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == EXIT_FAILED, r.stderr[-3000:]
    want = (f"training stopped: checkpoint step 4 could not be written to {str(run / 'checkpoints')!r}: No space left "
            "on device (ENOSPC); the checkpoint of step 2 is intact: the same command resumes from it\n")
    assert r.stderr == want, r.stderr[-3000:]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 4 <= last < 60, r.stdout[-2000:]  # stopped within steps of the failure
    assert [p for p in entries(run / "checkpoints") if p.isdigit()] == ["2"]
