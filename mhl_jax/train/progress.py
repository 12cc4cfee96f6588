"""The end of each step, seen from the host: its metrics fetched and checked, recorded and shown, its evaluation,
checkpoint and profile when due; and the line that sums a run up.

The loop dispatches step n + 1 before it finishes step n (`Progress.needs_state` says when it must not), so the
device runs a step while the host waits for, checks and logs the one before and loads the next batch.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from mhl_jax.config import Config
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.errors import CheckpointSaveError
from mhl_jax.runtime.evaluate import evaluate
from mhl_jax.runtime.memory import GIB
from mhl_jax.train.metrics import StepClock, format_line, mfu
from mhl_jax.train.records import Records

ZERO_GRAD_STEPS = 3  # the launch's first steps at a gradient norm of exactly 0 that make `Progress` warn


class Progress:
    """Finishes the steps `start + 1 .. end` of a run (`finish`), and traces the profiled ones.

    `evaluation`: (eval_fn, validation sequences, batch, sharding), or None; `rate`: (FLOPs per token, peak FLOP/s
    per device or None, devices) for MFU; `comm`: the all-to-all bytes added to each record; `notes`: `train`'s
    phase, for an out-of-memory message."""

    def __init__(self, cfg: Config, run_dir: Path, lead: bool, log, start: int, end: int, ckpt: Checkpointer,
                 loader, records: Records, evaluation, tuned, rate: tuple, comm: dict, notes: dict) -> None:
        self.cfg, self.log, self.lead, self.start, self.end = cfg, log, lead, start, end
        self.total = cfg.schedule.total_steps
        self.ckpt, self.loader, self.records, self.evaluation, self.tuned = ckpt, loader, records, evaluation, tuned
        self.flops_tok, self.peak, self.devices = rate
        self.comm, self.notes = comm, notes
        self.tokens_per_step = cfg.train.global_batch * cfg.model.context
        self.history: list[dict] = []
        # a bar redrawn with carriage returns is noise in a log file or a pipe: on a terminal only
        show = cfg.logging.progress_bar and lead and sys.stderr.isatty()
        self.bar = tqdm(total=self.total, initial=start, disable=not show, file=sys.stderr, dynamic_ncols=True)
        self.t_start = time.perf_counter()
        self.clock = StepClock(self.tokens_per_step, self.t_start)
        # the profiled steps (logging.profile_start): a trace from the dispatch of the first to the end of the last
        first = cfg.logging.profile_start
        self.prof_first = first if lead and start < first <= end else 0
        self.prof_last = min(self.prof_first + cfg.logging.profile_steps - 1, end) if self.prof_first else 0
        self.prof_dir = run_dir / "profile"
        if first and not self.prof_first and lead:
            log(f"no profile: logging.profile_start={first} is not among this run's steps {start + 1}-{end}")
        self.tracing = False
        # a save that raised, raised again by the loop's next stop check (`Stopping.poll`) on every process alike
        self.save_failure: CheckpointSaveError | None = None
        self.zero_grad_steps = 0  # the launch's first steps whose gradient norm was exactly 0, until one was not

    def evaluates(self, n: int) -> bool:
        return self.evaluation is not None and (n % self.cfg.data.eval_every == 0 or n == self.total)

    def saves(self, n: int) -> bool:
        return bool(self.cfg.checkpoint.every and (n % self.cfg.checkpoint.every == 0 or n == self.end))

    def records_loads(self, n: int) -> bool:
        """Whether step n's per-expert loads go to loads.jsonl: at every logging.loads_every steps and the run's last
        (a function of the step alone, so a resumed run writes the records a straight one does)."""
        every = self.cfg.logging.loads_every
        return bool(every) and (n % every == 0 or n == self.total)

    def needs_state(self, n: int) -> bool:
        """Whether the end of step `n` (1-based) evaluates, checkpoints, ends the run or the profile: those read the
        state of step `n` (or its end) and must see its loss first, so its metrics are fetched before step n + 1 is
        dispatched."""
        return n == self.end or n == self.prof_last or self.evaluates(n) or self.saves(n)

    def dispatching(self, n: int) -> None:
        """Step `n` (1-based) is about to be dispatched: the trace starts with the first profiled one."""
        if n == self.prof_first:
            jax.profiler.start_trace(str(self.prof_dir))
            self.tracing = True

    def finish(self, n: int, m_device, ahead: bool, state: dict) -> None:
        """Step `n`'s metrics fetched (waiting for the step), checked, recorded and shown; then its evaluation and
        checkpoint when due, from `state` (step n's own when they are: `needs_state`). `ahead`: step n + 1 was
        dispatched first (StepClock)."""
        fetched = jax.device_get(m_device)
        m = {k: float(v) for k, v in fetched.items() if not k.startswith("loads/")}
        m["step"] = n
        if self.records_loads(n):
            self.records.write_loads(n, {k.split("/")[1]: v for k, v in fetched.items() if k.startswith("loads/")})
        m.update(self.comm)
        m["tokens_per_s"] = self.clock.finish(time.perf_counter(), ahead)
        m["mfu"] = mfu(self.flops_tok, m["tokens_per_s"], self.devices, self.peak)
        if self.tracing and n == self.prof_last:  # the step is done (its metrics fetched): the trace ends here
            self.tracing = False
            jax.profiler.stop_trace()
            self.log(f"profiler trace of steps {self.prof_first}-{self.prof_last} written to {self.prof_dir} "
                     "(TensorBoard's profile plugin or ui.perfetto.dev)")
            self.clock.pause(time.perf_counter())  # writing the trace is not training throughput
        self._check_finite(m, n)
        self._check_learning(m, n)
        if self.evaluates(n):
            self._evaluate(m, n, state)
        self.history.append(m)
        self.records.write(m)
        self.bar.update(1)
        if self.lead and (n % self.cfg.logging.log_every == 0 or n == self.start + 1 or n == self.end
                          or "val_loss" in m):
            self._show(m, n)
        if self.saves(n):
            try:
                self.ckpt.save(n, state, self.loader)
            except CheckpointSaveError as e:
                self.save_failure = e
            self.clock.pause(time.perf_counter())  # nor is saving a checkpoint

    def _check_finite(self, m: dict, n: int) -> None:
        """A non-finite loss, or gradient norm (the step's update made the parameters non-finite), stops the run
        before either is saved."""
        for k, what in (("loss", "loss"), ("grad_norm", "gradient norm")):
            if not math.isfinite(m[k]):
                kept = self.ckpt.latest_step()
                left = f"the last checkpoint, step {kept}, is kept" if kept is not None else "no checkpoint was written"
                raise FloatingPointError(f"{what} is {m[k]} at step {n}; stopping ({left})")

    def _check_learning(self, m: dict, n: int) -> None:
        """One warning when the launch's first ZERO_GRAD_STEPS steps (all of them, in a shorter launch) all had a
        gradient norm of exactly 0: nothing trains, and the run would go on silently (model.init_std=1e4 gives the tiny
        model's two-layer version a gradient of exactly 0 and its loss ln(vocab) from the first step on)."""
        if m["grad_norm"] != 0.0 or self.zero_grad_steps != n - self.start - 1:  # or a step before had a gradient
            return
        self.zero_grad_steps += 1
        if self.zero_grad_steps == min(ZERO_GRAD_STEPS, self.end - self.start):
            self.log(f"warning: the gradient norm is exactly 0 at steps {self.start + 1}-{n} (loss "
                     f"{m['loss']:.4f}): nothing is training; an init or a learning rate far too large is the usual "
                     f"cause (model.init_std={self.cfg.model.init_std}, optimizer.lr={self.cfg.optimizer.lr})")

    def _evaluate(self, m: dict, n: int, state: dict) -> None:
        eval_fn, val, batch, sharding = self.evaluation
        self.notes["phase"] = f"the evaluation at step {n}"
        m["val_loss"] = evaluate(eval_fn, state, val, batch, sharding)
        self.notes["phase"] = "training"
        m["val_ppl"] = math.exp(min(m["val_loss"], 50.0))
        self.tuned.commit()  # with the evaluation's too (a no-op once it has compiled)
        self.clock.pause(time.perf_counter())  # evaluation time is not training throughput

    def _show(self, m: dict, n: int) -> None:
        """The progress line of step `n`: its rate over the steps since the previous line, and the time left at the
        run's rate so far (evaluations and saves apart)."""
        tps = self.clock.line()
        rate, steady = self.clock.overall()
        eta = (self.end - n) * self.tokens_per_step / rate if steady and rate > 0 and n < self.end else None
        line = {**m, "tokens_per_s": tps, "mfu": mfu(self.flops_tok, tps, self.devices, self.peak), "eta_s": eta}
        self.bar.write(format_line(n, self.total, line), file=sys.stdout)

    def close(self) -> None:
        """After the last step, or an error: a trace stopped early is still written, and the files are closed."""
        if self.tracing:
            self.tracing = False
            try:
                jax.profiler.stop_trace()
            except Exception as e:  # never in place of the error that stopped the run
                self.log(f"the profiler trace could not be written: {type(e).__name__}: {e}")
        self.bar.close()
        self.records.close()

    def summary(self, records: Path, ckpt_dir: Path | None, explicit_resume: bool, peak_bytes: int | None) -> str:
        rate, steady = self.clock.overall()
        return run_summary(self.history, self.start, self.end, self.total, time.perf_counter() - self.t_start, rate,
                           steady, mfu(self.flops_tok, rate, self.devices, self.peak), records, ckpt_dir,
                           explicit_resume=explicit_resume, peak_bytes=peak_bytes)


def run_summary(history: list[dict], start: int, end: int, total: int, wall_s: float, tokens_per_s: float,
                steady: bool, mfu_value: float | None, records: Path, ckpt_dir: Path | None,
                explicit_resume: bool = False, peak_bytes: int | None = None) -> str:
    """The line printed when a run's steps are done: steps, wall time, steady-state throughput (`steady` False: no
    span between like finishes, so the mean since the start, compilation included), the last loss and validation,
    where the records and checkpoints are, and after --stop-after how the run continues. `peak_bytes`: the devices'
    measured memory peak (GPUs)."""
    last = history[-1]
    rate = f"{tokens_per_s / 1e3:.1f}k tok/s" + (f", MFU {100 * mfu_value:.1f}%" if mfu_value is not None else "")
    parts = [f"steps {start + 1}-{end} of {total} in {wall_s:.0f} s",
             rate + (" (compilation, evaluation and saves left out)" if steady else " (compilation included)"),
             f"loss {last['loss']:.4f}"]
    val = [m for m in history if "val_loss" in m]
    if val:
        parts.append(f"val_loss {val[-1]['val_loss']:.4f} val_ppl {val[-1]['val_ppl']:.2f} (step {val[-1]['step']})")
    if peak_bytes is not None:
        parts.append(f"peak device memory {peak_bytes / GIB:.2f} GiB")
    parts.append(f"records {records}")
    if ckpt_dir is not None:
        parts.append(f"checkpoints {ckpt_dir}")
    if end == total:
        head = "done"
    elif ckpt_dir is None:
        head = f"stopped after step {end} (--stop-after; checkpoint.every=0, so no checkpoint of it was saved)"
    else:
        head = (f"stopped after step {end} (--stop-after; to continue, run the same command without --stop-after"
                + (" and without --resume / checkpoint.resume: the run directory's latest checkpoint is resumed)"
                   if explicit_resume else ")"))
    return f"{head}: " + " | ".join(parts)
