"""Checkpoints: Orbax `CheckpointManager` holding the training state, the Grain iterator position
and a fingerprint of the model config.

One checkpoint is a step directory `<directory>/<step>/` with three Orbax items:
- `state`: the training state pytree (params, optimizer state, balancing biases, step, RNG key
  data, ...) stored as a nested dict named by the pytree paths, so any pytree of jax/numpy arrays
  round-trips bitwise (dtype and values) into the structure of a template;
- `meta`: JSON with the step, the model fingerprint and the table of leaves (mhl_jax/runtime/checkpoint_meta.py),
  and their checksums (mhl_jax/runtime/checkpoint_integrity.py);
- `data`: the Grain iterator state (`grain.checkpoint.CheckpointSave/CheckpointRestore`, one JSON
  file per JAX process); a run of another process count restores it when every process saved the same
  state (train.py's loader, where every process reads the whole global batch).
Orbax writes each checkpoint into a temporary directory and renames it when complete, so a process
killed in the middle of a save leaves the previous checkpoint as the latest one; leftover temporary
directories are removed when the next `Checkpointer` opens the directory. With `async_save`, arrays
are copied to host memory before `save` returns (donating them afterwards is safe) and written in
the background; the iterator state is captured synchronously. A save the disk has no room for is
refused before writing (mhl_jax.runtime.disk), and one that fails, in the background too, raises
CheckpointSaveError naming the checkpoint that is intact (`save`, `check`, `wait`).

A save refuses a state holding NaN or inf; a restore verifies the arrays against their checksums. A damaged latest
checkpoint is moved aside and the newest intact one restored (`checkpoint.on_damage=fallback`, `Checkpointer.restore`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp

from mhl_jax.config import CheckpointConfig
from mhl_jax.runtime.checkpoint_data import require_data_state, shared_data_state
from mhl_jax.runtime.checkpoint_integrity import (
    DamagedCheckpoint,
    agree_intact,
    damage_advice,
    is_damage,
    move_aside,
    seal,
    verify,
)
from mhl_jax.runtime.checkpoint_meta import check_meta
from mhl_jax.runtime.checkpoint_tree import (
    PyTree,
    abstract_leaf,
    describe,
    is_prng_key,
    lookup,
    named_leaves,
    nest,
    storable,
    unflatten,
)
from mhl_jax.runtime.disk import check_free_space, state_bytes, write_failure
from mhl_jax.runtime.distributed import failed_processes
from mhl_jax.runtime.errors import CheckpointError, CheckpointSaveError
from mhl_jax.runtime.orbax_quiet import absl_quiet, drop_orbax_errors, quiet_failed_reads

STATE, META, DATA = "state", "meta", "data"
FORMAT = 1  # version of the layout above


def _warn(line: str) -> None:
    """A restore's warning: one line on stderr, from process 0."""
    if jax.process_index() == 0:
        print(f"warning: {line}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Save and restore (state pytree, Grain iterator) under `directory`, keeping the last `cfg.keep`.

    `fingerprint`: a JSON-able dict (the model and FFN config) stored with every checkpoint;
    restoring a checkpoint whose fingerprint differs on this one's keys raises CheckpointError naming them.
    """

    def __init__(self, directory: str | Path, cfg: CheckpointConfig, fingerprint: dict,
                 read_only: bool = False) -> None:
        """`read_only`: only restore (`restore_parts` included): the directory must exist, and nothing in it is
        created, deleted or cleaned up, so a run that is writing checkpoints there is not disturbed."""
        if cfg.keep < 1:
            raise CheckpointError(f"checkpoint.keep={cfg.keep}: must be >= 1")
        self.directory = Path(directory).expanduser().absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {str(self.directory)!r} is a file; expected a directory "
                                  "(move the file away, or use another logging.run_dir)")
        self.cfg = cfg
        try:
            self.fingerprint = json.loads(json.dumps(fingerprint))  # as it will read back
        except TypeError as e:
            raise CheckpointError(f"the checkpoint fingerprint must be JSON-able: {e}") from e
        self.read_only = read_only
        if read_only:
            if not self.directory.is_dir():
                raise CheckpointError(f"no checkpoint directory {str(self.directory)!r}")
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                                   save_interval_steps=0, cleanup_tmp_directories=False,
                                                   enable_async_checkpointing=False)
            # the state item read through the PyTree handler, which can restore a part of the saved tree
            handlers = {STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
            with absl_quiet("Given directory is read only"):  # Orbax's warning for what was asked of it
                self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        else:
            options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                                   create=True, cleanup_tmp_directories=True)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
            # a failed save is raised as one CheckpointSaveError (`save`, `check`, `wait`): Orbax's own records of it,
            # a traceback from each of its threads, would only bury that line
            logging.getLogger("absl").addFilter(drop_orbax_errors)
        self._writing: int | None = None  # the step of the background save not yet waited for

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints kept, ascending."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: PyTree, data_iter: Any = None) -> None:
        """Write checkpoint `step` of `state` (any pytree of jax/numpy arrays, typed PRNG keys
        included) and the position of `data_iter` (a Grain DatasetIterator; None: no data item).
        Returns once the arrays are on the host when async (call `wait()` to wait for the files).

        CheckpointSaveError, on every process alike, when the previous background save failed, when the file system
        has less free than the checkpoint needs (`disk.check_free_space`: nothing is written), or when the write
        fails; the message names the checkpoint that is intact."""
        if self.read_only:
            raise CheckpointError(f"cannot save into {str(self.directory)!r}: opened read-only")
        named, _ = named_leaves(state)
        described = [describe(leaf) for _, leaf in named]
        self._before_save(step, state_bytes(described))
        stored = [(n, storable(leaf)) for n, leaf in named]
        meta = {"format": FORMAT, "step": int(step), "fingerprint": self.fingerprint,
                "leaves": [[list(names), *d] for (names, _), d in zip(named, described)],
                "key_impls": {"/".join(names): str(jax.random.key_impl(leaf)) for names, leaf in named
                              if is_prng_key(leaf)},
                # checksums, from one pass over the state on its devices; a non-finite state is refused here
                **seal(stored, step, self.latest_step())}
        items = {STATE: ocp.args.StandardSave(nest(stored)),
                 META: ocp.args.JsonSave(meta)}
        if data_iter is not None:
            items[DATA] = grain.checkpoint.CheckpointSave(data_iter)
        quiet_failed_reads()  # a failing write's late callbacks into Orbax's closed event loop
        try:
            saved = self._manager.save(int(step), args=ocp.args.Composite(**items))
        except Exception as e:
            raise self._save_failed(step, e) from e
        if not saved:
            raise CheckpointError(f"cannot save step {step} into {str(self.directory)!r}: Orbax only saves steps "
                                  f"newer than the latest one there (steps: {self.all_steps()}); use a fresh run "
                                  "directory when resuming an older checkpoint")
        self._writing = int(step) if self.cfg.async_save else None

    def _before_save(self, step: int, nbytes: int) -> None:
        """The previous background save committed and room on the disk for this one, agreed between the processes
        before Orbax's save (whose first barrier a process that refused would leave the others waiting at)."""
        failure = None
        try:
            self.wait()
            check_free_space(self.directory, nbytes, f"checkpoint step {step}", self._kept)
        except CheckpointSaveError as e:
            failure = e
        except Exception as e:  # any other failure is this process's too: the others must hear of it, not wait
            failure = CheckpointSaveError(f"checkpoint step {step} not saved: {write_failure(e)}; {self._kept()}")
            failure.__cause__ = e
        others = failed_processes(failure is None)
        if failure is not None:
            raise failure
        if others:
            raise CheckpointSaveError(f"checkpoint step {step} not saved: process(es) {others} could not save it "
                                      f"(their errors say why); {self._kept()}")

    def _kept(self) -> str:
        """Which checkpoint a failed save left intact, and what the same command then does. Read from the directory:
        Orbax's own list drops the step a save would rotate out (checkpoint.keep) when the save starts, and the step
        that failed, while the older step's files are still there."""
        try:
            self._manager.reload()
        except Exception:  # the directory is what failed: the list as it was
            pass
        latest = self.latest_step()
        if latest is None:
            return "no earlier checkpoint was written: the same command starts the run again"
        return f"the checkpoint of step {latest} is intact: the same command resumes from it"

    def _save_failed(self, step: int, e: BaseException) -> CheckpointSaveError:
        """The one-line error of checkpoint `step`, whose write raised `e`."""
        return CheckpointSaveError(f"checkpoint step {step} could not be written to {str(self.directory)!r}: "
                                   f"{write_failure(e)}; {self._kept()}")

    def check(self) -> None:
        """CheckpointSaveError when the background save has failed; returns at once while it is still writing (a
        cheap test, made every step)."""
        if self._writing is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until background writes are finished and committed; CheckpointSaveError when one failed."""
        step, self._writing = self._writing, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            if step is None:
                raise CheckpointSaveError(f"a checkpoint could not be written to {str(self.directory)!r}: "
                                          f"{write_failure(e)}; {self._kept()}") from e
            raise self._save_failed(step, e) from e

    def close(self) -> None:
        """Wait for writes and for Orbax's cleanup of leftover temporary directories (started when the manager
        opened the directory; `CheckpointManager.close` does not wait for it, and a process that exits while it
        runs prints its thread's traceback), then release Orbax's resources."""
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
        self._manager.close()
        logging.getLogger("absl").removeFilter(drop_orbax_errors)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.wait()  # background writes committed, also when the run fails
        except CheckpointSaveError as e:
            if exc is None:
                raise
            exc.add_note(str(e))  # the error that stopped the run stays the one raised
        finally:
            self.close()  # Orbax's threads released: no tracebacks from them at exit

    def step_of(self, path: str | Path | None = None) -> int:
        """The step `restore(path=path)` would restore (the latest here when path is None), read from the directory
        names only; CheckpointError when there is none."""
        return self._locate(None, path)[1]

    def _locate(self, step: int | None, path: str | Path | None) -> tuple[Path, int]:
        """(directory of step directories, step) to restore."""
        if path is None:
            if step is None:
                step = self.latest_step()
                if step is None:
                    raise CheckpointError(f"no complete checkpoint in {str(self.directory)!r}")
            elif step not in self.all_steps():
                raise CheckpointError(f"no checkpoint of step {step} in {str(self.directory)!r}; "
                                      f"steps there: {self.all_steps()}")
            return self.directory, int(step)
        p = Path(path).expanduser().absolute()
        if not p.is_dir():
            raise CheckpointError(f"checkpoint path {str(path)!r} does not exist (or is not a directory)")
        if (p / META).is_dir() and (p / STATE).is_dir():
            if not p.name.isdigit():
                raise CheckpointError(f"checkpoint path {str(path)!r}: a step directory must be named by its step")
            if step is not None and step != int(p.name):
                raise CheckpointError(f"checkpoint path {str(path)!r} holds step {p.name}, not the step {step} asked "
                                      "for")
            return p.parent, int(p.name)
        steps = sorted(int(c.name) for c in p.iterdir()
                       if c.name.isdigit() and (c / META).is_dir() and (c / STATE).is_dir())
        if not steps:
            raise CheckpointError(f"checkpoint path {str(path)!r} is not a checkpoint: expected a step directory "
                                  f"holding {STATE}/ and {META}/, or a directory of such step directories")
        if step is None:
            return p, steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {str(path)!r}; steps there: {steps}")
        return p, int(step)

    def _read(self, step: int, directory: Path, args: Any, where: str, what: str) -> Any:
        """Orbax's restore of `args`; a damaged or incomplete step directory raises DamagedCheckpoint naming it (Orbax's
        own error, often buried under its threads' tracebacks, is chained; `quiet_failed_reads`)."""
        quiet_failed_reads()  # before: a failing restore's late reads can call back while it still runs
        try:
            return self._manager.restore(step, directory=directory, args=args)
        except CheckpointError:
            raise
        except Exception as e:
            if not is_damage(e):  # the machine's fault, not the checkpoint's: no checkpoint is moved aside for it
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            first = re.split(r" \[tensorstore_spec| See full TensorStore details", first)[0][:300]  # long specs
            raise DamagedCheckpoint(f"checkpoint {where}: its {what} cannot be read ({type(e).__name__}: {first}); "
                                    "the step directory is damaged or incomplete") from e

    def restore(self, state_template: PyTree, data_iter: Any = None, step: int | None = None,
                path: str | Path | None = None, warn: Callable[[str], None] | None = None) -> tuple[int, PyTree]:
        """Restore (step, state) with the structure, dtypes and shardings of `state_template`, its arrays verified
        against their checksums.

        `step`: that step of this directory (default: the latest). `path`: an explicit checkpoint
        instead, either a step directory or a directory of them (then its latest). `data_iter`: a
        Grain DatasetIterator built like the saved one; its position is set in place (None: skip).

        A damaged checkpoint (unreadable, incomplete, failing its checksums, or not finite) is refused with
        CheckpointError, unless it is this directory's latest, restored because neither `step` nor `path` was given,
        and `checkpoint.on_damage` is fallback: then the next older one is tried, and once one restores, each damaged
        one is moved aside to `<step>.damaged` (never deleted; Orbax saves only steps newer than the latest there) with
        a one-line warning through `warn` (default: stderr, process 0). When none restores, nothing is moved and the
        error names them all: starting over would drop the training they hold, which is for a person to decide.
        """
        self.wait()
        warn = warn or _warn
        restored, skipped = self._first_intact(
            lambda directory, at: self._restore_one(state_template, data_iter, directory, at, warn), step, path)
        for at, e in skipped:
            moved = move_aside(self.directory / str(at))
            warn(f"{e}; moved aside to {moved.name} and step {restored[0]} restored instead "
                 "(checkpoint.on_damage=fallback)")
        if skipped:
            self._manager.reload()  # Orbax's list of steps, without the moved ones
        return restored

    def _first_intact(self, attempt: Callable[[Path, int], Any], step: int | None, path: str | Path | None):
        """(attempt(directory, step) of the checkpoint `restore` takes, [(step, DamagedCheckpoint)] of the newer ones
        it found damaged and skipped). The checkpoint named by `step` or `path` (`_locate`), else the latest; with
        checkpoint.on_damage=fallback and neither named, the newest one `attempt` does not find damaged.
        CheckpointError when none is there, or a damaged one has no stand-in."""
        explicit = step is not None or path is not None
        if explicit or self.cfg.on_damage == "stop":
            directory, at = self._locate(step, path)
            try:
                return attempt(directory, at), []
            except DamagedCheckpoint as e:
                raise CheckpointError(f"{e}; {damage_advice(directory, at, self.read_only, explicit)}") from e
        skipped: list[tuple[int, DamagedCheckpoint]] = []
        for candidate in reversed(self.all_steps()):
            try:
                return attempt(self.directory, candidate), skipped
            except DamagedCheckpoint as e:
                skipped.append((candidate, e))
        if not skipped:
            raise CheckpointError(f"no complete checkpoint in {str(self.directory)!r}")
        reasons = "; ".join(str(e) for _, e in skipped)
        raise CheckpointError(f"no intact checkpoint in {str(self.directory)!r} ({reasons}); nothing was moved: move "
                              "those step directories away (or delete them) to start the run over")

    def _restore_one(self, template: PyTree, data_iter: Any, directory: Path, step: int,
                     warn: Callable[[str], None]) -> tuple[int, PyTree]:
        """`restore` of checkpoint `step` of `directory`; DamagedCheckpoint on every process when any finds it
        damaged."""
        where = str(directory / str(step))
        damage, restored = None, None
        try:
            named, treedef, meta = self._checked(template, directory, step, partial=False)
            items = {STATE: ocp.args.StandardRestore(nest([(n, abstract_leaf(leaf)) for n, leaf in named]))}
            shared = None  # the iterator state when another process count wrote it (shared_data_state)
            if data_iter is not None:
                require_data_state(directory / str(step) / DATA)
                shared = shared_data_state(directory / str(step) / DATA, where)
                if shared is None:
                    items[DATA] = grain.checkpoint.CheckpointRestore(data_iter)
            restored = self._read(step, directory, ocp.args.Composite(**items), where, "/".join(items))[STATE]
        except DamagedCheckpoint as e:
            damage = e
        agree_intact(damage, where)  # before the verification, which every process runs together
        if not verify(meta, [(n, lookup(restored, n)) for n, _ in named], where):
            warn(f"checkpoint {where} has no checksums (written before they existed): restored without verifying its "
                 "arrays")
        if shared is not None:
            data_iter.set_state(shared)
            if hasattr(data_iter, "start_prefetch"):  # as Grain's own restore does
                data_iter.start_prefetch()
        return int(meta["step"]), unflatten(restored, named, treedef, meta, where)

    def _checked(self, template: PyTree, directory: Path, step: int, partial: bool):
        """(named leaves, treedef, meta) of checkpoint `step` of `directory` to restore into `template`, its meta item
        read and checked against the template (`check_meta`) before any array is read."""
        where = str(directory / str(step))
        named, treedef = named_leaves(template)
        meta = self._read(step, directory, ocp.args.Composite(**{META: ocp.args.JsonRestore()}), where, META)[META]
        if not isinstance(meta, dict) or not {"format", "step", "leaves"} <= set(meta):
            raise DamagedCheckpoint(f"checkpoint {where}: its {META} item is not the dict of format, step and leaves "
                                    "that a save writes")
        check_meta(meta, FORMAT, self.fingerprint, named, where, partial=partial)
        return named, treedef, meta

    def check_restorable(self, template: PyTree, data: bool = False, path: str | Path | None = None) -> int:
        """The step `restore(template, path=path)` would restore (`data`: with a data iterator), chosen as it chooses,
        reading meta items only: CheckpointError where it would refuse a checkpoint of another model config or state
        layout, or one whose meta item or data state is damaged (or, with checkpoint.on_damage=fallback, the step
        of the newest one that is not). What `train.py --check` can promise without reading an array; damage in the
        arrays shows only when the run restores them."""
        def check(directory: Path, step: int) -> int:
            self._checked(template, directory, step, partial=False)
            if data:
                require_data_state(directory / str(step) / DATA)
            return step

        return self._first_intact(check, None, path)[0]

    def restore_parts(self, template: dict, step: int | None = None, path: str | Path | None = None,
                      warn: Callable[[str], None] | None = None) -> tuple[int, dict]:
        """(step, parts): only the top-level parts of the saved state that `template` names (e.g. {"params": ...,
        "biases": ...}: a model without its optimizer state, which is never read), with the template's structure,
        dtypes and shardings, verified against their checksums. Needs a read-only Checkpointer. `step` and `path` as
        in `restore`; a damaged checkpoint is refused (a read-only Checkpointer moves nothing)."""
        if not self.read_only:
            raise CheckpointError("restore_parts needs a Checkpointer opened with read_only=True")
        directory, step = self._locate(step, path)
        where = str(directory / str(step))
        try:
            named, treedef, meta = self._checked(template, directory, step, partial=True)
            tree = nest([(n, abstract_leaf(leaf)) for n, leaf in named])
            args = ocp.args.PyTreeRestore(item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
                                          partial_restore=True)
            restored = self._read(step, directory, ocp.args.Composite(**{STATE: args}), where, STATE)[STATE]
            if not verify(meta, [(n, lookup(restored, n)) for n, _ in named], where):
                (warn or _warn)(f"checkpoint {where} has no checksums (written before they existed): read without "
                                "verifying its arrays")
        except DamagedCheckpoint as e:
            raise CheckpointError(f"{e}; {damage_advice(directory, step, self.read_only, explicit=False)}") from e
        return int(meta["step"]), unflatten(restored, named, treedef, meta, where)
