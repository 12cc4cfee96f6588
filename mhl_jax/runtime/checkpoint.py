"""Checkpoints: Orbax `CheckpointManager` holding the training state, the Grain iterator position
and a fingerprint of the model config.

One checkpoint is a step directory `<directory>/<step>/` with three Orbax items:
- `state`: the training state pytree (params, optimizer state, balancing biases, step, RNG key
  data, ...) stored as a nested dict named by the pytree paths, so any pytree of jax/numpy arrays
  round-trips bitwise (dtype and values) into the structure of a template;
- `meta`: JSON with the step, the fingerprint (model + FFN config) and the table of leaves, checked
  before any array is read, so a checkpoint of another model fails with the keys that differ;
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
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from mhl_jax.config import CheckpointConfig, Config, config_to_dict
from mhl_jax.runtime.checkpoint_tree import (
    PyTree,
    abstract_leaf,
    changed_leaves,
    describe,
    is_prng_key,
    named_leaves,
    nest,
    storable,
    unflatten,
)
from mhl_jax.runtime.disk import check_free_space, state_bytes, write_failure
from mhl_jax.runtime.distributed import failed_processes
from mhl_jax.runtime.errors import CheckpointError, CheckpointSaveError

STATE, META, DATA = "state", "meta", "data"
FORMAT = 1  # version of the layout above


def model_fingerprint(cfg: Config) -> dict:
    """What a checkpoint must agree on to be restored into this run: the model and FFN config, less the settings
    that change how it runs (kernels, attention implementation, compute dtype, remat) or trains (balance_gamma)."""
    d = config_to_dict(cfg)
    ffn = {k: v for k, v in d["ffn"].items() if k not in ("kernels", "balance_gamma")}
    model = {k: v for k, v in d["model"].items() if k not in ("attention_impl", "compute_dtype", "remat")}
    return {"model": model, "ffn": ffn}


def _quiet_closed_loop_callbacks() -> None:
    """When a restore fails, the reads still in flight finish on tensorstore's threads and call back into Orbax's
    asyncio loop, which is closed by then: each callback's RuntimeError('Event loop is closed') reaches
    sys.unraisablehook and printed a traceback around the one-line error (2-20 of them, some before it). Those, and
    only those, are dropped from the first restore on; every other unraisable exception goes to the hook before."""
    prev = sys.unraisablehook
    if getattr(prev, "_drops_closed_loop", False):
        return

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        prev(unraisable)

    hook._drops_closed_loop = True
    sys.unraisablehook = hook


def _drop_orbax_errors(record: logging.LogRecord) -> bool:
    """False for Orbax's error records (a Checkpointer that writes raises its failures itself)."""
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


@contextlib.contextmanager
def _absl_quiet(prefix: str):
    """Drop absl log records starting with `prefix` while the block runs."""
    def drop(record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(prefix)

    logger = logging.getLogger("absl")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)



