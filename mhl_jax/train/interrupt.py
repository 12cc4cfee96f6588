"""Stopping a run early and cleanly: preemption signals, and the decision to stop, taken alike by every process.

A scheduler about to stop a job sends SIGTERM (SLURM sends SIGUSR1 a while before its time limit with
`--signal=USR1@120`; Ctrl-C is SIGINT). While `train()` runs, the first of them is a request (`PreemptionSignals`):
the loop finishes the step in flight, saves a checkpoint of it synchronously (whether or not checkpoint.every falls on
it) and raises `Interrupted`, whose message train.py prints before it exits with EXIT_INTERRUPTED. A second signal
means now: the process exits at once with status 128 + its number, without saving and without a traceback; the last
complete checkpoint stays intact, since Orbax writes each one into a temporary directory and renames it when done.
The same signal again within DUPLICATE_WINDOW_S of the first is the same request, not a second one: GNU `timeout`
(and some schedulers) signal the process and then its process group, so one request can arrive twice at once.

The second signal is seen by a thread reading Python's signal wakeup file descriptor, which the interpreter writes
as the signal arrives: a Python handler runs only once the main thread executes bytecode again, which it does not
for minutes inside a compilation or a long device wait.

With several processes the signal may reach only some of them, and a checkpoint may fail on only some, so
`Stopping.poll` exchanges both facts between the processes before every step (`gather_flags`: through the
coordination service, host to host) and every process stops at the same step and saves the same checkpoint. With
one process the poll reads two local flags.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.distributed import gather_flags
from mhl_jax.runtime.errors import CheckpointSaveError

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SIGNALLED, SAVE_FAILED = 1, 2  # the flags a process contributes to `Stopping.poll`
# a repeat of the first signal this soon is its echo (sent to the process and to its group); a person pressing Ctrl-C
# twice to mean "now" is slower than this, and any press after it stops at once. Another signal is a second request
# at any time (SIGINT right after SIGTERM: someone means it)
DUPLICATE_WINDOW_S = 0.5


class Interrupted(Exception):
    """train() stopped at a preemption signal, after saving the checkpoint of `step` when `saved`; the message is the
    line train.py prints."""

    def __init__(self, message: str, step: int, saved: bool) -> None:
        super().__init__(message)
        self.step, self.saved = step, saved


def _noop(signum, frame) -> None:
    """The Python-level handler: a signal's only effect is the byte Python writes to the wakeup descriptor."""


class PreemptionSignals:
    """While the `with` block runs, SIGTERM, SIGINT and SIGUSR1 request a stop (`requested`: the first one's name,
    else None) and a second one ends the process at once (the first one's duplicate does not); the previous handlers
    (and wakeup descriptor) are put back when it ends. Python delivers signals to the main thread only: from another
    thread nothing is installed, and `log` says so."""

    def __init__(self, log) -> None:
        self.log = log
        self.requested: str | None = None
        self._first_at = 0.0
        self._previous: dict = {}
        self._wakeup = -1
        self._write = None
        self._watcher = None

    def __enter__(self) -> "PreemptionSignals":
        if threading.current_thread() is not threading.main_thread():
            self.log("train() runs outside the main thread, where Python cannot catch signals: SIGTERM, SIGINT and "
                     "SIGUSR1 keep their handlers, and a preempted run saves no checkpoint of its last steps")
            return self
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # as set_wakeup_fd requires: a full pipe drops a byte, never blocks
        # the descriptor first, then the handlers: a signal in between is then seen, not lost
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous = {s: signal.signal(s, _noop) for s in SIGNALS}
        self._watcher = threading.Thread(target=self._watch, args=(read,), name="preemption-signals", daemon=True)
        self._watcher.start()
        return self

    def _watch(self, read: int) -> None:
        """The wakeup descriptor's reader: the first of SIGNALS requests the stop, a second one exits."""
        try:
            while data := os.read(read, 64):
                for signum in data:
                    if signum in SIGNALS and self.second(signum, time.monotonic()):
                        os.write(2, f"second signal ({signal.Signals(signum).name}) after {self.requested}: stopping "
                                    "now, without saving; checkpoints saved before are intact\n".encode())
                        os._exit(128 + signum)
        finally:
            os.close(read)

    def second(self, signum: int, now: float) -> bool:
        """Records signal `signum` seen at `now` (time.monotonic()): True when it is a second request, False when it
        is the first or the first one's duplicate."""
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self._first_at = name, now
            return False
        return not (name == self.requested and now - self._first_at < DUPLICATE_WINDOW_S)

    def __exit__(self, *exc) -> None:
        if self._watcher is None:
            return
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._wakeup)
        os.close(self._write)  # the watcher reads the end of the pipe and returns
        self._watcher.join()
        self._watcher = None


class Stopping:
    """Whether the run stops before its next step, answered alike on every process: it stops when a preemption
    signal reached any of them, and fails when a checkpoint could not be saved on any of them."""

    def __init__(self, signals: PreemptionSignals, ckpt: Checkpointer) -> None:
        self.signals, self.ckpt = signals, ckpt

    def poll(self, failure: CheckpointSaveError | None, last: bool = False) -> bool:
        """True when a signal asks the run to stop. Raises CheckpointSaveError when a save failed: `failure` (a save
        of the step before, which raised), the background save (at `last`, the end of the run: waited for), or a save
        on another process. A cheap call: local flags, and with several processes one exchange of them."""
        if failure is None:
            try:
                self.ckpt.wait() if last else self.ckpt.check()
            except CheckpointSaveError as e:
                failure = e
        flags = gather_flags((SIGNALLED if self.signals.requested else 0) | (SAVE_FAILED if failure else 0))
        if failure is not None:
            raise failure
        failed = [i for i, f in enumerate(flags) if f & SAVE_FAILED]
        if failed:
            raise CheckpointSaveError(f"process(es) {failed} could not save a checkpoint (their errors say which and "
                                      "why); stopping every process")
        return any(f & SIGNALLED for f in flags)


def interrupted_line(step: int, start: int, saved: bool, every: int, explicit_resume: bool) -> str:
    """What a run stopped by a signal after step `step` says (this launch began at step `start`; `saved`: a checkpoint
    of `step` is in the run directory)."""
    if step == start:
        if start == 0:
            return "interrupted before step 1: nothing to save; run the same command to start the run"
        return (f"interrupted before step {start + 1}: nothing new to save (the checkpoint of step {start} is "
                "intact); run the same command to resume")
    if not saved:
        return (f"interrupted at step {step}: nothing could be saved (checkpoint.every={every}); the same command "
                f"starts again from step {start}")
    # the run directory now holds a checkpoint later than the one named, which the same command would be refused
    how = " without --resume / checkpoint.resume" if explicit_resume else ""
    return f"interrupted at step {step}: checkpoint saved; run the same command{how} to resume"
