"""Bad arguments of generation and of the commands (train.py, infer, compare, export, prepare)."""

from __future__ import annotations

from functools import partial

import jax
import pytest

import train as train_py
from mhl_jax import compare, export, infer
from mhl_jax.config import ConfigError, dump_config
from mhl_jax.data import DataError, prepare
from mhl_jax.generation import generate
from mhl_jax.runtime.checkpoint import CheckpointError
from tests.unit.bad_input.catalogue import (
    ROOT,
    SMALL,
    TINY,
    Section,
    calls,
    check_command_refused,
    check_refused,
    saved_run,
    small,
    without,
)

# ============================================================================= generation's arguments (mhl_jax.infer)

GENERATE = Section("generate")
for _id, _kw, _fragment in [
    ("temperature-negative", dict(temperature=-1.0), "temperature=-1.0: must be a number >= 0"),
    ("temperature-nan", dict(temperature=float("nan")), "temperature=nan: must be a number >= 0"),
    ("top-k-negative", dict(top_k=-1), "top_k=-1: must be >= 0 (0: no cut)"),
    ("top-p-zero", dict(top_p=0), "top_p=0: must be in (0, 1] (1: no cut)"),
    ("max-new-tokens-negative", dict(max_new_tokens=-1), "max_new_tokens=-1: must be >= 0"),
    ("empty-prompt", dict(prompts=[[1], []]), "every prompt needs at least one token"),
    ("stop-past-vocab", dict(vocab=257, stop=257), "stop=257: must be an id in [0, 257)"),
]:
    GENERATE.add(_id, ConfigError, _fragment, calls(generate, None, **{"prompts": [[1]], "max_new_tokens": 1,
                                                                              **_kw}))


# ============================================================================= commands: exit status 2, one line

TRAIN_CLI = Section("train.py")


def _command(main, *argv: str, setup=None):
    """`main(argv)` with `argv` formatted with tmp, ROOT and the tiny config (after `setup(tmp)`)."""
    def provoke(tmp, mp):
        if setup is not None:
            setup(tmp)
        return partial(main, [a.format(tmp=tmp, root=ROOT, tiny=TINY) for a in argv])
    return provoke


def _train_py(*argv: str, setup=None):
    """train.py's main with the smallest tiny config, its run directory tmp/run, and `argv`."""
    small_run = [x for s in (*SMALL, "logging.run_dir={tmp}/run") for x in ("--set", s)]
    return _command(train_py.main, "--config", "{tiny}", *small_run, *argv, setup=setup)


TRAIN_CLI.add("stop-after-negative", SystemExit, "--stop-after -1: must be a step number >= 0",
              _train_py("--stop-after", "-1"))
TRAIN_CLI.add("stop-after-word", SystemExit, "argument --stop-after: invalid int value: 'x'",
              _train_py("--stop-after", "x"))
TRAIN_CLI.add("config-missing", ConfigError, "config error: config file '", _command(
    train_py.main, "--config", "{tmp}/none.yaml"))
TRAIN_CLI.add("bad-value", ConfigError, "config error: ffn.top_k=99 > ffn.num_experts=16", _train_py(
    "--set", "ffn.top_k=99"))
TRAIN_CLI.add("unknown-key", ConfigError, "config error: unknown config key 'optimizer.learning_rate'", _train_py(
    "--set", "optimizer.learning_rate=1"))
