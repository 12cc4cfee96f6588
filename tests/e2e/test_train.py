"""End to end on CPU: the tiny default trains and its loss falls; the CLI rejects bad configs."""

import dataclasses
import glob
import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.profiler import ProfileData

from mhl_jax.config import ConfigError, load_config
from mhl_jax.data import DataError
from mhl_jax.data.bin_shards import write_shard
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.checkpoint import Checkpointer, CheckpointError
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.runtime.state import state_creator
from mhl_jax.train import loop, progress
from mhl_jax.train.loop import train
from mhl_jax.train.metrics import StepClock, duration, format_line
from mhl_jax.train.optimizer import make_optimizer
from tests.runs import dir_snapshot, records, tiny


def _tensorboard_scalars(directory):
    """{(tag, step): value} from the TFRecord event files in `directory` (read here, frame by frame)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for f in sorted(Path(directory).glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4  # length, its crc, the record, its crc
            for v in event.summary.value:
                out[(v.tag, event.step)] = v.simple_value
    return out


def test_tiny_run_loss_falls_logs_and_writes_tensorboard(tmp_path, capsys):
    """The tiny default trains 40 steps: its loss falls, validation improves, the records, the progress lines and the
    TensorBoard scalars (the records' values, read back from the event files) are written."""
    hist = train(tiny(tmp_path, "logging.tensorboard=true"))
    losses = [m["loss"] for m in hist]
    assert len(losses) == 40
    assert losses[0] > 5.0  # ~ln(320) at init
    assert sum(losses[-10:]) / 10 < losses[0] - 2.0, losses
    # validation ran at step 20 and at the end, and improved
    vals = [m["val_loss"] for m in hist if "val_loss" in m]
    assert len(vals) == 2 and vals[1] < vals[0]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "load_max/1", "load_min/1", "val_ppl"):  # layer 1: MoE
        assert key in rec
    out = capsys.readouterr().out
    assert "active" in out and "total parameters" in out
    assert "attention: xla, LM-head loss: xla" in out  # the CPU's choices, shown and kept with the kernel plan
    plan = json.loads((tmp_path / "run" / "run.json").read_text())["kernel_plan"]
    assert (plan["attention_impl"], plan["loss_impl"]) == ("xla", "xla")
    assert "loss" in out and "tok/s" in out and "load max/min L1" in out
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert progress and all(("ETA " in line) == (not line.startswith("step 40/")) for line in progress[1:]), progress
    assert "ETA" not in progress[-1]  # the last step: nothing left
    board = _tensorboard_scalars(tmp_path / "run" / "tensorboard")
    want = {}
    for m in hist:
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)):
                tag = "val/" + k[4:] if k.startswith("val_") else k if "/" in k else "train/" + k
                want[(tag, m["step"])] = v
    assert ("val/loss", 20) in want and ("load_max/1", 1) in want and ("train/loss", 40) in want
    assert set(board) == set(want)
    for key, v in want.items():
        assert board[key] == pytest.approx(v, rel=1e-6, abs=1e-30), key  # float32 in the event files


def test_progress_line_durations():
    assert [duration(x) for x in (0, 44.6, 192, 3720, 7200, 183600)] == ["0s", "45s", "3m12s", "1h02m", "2h00m",
                                                                          "2d03h"]
    m = {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "eta_s": 75}
    assert format_line(3, 10, m) == "step 3/10 | loss 2.0000 | lr 1.00e-03 | gnorm 0.500 | 1.0k tok/s | ETA 1m15s"


@pytest.mark.parametrize("kind", ["tiny_moe", "tiny_latent_moe", "tiny_mlp"])
def test_other_variants_train(tmp_path, kind):
    cfg = tiny(tmp_path, "schedule.total_steps=10", "data.val_sequences=0", config=kind)
    losses = [m["loss"] for m in train(cfg)]
    assert losses[-1] < losses[0] - 0.5


