"""The training loop: prepare the run, check that its step fits the devices, build or restore the state, run the
steps, finish.

Bad input (a run directory that cannot hold the run, a checkpoint that does not fit it, a validation set smaller than
one evaluation batch) is refused before anything in the run directory is written. With several processes
(mhl_jax.runtime.distributed) every process runs the same calls; process 0 alone logs and writes the run's files.
A preemption signal, or a checkpoint that could not be saved, stops every process before the same step
(mhl_jax.train.interrupt).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, NoReturn

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from mhl_jax.config import Config, ConfigError, dump_config
from mhl_jax.data import load_val_sequences, make_train_loader
from mhl_jax.model.gpt import implementations
from mhl_jax.model.params import count_params, train_flops_per_token
from mhl_jax.moe.plan import plan_for_config
from mhl_jax.parallel.mesh import batch_spec, make_mesh
from mhl_jax.parallel.traffic import comm_bytes_per_layer
from mhl_jax.runtime.autotune import AutotuneFile, autotune_file, step_key
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.runtime.distributed import agree, check_shared_directory, global_array, is_lead, sync, xla_options
from mhl_jax.runtime.errors import CheckpointError, CheckpointSaveError
from mhl_jax.runtime.evaluate import eval_sharding, make_eval_step
from mhl_jax.runtime.memory import (
    DeviceMemoryError,
    amount,
    check_fits,
    describe,
    device_limit,
    is_out_of_memory,
    out_of_memory_message,
    peak_in_use,
    step_memory,
)
from mhl_jax.runtime.state import shardings_of, state_creator
from mhl_jax.train.interrupt import Interrupted, PreemptionSignals, Stopping, interrupted_line
from mhl_jax.train.metrics import device_peak_flops, require_tensorboard
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.progress import Progress
from mhl_jax.train.records import open_records, run_info
from mhl_jax.train.schedule import make_schedule
from mhl_jax.train.state import moment_dtype_saving, shard_optimizer_saving
from mhl_jax.train.step import jit_train_step


def accumulation_steps(cfg: Config, num_devices: int) -> int:
    """Micro-batches per optimizer step: the global batch over (micro-batch x devices), which must divide it."""
    micro_global = cfg.train.micro_batch * num_devices
    if cfg.train.global_batch % micro_global:
        fits = [m for m in range(cfg.train.micro_batch, 0, -1) if cfg.train.global_batch % (m * num_devices) == 0]
        hint = f"; e.g. --set train.micro_batch={fits[0]}" if fits else ""
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is not a multiple of train.micro_batch="
                          f"{cfg.train.micro_batch} x {num_devices} devices = {micro_global}{hint}")
    return cfg.train.global_batch // micro_global


@dataclasses.dataclass
class Run:
    """A run as prepared before its state exists: the mesh, the state's layout, the data, the compile options."""

    cfg: Config
    run_dir: Path
    log: Callable
    lead: bool
    resume: str | None  # the checkpoint asked for (--resume or checkpoint.resume), or None: the run directory's
    mesh: Mesh
    accum: int
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    create_state: Callable[[], dict]
    abstract: dict  # the state's leaves as ShapeDtypeStructs, with their shardings
    batch_sharding: NamedSharding
    loader: Any
    val: np.ndarray | None  # the validation sequences (None: no evaluation)
    eval_batch: int
    tuned: AutotuneFile
    compile_options: dict
    kernel_plan: dict


def train(cfg: Config, resume: str | None = None, stop_after: int | None = None, log=print,
          check: bool = False) -> list[dict]:
    """Train `cfg`; returns the per-step metric dicts of this process. `stop_after`: stop (with a checkpoint unless
    checkpoint.every=0) once that many optimizer steps are done in total, as a preempted job would. Directories this
    call created are removed again if the run stops before its config.yaml is written and they are empty. `check`:
    stop once the train step is compiled and its memory checked (train.py --check): no state is created or
    restored, nothing is written, the directories the call created are removed.

    SIGTERM, SIGINT or SIGUSR1 while it runs (in the main thread) stops the run after the step in flight with a
    checkpoint of it: `Interrupted`; a second one ends the process at once (mhl_jax.train.interrupt). A checkpoint
    that cannot be saved raises CheckpointSaveError at the next step."""
    run_dir = Path(cfg.logging.run_dir)
    # deepest first: the directories this call may create (an existing run directory can still gain checkpoints/)
    created = [d for d in (run_dir / "checkpoints", run_dir, *run_dir.parents) if not d.exists()]
    lead = is_lead()
    notes = {"phase": "setting up"}  # what _train learned before an error: its phase, the step's memory estimate

    def remove_created() -> None:
        if "autotune" in notes:
            notes["autotune"].discard()
        if created and not (run_dir / "config.yaml").exists():  # each process: what it created
            for d in created:
                try:
                    d.rmdir()  # only if empty
                except OSError:
                    pass

    try:
        with PreemptionSignals(log if lead else _quiet) as signals:
            history = _train(cfg, run_dir, resume, stop_after, log if lead else _quiet, lead, notes, check, signals)
    except BaseException as e:
        remove_created()
        if isinstance(e, Exception) and is_out_of_memory(e):  # XLA's error (and its allocator's dump) as one line
            raise DeviceMemoryError(out_of_memory_message(e, notes.get("memory"), notes["phase"])) from e
        raise
    if check:
        remove_created()
    return history


