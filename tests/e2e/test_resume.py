"""Exact resume (issue 3): 2N steps straight == N steps, a fresh process restoring, N more steps.

Per-step losses and the final parameters must be bitwise identical on CPU, and on a GPU (marker gpu) where each
process compiles afresh and XLA's autotuning could pick other kernels: there the run's XLA autotuning results
(train.xla_autotune_file) carry the choice across processes. Also: a run on .bin shards killed with SIGKILL after a
checkpoint resumes exactly, and what a resuming user gets wrong is refused.

The CPU runs all share one config (on .bin shards, TOTAL steps), so one straight run is every test's reference and
the processes after the first find its programs in the persistent compilation cache.
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
from tests.runs import assert_same_state, common, final_state, losses, run

ROOT = Path(__file__).resolve().parents[2]
N = 4
TOTAL = 40  # steps enough for a SIGKILL sent at the first checkpoint to land well before the end
EVERY = 10  # checkpoint.every: the last two (keep 2) are TOTAL - EVERY and TOTAL


def assert_same_final_state(a, b):
    """The newest checkpoints of runs `a` and `b`: the same step, every leaf bitwise equal."""
    (sa, la), (sb, lb) = final_state(a), final_state(b)
    assert sa == sb and len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """train.py's arguments for .bin shards of a small corpus (train and validation), TOTAL steps, a checkpoint every
    EVERY steps."""
    tmp = tmp_path_factory.mktemp("shards")
    text = tmp / "corpus.txt"
    rng = np.random.default_rng(0)
    words = ["moe", "expert", "head", "token", "router", "parallel", "latent", "gate", "load", "bias"]
    text.write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(4000)))
    shards = tmp / "shards"
    prepare_main(["--input", str(text), "--tokenizer", "byte", "--out", str(shards), "--shard-tokens", "60000",
                  "--val-tokens", "4000"])
    return ["--set", "data.source=bin", "--set", f"data.path={shards}/train_*.bin",
            "--set", f"data.val_path={shards}/val_*.bin", "--set", f"schedule.total_steps={TOTAL}",
            "--set", "schedule.decay_steps=4", "--set", f"checkpoint.every={EVERY}", "--set", "logging.loads_every=3"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data):
    """The uninterrupted run, in one process."""
    d = tmp_path_factory.mktemp("straight") / "run"
    run(common(d, *data))
    assert [s for s, _, _ in losses(d)] == list(range(1, TOTAL + 1))
    return d


def test_stop_and_resume_is_exact(tmp_path, data, straight):
    split = tmp_path / "split"
    run(common(split, *data, "--stop-after", str(N)))
    assert [s for s, _, _ in losses(split)] == list(range(1, N + 1))
    r = run(common(split, *data))  # a fresh process finds the checkpoint at step N and resumes
    assert f"resumed from step {N}" in r.stdout
    assert losses(split) == losses(straight)  # bitwise-equal floats, same steps, same val losses
    assert (split / "loads.jsonl").read_text() == (straight / "loads.jsonl").read_text()  # every 3rd step's loads
    assert_same_final_state(straight, split)
    # --resume PATH: a new run directory continues from an explicit checkpoint of another run
    explicit, at = tmp_path / "explicit", TOTAL - EVERY
    r = run(common(explicit, *data, "--resume", str(straight / "checkpoints" / str(at))))
    assert f"resumed from step {at}" in r.stdout
    assert losses(explicit) == losses(straight)[at:]
    assert_same_final_state(straight, explicit)


def test_killed_run_on_bin_shards_resumes_exactly(tmp_path, data, straight):
    killed = tmp_path / "killed"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    args = common(killed, *data)
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
    assert losses(killed)[-1][0] < TOTAL, "the run finished before the kill: the test proves nothing"
    r = run(args)
    assert "resumed from step" in r.stdout
    assert losses(killed) == losses(straight)
    # the killed launch's loads past its checkpoint were dropped, and written again
    assert (killed / "loads.jsonl").read_text() == (straight / "loads.jsonl").read_text()
    assert_same_final_state(straight, killed)


def test_refused_or_damaged_checkpoint_and_nothing_to_train(tmp_path, data, straight):
    """What a resuming user gets wrong, answered without a traceback and without touching the run directory: a
    checkpoint past the run's last step, a model config that differs from the checkpoint's (config.yaml of the run
    kept), and, with checkpoint.on_damage=stop, a damaged latest checkpoint (named, with the steps still there).
    On a copy of the straight run (none of these compiles a step)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    go = lambda args: subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,  # noqa: E731
                                     text=True, env=env)
    d = tmp_path / "run"
    shutil.copytree(straight, d)
    last, before_last = str(TOTAL), str(TOTAL - EVERY)
    assert sorted((p.name for p in (d / "checkpoints").iterdir()), key=int) == [before_last, last]
    before = (d / "config.yaml").read_text()

    r = go(common(d, *data))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"nothing to train: the checkpoint is at step {last}" in r.stdout
    assert f"schedule.total_steps={last}" in r.stdout

    r = go(common(d, *data, "--set", "ffn.top_k=3"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("checkpoint error:") and "ffn.top_k: checkpoint 2, this run 3" in r.stderr
    assert (d / "config.yaml").read_text() == before

    for f in (d / "checkpoints" / last / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0" * 7)
    stop = ["--set", "checkpoint.on_damage=stop"]  # refused, not skipped (tests/e2e/test_checkpoint_fallback.py)
    r = go(common(d, *data, *stop))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "checkpoint error:" in r.stderr and f"/checkpoints/{last}: its state" in r.stderr, r.stderr[-2000:]
    assert f"[{before_last}]" in r.stderr, r.stderr[-2000:]
    assert (d / "config.yaml").read_text() == before
    # the latest deleted as advised, and the one before's data directory gone: tensorstore's reads still in flight then
    # called back into Orbax's closed event loop, which printed 2-20 tracebacks under the error line unless dropped
    shutil.rmtree(d / "checkpoints" / last)
    shutil.rmtree(d / "checkpoints" / before_last / "state" / "d")
    r = go(common(d, *data, *stop))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and f"/checkpoints/{before_last}: its state" in r.stderr, r.stderr
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