TRAIN_CLI.add("launch", ConfigError, "config error: --num-processes=2 --process-id=5", _train_py(
    "--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "5"))
TRAIN_CLI.add("data-missing", DataError, "data error: data.path=", _train_py(
    "--set", "data.source=bin", "--set", "data.path={tmp}/no_shards"))
TRAIN_CLI.add("resume-missing", CheckpointError, "checkpoint error: checkpoint path '", _train_py(
    "--resume", "{tmp}/nowhere"))

INFER_CLI = Section("infer")


def _infer(*argv: str, run: bool = True):
    """infer's main with `argv` ({run}: tmp/run, a run at step 2 when `run`)."""
    def provoke(tmp, mp):
        if run:
            saved_run(tmp, optimizer=False)
        (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
        return partial(infer.main, [a.format(tmp=tmp, run=tmp / "run") for a in argv])
    return provoke


for _id, _error, _argv, _fragment in [
    ("no-command", SystemExit, [], "the following arguments are required: command"),
    ("run-missing", ConfigError, ["evaluate", "{tmp}/nowhere"], "config error: run directory '"),
    ("run-without-config", ConfigError, ["evaluate", "{tmp}"], "holds no config.yaml; expected a logging.run_dir"),
    ("no-such-step", CheckpointError, ["evaluate", "{run}", "--step", "40"], "checkpoint error: no checkpoint of step "
     "40 in"),
    ("another-model", CheckpointError, ["evaluate", "{run}", "--set", "model.d_model=64"],
     "was written by a different model config (model.d_model: checkpoint 128, this run 64)"),
    ("nothing-to-evaluate", ConfigError, ["evaluate", "{run}", "--set", "data.val_sequences=0"],
     "config error: data.val_sequences=0: nothing to evaluate; set it > 0"),
    ("checkpoint-not-a-checkpoint", CheckpointError, ["evaluate", "{run}", "--checkpoint", "{tmp}"],
     "is not a checkpoint: expected a step directory"),
    ("checkpoint-missing", CheckpointError, ["evaluate", "{run}", "--checkpoint", "{tmp}/a/b/2"],
     "b/2' does not exist (or is not a directory)"),
    ("checkpoint-of-another-step", CheckpointError, ["evaluate", "{run}", "--checkpoint", "{run}/checkpoints/2",
                                                     "--step", "60"], "holds step 2, not the step 60 asked for"),
    ("devices-not-visible", ConfigError, ["evaluate", "{run}", "--set", "parallel.devices=99"],
     "config error: parallel.devices=99 but "),
    ("gpt2-on-builtin", ConfigError, ["generate", "{run}", "--set", "data.tokenizer=gpt2"],
     "config error: data.tokenizer='gpt2' with data.source='builtin'"),
    ("prompt-not-utf8", DataError, ["generate", "{run}", "--prompt-file", "{tmp}/latin1.txt"],
     "latin1.txt' is not UTF-8 text"),
    ("prompt-file-missing", DataError, ["generate", "{run}", "--prompt-file", "{tmp}/none.txt"],
     "none.txt' cannot be read (No such file or directory)"),
    ("prompt-and-prompt-file", SystemExit, ["generate", "{run}", "--prompt", "a", "--prompt-file", "x"],
     "argument --prompt-file: not allowed with argument --prompt"),
    ("temperature-negative", SystemExit, ["generate", "{run}", "--temperature", "-1"],
     "--temperature -1.0: must be a number >= 0"),
    ("temperature-nan", SystemExit, ["generate", "{run}", "--temperature", "nan"], "--temperature nan: must be a"),
    ("max-new-tokens-zero", SystemExit, ["generate", "{run}", "--max-new-tokens", "0"],
     "--max-new-tokens 0: must be >= 1"),
    ("top-k-negative", SystemExit, ["generate", "{run}", "--top-k", "-1"], "--top-k -1: must be >= 0 (0: no cut)"),
    ("top-p-past-one", SystemExit, ["generate", "{run}", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    ("no-samples", SystemExit, ["generate", "{run}", "--num-samples", "0"], "--num-samples 0: must be >= 1"),
]:
    INFER_CLI.add(_id, _error, _fragment, _infer(*_argv))
INFER_CLI.add("validation-below-devices", ConfigError, "config error: data.val_sequences=1 is fewer than the 2 "
              "devices of the mesh", _infer("evaluate", "{run}", "--set", "data.val_sequences=1", "--set",
                                            "parallel.devices=2"), cpu_only=True)
INFER_CLI.add("cudnn-without-gpu", ConfigError, "config error: model.attention_impl='cudnn' needs a GPU JAX backend",
              _infer("generate", "{run}", "--set", "model.attention_impl=cudnn", "--max-new-tokens", "1"),
              cpu_only=True)
INFER_CLI.add("triton-without-gpu", ConfigError, "config error: ffn.kernels='triton' needs a GPU",
              _infer("generate", "{run}", "--set", "ffn.kernels=triton"), cpu_only=True)


@INFER_CLI.refusal(ConfigError, "config error: mhl_jax.infer runs as one process; this is one of 2")
def infer_of_several_processes(tmp, mp):
    mp.setattr(jax, "process_count", lambda: 2)
    return partial(infer.main, ["evaluate", str(tmp)])


@INFER_CLI.refusal(CheckpointError, "holds no checkpoints/ directory (did the run save one? checkpoint.every)")
def run_without_checkpoints(tmp, mp):
    (tmp / "config.yaml").write_text(dump_config(small(tmp)))
    return partial(infer.main, ["evaluate", str(tmp)])


COMPARE_CLI = Section("compare")


def _compare(*argv: str, config: str | None = None, metrics: str | None = None, loads: str | None = None):
    """compare's main with `argv` ({run}: tmp/r, holding `config`, `metrics` and `loads` (loads.jsonl) when given:
    'tiny' writes the tiny config)."""
    def provoke(tmp, mp):
        run = tmp / "r"
        if config is not None or metrics is not None:
            run.mkdir()
        if config is not None:
            (run / "config.yaml").write_text(dump_config(small(tmp)) if config == "tiny" else config)
        if metrics is not None:
            (run / "metrics.jsonl").write_text(metrics)
        if loads is not None:
            (run / "loads.jsonl").write_text(loads)
        return partial(compare.main, [a.format(tmp=tmp, run=run) for a in argv])
    return provoke


RECORDS = '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n'
for _id, _error, _setup, _argv, _fragment in [
    ("smooth-zero", SystemExit, {}, ["{tmp}", "--smooth", "0"], "--smooth 0: must be >= 1"),
    ("run-missing", ConfigError, {}, ["{run}"], "error: run directory '"),
    ("no-config", ConfigError, dict(metrics=RECORDS), ["{run}"], "holds no config.yaml"),
    ("no-metrics", ConfigError, dict(config="tiny"), ["{run}"], "holds no metrics.jsonl (has the run taken a step "
     "yet?)"),
    ("empty-config", ConfigError, dict(config="\n", metrics=RECORDS), ["{run}"], "r': config.yaml is empty"),
    ("bad-config", ConfigError, dict(config="model:\n  foo: 1\n", metrics=RECORDS), ["{run}"],
     "r': config.yaml: unknown config key 'model.foo'"),
    ("line-not-json", ConfigError, dict(config="tiny", metrics='{"step": 1,\n' + RECORDS), ["{run}"],
     "metrics.jsonl: line 1 is not JSON"),
    ("line-not-a-record", ConfigError, dict(config="tiny", metrics="[1, 2]\n"), ["{run}"],
     "metrics.jsonl: line 1 is not a train.py metrics record (an integer step and a finite loss expected)"),
    ("step-as-string", ConfigError, dict(config="tiny", metrics='{"step": "1", "loss": 1.0}\n' + RECORDS), ["{run}"],
     "metrics.jsonl: line 1 is not a train.py metrics record"),
    ("loss-null", ConfigError, dict(config="tiny", metrics='{"step": 1, "loss": null}\n' + RECORDS), ["{run}"],
     "metrics.jsonl: line 1 is not a train.py metrics record"),
    ("no-records", ConfigError, dict(config="tiny", metrics=""), ["{run}"], "metrics.jsonl holds no records yet"),
    ("plot-unwritable", ConfigError, dict(config="tiny", metrics=RECORDS), ["{run}", "--plot", "{tmp}/no/curves.png"],
     "curves.png': cannot write it (No such file or directory)"),
    ("runs-and-plot-load", SystemExit, {}, ["{run}", "--plot-load", "{run}"], "give RUN_DIRs to compare, or "
     "--plot-load RUN_DIR"),
    ("neither-runs-nor-plot-load", SystemExit, {}, [], "give RUN_DIRs to compare, or --plot-load RUN_DIR"),
    ("plot-load-without-loads", ConfigError, dict(config="tiny", metrics=RECORDS), ["--plot-load", "{run}", "--out",
     "{tmp}/maps.png"], "r' holds no loads.jsonl (it records per-expert loads every logging.loads_every steps"),
    ("plot-load-line", ConfigError, dict(config="tiny", metrics=RECORDS, loads='{"step": 1, "loads": [1]}\n'),
     ["--plot-load", "{run}", "--out", "{tmp}/maps.png"], "loads.jsonl: line 1 is not a loads record"),
    ("plot-load-layers-change", ConfigError, dict(config="tiny", metrics=RECORDS, loads=(
        '{"step": 1, "loads": {"1": [[1, 2]]}}\n{"step": 2, "loads": {"1": [[1, 2, 3]]}}\n')),
     ["--plot-load", "{run}", "--out", "{tmp}/maps.png"], "loads.jsonl: step 1 records other layers or shapes than "
     "step 2"),
]:
    COMPARE_CLI.add(_id, _error, _fragment, _compare(*_argv, **_setup))


@COMPARE_CLI.refusal(ConfigError, "error: --plot needs matplotlib (pip install matplotlib)")
def plot_without_matplotlib(tmp, mp):
    without(mp, "matplotlib")
    return _compare("{run}", "--plot", "{tmp}/curves.png", config="tiny", metrics=RECORDS)(tmp, mp)


EXPORT_CLI = Section("export")


def _export(*argv: str):
    """export's main with `argv` ({run}: tmp/run, a run at step 2; {tmp}/taken: a directory holding a file)."""
    def provoke(tmp, mp):
        saved_run(tmp, optimizer=False)
        (tmp / "taken").mkdir()
        (tmp / "taken" / "mine.txt").write_text("kept")
        return partial(export.main, [a.format(tmp=tmp, run=tmp / "run") for a in argv])
    return provoke


for _id, _error, _argv, _fragment in [
    ("no-out", SystemExit, ["{run}"], "the following arguments are required: --out"),
    ("out-holds-files", ConfigError, ["{run}", "--out", "{tmp}/taken"], "config error: --out '"),
    ("out-is-a-file", ConfigError, ["{run}", "--out", "{tmp}/taken/mine.txt"], "mine.txt' exists and is not an empty "
     "directory: export writes a new directory (name another, or remove it)"),
    ("run-missing", ConfigError, ["{tmp}/nowhere", "--out", "{tmp}/new"], "config error: run directory '"),
    ("no-such-step", CheckpointError, ["{run}", "--out", "{tmp}/new", "--step", "40"], "checkpoint error: no "
     "checkpoint of step 40 in"),
]:
    EXPORT_CLI.add(_id, _error, _fragment, _export(*_argv))


PREPARE_CLI = Section("prepare")
for _id, _argv, _fragment in [
    ("no-source", ["--tokenizer", "byte", "--out", "o"],
     "give one source: a NAME (fineweb10B), --input FILES or --hf-dataset NAME"),
    ("two-sources", ["--input", "a", "--hf-dataset", "b", "--tokenizer", "byte", "--out", "o"],
     "give one source: a NAME (fineweb10B), --input FILES or --hf-dataset NAME"),
    ("no-tokenizer", ["--input", "a", "--out", "o"], "--tokenizer is required with --input or --hf-dataset"),
    ("unknown-tokenizer", ["--input", "a", "--tokenizer", "wordpiece", "--out", "o"], "argument --tokenizer: invalid "
     "choice: 'wordpiece'"),
    ("shard-tokens-zero", ["--input", "a", "--tokenizer", "byte", "--out", "o", "--shard-tokens", "0"],
     "--shard-tokens=0: must be >= 1"),
    ("val-tokens-zero", ["--input", "a", "--tokenizer", "byte", "--out", "o", "--val-tokens", "0"],
     "--val-tokens=0: must be >= 1"),
]:
    PREPARE_CLI.add(_id, SystemExit, _fragment, calls(prepare.main, _argv))


# ============================================================================= every row, checked alike (catalogue.py)

@pytest.mark.parametrize("provoke, error, fragment", [*GENERATE])
def test_refused_in_one_line_leaving_nothing_behind(provoke, error, fragment, tmp_path, monkeypatch):
    check_refused(provoke, error, fragment, tmp_path, monkeypatch)


@pytest.mark.parametrize("provoke, error, fragment", [*TRAIN_CLI, *INFER_CLI, *COMPARE_CLI, *EXPORT_CLI, *PREPARE_CLI])
def test_command_exits_2_with_one_line(provoke, error, fragment, tmp_path, monkeypatch, capsys):
    check_command_refused(provoke, error, fragment, tmp_path, monkeypatch, capsys)