def _simulate_clock(n_steps, drained, lag, log_every, evals=(), period=lambda n: 0.25, compile_s=3.0, pause_s=0.7,
                    host_s=0.002):
    """StepClock fed by a simulated train loop and device. The host compiles step 1 (`compile_s`) before it runs;
    step n runs `period(n)` seconds on the device once the device is free and the host has begun its dispatch; the
    dispatch returns `lag` seconds before the step ends (a full launch queue; None: at once). A step in `drained` is
    finished right after its own dispatch (then `pause_s` of evaluation or checkpoint), any other after the next
    step's dispatch, as the loop does; each call costs the host `host_s`. Lines as the loop prints them (every
    `log_every` steps, the first, the last, the `evals`). Returns {step: reading} and {step: line rate}."""
    clock = StepClock(1000, 0.0)
    t, free, pending, ends, steps, lines = 0.0, 0.0, None, {}, {}, {}

    def done(n, at, ahead):
        steps[n] = clock.finish(at, ahead)
        if n % log_every == 0 or n == 1 or n == n_steps or n in evals:
            lines[n] = clock.line()

    for n in range(1, n_steps + 1):
        if n == 1:
            t += compile_s
        ends[n] = max(free, t) + period(n)
        free = ends[n]
        t = max(t + host_s, ends[n] - lag) if lag is not None else t + host_s
        if pending is not None:
            t = max(t, ends[pending]) + host_s
            done(pending, t, True)
        if n not in drained:
            pending = n
        else:
            pending = None
            t = max(t, ends[n]) + host_s
            done(n, t, False)
            t += pause_s
            clock.pause(t)
    return steps, lines


RUNS = {  # n_steps, drained steps, evaluation steps
    "eval_ckpt": (16, {4, 5, 8, 11, 16}, {4, 8, 16}),  # eval_every 4, checkpoint.every 5 (11: the run's stop)
    "alternate": (16, set(range(2, 17, 2)), set(range(2, 17, 2))),  # eval_every 2
    "profile_1": (16, {1, 16}, {16}),  # a profile of step 1 only
}


@pytest.mark.parametrize("lag", [None, 0.03, 0.2])
@pytest.mark.parametrize("log_every", [1, 3])
@pytest.mark.parametrize("run", sorted(RUNS))
def test_step_clock_reads_the_device_rate(run, lag, log_every):
    """StepClock against a simulated loop and device, steps of 0.25 s up to step 8 and 0.5 s after (1000 tokens
    each), whether the host's dispatch returns at once (the CPU) or blocks until a full launch queue has `lag` seconds
    left (a large step on a GPU: an ahead finish then lands near the next step's end). No reading is above the
    fastest steps' rate; from step 3 every step's reading and line lies between the two rates; from step 12 (windows
    wholly in the slow part) they are the slow rate. Counting every interval between finishes instead, the GPU-like
    timelines would read ~period / lag times the rate at a drained step and about half of it after an evaluation (the
    2.2B run: 2078k and 139k tok/s around ~262k); a line window never reset would reach back into the fast steps."""
    n_steps, drained, evals = RUNS[run]
    steps, lines = _simulate_clock(n_steps, drained, lag, log_every, evals, period=lambda n: 0.25 if n <= 8 else 0.5)
    tol = 0.02  # the no-lag simulation's host time (2 ms a call) between a pause and the next step's start
    assert steps[1] < 1000 / 3.0 and lines[1] == steps[1]  # the first step: compilation included
    for n, r in [*steps.items(), *lines.items()]:
        assert r <= 4000 * (1 + 1e-9), (n, r, steps, lines)
        if n >= 3:
            assert 2000 * (1 - tol) <= r, (n, r, steps, lines)
        if n >= 12:
            assert abs(r - 2000) <= 2000 * tol, (n, r, steps, lines)


def test_step_clock_two_step_run_never_over_reads():
    """A 2-step run (ahead, then drained at its end) on the GPU-like timeline: no span of one kind exists, so both
    readings are the mean since the start (compilation included), below the device's rate, never the ~8x that the
    interval between the two finishes alone gives."""
    steps, lines = _simulate_clock(2, {2}, 0.03, 1)
    assert all(r < 4000 for r in [*steps.values(), *lines.values()]), (steps, lines)


def test_step_clock_without_fetch_ahead_counts_every_interval():
    """Every step drained (the loop without fetch-ahead): each interval is one step plus the host's time between
    steps, all counted; pauses are not."""
    clock = StepClock(100, 0.0)
    assert clock.finish(5.0, False) == 20.0  # the first: raw (compilation)
    assert clock.finish(6.0, False) == 100.0
    clock.pause(9.0)
    assert clock.finish(9.5, False) == 200.0
    assert clock.line() == 200 / 1.5  # two counted intervals, 1.5 s


def _recording_clock(calls):
    class Recording(StepClock):
        def finish(self, now, ahead):
            calls.append(("finish", ahead))
            return super().finish(now, ahead)

        def line(self):
            calls.append(("line", super().line()))
            return calls[-1][1]

        def pause(self, now):
            calls.append(("pause", None))
            super().pause(now)

    return Recording