def _shared_data_state(data_dir: Path, where: str) -> dict | None:
    """The iterator state to restore by hand when the checkpoint was written by another number of processes than
    this run has (Grain's handler reads only `process_<i>-of-<n>.json` of this run's own count): the state saved by
    every process, which must be one and the same (train.py's loader: every process reads the whole global batch).
    None when this process's own file is there (Grain's handler restores it)."""
    index, count = jax.process_index(), jax.process_count()
    if (data_dir / f"process_{index}-of-{count}.json").is_file():
        return None
    files = sorted(data_dir.glob("process_*-of-*.json"))
    if not files:
        raise CheckpointError(f"checkpoint {where}: {DATA}/ holds no iterator state file (process_<i>-of-<n>.json); "
                              "the step directory is damaged or incomplete")
    counts = {f.name.rsplit("-of-", 1)[1].removesuffix(".json") for f in files}
    if len(counts) != 1 or counts != {str(len(files))}:
        raise CheckpointError(f"checkpoint {where}: {DATA}/ holds the iterator states {[f.name for f in files]}, not "
                              "one per process of the run that wrote it; the step directory is damaged or incomplete")
    states = {f.name: f.read_text() for f in files}
    if len(set(states.values())) != 1:
        raise CheckpointError(f"checkpoint {where} was written by {len(files)} processes whose input pipelines "
                              f"stood at different positions ({', '.join(states)}), so it cannot resume in a run of "
                              f"{count} process(es); resume it with {len(files)} processes")
    try:
        return json.loads(next(iter(states.values())))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {where}: {files[0]} is not JSON ({e}); the step directory is damaged or "
                              "incomplete") from e


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Save and restore (state pytree, Grain iterator) under `directory`, keeping the last `cfg.keep`.

    `fingerprint`: a JSON-able dict (the model and FFN config) stored with every checkpoint;
    restoring a checkpoint whose fingerprint differs raises CheckpointError naming the keys.
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
            with _absl_quiet("Given directory is read only"):  # Orbax's warning for what was asked of it
                self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        else:
            options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                                   create=True, cleanup_tmp_directories=True)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
            # a failed save is raised as one CheckpointSaveError (`save`, `check`, `wait`): Orbax's own records of it,
            # a traceback from each of its threads, would only bury that line
            logging.getLogger("absl").addFilter(_drop_orbax_errors)
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
        self._before_save(step, state_bytes(describe(leaf) for _, leaf in named))
        meta = {"format": FORMAT, "step": int(step), "fingerprint": self.fingerprint,
                "leaves": [[list(names), *describe(leaf)] for names, leaf in named],
                "key_impls": {"/".join(names): str(jax.random.key_impl(leaf)) for names, leaf in named
                              if is_prng_key(leaf)}}
        items = {STATE: ocp.args.StandardSave(nest([(n, storable(leaf)) for n, leaf in named])),
                 META: ocp.args.JsonSave(meta)}
        if data_iter is not None:
            items[DATA] = grain.checkpoint.CheckpointSave(data_iter)
        _quiet_closed_loop_callbacks()  # a failing write's late callbacks into Orbax's closed event loop
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
            check_free_space(self.directory, nbytes, f"checkpoint step {step}", self._kept())
        except CheckpointSaveError as e:
            failure = e
        others = failed_processes(failure is None)
        if failure is not None:
            raise failure
        if others:
            raise CheckpointSaveError(f"checkpoint step {step} not saved: process(es) {others} could not save it "
                                      f"(their errors say why); {self._kept()}")

    def _kept(self) -> str:
        """Which checkpoint a failed save left intact, and what the same command then does."""
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
                raise
            raise self._save_failed(step, e) from e

    def close(self) -> None:
        """Wait for writes and for Orbax's cleanup of leftover temporary directories (started when the manager
        opened the directory; `CheckpointManager.close` does not wait for it, and a process that exits while it
        runs prints its thread's traceback), then release Orbax's resources."""
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
        self._manager.close()
        logging.getLogger("absl").removeFilter(_drop_orbax_errors)

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

    def _check_meta(self, meta: dict, named: list[tuple[tuple[str, ...], Any]], where: str,
                    partial: bool = False) -> None:
        """The checkpoint's layout version, fingerprint and leaves against `named` (`partial`: named may be a part
        of the saved leaves)."""
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {where}: layout version {meta.get('format')!r}, expected {FORMAT}")
        diff = changed_leaves(meta.get("fingerprint", {}), self.fingerprint)
        if diff:
            lines = "; ".join(f"{k}: checkpoint {theirs!r}, this run {ours!r}" for k, theirs, ours in diff)
            raise CheckpointError(f"checkpoint {where} was written by a different model config ({lines})")
        saved = {tuple(names): (shape, dtype) for names, shape, dtype in meta["leaves"]}
        wanted = {names: tuple(describe(leaf)) for names, leaf in named}
        missing = [n for n in wanted if n not in saved]
        extra = [] if partial else [n for n in saved if n not in wanted]
        if missing or extra:
            show = lambda ns: ", ".join("/".join(n) for n in ns[:4]) + (" ..." if len(ns) > 4 else "")
            raise CheckpointError(f"checkpoint {where} holds a different state layout: "
                                  f"{len(missing)} leaves missing from it ({show(missing)}), "
                                  f"{len(extra)} not in this run ({show(extra)})")
        for names, (shape, dtype) in wanted.items():
            if [list(saved[names][0]), saved[names][1]] != [shape, dtype]:
                hint = (f" (the optimizer's moments: set optimizer.moment_dtype={saved[names][1]} as the run that "
                        "wrote it had)" if names[0] == "opt_state" and list(saved[names][0]) == list(shape)
                        and {saved[names][1], dtype} == {"float32", "bfloat16"} else "")
                raise CheckpointError(f"checkpoint {where}: leaf {'/'.join(names)} is {saved[names][1]}"
                                      f"{tuple(saved[names][0])}, this run expects {dtype}{tuple(shape)}{hint}")

    def _read(self, step: int, directory: Path, args: Any, where: str, what: str) -> Any:
        """Orbax's restore of `args`; a damaged or incomplete step directory raises CheckpointError naming it and the
        other steps there (Orbax's own error, often buried under its threads' tracebacks, is chained)."""
        _quiet_closed_loop_callbacks()  # before: a failing restore's late reads can call back while it still runs
        try:
            return self._manager.restore(step, directory=directory, args=args)
        except CheckpointError:
            raise
        except Exception as e:
            others = sorted(int(c.name) for c in directory.iterdir() if c.name.isdigit() and int(c.name) != step)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            if self.read_only:  # beside a run that may be rotating its checkpoints out (checkpoint.keep)
                advice = (f"it may have been removed by the run writing there while it was read; steps there now: "
                          f"{others}; pick one of them")
            else:
                advice = (f"other steps there: {others}; delete {where} to resume from the latest of them" if others
                          else f"no other steps there; delete {where} to start the run over")
            raise CheckpointError(
                f"checkpoint {where}: its {what} cannot be read ({type(e).__name__}: {first}); the step directory is "
                f"damaged or incomplete; {advice}") from e

    def restore(self, state_template: PyTree, data_iter: Any = None, step: int | None = None,
                path: str | Path | None = None) -> tuple[int, PyTree]:
        """Restore (step, state) with the structure, dtypes and shardings of `state_template`.

        `step`: that step of this directory (default: the latest). `path`: an explicit checkpoint
        instead, either a step directory or a directory of them (then its latest). `data_iter`: a
        Grain DatasetIterator built like the saved one; its position is set in place (None: skip).
        """
        self.wait()
        directory, step, where, named, treedef, meta = self._checked(state_template, step, path, partial=False)
        items = {STATE: ocp.args.StandardRestore(nest([(n, abstract_leaf(leaf)) for n, leaf in named]))}
        shared = None  # the iterator state when another process count wrote it (_shared_data_state)
        if data_iter is not None:
            if not (directory / str(step) / DATA).is_dir():
                raise CheckpointError(f"checkpoint {where} holds no data-iterator state ({DATA}/), so the input "
                                      "pipeline cannot resume where it stopped; it was not written by train.py, or its "
                                      f"{DATA}/ directory was removed")
            shared = _shared_data_state(directory / str(step) / DATA, where)
            if shared is None:
                items[DATA] = grain.checkpoint.CheckpointRestore(data_iter)
        restored = self._read(step, directory, ocp.args.Composite(**items), where, "/".join(items))[STATE]
        if shared is not None:
            data_iter.set_state(shared)
            if hasattr(data_iter, "start_prefetch"):  # as Grain's own restore does
                data_iter.start_prefetch()
        return int(meta["step"]), unflatten(restored, named, treedef, meta, where)

    def _checked(self, template: PyTree, step: int | None, path: str | Path | None, partial: bool):
        """(directory, step, where, named leaves, treedef, meta) of the checkpoint to restore into `template`, its
        meta item read and checked against the template (`_check_meta`) before any array is read."""
        directory, step = self._locate(step, path)
        where = str(directory / str(step))
        named, treedef = named_leaves(template)
        meta = self._read(step, directory, ocp.args.Composite(**{META: ocp.args.JsonRestore()}), where, META)[META]
        self._check_meta(meta, named, where, partial=partial)
        return directory, step, where, named, treedef, meta


    def restore_parts(self, template: dict, step: int | None = None,
                      path: str | Path | None = None) -> tuple[int, dict]:
        """(step, parts): only the top-level parts of the saved state that `template` names (e.g. {"params": ...,
        "biases": ...}: a model without its optimizer state, which is never read), with the template's structure,
        dtypes and shardings. Needs a read-only Checkpointer. `step` and `path` as in `restore`."""
        if not self.read_only:
            raise CheckpointError("restore_parts needs a Checkpointer opened with read_only=True")
        directory, step, where, named, treedef, meta = self._checked(template, step, path, partial=True)
        tree = nest([(n, abstract_leaf(leaf)) for n, leaf in named])
        args = ocp.args.PyTreeRestore(item=tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
                                      partial_restore=True)
        restored = self._read(step, directory, ocp.args.Composite(**{STATE: args}), where, STATE)[STATE]
        return int(meta["step"]), unflatten(restored, named, treedef, meta, where)
