"""Host-side timing of jitted JAX callables, shared by the bench scripts (device METHOD.md)."""

from __future__ import annotations

import json
import time

import jax
import numpy as np


def time_jax(fn, arg_sets, reps: int = 20, inner: int = 3, budget_s: float = 10.0) -> float:
    """Median ms per call over `reps` batches of `inner` back-to-back calls, rotating input sets.

    Every input set is run once first (compile, warm-up); block_until_ready closes each batch, so
    the time is the device's, launch gaps amortised over `inner` calls. A slow function (one warm call
    times reps x inner over `budget_s`) gets fewer batches (at least 3) of one call each.
    """
    for a in arg_sets:
        jax.block_until_ready(fn(*a))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    one = time.perf_counter() - t0
    if one * reps * inner > budget_s:
        reps, inner = max(3, min(reps, int(budget_s / max(one, 1e-9)))), 1
    ts = []
    for r in range(reps):
        t0 = time.perf_counter()
        for i in range(inner):
            out = fn(*arg_sets[(r * inner + i) % len(arg_sets)])
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / inner * 1e3)
    return float(np.median(ts))


def dispatch_ms(fn, arg_sets, reps: int = 20) -> float:
    """Median host time (ms) for one call of `fn` to return, with the device idle before it (each call is waited for
    after the clock stops): the host's cost of enqueuing the call's launches, which the device waits for wherever it
    catches up with the host (a timed batch's first call)."""
    jax.block_until_ready(fn(*arg_sets[0]))
    ts = []
    for r in range(reps):
        a = arg_sets[r % len(arg_sets)]
        t0 = time.perf_counter()
        out = fn(*a)
        ts.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(out)
    return float(np.median(ts))


def emit(rec: dict, outf=None) -> None:
    """Print one JSON line and append it to the open results file `outf` (if any), flushed at once."""
    line = json.dumps(rec)
    print(line, flush=True)
    if outf is not None:
        outf.write(line + "\n")
        outf.flush()