def _quiet(*args, **kwargs) -> None:
    """The log of processes other than 0."""


def _train(cfg: Config, run_dir: Path, resume: str | None, stop_after: int | None, log, lead: bool,
           notes: dict, check: bool, signals: PreemptionSignals) -> list[dict]:
    run = _prepare(cfg, run_dir, resume, log, lead, check, notes)
    # closed on every way out (a refused restore too): Orbax's threads released, no tracebacks from them at exit
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ckpt:
        restoring, start, state = _find_start(run, ckpt, check, notes)
        sync("run checks done")  # every process has read the run directory before process 0 writes to it
        total = cfg.schedule.total_steps
        end = total if stop_after is None else min(total, stop_after)
        if start >= end:
            why = (f"schedule.total_steps={total} (raise it to train on)" if end == total
                   else f"--stop-after {stop_after}")
            at = f"the checkpoint is at step {start}" if restoring else f"the run starts at step {start}"
            log(f"nothing to train: {at}, and this run stops at {why}")
            return []
        step_fn, fits = _compile_checked(run, notes)
        if check:
            log("check done: " + ("the train step fits the devices" if fits else
                                  "the train step compiles (no device limit to check it against here)")
                + (f"; the run would resume from step {start}" if restoring else "") + "; nothing was written")
            return []
        stopping = Stopping(signals, ckpt)
        if stopping.poll(None):  # a signal during the setup or the compilation: nothing written yet, nothing to save
            raise Interrupted(interrupted_line(start, start, False, cfg.checkpoint.every, bool(run.resume)), start,
                              False)
        if not restoring:
            notes["phase"] = "creating the state"
            state = run.create_state()
        records = open_records(cfg, run_dir, lead, restoring, start, run_info(run.kernel_plan, start), log)
        progress = _progress(run, ckpt, records, start, end, notes)
        try:
            _run_steps(run, step_fn, state, progress, stopping, start, end, notes)
        finally:
            progress.close()
        log(progress.summary(run_dir / "metrics.jsonl", run_dir / "checkpoints" if cfg.checkpoint.every else None,
                             explicit_resume=bool(run.resume), peak_bytes=peak_in_use(jax.local_devices())))
        return progress.history


def _prepare(cfg: Config, run_dir: Path, resume: str | None, log, lead: bool, check: bool, notes: dict) -> Run:
    """The run directory made, the model counted and its kernel plan shown, the mesh, the state's layout, the data
    and the compile options set up; nothing is created on the devices yet."""
    _make_run_dir(cfg, run_dir, check)
    counts = count_params(cfg)
    log(f"model {cfg.ffn.kind}: {counts.active / 1e6:.1f}M active / {counts.total / 1e6:.1f}M total parameters")
    plan = plan_for_config(cfg)
    impls = implementations(cfg)
    log(f"{plan.summary()}; attention: {impls['attention_impl']}, LM-head loss: {impls['loss_impl']}")
    mesh = make_mesh(cfg)
    accum = accumulation_steps(cfg, mesh.size)
    tx = make_optimizer(cfg)
    # the state is created (each device its own shards) or restored only once the step is known to fit
    graphdef, create_state, abstract = state_creator(cfg, mesh, tx)
    # every process reads the whole global batch and places its own rows (global_array): the batches, and so the
    # losses, do not depend on how the devices are split into processes
    loader = make_train_loader(cfg.data, seq_len=cfg.model.context, batch_size=cfg.train.global_batch,
                               seed=cfg.train.seed, vocab_size=cfg.model.vocab_size)
    eval_batch = cfg.train.micro_batch * mesh.size
    val = _validation(cfg, eval_batch, mesh.size, log)
    resume = resume or cfg.checkpoint.resume or None
    # XLA's autotuning results kept with the run and shared by runs of this config (GPU); a bad setting is refused
    # before anything is written
    backend = jax.default_backend()
    tuned = autotune_file(cfg.train.xla_autotune_file, run_dir, resume, backend, jax.process_index(),
                          key=step_key(cfg) if backend == "gpu" else None)
    notes["autotune"] = tuned
    return Run(cfg, run_dir, log, lead, resume, mesh, accum, tx, graphdef, create_state, abstract,
               NamedSharding(mesh, batch_spec(mesh)), loader, val, eval_batch, tuned,
               {**tuned.compiler_options(), **xla_options(jax.default_backend())}, {**plan.as_dict(), **impls})


