"""Exact resume (issue 3): 2N steps straight == N steps, a fresh process restoring, N more steps.

Per-step losses and the final parameters must be bitwise identical on CPU, and on a GPU (marker gpu) where each
process compiles afresh and XLA's autotuning could pick other kernels: there the run's XLA autotuning results
(train.xla_autotune_file) carry the choice across processes. Also: a run on .bin shards killed with SIGKILL after a
checkpoint resumes exactly.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mhl_jax.data.prepare import main as prepare_main
from mhl_jax.runtime.autotune import DEFAULT_NAME
from tests.runs import assert_same_state, common, losses, run

ROOT = Path(__file__).resolve().parents[2]
N = 4


def test_stop_and_resume_is_exact(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(common(straight))
    run(common(split, "--stop-after", str(N)))
    assert [s for s, _, _ in losses(split)] == list(range(1, N + 1))
    r = run(common(split))  # a fresh process finds the checkpoint at step N and resumes
    assert f"resumed from step {N}" in r.stdout
    assert losses(split) == losses(straight)  # bitwise-equal floats, same steps, same val losses
    assert_same_state(straight, split)
    # --resume PATH: a new run directory continues from an explicit checkpoint of another run
    explicit = tmp_path / "explicit"
    r = run(common(explicit, "--resume", str(straight / "checkpoints" / "6")))
    assert "resumed from step 6" in r.stdout
    assert losses(explicit) == losses(straight)[6:]
    assert_same_state(straight, explicit)


def test_killed_run_on_bin_shards_resumes_exactly(tmp_path):
    text = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    words = ["moe", "expert", "head", "token", "router", "parallel", "latent", "gate", "load", "bias"]
    text.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(4000)))
    shards = tmp_path / "shards"
    prepare_main(["--input", str(text), "--tokenizer", "byte", "--out", str(shards), "--shard-tokens", "60000",
                  "--val-tokens", "4000"])
    data = ["--set", "data.source=bin", "--set", f"data.path={shards}/train_*.bin",
            "--set", f"data.val_path={shards}/val_*.bin"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(common(straight, *data, "--set", "schedule.total_steps=40", "--set", "schedule.decay_steps=4"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    args = common(killed, *data, "--set", "schedule.total_steps=40", "--set", "schedule.decay_steps=4")
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    ckpt = killed / "checkpoints"
    while time.time() < deadline and not (ckpt.exists() and any(p.name.isdigit() and int(p.name) >= 6
                                                                    for p in ckpt.iterdir())):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if not any(p.name.isdigit() for p in ckpt.iterdir()):
        pytest.fail("no checkpoint appeared before the kill")
    assert losses(killed)[-1][0] < 40, "the run finished before the kill: the test proves nothing"
    r = run(args)
    assert "resumed from step" in r.stdout
    assert losses(killed) == losses(straight)
    assert_same_state(straight, killed)


def test_refused_or_damaged_checkpoint_and_nothing_to_train(tmp_path):
    """What a resuming user gets wrong, answered without a traceback and without touching the run directory: a
    checkpoint past the run's last step, a model config that differs from the checkpoint's (config.yaml of the run
    kept), and, with checkpoint.on_damage=stop, a damaged latest checkpoint (named, with the steps still there)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    go = lambda args: subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,  # noqa: E731
                                     text=True, env=env)
    d = tmp_path / "run"
    short = ["--set", "schedule.total_steps=4"]
    run(common(d, *short))
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["2", "4"]
    before = (d / "config.yaml").read_text()

    r = go(common(d, *short))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nothing to train: the checkpoint is at step 4" in r.stdout and "schedule.total_steps=4" in r.stdout

    r = go(common(d, "--set", "ffn.top_k=3"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("checkpoint error:") and "ffn.top_k: checkpoint 2, this run 3" in r.stderr
    assert (d / "config.yaml").read_text() == before

    for f in (d / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0" * 7)
    stop = ["--set", "checkpoint.on_damage=stop"]  # refused, not skipped (tests/e2e/test_checkpoint_fallback.py)
    r = go(common(d, *stop))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "checkpoint error:" in r.stderr and "/checkpoints/4: its state" in r.stderr and "[2]" in r.stderr
    assert (d / "config.yaml").read_text() == before
    # step 4 deleted as advised, and step 2's data directory gone: tensorstore's reads still in flight then called
    # back into Orbax's closed event loop, which printed 2-20 tracebacks under the error line unless dropped
    shutil.rmtree(d / "checkpoints" / "4")
    shutil.rmtree(d / "checkpoints" / "2" / "state" / "d")
    r = go(common(d, *stop))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "/checkpoints/2: its state" in r.stderr, r.stderr
    assert "no other steps there; delete" in r.stderr and "to start the run over" in r.stderr, r.stderr


@pytest.mark.gpu
def test_gpu_stop_and_resume_is_exact(tmp_path):
    """On a GPU, with the default train.xla_autotune_file ("auto"): the straight run writes its autotuning results;
    the split run starts from a copy of them (so its first process compiles what the straight one did: two fresh
    processes may otherwise tune differently), and its resumed
    process loads its own file, as a user's resume does."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    r = run(common(straight), gpu=True)  # ffn.kernels auto: the Triton kernels on a GPU
    assert "XLA autotuning results from" not in r.stdout
    tuned = straight / DEFAULT_NAME
    assert tuned.is_file()
    assert not (straight / f"{tuned.stem}.partial{tuned.suffix}").exists()
    split.mkdir()
    shutil.copy(tuned, split / DEFAULT_NAME)
    run(common(split, "--stop-after", str(N)), gpu=True)
    r = run(common(split), gpu=True)
    assert f"resumed from step {N}" in r.stdout
    assert f"XLA autotuning results from {(split / DEFAULT_NAME).resolve()}" in r.stdout
    assert losses(split) == losses(straight)
    assert_same_state(straight, split)
