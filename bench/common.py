"""What every benchmark shares: the device description, timing of jitted calls, compiled memory, and the JSON lines
each measurement is written as (one line per measurement, to stdout and to `--out FILE.jsonl` when given)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import jax
import numpy as np

import bench

GIB = 2 ** 30


def device_name() -> str:
    """'N x <kind>' of the visible devices, e.g. '1 x NVIDIA H200'."""
    devs = jax.devices()
    return f"{len(devs)} x {devs[0].device_kind}"


def user_env() -> dict[str, str]:
    """This process's environment with JAX's own allocator default where `bench` set its own: for a child process
    that should allocate as a user's run of train.py does (set, not removed, so that a child importing `bench` keeps
    it)."""
    env = dict(os.environ)
    if bench.PREALLOCATE_DEFAULTED:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    return env


def today() -> str:
    return datetime.date.today().isoformat()


def time_jax(fn, arg_sets, reps: int = 20, inner: int = 3, budget_s: float = 10.0,
             batch_ms: float | None = None) -> float:
    """Median ms per call over `reps` batches of `inner` back-to-back calls, rotating input sets.

    Every input set runs once first (compile and warm-up). block_until_ready closes each batch rather than each call,
    so the figure is the device's time with the host's launch gaps amortised over `inner` calls. A slow function (one
    warm call x reps x inner over `budget_s`) gets fewer batches (at least 3) of one call each, so a sweep over large
    shapes still ends in reasonable time.

    batch_ms: more calls per batch, each batch at least this long: the device's time per call in a stream of calls,
    as a kernel runs inside a jitted step. Batches of 3 leave ~0.1 ms per call of the host's dispatch of a batch's
    first call in a call of a few kernels (none measurable in a 10 ms one).
    """
    for a in arg_sets:
        jax.block_until_ready(fn(*a))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    one = time.perf_counter() - t0
    if batch_ms is not None:
        inner = max(inner, int(np.ceil(batch_ms / 1e3 / max(one, 1e-6))))
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


def time_calls(fn, arg_sets, repeats: int) -> float:
    """Median ms of one call, each closed by block_until_ready, over `repeats` calls after one warm-up call per input
    set: for calls that hold many rounds of work inside (unrolled collectives), where launch gaps do not matter."""
    for a in arg_sets:
        jax.block_until_ready(fn(*a))
    ts = []
    for r in range(repeats):
        a = arg_sets[r % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def dispatch_ms(fn, arg_sets, reps: int = 20) -> float:
    """Median host time (ms) for one call to return with the device idle before it: the host's cost of enqueuing the
    call's launches. The device waits for it wherever it catches up with the host, e.g. a timed batch's first call."""
    jax.block_until_ready(fn(*arg_sets[0]))
    ts = []
    for r in range(reps):
        a = arg_sets[r % len(arg_sets)]
        t0 = time.perf_counter()
        out = fn(*a)
        ts.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(out)
    return float(np.median(ts))


def memory_gib(analysis) -> float | None:
    """A compiled executable's `memory_analysis()` -> GiB per device: arguments + outputs + temporaries - donated
    aliases. Shapes are static, so this is the call's peak (None when the backend reports nothing)."""
    if analysis is None:
        return None
    a = analysis
    return (a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes - a.alias_size_in_bytes) / GIB


def compiled_gib(jitted, *args) -> float | None:
    """`memory_gib` of `jitted` compiled for `args`."""
    return memory_gib(jitted.lower(*args).compile().memory_analysis())


class JsonLines:
    """Writes each record as one JSON line to stdout and, when a path is given, appends it to that file (flushed at
    once, so a run cut short by a time limit keeps what it measured)."""

    def __init__(self, path: str | None = None):
        self.file = open(path, "a") if path else None

    def __call__(self, rec: dict) -> dict:
        line = json.dumps(rec)
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()
        return rec

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser showing the bench's docstring in --help, with --out FILE.jsonl."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, metavar="FILE.jsonl", help="also append the JSON lines to this file")
    return ap


def error_text(e: BaseException, limit: int = 300) -> str:
    """A failed measurement's record field: the exception's type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:limit]}"


def routing_summary(metrics: dict) -> dict | None:
    """A step's routing per MoE layer, from its `loads/<layer>` metrics ((heads, Ne) or (Ne,) routed slots summed
    over the step's micro-batches): the largest group over the mean, the groups without a slot, and the least
    over the heads of the 4 busiest experts' share of a head's slots. None without MoE layers."""
    out = {}
    for key, value in metrics.items():
        if key.startswith("loads/"):
            loads = np.asarray(value, np.float64)
            loads = loads.reshape(-1, loads.shape[-1])
            top4 = np.sort(loads, axis=1)[:, -4:].sum(1) / np.maximum(loads.sum(1), 1.0)
            out[key.split("/", 1)[1]] = dict(max_over_mean=round(float(loads.max() / max(loads.mean(), 1e-12)), 2),
                                             empty_groups=int((loads == 0).sum()), groups=int(loads.size),
                                             top4_share_min=round(float(top4.min()), 4))
    return out or None