def test_fetch_ahead_matches_fetching_each_step_first(tmp_path, monkeypatch, capsys):
    """The loop dispatches step n + 1 before it fetches step n's metrics; evaluation and checkpoint steps are finished
    first, since they read the state of their own step. Against the loop that fetches every step's metrics before
    dispatching the next (every step made to need its state first): the same records (losses, validation, load
    statistics), the same progress lines and the same checkpoints, each holding its own step's state (its step
    counter, and every array bitwise the other run's). An evaluation run on the next step's state would change
    val_loss; a checkpoint of it would hold the next step's counter."""
    runs, arrays = {}, {}
    own_step = progress.Progress.needs_state
    for ahead in (False, True):
        monkeypatch.setattr(progress.Progress, "needs_state", own_step if ahead else lambda self, n: True)
        run_dir = tmp_path / f"ahead_{ahead}"
        cfg = tiny(tmp_path, "schedule.total_steps=11", "data.eval_every=4", "checkpoint.every=5", "checkpoint.keep=5",
                   "checkpoint.async_save=false", "logging.log_every=3", f"logging.run_dir={run_dir}")
        calls = []
        monkeypatch.setattr(progress, "StepClock", _recording_clock(calls))
        hist = train(cfg)
        out = capsys.readouterr().out
        lines = [line.split(" | ") for line in out.splitlines() if line.startswith("step ")]
        # the clock is told which steps were finished ahead (all but evaluation, checkpoint and the last; none
        # without fetch-ahead) and the lines show its window rates
        drained = [n for n in range(1, 12) if not ahead or n in (4, 5, 8, 10, 11)]
        assert [i + 1 for i, c in enumerate(c for c in calls if c[0] == "finish") if not c[1]] == drained
        # the time of evaluations (4, 8, 11) and checkpoint saves (5, 10, 11) is left out: a pause after each
        n, paused = 0, []
        for c in calls:
            n += c[0] == "finish"
            paused += [n] if c[0] == "pause" else []
        assert paused == [4, 5, 8, 10, 11, 11], paused
        shown = [float(next(p for p in parts if p.endswith("tok/s")).split("k")[0]) for parts in lines]
        assert shown == [round(c[1] / 1e3, 1) for c in calls if c[0] == "line"]
        timed = ("tok/s", "MFU", "ETA")  # readings of the clock, which differ between the runs
        lines = [[p for p in parts if not any(t in p for t in timed)] for parts in lines]
        # restored into the state's layout (state_creator's abstract state: no model built eagerly for each)
        abstract = state_creator(cfg, make_mesh(cfg), make_optimizer(cfg))[2]
        with Checkpointer(run_dir / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ckpt:
            saved = ckpt.all_steps()
            states = {n: [np.asarray(x) for x in jax.tree.leaves(ckpt.restore(abstract, step=n)[1])] for n in saved}
        for n in saved:  # the state's step counter (its last leaf: the keys sort as biases, ..., rng, step) is n
            assert states[n][-1].shape == () and int(states[n][-1]) == n
        runs[ahead] = (records(run_dir), lines, saved, len(hist))
        arrays[ahead] = states
    base, ahead = runs[False], runs[True]
    for n in base[2]:
        assert all(np.array_equal(x, y) for x, y in zip(arrays[False][n], arrays[True][n], strict=True))
    assert [r["step"] for r in base[0]] == list(range(1, 12))
    assert [r["step"] for r in base[0] if "val_loss" in r] == [4, 8, 11]
    assert base[2] == [5, 10, 11], base[2]
    assert [p[0] for p in base[1]] == ["step 1/11", "step 3/11", "step 4/11", "step 6/11", "step 8/11",
                                       "step 9/11", "step 11/11"]
    assert ahead == base


def test_non_finite_loss_stops_before_a_checkpoint(tmp_path):
    """A loss that turns non-finite stops the run with the step named; no checkpoint or record holds a later state
    (with fetch-ahead the next step is already dispatched when the loss is seen: it is dropped)."""
    cfg = tiny(tmp_path, "schedule.total_steps=12", "schedule.warmup_steps=1", "optimizer.lr=1e30",
               "optimizer.grad_clip=null", "data.val_sequences=0", "checkpoint.every=2", "checkpoint.keep=20",
               "checkpoint.async_save=false")
    with pytest.raises(FloatingPointError, match=r"(loss|gradient norm) is (nan|inf|-inf) at step (\d+)") as err:
        train(cfg)
    # 2 on the CPU: step 2's gradient norm is nan while its loss is still finite (its state is not saved: the
    # checkpoint of step 2 would hold non-finite parameters); step 3 was already dispatched
    bad = int(str(err.value).split(" at step ")[1].split(";")[0])
    assert bad >= 2
    run_dir = tmp_path / "run"
    recs = records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, bad))
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ckpt:
        assert ckpt.all_steps() == list(range(2, bad, 2))


