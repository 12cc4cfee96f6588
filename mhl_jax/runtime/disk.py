"""The disk under the checkpoints: its free space, checked before a checkpoint is written, and the operating system's
reason when a write failed anyway.

A checkpoint takes about the state's bytes on disk (Orbax compresses little of it: the tiny model's 3.35 MB state
took 2.93 MB) plus its metadata; the previous checkpoints stay until the new one is complete, so the whole of it must
fit in what is free. Refusing before the write says what is needed and what is free; a write that fills the disk
midway says only "No space left on device", from a background thread, after the run has gone on.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from mhl_jax.runtime.errors import CheckpointSaveError

# On top of the state's bytes: Orbax's metadata (a JSON entry per leaf), the iterator state, the file system's blocks
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 2**20


def free_bytes(directory: Path) -> int:
    """Bytes free to this user on the file system of `directory` (of its nearest existing parent before it exists)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def state_bytes(shapes_and_dtypes) -> int:
    """Bytes of the arrays described by (shape, dtype name) pairs, as `checkpoint_tree.describe` gives them."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in shapes_and_dtypes)


def needed_bytes(nbytes: int) -> int:
    """The free space a checkpoint of a state of `nbytes` asks for: its bytes plus a margin."""
    return nbytes + max(int(nbytes * MARGIN_FRACTION), MARGIN_BYTES)


def size(nbytes: float) -> str:
    """A byte count for a message: 512 B, 3.2 MiB, 41.70 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}" if unit in ("TiB", "GiB") else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def check_free_space(directory: Path, nbytes: int, what: str, kept: Callable[[], str]) -> None:
    """CheckpointSaveError when the file system of `directory` has less free than a checkpoint of a state of `nbytes`
    needs (`needed_bytes`): the figures, the directory, `what` was refused and `kept()` (which checkpoint is intact,
    and what the same command then does; asked only on a refusal, since finding out reads the directory)."""
    needed, free = needed_bytes(nbytes), free_bytes(directory)
    if free < needed:
        raise CheckpointSaveError(f"{what} not saved: it needs about {size(needed)} (the state's {size(nbytes)} plus "
                                  f"a margin) and the file system of {str(directory)!r} has {size(free)} free; free "
                                  f"some space there (or move logging.run_dir); {kept()}")


def write_failure(e: BaseException) -> str:
    """Why a checkpoint write failed, short: the operating system's words when the error carries them (an OSError, or
    tensorstore's `[os_error_code='28']` under Orbax's ValueError), else the error's first line."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
    text = str(e).strip()
    code = re.search(r"os_error_code='?(\d+)", text)
    if code:
        n = int(code.group(1))
        return f"{os.strerror(n)} ({errno.errorcode.get(n, n)})"
    first = (text.splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"
