"""JAX profiler traces read back: GPU 0's kernel lines, the events of a plane by the HLO op they ran (`op_events`,
read by `bench.step_profile`), and a jitted call's device time split into communication and
compute (`python -m bench.train_scale --profile`, `python -m bench.tools.profile_layer`).

    split = device_time_split(fn, *args, calls=2)
    # {"devices": 4, "wall_ms": ..., "comm_ms": ..., "compute_ms": ..., "busy_ms": ..., "per_device": [...]}

One trace of `calls` calls (after the caller has compiled and warmed `fn`), read back with
`jax.profiler.ProfileData`. On each GPU plane, the kernels of the "XLA Ops" line (else of the stream
lines) are classed as communication when their name is a collective's (all-to-all, ragged-all-to-all, all-reduce,
all-gather, reduce-scatter, collective-permute, send / recv, nccl) and as compute otherwise; the sums are
divided by `calls`; `top_ops_ms`: the first GPU's `top_ops` XLA ops with the most time (name, ms per
call). Collectives run on their own streams and may overlap compute, so comm + compute can
exceed the busy time (`busy_ms` = the union of both, per device); a collective's time also includes
waiting for the slowest peer. The figures are medians over devices. Without GPU planes (CPU) the
result says so and holds no split.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from jax.profiler import ProfileData

DERIVED_LINES = ("XLA Ops", "XLA Modules", "Framework", "Steps", "Source", "TensorFlow", "Launch Stats")
COMM_MARKERS = ("all-to-all", "all_to_all", "alltoall", "all-reduce", "allreduce", "all-gather", "allgather",
                "reduce-scatter", "reducescatter", "collective-permute", "send", "recv", "nccl")


def is_comm(name: str) -> bool:
    n = name.lower()
    return any(m in n for m in COMM_MARKERS)


def gpu0_lines(trace_dir: str) -> tuple[int, list[tuple[str, list[tuple[int, int, str]]]]]:
    """A JAX profiler trace folder -> (the number of .xplane.pb files, GPU 0's lines as (line name, [(start ns,
    duration ns, event name)])), from the first file; no lines without a file or a GPU plane."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    lines = []
    for plane in ProfileData.from_file(files[0]).planes if files else []:
        if plane.name.startswith("/device:GPU:0"):
            lines += [(line.name, [(int(ev.start_ns), int(ev.duration_ns), ev.name) for ev in line.events])
                      for line in plane.lines]
    return len(files), lines


def op_events(trace_dir: str, plane: str = "/device:GPU:0") -> tuple[str, list[tuple[int, int, str, str]]]:
    """The events of the first plane named `plane...` that name the HLO op they ran -> (where the names came from,
    [(start ns, duration ns, HLO op, HLO module or "")]). A GPU kernel's and a CPU thunk's events carry the op in an
    `hlo_op` stat (and the program in `hlo_module`): those of the plane's own lines ("kernel stats"). Without such
    stats, the events of the "XLA Ops" line, named by their op ("XLA Ops line"); ("none", []) without either."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    planes = [p for p in (ProfileData.from_file(files[0]).planes if files else []) if p.name.startswith(plane)]
    if not planes:
        return "none", []
    events, named = [], []
    for line in planes[0].lines:
        for ev in line.events:
            span = (int(ev.start_ns), int(ev.duration_ns))
            if line.name == "XLA Ops":
                named.append((*span, ev.name, ""))
            elif not line.name.startswith(DERIVED_LINES):
                stats = dict(s for s in ev.stats if s[0] is not None)
                if "hlo_op" in stats:
                    events.append((*span, str(stats["hlo_op"]), str(stats.get("hlo_module", ""))))
    if events:
        return "kernel stats", events
    return ("XLA Ops line", named) if named else ("none", [])


def traced_calls(fn, calls: int, read):
    """`calls` back-to-back calls of the warmed fn() inside one JAX profiler trace -> (read(trace directory), wall ms
    per call). The directory is deleted afterwards."""
    tmp = tempfile.mkdtemp(prefix="mhl_prof_")
    try:
        jax.profiler.start_trace(tmp)
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t0) * 1e3 / calls
        jax.profiler.stop_trace()
        return read(tmp), wall
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def traced_op_events(fn, calls: int, plane: str = "/device:GPU:0") -> tuple[str, list[tuple[int, int, str, str]]]:
    """`calls` back-to-back calls of the warmed fn() inside one JAX profiler trace -> `op_events` of the trace."""
    return traced_calls(fn, calls, lambda tmp: op_events(tmp, plane))[0]


def union_ms(intervals: list[tuple[int, int]]) -> float:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e6


def device_time_split(fn, *args, calls: int = 2, top_ops: int = 40) -> dict:
    """The split described above, of `calls` calls of the warmed fn(*args)."""
    jax.block_until_ready(fn(*args))
    split, wall = traced_calls(lambda: fn(*args), calls, lambda tmp: _split(tmp, calls, top_ops))
    return {"wall_ms": wall, **split}


def _split(trace_dir: str, calls: int, top_ops: int) -> dict:
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {"split": "no profile written"}
    per_device, by_op = [], {}
    planes = list(ProfileData.from_file(files[0]).planes)
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        comm, comp, spans = 0, 0, []
        lines = list(plane.lines)
        # XLA's per-op line where the trace has one, else the streams' kernel lines (a long step's trace may come
        # without the derived lines, as a 2.2B train step's did on an H100)
        ops = [line for line in lines if line.name == "XLA Ops"] or [
            line for line in lines if not line.name.startswith(DERIVED_LINES)]
        for line in ops:
            for ev in line.events:
                start, dur = int(ev.start_ns), int(ev.duration_ns)
                spans.append((start, start + dur))
                if not per_device:  # the first GPU's ops by name
                    by_op[ev.name] = by_op.get(ev.name, 0) + dur
                if is_comm(ev.name):
                    comm += dur
                else:
                    comp += dur
        if spans:
            per_device.append({"device": plane.name, "comm_ms": comm / 1e6 / calls,
                               "compute_ms": comp / 1e6 / calls, "busy_ms": union_ms(spans) / calls})
    if not per_device:
        return {"split": "no GPU planes in the profile", "files": len(files),
                "planes": [(p.name, [line.name for line in p.lines][:8]) for p in planes][:12]}
    med = lambda key: float(np.median([d[key] for d in per_device]))  # noqa: E731
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:top_ops]
    return {"devices": len(per_device), "comm_ms": med("comm_ms"), "compute_ms": med("compute_ms"),
            "busy_ms": med("busy_ms"), "per_device": per_device,
            "top_ops_ms": [(name, round(d / 1e6 / calls, 3)) for name, d in top]}