def test_profile_traces_the_asked_steps(tmp_path, capsys):
    """logging.profile_start / profile_steps: a JAX profiler trace in run_dir/profile from the dispatch of the first
    asked step to the end of the last: the host dispatched the train step exactly that many times inside it (the
    step after the last is dispatched only once the trace has ended); the run's losses are those of a run without."""
    common = ["schedule.total_steps=6", "data.val_sequences=0"]
    plain = [m["loss"] for m in train(tiny(tmp_path, *common, f"logging.run_dir={tmp_path / 'plain'}"))]
    hist = train(tiny(tmp_path, *common, "logging.profile_start=2", "logging.profile_steps=3"))
    assert [m["loss"] for m in hist] == plain
    files = glob.glob(str(tmp_path / "run" / "profile" / "**" / "*.xplane.pb"), recursive=True)
    assert len(files) == 1
    calls = sorted((int(e.start_ns), int(e.start_ns) + int(e.duration_ns))
                   for plane in ProfileData.from_file(files[0]).planes if plane.name.startswith("/host")
                   for line in plane.lines for e in line.events
                   if e.name in ("PjitFunction(train_step)", "PjitFunction(jit(train_step))"))
    outer = [c for i, c in enumerate(calls) if i == 0 or c[0] >= calls[i - 1][1]]  # nested TraceMe events once
    assert len(outer) == 3, calls
    assert "profiler trace of steps 2-4 written to" in capsys.readouterr().out


@pytest.mark.parametrize("metric, what", [("grad_norm", "gradient norm"), ("loss", "loss")])
def test_a_non_finite_metric_stops_before_its_record_and_checkpoint(tmp_path, monkeypatch, metric, what):
    """A step whose loss or gradient norm is not finite (a non-finite gradient norm: its update has made the
    parameters non-finite, even where its loss was still finite) stops the run naming the step: neither its record
    nor its checkpoint is written, the steps before it are kept."""
    real = loop.jit_train_step

    def nan_norm_at_step_3(*args, **kwargs):
        step_fn = real(*args, **kwargs)

        def wrapped(state, batch):
            new, m = step_fn(state, batch)
            return new, {**m, metric: jnp.where(new["step"] == 3, jnp.nan, m[metric])}
        wrapped.lower = step_fn.lower  # the loop's memory check compiles the step ahead (the same program)
        return wrapped

    monkeypatch.setattr(loop, "jit_train_step", nan_norm_at_step_3)
    # step 3 is not a checkpoint step: its metrics are read after step 4 was dispatched (fetch-ahead), and step 4
    # is a checkpoint step, so the check must come before step 4's save
    cfg = tiny(tmp_path, "schedule.total_steps=6", "data.val_sequences=0", "checkpoint.every=2", "checkpoint.keep=10")
    with pytest.raises(FloatingPointError, match=rf"^{what} is nan at step 3; stopping"):
        train(cfg)
    run_dir = tmp_path / "run"
    assert [r["step"] for r in records(run_dir)] == [1, 2]
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ckpt:
        assert ckpt.all_steps() == [2]


def test_resuming_an_older_checkpoint_into_a_run_with_later_ones_is_refused_first(tmp_path):
    """--resume of step 2 into the run directory that holds steps 2 and 4: refused before a step is trained, with the
    later steps named; metrics, config and checkpoints left as they were. Into a fresh run directory it resumes."""
    common = ("schedule.total_steps=4", "data.val_sequences=0", "checkpoint.every=2", "checkpoint.keep=5",
              "checkpoint.async_save=false")
    straight = train(tiny(tmp_path, *common))
    run_dir = tmp_path / "run"
    before = dir_snapshot(run_dir)
    with pytest.raises(CheckpointError, match=r"resuming step 2 .* already holds later checkpoints \(steps \[4\]\)"):
        train(tiny(tmp_path, *common), resume=str(run_dir / "checkpoints" / "2"))
    assert dir_snapshot(run_dir) == before
    other = tmp_path / "other"
    resumed = train(tiny(tmp_path, *common, f"logging.run_dir={other}"), resume=str(run_dir / "checkpoints" / "2"))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight[2:]]


