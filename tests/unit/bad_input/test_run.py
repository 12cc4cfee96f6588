"""Bad runs: what train() refuses before its step compiles, and a run's other files and its memory."""

from __future__ import annotations

from functools import partial

import pytest

from mhl_jax.config import ConfigError, dump_config
from mhl_jax.data import DataError
from mhl_jax.runtime.autotune import DEFAULT_NAME, autotune_file
from mhl_jax.runtime.checkpoint import CheckpointError
from mhl_jax.runtime.memory import GIB, StepMemory, check_fits
from mhl_jax.train.loop import train
from mhl_jax.train.records import truncate_metrics
from tests.unit.bad_input.catalogue import Section, check_refused, overwrite, save, saved_run, small, tree, without

# ============================================================================= a run: train() before its step compiles

RUN = Section("run")


def _quiet(*args, **kwargs) -> None:
    """train's log."""


def _train(*sets: str, resume: str | None = None, setup=None):
    """train() of `small(tmp, *sets)` (`resume`: formatted with tmp), after `setup(tmp)`."""
    def provoke(tmp, mp):
        if setup is not None:
            setup(tmp)
        return partial(train, small(tmp, *(s.format(tmp=tmp) for s in sets)),
                       resume=resume and resume.format(tmp=tmp), log=_quiet)
    return provoke


RUN.add("run-dir-is-a-file", ConfigError, "a_file' is a file; expected a directory (or a path to create)",
        _train("logging.run_dir={tmp}/a_file", setup=lambda tmp: (tmp / "a_file").write_text("x")))
RUN.add("run-dir-cannot-be-created", ConfigError, "a_file/run' cannot be created: ",
        _train("logging.run_dir={tmp}/a_file/run", setup=lambda tmp: (tmp / "a_file").write_text("x")))
RUN.add("validation-below-one-batch", ConfigError, "data.val_sequences=8 is fewer than one evaluation batch "
        "(train.micro_batch=16 x 1 devices = 16); raise it, or set data.eval_every=0",
        _train("data.val_sequences=8", "data.eval_every=1"))
RUN.add("batch-over-the-devices", ConfigError, "train.global_batch=16 is not a multiple of train.micro_batch=16 x 2 "
        "devices = 32; e.g. --set train.micro_batch=8", _train("parallel.devices=2"), cpu_only=True)
RUN.add("devices-not-visible", ConfigError, "parallel.devices=99 but ", _train("parallel.devices=99"))
RUN.add("cudnn-without-gpu", ConfigError, "model.attention_impl='cudnn' needs a GPU JAX backend",
        _train("model.attention_impl=cudnn"), cpu_only=True)
RUN.add("triton-attention-without-gpu", ConfigError, "model.attention_impl='triton' needs a GPU JAX backend",
        _train("model.attention_impl=triton"), cpu_only=True)
RUN.add("triton-without-gpu", ConfigError, "ffn.kernels='triton' needs a GPU JAX backend and jax-triton",
        _train("ffn.kernels=triton"), cpu_only=True)
RUN.add("shards-missing-fresh-dirs-removed", DataError, "no_shards': no such file or directory",
        _train("logging.run_dir={tmp}/new/run", "data.source=bin", "data.path={tmp}/no_shards"))
RUN.add("shards-missing-existing-dir-kept", DataError, "no_shards': no such file or directory",
        _train("data.source=bin", "data.path={tmp}/no_shards", setup=lambda tmp: (tmp / "run").mkdir()))
RUN.add("prefetch-negative", DataError, "data.prefetch=-1", _train("data.prefetch=-1"))
RUN.add("val-fraction", DataError, "data.val_fraction=0.0: must be in (0, 1)", _train("data.val_fraction=0"))
RUN.add("resume-missing", CheckpointError, "nowhere' does not exist (or is not a directory)",
        _train(resume="{tmp}/nowhere"))
RUN.add("resume-missing-into-an-existing-run-dir", CheckpointError, "nowhere' does not exist (or is not a directory)",
        _train(resume="{tmp}/nowhere", setup=lambda tmp: (tmp / "run").mkdir()))
RUN.add("resume-a-file", CheckpointError, "a_file' does not exist (or is not a directory)",
        _train(resume="{tmp}/a_file", setup=lambda tmp: (tmp / "a_file").write_text("x")))


@RUN.refusal(CheckpointError, "checkpoints' is a file; expected a directory")
def checkpoints_is_a_file(tmp, mp):
    (tmp / "run").mkdir()
    (tmp / "run" / "checkpoints").write_text("y")
    return partial(train, small(tmp), log=_quiet)


@RUN.refusal(ConfigError, "logging.tensorboard=true needs the tensorboardX package")
def tensorboard_missing(tmp, mp):
    without(mp, "tensorboardX")
    return partial(train, small(tmp, "logging.tensorboard=true"), log=_quiet)


@RUN.refusal(ConfigError, "holds the metrics of an earlier run")
def earlier_runs_records_under_another_config(tmp, mp):  # a launch killed before its first checkpoint
    (tmp / "run" / "checkpoints").mkdir(parents=True)
    (tmp / "run" / "config.yaml").write_text(dump_config(small(tmp, "optimizer.lr=1e-3")))
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return partial(train, small(tmp), log=_quiet)


@RUN.refusal(CheckpointError, "which already holds later checkpoints (steps [4]): this run's checkpoints and metrics "
                              "would collide with them")
