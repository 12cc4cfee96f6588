"""The training loop: build, restore, step, log, validate, checkpoint."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from mhl_jax.config import Config, ConfigError, config_to_dict, dump_config
from mhl_jax.data import DataError, load_val_sequences, make_train_loader
from mhl_jax.model.attention import attention_impl
from mhl_jax.model.params import count_params, train_flops_per_token
from mhl_jax.parallel.mesh import batch_spec, make_mesh
from mhl_jax.parallel.traffic import comm_bytes_per_layer
from mhl_jax.runtime.autotune import autotune_file
from mhl_jax.runtime.distributed import agree, check_shared_directory, global_array, is_lead, sync, xla_options
from mhl_jax.runtime.memory import (
    GIB,
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
from mhl_jax.train.checkpoint import Checkpointer, CheckpointError, changed_leaves
from mhl_jax.train.metrics import StepClock, TensorBoardLog, device_peak_flops, format_line, mfu, require_tensorboard
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.schedule import make_schedule
from mhl_jax.train.state import moment_dtype_saving, shard_optimizer_saving, shardings_of, state_creator
from mhl_jax.train.step import jit_train_step, make_eval_step

# Dispatch each step before fetching the previous step's metrics (False: fetch them first, the device idling while
# the host logs and loads the next batch; kept for bench/loop_overlap.py's A/B).
FETCH_AHEAD = True


# Bad input found once a run is set up (config, data files, checkpoints): one line and status 2, no traceback
INPUT_ERRORS = (ConfigError, DataError, CheckpointError)


def input_error_line(e: Exception) -> str:
    """`config error: ...`, `data error: ...` or `checkpoint error: ...` for one of INPUT_ERRORS."""
    kind = next(n for c, n in zip(INPUT_ERRORS, ("config", "data", "checkpoint")) if isinstance(e, c))
    return f"{kind} error: {e}"


def model_fingerprint(cfg: Config) -> dict:
    """What a checkpoint must agree on to be restored into this run."""
    d = config_to_dict(cfg)
    ffn = {k: v for k, v in d["ffn"].items() if k not in ("kernels", "balance_gamma")}
    model = {k: v for k, v in d["model"].items() if k not in ("attention_impl", "compute_dtype", "remat")}
    return {"model": model, "ffn": ffn}


def accumulation_steps(cfg: Config, num_devices: int) -> int:
    micro_global = cfg.train.micro_batch * num_devices
    if cfg.train.global_batch % micro_global:
        fits = [m for m in range(cfg.train.micro_batch, 0, -1) if cfg.train.global_batch % (m * num_devices) == 0]
        hint = f"; e.g. --set train.micro_batch={fits[0]}" if fits else ""
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is not a multiple of train.micro_batch="
                          f"{cfg.train.micro_batch} x {num_devices} devices = {micro_global}{hint}")
    return cfg.train.global_batch // micro_global


def evaluate(eval_fn, state: dict, val: np.ndarray, batch: int, sharding) -> float:
    """Mean NLL over the fixed validation sequences (the last partial batch is dropped; `train` has refused fewer
    sequences than one batch)."""
    total, count = 0.0, 0
    for i in range(0, len(val) - batch + 1, batch):
        tokens = global_array(val[i:i + batch], sharding)
        total += float(eval_fn(state["params"], state["biases"], tokens))
        count += batch * (val.shape[1] - 1)
    return total / count


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


def config_changes(old: dict, new: dict) -> str:
    """'key: old -> new; ...' over the leaves of two config dicts that differ ('' when none)."""
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed_leaves(old, new))


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old or the new file whole."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records past `step` (written by a run killed after its last checkpoint), atomically; a last line cut
    short (the run killed while writing it) goes too. ConfigError for a malformed line before the last."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            n = rec["step"]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            if i == len(lines) - 1:
                break
            raise ConfigError(f"{path}: line {i + 1} is not a metrics record ({type(e).__name__}: {e}); remove it, "
                              "or the file") from e
        if n <= step:
            keep.append(line)
    write_atomic(path, "".join(line + "\n" for line in keep))


def train(cfg: Config, resume: str | None = None, stop_after: int | None = None, log=print,
          check: bool = False) -> list[dict]:
    """Train `cfg`; returns the per-step metric dicts of this process. `stop_after`: stop (with a
    checkpoint unless checkpoint.every=0) once that many optimizer steps are done in total, as a preempted job
    would. Bad input (a run directory that cannot hold the run, a checkpoint that does not fit it, a validation set
    smaller than one evaluation batch) is refused before anything in the run directory is written; directories
    this call created are removed again if the run stops before its config.yaml is written and they are empty.
    With several processes (mhl_jax.runtime.distributed) every process calls this; process 0 alone logs and writes
    the run directory's files. `check`: stop once the train step is compiled and its memory checked (train.py
    --check): no state is created or restored, nothing is written, the directories the call created are removed."""
    run_dir = Path(cfg.logging.run_dir)
    created = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
    lead = is_lead()
    notes = {"phase": "setting up"}  # what _train learned before an error: its phase, the step's memory estimate

    def remove_created() -> None:
        if "autotune" in notes:
            notes["autotune"].discard()
        if created and not (run_dir / "config.yaml").exists():  # each process: what it created
            for d in [run_dir / "checkpoints", *created]:
                try:
                    d.rmdir()  # only if empty
                except OSError:
                    pass

    try:
        history = _train(cfg, run_dir, resume, stop_after, log if lead else _quiet, lead, notes, check)
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
           notes: dict, check: bool) -> list[dict]:
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
    counts = count_params(cfg)
    log(f"model {cfg.ffn.kind}: {counts.active / 1e6:.1f}M active / {counts.total / 1e6:.1f}M total parameters")

    mesh = make_mesh(cfg)
    accum = accumulation_steps(cfg, mesh.size)
    t = cfg.model.context
    tx = make_optimizer(cfg)
    # the state is created (each device its own shards) or restored only once the step is known to fit (below)
    graphdef, create_state, abstract = state_creator(cfg, mesh, tx)
    shardings = shardings_of(abstract)
    batch_sharding = NamedSharding(mesh, batch_spec(mesh))
    eval_sharding = NamedSharding(mesh, P(*batch_spec(mesh)[1:]))

    # every process reads the whole global batch and places its own rows (global_array): the batches, and so the
    # losses, do not depend on how the devices are split into processes
    loader = make_train_loader(cfg.data, seq_len=t, batch_size=cfg.train.global_batch, seed=cfg.train.seed,
                               vocab_size=cfg.model.vocab_size)
    val = (load_val_sequences(cfg.data, seq_len=t, vocab_size=cfg.model.vocab_size)
           if cfg.data.val_sequences and cfg.data.eval_every else None)  # no validation data read without evaluation
    eval_batch = cfg.train.micro_batch * mesh.size
    if val is not None and len(val) < eval_batch:
        raise ConfigError(f"data.val_sequences={len(val)} is fewer than one evaluation batch (train.micro_batch="
                          f"{cfg.train.micro_batch} x {mesh.size} devices = {eval_batch}); raise it, or set "
                          "data.eval_every=0 to train without validation")
    if val is not None and len(val) % eval_batch:
        log(f"validation: {len(val) // eval_batch * eval_batch} of data.val_sequences={len(val)} sequences (whole "
            f"evaluation batches of {eval_batch})")
    resume = resume or cfg.checkpoint.resume or None
    # XLA's autotuning results kept with the run (GPU); a bad setting is refused before anything is written
    tuned = autotune_file(cfg.train.xla_autotune_file, run_dir, resume, jax.default_backend(), jax.process_index())
    compile_options = {**tuned.compiler_options(), **xla_options(jax.default_backend())}
    notes["autotune"] = tuned
    # closed on every way out (a refused restore too): Orbax's threads released, no tracebacks from them at exit
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ckpt:
        restoring = bool(resume) or ckpt.latest_step() is not None
        records = run_dir / "metrics.jsonl"
        start = 0  # a fresh run's (or a relaunched one's, below, that never saved a checkpoint)
        if restoring:  # refused or unreadable: the run directory is left as it was
            step = ckpt.step_of(resume)
            later = [s for s in ckpt.all_steps() if s > step]
            if later:  # Orbax would refuse this run's first save, and the metrics past the step would be dropped
                raise CheckpointError(f"resuming step {step} ({resume}) into logging.run_dir="
                                      f"{cfg.logging.run_dir!r}, which already holds later checkpoints (steps {later}):"
                                      " this run's checkpoints and metrics would collide with them; resume into "
                                      "another logging.run_dir, or delete those step directories first")
            start = step
            if not check:  # into the state's shardings: nothing is created first
                notes["phase"] = "restoring the checkpoint"
                start, state = ckpt.restore(abstract, loader, path=resume)
                log(f"resumed from step {start} ({resume or ckpt.directory})")
        elif records.exists() and records.stat().st_size > 0:
            # no checkpoint yet: the same run relaunched (killed or preempted before its first checkpoint) starts
            # over; another run's records are not dropped
            saved = run_dir / "config.yaml"
            if not (saved.is_file() and saved.read_text() == dump_config(cfg)):
                raise ConfigError(f"logging.run_dir={cfg.logging.run_dir!r} holds the metrics of an earlier run "
                                  f"({records}) with another config ({saved.name}) and no checkpoint to resume from;"
                                  " use another logging.run_dir, or delete that file to start over there")
            log(f"no checkpoint of this run's earlier launch in {run_dir}: starting over from step 0 (its records "
                "are replaced)")
        sync("run checks done")  # every process has read the run directory before process 0 writes to it
        total = cfg.schedule.total_steps
        end = total if stop_after is None else min(total, stop_after)
        if start >= end:
            why = (f"schedule.total_steps={total} (raise it to train on)" if end == total
                   else f"--stop-after {stop_after}")
            at = f"the checkpoint is at step {start}" if restoring else f"the run starts at step {start}"
            log(f"nothing to train: {at}, and this run stops at {why}")
            return []
        # the step compiled ahead of its first run, so that one that cannot fit the devices is refused here, before
        # anything in the run directory is written
        schedule = make_schedule(cfg.optimizer, cfg.schedule)
        if tuned.load is not None:
            log(f"XLA autotuning results from {tuned.load}")
        step_fn = jit_train_step(graphdef, tx, cfg.balance_gamma, schedule, shardings, batch_sharding, donate=True,
                                 deterministic=cfg.train.xla_deterministic_ops,
                                 cudnn_attention=attention_impl(cfg.model.attention_impl) == "cudnn",
                                 autotune_options=compile_options)
        batch_shape = jax.ShapeDtypeStruct((accum, cfg.train.global_batch // accum, t + 1), np.int32,
                                           sharding=batch_sharding)
        # (the step's calls below reuse this compilation: jit caches it); a failure on one process is raised after
        # `agree`, so that the others do not wait for it in the next collective
        notes["phase"] = "compiling the train step"
        memory, failed, limit = None, None, None
        try:
            memory = step_memory(step_fn.lower(abstract, batch_shape).compile())
            notes["memory"] = memory
            if memory is not None:
                limit = device_limit(jax.local_devices())
                log(describe(memory, limit))
                saving = shard_optimizer_saving(cfg, mesh, abstract)
                if saving > 0:
                    log(f"parallel.shard_optimizer=true would hold {amount(saving)} less per device (AdamW's moments "
                        "split over the devices that hold copies of them)")
                check_fits(memory, limit, cfg, mesh.size, saving, moment_dtype_saving(cfg, abstract))
        except Exception as e:
            failed = e
        agree(failed is None, "the memory check")
        if failed is not None:
            raise failed
        if check:
            log("check done: " + ("the train step fits the devices" if memory is not None and limit is not None else
                                  "the train step compiles (no device limit to check it against here)")
                + (f"; the run would resume from step {start}" if restoring else "") + "; nothing was written")
            return []
        if not restoring:
            notes["phase"] = "creating the state"
            state = create_state()
        # the run's config, once it is known to fit the checkpoint it resumes (a refused run leaves the old one); a
        # resumed run whose settings changed keeps the earlier config beside it and names the changes
        saved, text = run_dir / "config.yaml", dump_config(cfg)
        before = saved.read_text() if restoring and saved.is_file() else text
        changes = config_changes(yaml.safe_load(before) or {}, config_to_dict(cfg)) if before != text else ""
        kept = run_dir / f"config-until-step{start}.yaml"
        metrics_file, board, failed = None, None, None
        if lead:  # the others wait in `agree` below: a failure here stops every process, not only this one
            try:
                if changes:
                    write_atomic(kept, before)
                write_atomic(saved, text)
                truncate_metrics(records, start)
                metrics_file = open(records, "a")
                if cfg.logging.tensorboard:
                    board = TensorBoardLog(run_dir / "tensorboard")
            except (OSError, ConfigError) as e:
                failed = e
        agree(failed is None, "to write the run directory's files")
        if isinstance(failed, OSError):
            raise ConfigError(f"logging.run_dir={cfg.logging.run_dir!r}: cannot write the run's files ({failed})") \
                from failed
        if failed is not None:
            raise failed
        if changes:
            log(f"resuming with changed settings: {changes} (the earlier config.yaml is kept as {kept.name})")

        eval_fn = jax.jit(make_eval_step(graphdef), compiler_options=compile_options or None)

        flops_tok = train_flops_per_token(cfg)
        peak = device_peak_flops(cfg.logging.peak_tflops)
        tokens_per_step = cfg.train.global_batch * t
        comm = comm_bytes_per_layer(cfg, mesh, cfg.train.micro_batch * t)  # all-to-all bytes per device per MoE layer
        if comm:
            log("all-to-all per device per MoE layer, each way: "
                + ", ".join(f"{k.split('/')[1]} {v / 2**20:.2f} MiB" for k, v in comm.items()))
        history: list[dict] = []
        bar = tqdm(total=total, initial=start, disable=not (cfg.logging.progress_bar and lead), file=sys.stderr,
                   dynamic_ncols=True)
        t_start = time.perf_counter()
        clock = StepClock(tokens_per_step, t_start)
        # the profiled steps (logging.profile_start): a trace from the dispatch of the first to the end of the last
        prof_first = cfg.logging.profile_start if lead and start < cfg.logging.profile_start <= end else 0
        prof_last = min(prof_first + cfg.logging.profile_steps - 1, end) if prof_first else 0
        prof_dir = run_dir / "profile"
        if cfg.logging.profile_start and not prof_first and lead:
            log(f"no profile: logging.profile_start={cfg.logging.profile_start} is not among this run's steps "
                f"{start + 1}-{end}")
        tracing = False

        def evaluates(n: int) -> bool:
            return val is not None and (n % cfg.data.eval_every == 0 or n == total)  # val: only with eval_every

        def saves(n: int) -> bool:
            return bool(cfg.checkpoint.every and (n % cfg.checkpoint.every == 0 or n == end))

        def needs_state(n: int) -> bool:
            """Whether the end of step `n` (1-based) evaluates, checkpoints, ends the run or the profile: those read
            the state of step `n` (or its end) and must see its loss first, so its metrics are fetched before step
            n + 1 is dispatched."""
            return n == end or n == prof_last or evaluates(n) or saves(n)

        def finish(n: int, m_device, ahead: bool) -> None:
            """Step `n`'s metrics fetched (waiting for the step), checked, logged; then its evaluation and
            checkpoint when due. `ahead`: step n + 1 was dispatched first (StepClock)."""
            nonlocal tracing
            m = {k: float(v) for k, v in jax.device_get(m_device).items()}
            m["step"] = n
            m.update(comm)
            m["tokens_per_s"] = clock.finish(time.perf_counter(), ahead)
            m["mfu"] = mfu(flops_tok, m["tokens_per_s"], mesh.size, peak)
            if tracing and n == prof_last:  # the step is done (its metrics fetched): the trace ends here
                tracing = False
                jax.profiler.stop_trace()
                log(f"profiler trace of steps {prof_first}-{prof_last} written to {prof_dir} (TensorBoard's profile "
                    "plugin or ui.perfetto.dev)")
                clock.pause(time.perf_counter())  # writing the trace is not training throughput
            for k, what in (("loss", "loss"), ("grad_norm", "gradient norm")):  # a non-finite gradient norm: the
                if not math.isfinite(m[k]):  # step's update made the parameters non-finite; neither is saved
                    kept = ckpt.latest_step()
                    raise FloatingPointError(f"{what} is {m[k]} at step {n}; stopping (" + (
                        f"the last checkpoint, step {kept}, is kept)" if kept is not None
                        else "no checkpoint was written)"))
            if evaluates(n):
                notes["phase"] = f"the evaluation at step {n}"
                m["val_loss"] = evaluate(eval_fn, state, val, eval_batch, eval_sharding)
                notes["phase"] = "training"
                m["val_ppl"] = math.exp(min(m["val_loss"], 50.0))
                tuned.commit()  # with the evaluation's too (a no-op once it has compiled)
                clock.pause(time.perf_counter())  # evaluation time is not training throughput
            history.append(m)
            if metrics_file is not None:
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
            if board is not None:
                board.write(m)
            bar.update(1)
            if lead and (n % cfg.logging.log_every == 0 or n == start + 1 or n == end or "val_loss" in m):
                tps = clock.line()  # over the steps since the previous line
                rate, steady = clock.overall()  # the steps left at the run's rate so far (evaluations, saves apart)
                eta = (end - n) * tokens_per_step / rate if steady and rate > 0 and n < end else None
                line = {**m, "tokens_per_s": tps, "mfu": mfu(flops_tok, tps, mesh.size, peak), "eta_s": eta}
                bar.write(format_line(n, total, line), file=sys.stdout)
            if saves(n):
                ckpt.save(n, state, loader)
                clock.pause(time.perf_counter())  # nor is saving a checkpoint

        # Step n + 1 is dispatched before step n's metrics are fetched (FETCH_AHEAD), so the device runs it
        # while the host waits for, checks and logs step n and loads the next batch: no idle gap between steps.
        # A step whose end reads the state (evaluation, checkpoint, the last step) is finished before the next
        # is dispatched. A non-finite loss at step n stops the run one step later, before any checkpoint.
        pending = None  # (step number, metrics on the device) not yet finished
        notes["phase"] = "training"
        try:
            for step in range(start, end):
                if step + 1 == prof_first:
                    jax.profiler.start_trace(str(prof_dir))
                    tracing = True
                batch = np.asarray(next(loader)).reshape(accum, -1, t + 1)
                state, m_device = step_fn(state, global_array(batch, batch_sharding))
                if step == start:
                    tuned.commit()  # the step compiled: XLA's autotuning results in place
                if pending is not None:
                    finish(*pending, ahead=True)
                if FETCH_AHEAD and not needs_state(step + 1):
                    pending = (step + 1, m_device)
                else:
                    pending = None
                    finish(step + 1, m_device, ahead=False)
        finally:
            if tracing:  # stopped early (an error): what was traced is still written
                tracing = False
                try:
                    jax.profiler.stop_trace()
                except Exception as e:  # never in place of the error that stopped the run
                    log(f"the profiler trace could not be written: {type(e).__name__}: {e}")
            bar.close()
            if metrics_file is not None:
                metrics_file.close()
            if board is not None:
                board.close()
        rate, steady = clock.overall()
        log(run_summary(history, start, end, total, time.perf_counter() - t_start, rate, steady,
                        mfu(flops_tok, rate, mesh.size, peak), records,
                        run_dir / "checkpoints" if cfg.checkpoint.every else None, explicit_resume=bool(resume),
                        peak_bytes=peak_in_use(jax.local_devices())))
        return history
