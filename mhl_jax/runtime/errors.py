"""Bad input, found once a run is set up: a config, data files or a checkpoint that cannot serve it.

train.py and `python -m mhl_jax.infer` print these as one line and exit with status 2, without a traceback: the
message names the key, file or step at fault and what to do, which a traceback would only bury.
"""

from __future__ import annotations

from mhl_jax.config import ConfigError
from mhl_jax.data.errors import DataError


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or was written by a different model or state layout."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, an I/O error): not bad input but a failure during the run, so
    train.py prints it as one line and exits with EXIT_FAILED; the message names the checkpoint, why, and the earlier
    checkpoint that is intact."""


INPUT_ERRORS = (ConfigError, DataError, CheckpointError)

# Exit statuses of every command (train.py, `python -m mhl_jax.infer`, `compare`, `data.prepare`), so that a job
# script or scheduler can tell what to do next without reading the log.
EXIT_OK = 0  # done
EXIT_FAILED = 1  # stopped by a failure during the run (diverged, out of memory, a checkpoint that could not be saved)
EXIT_BAD_INPUT = 2  # refused before the work started: config, data, checkpoint or command line (one line says why)
EXIT_INTERRUPTED = 3  # stopped by a signal after saving a checkpoint: run the same command again to resume


def input_error_line(e: Exception) -> str:
    """`config error: ...`, `data error: ...` or `checkpoint error: ...` for one of INPUT_ERRORS."""
    kind = next(n for c, n in zip(INPUT_ERRORS, ("config", "data", "checkpoint")) if isinstance(e, c))
    return f"{kind} error: {e}"