def resume_older_than_the_latest(tmp, mp):
    save(tmp / "run" / "checkpoints", tree(), (2, 4))
    (tmp / "run" / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 5.0}}\n' for s in range(1, 5)))
    return partial(train, small(tmp), resume=str(tmp / "run" / "checkpoints" / "2"), log=_quiet)


RUN.add("checkpoint-of-another-model", CheckpointError, "was written by a different model config (model.d_model: "
        "checkpoint 64, this run 128)", _train(setup=lambda tmp: saved_run(tmp, fingerprint_sets=["model.d_model=64"])))


@RUN.refusal(CheckpointError, "was written by a different model config (model.d_model: checkpoint 64, this run 128)")
def check_of_a_checkpoint_of_another_model(tmp, mp):  # train.py --check refuses what the run would refuse
    saved_run(tmp, fingerprint_sets=["model.d_model=64"])
    return partial(train, small(tmp), log=_quiet, check=True)


def _check(*sets: str, resume: str | None = None, setup=None):
    """train.py --check of `small(tmp, *sets)` (`resume`: formatted with tmp), after `setup(tmp)`: refused where the
    run would refuse the checkpoint, though no array of it is read."""
    def provoke(tmp, mp):
        return partial(_train(*sets, resume=resume, setup=setup)(tmp, mp), check=True)
    return provoke


def _damaged_meta(tmp):
    overwrite("meta")(saved_run(tmp, data=True) / "checkpoints" / "2")


RUN.add("check-damaged-meta-by-name", CheckpointError, "its meta cannot be read (",
        _check(resume="{tmp}/run/checkpoints/2", setup=_damaged_meta))
RUN.add("check-damaged-meta-on-damage-stop", CheckpointError, "its meta cannot be read (",
        _check("checkpoint.on_damage=stop", setup=_damaged_meta))
RUN.add("check-no-intact-checkpoint", CheckpointError, "no intact checkpoint in ", _check(setup=_damaged_meta))
RUN.add("check-without-data-state", CheckpointError, "holds no data-iterator state (data/)", _check(
    setup=lambda tmp: saved_run(tmp)))
RUN.add("checkpoint-of-another-layout", CheckpointError, "leaves missing from it (opt_state/",
        _train(setup=lambda tmp: saved_run(tmp, optimizer=False, data=True)))
RUN.add("checkpoint-moments-in-bf16", CheckpointError, "set optimizer.moment_dtype=bfloat16 as the run that wrote it "
        "had", _train(setup=lambda tmp: saved_run(tmp, "optimizer.moment_dtype=bfloat16", data=True)))
RUN.add("checkpoint-without-data-state", CheckpointError, "holds no data-iterator state (data/)",
        _train(setup=lambda tmp: saved_run(tmp)))
RUN.add("checkpoint-damaged", CheckpointError, "checkpoints/2: its state/data cannot be read (", _train(
    setup=lambda tmp: overwrite("state")(saved_run(tmp, data=True) / "checkpoints" / "2")))


# ============================================================================= a run's other files and its memory

RUN_FILES = Section("run-files")


@RUN_FILES.refusal(ConfigError, "metrics.jsonl: line 2 is not a metrics record (JSONDecodeError: ")
def metrics_line_malformed(tmp, mp):
    (tmp / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"st\n{"step": 2, "loss": 1.5}\n')
    return partial(truncate_metrics, tmp / "metrics.jsonl", 2)


RUN_FILES.add("autotune-file-is-a-directory", ConfigError, "' is a directory; expected 'auto', '' (off) or a file path",
              lambda tmp, mp: partial(autotune_file, str(tmp), tmp, backend="gpu"))
RUN_FILES.add("autotune-directory-missing", ConfigError, "no_such_dir does not exist; expected 'auto', '' (off) or a "
              "file path in an existing directory", lambda tmp, mp: partial(
                  autotune_file, str(tmp / "no_such_dir" / "tuned.txt"), tmp, backend="gpu"))


@RUN_FILES.refusal(ConfigError, "bad.txt is not a file of XLA autotuning results; delete it")
def autotune_not_results(tmp, mp):
    (tmp / "bad.txt").write_text("not autotune results\n")
    return partial(autotune_file, str(tmp / "bad.txt"), tmp, backend="gpu")


@RUN_FILES.refusal(ConfigError, "train.xla_autotune_file='auto': ")
def autotune_auto_not_results(tmp, mp):  # another file under the run directory's name for it
    (tmp / DEFAULT_NAME).write_text("{'some': 'json'}\n")
    return partial(autotune_file, "auto", tmp, backend="gpu")


RUN_FILES.add("step-over-device-memory", ConfigError, "the train step needs 2.00 GiB per device on 1 device(s) (XLA's "
              "estimate: state and batch 1.00 GiB, activations and other temporaries 1.00 GiB), more than the 1.50 GiB "
              "that JAX may allocate on each FakeGPU; try ", lambda tmp, mp: partial(
                  check_fits, StepMemory(GIB, 0, GIB, 0), (int(1.5 * GIB), "FakeGPU"), small(tmp), 1))


# ============================================================================= every row, checked alike (catalogue.py)

@pytest.mark.parametrize("provoke, error, fragment", [*RUN, *RUN_FILES])
def test_refused_in_one_line_leaving_nothing_behind(provoke, error, fragment, tmp_path, monkeypatch):
    check_refused(provoke, error, fragment, tmp_path, monkeypatch)
