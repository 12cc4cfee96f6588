"""Orbax's noise kept off the terminal: the leftovers of a failed checkpoint read, its error logs when a write fails
(`drop_orbax_errors`: the Checkpointer raises those failures itself, as one line) and the warnings it gives for what
was asked of it (`absl_quiet`).

When a restore fails (a damaged step directory), its one-line error (or warning, when an older checkpoint stands in)
is what the user needs. The reads still in flight end later and each printed kilobytes of their own, before and after
that line:
- tensorstore's callbacks into Orbax's asyncio loop, closed by then: RuntimeError('Event loop is closed') through
  sys.unraisablehook (2-20 tracebacks);
- Orbax's read coroutines that failed beside the one whose error was raised, finalised when Python collects them
  (often at exit): their tracebacks through sys.unraisablehook, each with a TensorStore spec (~2 KB);
- the futures of those reads, collected unretrieved: 'Future exception was never retrieved' with tensorstore's error
  on asyncio's logger (~3 KB each).
`quiet_failed_reads` drops those, and only those, for the rest of the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

_ORBAX_CODE = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"


def quiet_failed_reads() -> None:
    """Install the filters (once): a sys.unraisablehook in front of the one there before, which gets every other
    unraisable exception, and a filter on asyncio's logger."""
    prev = sys.unraisablehook
    if not getattr(prev, "_drops_failed_reads", False):
        def hook(unraisable):
            exc = unraisable.exc_value
            if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
                return
            code = getattr(getattr(unraisable, "object", None), "cr_code", None)  # a coroutine's
            if code is not None and _ORBAX_CODE in code.co_filename:
                return
            prev(unraisable)

        hook._drops_failed_reads = True
        sys.unraisablehook = hook
    logger = logging.getLogger("asyncio")
    if _keep_unless_orphaned_read not in logger.filters:
        logger.addFilter(_keep_unless_orphaned_read)


def _keep_unless_orphaned_read(record: logging.LogRecord) -> bool:
    """False for asyncio's report of a tensorstore read whose error nobody retrieved."""
    text = record.getMessage()
    return not (text.startswith(("Future exception was never retrieved", "Task exception was never retrieved"))
                and "tensorstore" in text)


def drop_orbax_errors(record: logging.LogRecord) -> bool:
    """False for Orbax's error records (a Checkpointer that writes raises its failures itself)."""
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


@contextlib.contextmanager
def absl_quiet(prefix: str):
    """Drop absl log records starting with `prefix` while the block runs."""
    def drop(record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(prefix)

    logger = logging.getLogger("absl")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)