def _make_run_dir(cfg: Config, run_dir: Path, check: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"logging.run_dir={cfg.logging.run_dir!r} is a file; expected a directory (or a path to "
                          "create)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"logging.run_dir={cfg.logging.run_dir!r} cannot be created: {e}") from e
    check_shared_directory(run_dir)
    if cfg.logging.tensorboard and not check:
        require_tensorboard()  # before anything is written


def _validation(cfg: Config, eval_batch: int, devices: int, log) -> np.ndarray | None:
    """The fixed validation sequences, whole evaluation batches of them used (none read without evaluation)."""
    if not (cfg.data.val_sequences and cfg.data.eval_every):
        return None
    val = load_val_sequences(cfg.data, seq_len=cfg.model.context, vocab_size=cfg.model.vocab_size)
    if len(val) < eval_batch:
        raise ConfigError(f"data.val_sequences={len(val)} is fewer than one evaluation batch (train.micro_batch="
                          f"{cfg.train.micro_batch} x {devices} devices = {eval_batch}); raise it, or set "
                          "data.eval_every=0 to train without validation")
    if len(val) % eval_batch:
        log(f"validation: {len(val) // eval_batch * eval_batch} of data.val_sequences={len(val)} sequences (whole "
            f"evaluation batches of {eval_batch})")
    return val


def _find_start(run: Run, ckpt: Checkpointer, check: bool, notes: dict) -> tuple[bool, int, dict | None]:
    """(restoring, start step, restored state or None). A checkpoint (asked for, or the run directory's latest) is
    restored into the state's shardings, nothing created first; a refused or unreadable one leaves the run directory
    as it was. Without one, a relaunch of the same run (killed before its first checkpoint) starts over; another
    run's records are not dropped."""
    restoring = bool(run.resume) or ckpt.latest_step() is not None
    records = run.run_dir / "metrics.jsonl"
    if restoring:
        step = ckpt.step_of(run.resume)
        later = [s for s in ckpt.all_steps() if s > step]
        if later:  # Orbax would refuse this run's first save, and the metrics past the step would be dropped
            raise CheckpointError(f"resuming step {step} ({run.resume}) into logging.run_dir="
                                  f"{run.cfg.logging.run_dir!r}, which already holds later checkpoints (steps "
                                  f"{later}): this run's checkpoints and metrics would collide with them; resume into "
                                  "another logging.run_dir, or delete those step directories first")
        if check:  # refused now if the restore would refuse it (another model config, another state layout)
            return True, ckpt.check_restorable(run.abstract, data=run.loader is not None, path=run.resume), None
        notes["phase"] = "restoring the checkpoint"
        start, state = ckpt.restore(run.abstract, run.loader, path=run.resume)
        run.log(f"resumed from step {start} ({run.resume or ckpt.directory})")
        return True, start, state
    if records.exists() and records.stat().st_size > 0:
        saved = run.run_dir / "config.yaml"
        if not (saved.is_file() and saved.read_text() == dump_config(run.cfg)):
            raise ConfigError(f"logging.run_dir={run.cfg.logging.run_dir!r} holds the metrics of an earlier run "
                              f"({records}) with another config ({saved.name}) and no checkpoint to resume from;"
                              " use another logging.run_dir, or delete that file to start over there")
        run.log(f"no checkpoint of this run's earlier launch in {run.run_dir}: starting over from step 0 (its "
                "records are replaced)")
    return False, 0, None


def _compile_checked(run: Run, notes: dict) -> tuple[Callable, bool]:
    """(the jitted train step, whether its memory was checked against a device limit). The step is compiled ahead of
    its first run (its calls reuse this compilation: jit caches it), so that one that cannot fit the devices is
    refused before anything in the run directory is written. A failure on one process is raised after `agree`, so
    that the others do not wait for it in the next collective."""
    cfg, log = run.cfg, run.log
    if run.tuned.load is not None:
        log(f"XLA autotuning results from {run.tuned.load}")
    step_fn = jit_train_step(run.graphdef, run.tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule),
                             shardings_of(run.abstract), run.batch_sharding, donate=True,
                             deterministic=cfg.train.xla_deterministic_ops,
                             cudnn_attention=run.kernel_plan["attention_impl"] == "cudnn",
                             autotune_options=run.compile_options)
    batch_shape = jax.ShapeDtypeStruct((run.accum, cfg.train.global_batch // run.accum, cfg.model.context + 1),
                                       np.int32, sharding=run.batch_sharding)
    notes["phase"] = "compiling the train step"
    memory, failed, limit = None, None, None
    try:
        memory = step_memory(step_fn.lower(run.abstract, batch_shape).compile())
        notes["memory"] = memory
        if memory is not None:
            limit = device_limit(jax.local_devices())
            log(describe(memory, limit))
            saving = shard_optimizer_saving(cfg, run.mesh, run.abstract)
            if saving > 0:
                log(f"parallel.shard_optimizer=true would hold {amount(saving)} less per device (AdamW's moments "
                    "split over the devices that hold copies of them)")
            check_fits(memory, limit, cfg, run.mesh.size, saving, moment_dtype_saving(cfg, run.abstract))
    except Exception as e:
        failed = e
    agree(failed is None, "the memory check")
    if failed is not None:
        raise failed
    return step_fn, memory is not None and limit is not None


def _progress(run: Run, ckpt: Checkpointer, records, start: int, end: int, notes: dict) -> Progress:
    """What finishes each step: the evaluation (compiled on first use), the MFU's figures, the all-to-all bytes."""
    cfg = run.cfg
    eval_fn = jax.jit(make_eval_step(run.graphdef), compiler_options=run.compile_options or None)
    evaluation = None if run.val is None else (eval_fn, run.val, run.eval_batch, eval_sharding(run.mesh))
    # all-to-all bytes per device per MoE layer
    comm = comm_bytes_per_layer(cfg, run.mesh, cfg.train.micro_batch * cfg.model.context)
    if comm:
        run.log("all-to-all per device per MoE layer, each way: "
                + ", ".join(f"{k.split('/')[1]} {v / 2**20:.2f} MiB" for k, v in comm.items()))
    rate = (train_flops_per_token(cfg), device_peak_flops(cfg.logging.peak_tflops), run.mesh.size)
    return Progress(cfg, run.run_dir, run.lead, run.log, start, end, ckpt, run.loader, records, evaluation, run.tuned,
                    rate, comm, notes)


def _run_steps(run: Run, step_fn: Callable, state: dict, progress: Progress, stopping: Stopping, start: int,
               end: int, notes: dict) -> None:
    """Steps start + 1 .. end. Step n + 1 is dispatched before step n is finished, so the device runs it while the
    host waits for, checks and logs step n and loads the next batch: no idle gap between steps. A step whose end
    reads the state (evaluation, checkpoint, the last step) is finished before the next is dispatched. A non-finite
    loss at step n stops the run one step later, before any checkpoint. Before each dispatch the processes agree
    whether to stop (`Stopping.poll`, while the device runs the step before): at a signal the step in flight is
    finished and saved (`_interrupt`); a failed save stops the run."""
    t = run.cfg.model.context
    pending = None  # (step number, metrics on the device) not yet finished
    notes["phase"] = "training"
    for step in range(start, end):
        if stopping.poll(progress.save_failure):
            if pending is not None:
                progress.finish(*pending, ahead=False, state=state)
            _interrupt(run, progress, stopping, state, step, start,
                       stopping.signals.requested or "another process's signal")
        progress.dispatching(step + 1)
        batch = np.asarray(next(run.loader)).reshape(run.accum, -1, t + 1)
        state, m_device = step_fn(state, global_array(batch, run.batch_sharding))
        if step == start:
            run.tuned.commit()  # the step compiled: XLA's autotuning results in place
        if pending is not None:
            progress.finish(*pending, ahead=True, state=state)
        if progress.needs_state(step + 1):
            pending = None
            progress.finish(step + 1, m_device, ahead=False, state=state)
        else:
            pending = (step + 1, m_device)
    stopping.poll(progress.save_failure, last=True)  # the last checkpoint written (a signal now changes nothing)


def _interrupt(run: Run, progress: Progress, stopping: Stopping, state: dict, step: int, start: int,
               signal_name: str) -> NoReturn:
    """The run stops at a preemption signal after step `step` (`state` is its state): a checkpoint of it saved and
    committed (unless checkpoint.every=0 or no step ran; the step's own checkpoint when it just saved one), then
    Interrupted. Whether the save worked is shared between the processes (`Stopping.poll`), so that all of them say
    the same."""
    ckpt, every = progress.ckpt, run.cfg.checkpoint.every
    saved = step > start and every > 0
    if saved:
        failure = None
        try:
            if ckpt.latest_step() != step:
                ckpt.save(step, state, run.loader)
        except CheckpointSaveError as e:
            failure = e
        try:
            stopping.poll(failure, last=True)  # waits for the write; raises the failure of any process
        except CheckpointSaveError as e:
            raise CheckpointSaveError(f"interrupted ({signal_name}) at step {step}, and {e}") from e
    raise Interrupted(interrupted_line(step, start, saved, every, bool(run.resume)), step, saved)
