"""The input pipeline's position in a checkpoint (its `data` item), read back by a run of another process count."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from mhl_jax.runtime.checkpoint_integrity import DamagedCheckpoint
from mhl_jax.runtime.errors import CheckpointError


def require_data_state(data_dir: Path) -> None:
    """DamagedCheckpoint unless the checkpoint holds the data iterator's state, `data_dir` (its `data` item)."""
    if not data_dir.is_dir():
        raise DamagedCheckpoint(f"checkpoint {data_dir.parent} holds no data-iterator state ({data_dir.name}/), so the "
                                "input pipeline cannot resume where it stopped; it was not written by train.py, or its "
                                f"{data_dir.name}/ directory was removed")


def shared_data_state(data_dir: Path, where: str) -> dict | None:
    """The iterator state to restore by hand when the checkpoint was written by another number of processes than
    this run has (Grain's handler reads only `process_<i>-of-<n>.json` of this run's own count): the state saved by
    every process, which must be one and the same (train.py's loader: every process reads the whole global batch).
    None when this process's own file is there (Grain's handler restores it)."""
    index, count = jax.process_index(), jax.process_count()
    if (data_dir / f"process_{index}-of-{count}.json").is_file():
        return None
    files = sorted(data_dir.glob("process_*-of-*.json"))
    if not files:
        raise DamagedCheckpoint(f"checkpoint {where}: data/ holds no iterator state file "
                                "(process_<i>-of-<n>.json); the step directory is damaged or incomplete")
    counts = {f.name.rsplit("-of-", 1)[1].removesuffix(".json") for f in files}
    if len(counts) != 1 or counts != {str(len(files))}:
        raise DamagedCheckpoint(f"checkpoint {where}: data/ holds the iterator states {[f.name for f in files]}, "
                                "not one per process of the run that wrote it; the step directory is damaged or "
                                "incomplete")
    states = {f.name: f.read_text() for f in files}
    if len(set(states.values())) != 1:
        raise CheckpointError(f"checkpoint {where} was written by {len(files)} processes whose input pipelines "
                              f"stood at different positions ({', '.join(states)}), so it cannot resume in a run of "
                              f"{count} process(es); resume it with {len(files)} processes")
    try:
        return json.loads(next(iter(states.values())))
    except json.JSONDecodeError as e:
        raise DamagedCheckpoint(f"checkpoint {where}: {files[0]} is not JSON ({e}); the step directory is damaged "
                                "or incomplete") from e
