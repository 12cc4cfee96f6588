"""Bad checkpoints: directories, steps and saved states a Checkpointer refuses to open or restore."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from mhl_jax.config import CheckpointConfig, DataConfig
from mhl_jax.data import make_train_loader
from mhl_jax.runtime.checkpoint import Checkpointer, CheckpointError
from tests.unit.bad_input.catalogue import FP, LOADER, Section, check_refused, overwrite, save, tree

# ============================================================================= checkpoints: Checkpointer

CHECKPOINT = Section("checkpoint")


def opened(directory: Path, action, fingerprint=None, read_only: bool = False, keep: int = 3):
    """The call that opens a Checkpointer on `directory` and does `action(ck)` with it."""
    def call():
        with Checkpointer(directory, CheckpointConfig(keep=keep, async_save=False), fingerprint or FP,
                          read_only=read_only) as ck:
            return action(ck)
    return call


def _saved(action, steps=(1,), damage=None, data_iter=None, **kw):
    """A row on tmp/ck holding `tree()` at `steps` (and the position of `data_iter()` when given), then
    `damage(tmp/ck/1)`: `action(ck, tmp)` with a Checkpointer opened there (`opened`'s `kw`) is refused."""
    def provoke(tmp, mp):
        save(tmp / "ck", tree(), steps, data_iter=data_iter and data_iter())
        if damage is not None:
            damage(tmp / "ck" / "1")
        return opened(tmp / "ck", lambda ck: action(ck, tmp), **kw)
    return provoke


def _builtin_loader():
    return make_train_loader(DataConfig(prefetch=0, read_threads=1), **LOADER)


def _data_files(*contents: str | None):
    """Damage: a step's iterator state replaced by files process_<i>-of-<len(contents)>.json holding `contents` (None:
    that one's file missing)."""
    def damage(step_dir: Path):
        for f in (step_dir / "data").iterdir():
            f.unlink()
        for i, text in enumerate(contents):
            if text is not None:
                (step_dir / "data" / f"process_{i}-of-{len(contents)}.json").write_text(text)
    return damage


CHECKPOINT.add("keep-zero", CheckpointError, "checkpoint.keep=0: must be >= 1",
               lambda tmp, mp: opened(tmp / "ck", None, keep=0))
CHECKPOINT.add("fingerprint-not-json", CheckpointError, "the checkpoint fingerprint must be JSON-able",
               lambda tmp, mp: opened(tmp / "ck", None, fingerprint={"model": {1, 2}}))


@CHECKPOINT.refusal(CheckpointError, "ck' is a file; expected a directory (move the file away, or use another "
                                     "logging.run_dir)")
def directory_is_a_file(tmp, mp):
    (tmp / "ck").write_text("not a directory")
    return opened(tmp / "ck", None)


CHECKPOINT.add("read-only-missing", CheckpointError, "no checkpoint directory",
               lambda tmp, mp: opened(tmp / "ck", None, read_only=True))
CHECKPOINT.add("save-read-only", CheckpointError, "ck': opened read-only",
               _saved(lambda ck, tmp: ck.save(2, tree()), read_only=True))
CHECKPOINT.add("parts-not-read-only", CheckpointError, "restore_parts needs a Checkpointer opened with read_only=True",
               _saved(lambda ck, tmp: ck.restore_parts(tree())))
CHECKPOINT.add("save-older-step", CheckpointError, "cannot save step 1 into", _saved(
    lambda ck, tmp: ck.save(1, tree()), steps=(1, 2)))


@CHECKPOINT.refusal(CheckpointError, "no complete checkpoint in")
def no_checkpoint(tmp, mp):
    (tmp / "ck").mkdir()
    return opened(tmp / "ck", lambda ck: ck.restore(tree()))


@CHECKPOINT.refusal(CheckpointError, "latest': a step directory must be named by its step")
def step_directory_renamed(tmp, mp):
    save(tmp / "ck", tree())
    (tmp / "ck" / "1").rename(tmp / "latest")
    return opened(tmp / "ck", lambda ck: ck.restore(tree(), path=tmp / "latest"))


CHECKPOINT.add("no-such-step", CheckpointError, "no checkpoint of step 5 in", _saved(
    lambda ck, tmp: ck.restore(tree(), step=5), steps=(1, 2)))
CHECKPOINT.add("path-missing", CheckpointError, "missing' does not exist (or is not a directory)",
               _saved(lambda ck, tmp: ck.restore(tree(), path=tmp / "missing")))
CHECKPOINT.add("path-not-a-checkpoint", CheckpointError, "is not a checkpoint: expected a step directory holding "
               "state/ and meta/, or a directory of such step directories",
               _saved(lambda ck, tmp: ck.restore(tree(), path=tmp)))
CHECKPOINT.add("path-of-another-step", CheckpointError, "holds step 1, not the step 2 asked for",
               _saved(lambda ck, tmp: ck.restore(tree(), step=2, path=tmp / "ck" / "1")))
CHECKPOINT.add("path-without-the-step", CheckpointError, "no checkpoint of step 5 in",
               _saved(lambda ck, tmp: ck.restore(tree(), step=5, path=tmp / "ck")))
CHECKPOINT.add("another-model", CheckpointError, "was written by a different model config (ffn.num_experts: checkpoint "
               "16, this run 32; model.rope: checkpoint '<absent>', this run 10000.0)",
               _saved(lambda ck, tmp: ck.restore(tree()), fingerprint={
                   "model": {**FP["model"], "rope": 10000.0}, "ffn": {**FP["ffn"], "num_experts": 32}}))
CHECKPOINT.add("leaf-of-another-shape", CheckpointError, "leaf params/w is float32(2, 3), this run expects "
               "float32(2, 4)", _saved(lambda ck, tmp: ck.restore(tree(4))))
CHECKPOINT.add("leaf-missing", CheckpointError, "holds a different state layout: 1 leaves missing from it (extra), 0 "
               "not in this run ()", _saved(lambda ck, tmp: ck.restore(tree(extra=np.zeros(3)))))
CHECKPOINT.add("leaf-not-in-this-run", CheckpointError, "0 leaves missing from it (), 1 not in this run (step)",
               _saved(lambda ck, tmp: ck.restore({"params": tree()["params"]})))
CHECKPOINT.add("another-layout-version", CheckpointError, "layout version 2, expected 1", _saved(
    lambda ck, tmp: ck.restore(tree()), damage=lambda step: (step / "meta" / "metadata").write_text(
        (step / "meta" / "metadata").read_text().replace('"format": 1', '"format": 2'))))
CHECKPOINT.add("damaged-state", CheckpointError, "1: its state cannot be read (", _saved(
    lambda ck, tmp: ck.restore(tree()), damage=overwrite("state")))
CHECKPOINT.add("damaged-meta", CheckpointError, "1: its meta cannot be read (", _saved(
    lambda ck, tmp: ck.restore(tree()), damage=overwrite("meta", b"{not json")))
CHECKPOINT.add("no-data-state", CheckpointError, "holds no data-iterator state (data/), so the input pipeline cannot "
               "resume where it stopped", _saved(lambda ck, tmp: ck.restore(tree(), _builtin_loader())))
CHECKPOINT.add("data-state-file-missing", CheckpointError, "data/ holds no iterator state file", _saved(
    lambda ck, tmp: ck.restore(tree(), _builtin_loader()), damage=_data_files(), data_iter=_builtin_loader))
CHECKPOINT.add("data-state-of-missing-processes", CheckpointError, "not one per process of the run that wrote it",
               _saved(lambda ck, tmp: ck.restore(tree(), _builtin_loader()), damage=_data_files("{}", None),
                      data_iter=_builtin_loader))
CHECKPOINT.add("data-states-that-differ", CheckpointError, "was written by 2 processes whose input pipelines stood at "
               "different positions (process_0-of-2.json, process_1-of-2.json), so it cannot resume in a run of 1 "
               "process(es); resume it with 2 processes", _saved(lambda ck, tmp: ck.restore(tree(), _builtin_loader()),
                                                                 damage=_data_files("{}", "[]"),
                                                                 data_iter=_builtin_loader))
CHECKPOINT.add("data-state-not-json", CheckpointError, "process_0-of-2.json is not JSON (", _saved(
    lambda ck, tmp: ck.restore(tree(), _builtin_loader()), damage=_data_files("{x", "{x"), data_iter=_builtin_loader))


@CHECKPOINT.refusal(CheckpointError, "opt_state/mu is float32(2, 3), this run expects bfloat16(2, 3) (the optimizer's "
                                     "moments: set optimizer.moment_dtype=float32 as the run that wrote it had)")
def moments_of_another_dtype(tmp, mp):
    save(tmp / "ck", {"opt_state": {"mu": np.zeros((2, 3), np.float32)}})
    return opened(tmp / "ck", lambda ck: ck.restore({"opt_state": {"mu": np.zeros((2, 3), jax.numpy.bfloat16)}}))


@CHECKPOINT.refusal(CheckpointError, "leaf k was saved as raw key data, the template asks for a typed PRNG key")
def raw_key_data_for_a_typed_key(tmp, mp):
    save(tmp / "ck", {"k": np.asarray(jax.random.key_data(jax.random.key(0)))})
    return opened(tmp / "ck", lambda ck: ck.restore({"k": jax.random.key(1)}))

# Not reachable from outside: two leaves with the same path names (checkpoint_tree.named_leaves), which JAX's own
# flattening of dict keys already refuses.


# ============================================================================= every row, checked alike (catalogue.py)

@pytest.mark.parametrize("provoke, error, fragment", [*CHECKPOINT])
def test_refused_in_one_line_leaving_nothing_behind(provoke, error, fragment, tmp_path, monkeypatch):
    check_refused(provoke, error, fragment, tmp_path, monkeypatch)