def test_a_fresh_run_over_an_earlier_runs_records(tmp_path):
    """No checkpoint to resume, metrics.jsonl of an earlier launch there: the same config relaunched (a job killed
    before its first checkpoint) starts over, its records replaced; another config is refused (its records would be
    dropped), the directory left as it was."""
    common = ("schedule.total_steps=2", "data.val_sequences=0")
    first = train(tiny(tmp_path, *common))
    run_dir = tmp_path / "run"
    before = dir_snapshot(run_dir)
    assert len(records(run_dir)) == 2
    with pytest.raises(ConfigError, match=r"holds the metrics of an earlier run .*metrics.jsonl.* with another config"):
        train(tiny(tmp_path, *common, "optimizer.lr=1e-3"))
    assert dir_snapshot(run_dir) == before
    lines = []
    again = train(tiny(tmp_path, *common), log=lines.append)
    assert any("starting over from step 0" in line for line in lines)
    assert [m["loss"] for m in again] == [m["loss"] for m in first]
    assert [r["step"] for r in records(run_dir)] == [1, 2]


def test_nothing_to_train_says_where_the_run_starts(tmp_path):
    lines = []
    assert train(tiny(tmp_path), stop_after=0, log=lines.append) == []
    assert lines[-1] == "nothing to train: the run starts at step 0, and this run stops at --stop-after 0"


def test_run_ends_with_a_summary_line(tmp_path):
    """The last line of a run: its steps, steady-state throughput, last loss and validation, and where records and
    checkpoints are; a run stopped by --stop-after says how it continues, and that advice works: followed literally
    after an explicit resume too (where rerunning with --resume would be refused: the directory then holds a later
    checkpoint). A resumed run whose settings changed names them and keeps the earlier config.yaml."""
    lines = []
    sets = ("schedule.total_steps=12", "data.eval_every=5", "checkpoint.every=4", "checkpoint.async_save=false")
    cfg = tiny(tmp_path, *sets)
    hist = train(cfg, stop_after=8, log=lines.append)
    run = tmp_path / "run"
    val = [m for m in hist if "val_loss" in m][-1]
    assert val["step"] == 5
    assert lines[-1].startswith("stopped after step 8 (--stop-after; to continue, run the same command without "
                                "--stop-after): steps 1-8 of 12 in "), lines[-1]
    assert " tok/s (compilation, evaluation and saves left out) | " in lines[-1], lines[-1]
    assert (f"| loss {hist[-1]['loss']:.4f} | val_loss {val['val_loss']:.4f} val_ppl {val['val_ppl']:.2f} (step 5) | "
            f"records {run / 'metrics.jsonl'} | checkpoints {run / 'checkpoints'}") in lines[-1], lines[-1]

    # resumed explicitly from step 4 into another directory, and stopped at 6
    other = tiny(tmp_path, *sets, f"logging.run_dir={tmp_path / 'other'}")
    train(other, resume=str(run / "checkpoints" / "4"), stop_after=6, log=lines.append)
    assert lines[-1].startswith("stopped after step 6 (--stop-after; to continue, run the same command without "
                                "--stop-after and without --resume / checkpoint.resume: the run directory's latest "
                                "checkpoint is resumed): steps 5-6 of 12 in "), lines[-1]
    hist = train(other, log=lines.append)  # as advised: no resume, no stop
    assert hist[0]["step"] == 7 and lines[-1].startswith("done: steps 7-12 of 12 in "), lines[-1]

    # resumed from step 8 to the end with another setting (one outside the train step's program: no compilation of
    # its own; every setting is compared alike)
    changed = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, log_every=2))
    hist = train(changed, log=lines.append)
    assert "resuming with changed settings: logging.log_every: 20 -> 2 (the earlier config.yaml is kept as " \
           "config-until-step8.yaml)" in lines, lines
    assert load_config(str(run / "config-until-step8.yaml")) == cfg
    assert load_config(str(run / "config.yaml")) == changed
    val = hist[-1]
    assert hist[0]["step"] == 9 and val["step"] == 12 and "val_loss" in val
    assert lines[-1].startswith("done: steps 9-12 of 12 in "), lines[-1]
    assert f"val_loss {val['val_loss']:.4f} val_ppl {val['val_ppl']:.2f} (step 12)" in lines[-1], lines[-1]


def test_no_validation_data_is_read_without_evaluation(tmp_path):
    """data.eval_every=0: a shard directory without validation shards trains (nothing reads them); with
    evaluation on, the missing shards are named."""
    d = tmp_path / "trainonly"
    d.mkdir()
    write_shard(d / "train_000000.bin", np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint16))
    small = ("schedule.total_steps=2", "data.source=bin", f"data.path={d}")
    with pytest.raises(DataError, match=r"holds no val .bin shards"):
        train(tiny(tmp_path, *small, f"logging.run_dir={tmp_path / 'a'}"))
    hist = train(tiny(tmp_path, *small, "data.eval_every=0", f"logging.run_dir={tmp_path / 'b'}"))
    assert [m["step"] for m in hist] == [1, 2] and all("val_loss" not in m for m in hist)
