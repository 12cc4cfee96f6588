"""Graceful preemption: a train.py process signalled at several moments (SIGINT during its setup and compilation,
SIGTERM between steps, SIGUSR1 while it saves a checkpoint every step, and a second signal) stops with one line and
status 3 (128 + signum for the second signal) and, run again, ends bitwise where an uninterrupted run ends: the same
per-step losses and final parameters. (Every train.py process here runs one config: the first compiles, the others
read its programs from the persistent compilation cache.) Also: the handlers put back when train() returns, train()
from another thread, and the processes' agreement on stopping (exchanged flags, simulated with threads as
processes)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import pytest

from mhl_jax.config import load_config
from mhl_jax.runtime import distributed
from mhl_jax.runtime.errors import EXIT_INTERRUPTED, CheckpointSaveError
from mhl_jax.train import interrupt
from mhl_jax.train.interrupt import SAVE_FAILED, SIGNALLED, PreemptionSignals, Stopping
from mhl_jax.train.loop import train
from tests.runs import final_state, losses

ROOT = Path(__file__).resolve().parents[2]
TOTAL = 60  # steps of ~10 ms: a signal sent at step 5 lands well before the end


def args(run_dir, *extra):
    return ["--set", f"schedule.total_steps={TOTAL}", "--set", "schedule.warmup_steps=2",
            "--set", "schedule.decay_steps=2", "--set", "model.n_layers=1", "--set", "model.context=32",
            "--set", "train.global_batch=8", "--set", "train.micro_batch=4", "--set", "data.val_sequences=0",
            "--set", "logging.progress_bar=false", "--set", "logging.log_every=1", "--set", "checkpoint.every=1000",
            "--set", f"logging.run_dir={run_dir}", *extra]


ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}


def pending(pid: int, signum: int) -> bool:
    """Whether signal `signum`, sent to process `pid`, has not reached it yet (Linux: /proc/PID/status's masks)."""
    masks = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return any(int(masks[k], 16) >> (signum - 1) & 1 for k in ("SigPnd", "ShdPnd"))


def signalled(run_dir, when: str, signals, *extra) -> subprocess.CompletedProcess:
    """train.py, sent `signals` (one after the other, each once the one before has reached it: two pending at once
    would reach it lowest number first) as soon as it prints a line containing `when`."""
    p = subprocess.Popen([sys.executable, "train.py", *args(run_dir, *extra)], cwd=ROOT, env=ENV, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = []
        for line in p.stdout:
            seen.append(line)
            if when in line:
                for s in signals:
                    p.send_signal(s)
                    while pending(p.pid, s):
                        time.sleep(0.001)
                break
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    return subprocess.CompletedProcess(p.args, p.returncode, "".join(seen) + out, err)


def again(run_dir, *extra) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "train.py", *args(run_dir, *extra)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def interrupted_step(r) -> int:
    assert r.returncode == EXIT_INTERRUPTED, r.stderr[-3000:]
    assert r.stderr.count("\n") == 1 and r.stderr.endswith(": checkpoint saved; run the same command to resume\n"), \
        r.stderr
    step = int(r.stderr.split()[3].rstrip(":"))
    assert 5 <= step < TOTAL, r.stderr  # not the run's own end: the test proves something
    return step


def assert_same_run(run_dir, reference):
    assert losses(run_dir) == losses(reference)  # bitwise-equal floats, one record per step
    (sa, la), (sb, lb) = final_state(run_dir), final_state(reference)
    assert sa == sb == TOTAL and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, as the relaunch of a run stopped by SIGINT during its setup or compilation: nothing had
    been written, and the relaunch trains from step 0."""
    run = tmp_path_factory.mktemp("reference") / "run"
    r = signalled(run, "kernels:", [signal.SIGINT])  # printed before the step is compiled
    assert r.returncode == EXIT_INTERRUPTED, r.stderr[-3000:]
    assert r.stderr == "interrupted before step 1: nothing to save; run the same command to start the run\n"
    assert not run.exists()  # the directories it created removed again
    again(run)
    assert [s for s, _, _ in losses(run)] == list(range(1, TOTAL + 1))
    return run


def test_signals_stop_with_a_checkpoint_and_the_relaunches_resume_exactly(tmp_path, reference):
    """One run stopped three times, each relaunch resuming where the stop before left it, the last one ending bitwise
    where the uninterrupted run ends (each relaunch is the same command but for the checkpoint settings its signal
    needs: one process per signal, and no straight run of its own to compare with):
    - SIGTERM between steps saves that step (checkpoint.every=1000: off its cycle);
    - SIGUSR1 with a checkpoint every step, written in the background, finds the step it stops at already saved (or
      being saved), which is waited for, not saved twice;
    - a second signal (SIGINT right after SIGTERM) stops at once, without saving: the last complete checkpoint (one
      every 4 steps) is intact, and the next relaunch resumes from it."""
    run = tmp_path / "run"
    first = interrupted_step(signalled(run, "step 5/", [signal.SIGTERM]))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(first)]
    assert losses(run)[-1][0] == first

    every = ("--set", "checkpoint.every=1", "--set", "checkpoint.async_save=true")
    r = signalled(run, f"step {first + 5}/", [signal.SIGUSR1], *every)
    assert f"resumed from step {first}" in r.stdout
    second = interrupted_step(r)
    assert second > first and max(int(p.name) for p in (run / "checkpoints").iterdir()) == second

    every = ("--set", "checkpoint.every=4")
    r = signalled(run, f"step {second + 6}/", [signal.SIGTERM, signal.SIGINT], *every)
    assert f"resumed from step {second}" in r.stdout
    assert r.returncode == 128 + signal.SIGINT, r.stderr[-3000:]
    assert r.stderr == ("second signal (SIGINT) after SIGTERM: stopping now, without saving; checkpoints saved "
                        "before are intact\n")
    r = again(run, *every)
    assert "resumed from step" in r.stdout
    assert_same_run(run, reference)


# ----------------------------------------------------------------------------- in-process


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


def test_handlers_are_put_back_and_a_signal_is_seen(tmp_path):
    before, wakeup = {s: signal.getsignal(s) for s in interrupt.SIGNALS}, _wakeup_fd()
    with PreemptionSignals(print) as signals:
        assert all(signal.getsignal(s) is not before[s] for s in interrupt.SIGNALS)
        os.kill(os.getpid(), signal.SIGUSR1)  # SIGUSR1's default action would end this process
        for _ in range(1000):
            if signals.requested:
                break
            threading.Event().wait(0.01)
        assert signals.requested == "SIGUSR1"
    assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before
    assert _wakeup_fd() == wakeup  # the wakeup descriptor put back too

    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [f"logging.run_dir={tmp_path / 'run'}",
                                                                       "parallel.devices=1"])
    assert train(cfg, stop_after=0, log=lambda *a: None) == []  # set up, nothing to train: the handlers came and went
    assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before


def test_the_first_signal_repeated_at_once_is_one_request():
    """GNU `timeout` signals the process and then its process group: one request arriving twice at once must not be
    taken for the second signal, which exits without saving. A real process delivers SIGTERM to itself twice (each
    os.kill to oneself is delivered before it returns, so the two are not merged into one pending signal)."""
    code = ("import os, signal, time\n"
            "from mhl_jax.train.interrupt import PreemptionSignals\n"
            "with PreemptionSignals(print) as s:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.2)\n"
            "    print('requested', s.requested)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "requested SIGTERM\n", ""), r.stderr[-3000:]

    signals, window = PreemptionSignals(print), interrupt.DUPLICATE_WINDOW_S
    assert not signals.second(signal.SIGTERM, 100.0) and signals.requested == "SIGTERM"
    assert not signals.second(signal.SIGTERM, 100.0 + window / 2)  # its echo
    assert signals.second(signal.SIGINT, 100.0 + window / 2)  # another signal: a second request
    assert signals.second(signal.SIGTERM, 100.0 + window)  # the same one, later: a second request


def test_train_from_another_thread_says_signals_are_not_caught(tmp_path):
    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [f"logging.run_dir={tmp_path / 'run'}",
                                                                       "parallel.devices=1"])
    lines, got = [], []
    t = threading.Thread(target=lambda: got.append(train(cfg, stop_after=0, log=lines.append)))
    t.start()
    t.join()
    assert got == [[]]
    assert lines[0].startswith("train() runs outside the main thread, where Python cannot catch signals"), lines


class _Coordinator:
    """The coordination service's key-value store and barriers, for processes simulated as threads."""

    def __init__(self, n: int):
        self.kv, self.lock = {}, threading.Lock()
        self.barriers: dict = {}
        self.n = n

    def key_value_set(self, key, value):
        with self.lock:
            assert key not in self.kv
            self.kv[key] = value

    def wait_at_barrier(self, key, timeout_in_ms):
        with self.lock:
            barrier = self.barriers.setdefault(key, threading.Barrier(self.n))
        barrier.wait(timeout=10)

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def key_value_delete(self, key):
        with self.lock:
            del self.kv[key]


class _CountPerThread:
    """`next()` counts 0, 1, ... in each thread (a simulated process) on its own."""

    def __init__(self, local):
        self.local = local

    def __next__(self):
        self.local.rounds += 1
        return self.local.rounds - 1


def test_processes_agree_on_stopping(monkeypatch):
    """Three processes (threads), rounds of `gather_flags` through one coordinator: each process gets every flag in
    process order, and the keys of finished rounds are deleted. `Stopping.poll` then stops all of them when any was
    signalled, and fails all of them when a save failed on any (that one with its own error)."""
    coordinator, me = _Coordinator(3), threading.local()
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: me.i)
    monkeypatch.setattr(distributed, "_FLAG_ROUNDS", _CountPerThread(me))  # each process counts its own rounds
    monkeypatch.setattr(distributed.ocp_multihost, "get_jax_distributed_client", lambda: coordinator)
    rounds = [[0, 0, 0], [0, SIGNALLED, 0], [SAVE_FAILED, 0, SIGNALLED]]
    got = {}

    def process(i):
        me.i, me.rounds = i, 0
        got[i] = [distributed.gather_flags(flags[i]) for flags in rounds]

    threads = [threading.Thread(target=process, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: rounds for i in range(3)}
    assert sorted(coordinator.kv) == ["mhl_jax/flags/2/0", "mhl_jax/flags/2/1", "mhl_jax/flags/2/2"]  # the last round's

    class Ckpt:
        def check(self):
            pass

    class Signals:
        requested = None

    stopping = Stopping(Signals(), Ckpt())
    monkeypatch.setattr(interrupt, "gather_flags", lambda flags: [flags, 0, 0])
    assert stopping.poll(None) is False
    monkeypatch.setattr(interrupt, "gather_flags", lambda flags: [flags, SIGNALLED, 0])
    assert stopping.poll(None) is True  # signalled elsewhere: this process stops too
    monkeypatch.setattr(interrupt, "gather_flags", lambda flags: [flags, SIGNALLED, SAVE_FAILED])
    with pytest.raises(CheckpointSaveError, match=r"process\(es\) \[2\] could not save a checkpoint"):
        stopping.poll(None)
    own = CheckpointSaveError("checkpoint step 4 could not be written")
    sent = []
    monkeypatch.setattr(interrupt, "gather_flags", lambda flags: sent.append(flags) or [flags, 0, 0])
    with pytest.raises(CheckpointSaveError, match="checkpoint step 4 could not be written"):
        stopping.poll(own)
    assert sent == [SAVE_FAILED]  # told the others before raising its own error
