"""The train loop's step period with and without fetch-ahead (mhl_jax/train/loop.py, FETCH_AHEAD).

    python bench/loop_overlap.py [--config FILE ...] [--steps 60] [--rounds 2] [--set key=value ...] [--out FILE]
                                 [--trace] [--host-split]

With fetch-ahead the loop dispatches step n + 1 before it fetches step n's metrics, so the device runs step n + 1
while the host waits for, checks and logs step n and loads the next batch. Without it (the loop before session 34),
the device idles between steps for the host's fetch, logging, batch load and dispatch. Both run here in one process
through `train()` itself (the real loop, loader and logging), alternating off / on `--rounds` times per config, with
evaluation and checkpoints off (those steps are finished before the next is dispatched either way).

Per run, one JSON line: the median step period (wall time between consecutive metric fetches, the loop's own
tokens_per_s) over the steps after the first 5, tokens/s, and the run's losses; the last line per config says
whether the two settings' losses are bitwise equal (they must be: the loop changes when the host waits, not what
the device computes). Default configs: the built-in tiny MH-LatentMoE (`make train`'s) and the same at d 512 with
bf16 compute, both small enough that the host's share of a step shows.

--trace adds a round per setting under the JAX profiler (the device's busy and idle time per step, `step_windows`),
--host-split one with the host's time per call of the loop's parts (`HostClock`); their lines carry `traced`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import emit  # noqa: E402
from mhl_jax.config import load_config  # noqa: E402
from mhl_jax.train import loop  # noqa: E402

DEFAULT_RUNS = [
    ("tiny", "configs/tiny_mh_latent_moe.yaml", []),
    ("small_bf16", "configs/tiny_mh_latent_moe.yaml",
     ["model.d_model=512", "ffn.latent_dim=512", "ffn.num_heads=4", "ffn.head_dim=128", "model.n_layers=6",
      "model.context=512", "train.global_batch=16", "train.micro_batch=16", "model.compute_dtype=bfloat16"]),
]


def step_windows(trace_dir: str, steps: int, skip: int = 5) -> dict:
    """From a JAX profiler trace of a run, GPU 0's lines: each step uploads its batch once (a MemcpyH2D; the last
    `steps` uploads, after the state's), so from the upload of step skip + 1 on (the compile, XLA's autotuning and
    the first steps left out) to the last kernel, the device's busy time per step (union of the intervals of every
    kernel and copy) and the wall time per step (`windows`); their difference is the device's idle time per step.
    On failure, what the trace held."""
    from bench.profile_split import DERIVED_LINES, gpu0_lines

    files, lines = gpu0_lines(trace_dir)
    uploads, work, seen = [], [], {}
    for name, evs in lines:
        seen[name] = len(evs)
        if name.startswith(DERIVED_LINES):
            continue
        evs = [(a, a + d, ev) for a, d, ev in evs]
        work += evs
        uploads += [e for e in evs if e[2].startswith("MemcpyH2D")]
    if len(set(uploads)) < steps or steps < skip + 3:
        return {"trace_error": f"{len(uploads)} uploads on GPU 0 for {steps} steps in {files} files; "
                               f"lines: {seen}"}
    return windows(uploads, work, steps, skip)


def windows(uploads: list[tuple], work: list[tuple], steps: int, skip: int) -> dict:
    """Events (start ns, end ns, name): the last `steps` uploads are the steps' batches; from the upload of step
    skip + 1 to the end of the last event, the busy time (union of the events' intervals) and wall time per step."""
    from bench.profile_split import _union_ms

    n = steps - skip
    t0 = sorted(set(uploads))[-n][0]
    inside = [(a, b) for a, b, _ in work if a >= t0]
    wall = (max(b for _, b in inside) - t0) / 1e6
    busy = _union_ms(inside)
    return {"traced_steps": n, "device_busy_ms_per_step": busy / n, "wall_ms_per_step": wall / n,
            "device_idle_ms_per_step": (wall - busy) / n}


class HostClock:
    """Host time per call of the loop's parts, by wrapping what `loop.train` calls: the jitted step (`jit_train_step`'s
    result: the time for a call to return, i.e. the host's enqueue of the step), the metrics' fetch (`jax.device_get`:
    waiting for the step and copying) and the loader's `next`. Installed for one run (`with HostClock() as clock`)."""

    def __init__(self):
        self.ms = {"dispatch": [], "fetch": [], "next_batch": []}

    def _timed(self, name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.ms[name].append(1e3 * (time.perf_counter() - t0))
            return out
        if hasattr(fn, "lower"):  # the jitted step: the loop compiles it ahead for its memory check
            call.lower = fn.lower
        return call

    def __enter__(self):
        clock = self
        self._saved = (loop.jit_train_step, loop.make_train_loader, loop.jax.device_get)

        def jit_step(*a, **k):
            return clock._timed("dispatch", self._saved[0](*a, **k))

        class Loader:  # the loader's iterator with its `next` timed (no checkpoints here: nothing else is used)
            def __init__(self, it):
                self.it = it

            def __next__(self):
                return clock._timed("next_batch", next)(self.it)

        loop.jit_train_step = jit_step
        loop.make_train_loader = lambda *a, **k: Loader(self._saved[1](*a, **k))
        jax.device_get = self._timed("fetch", self._saved[2])
        return self

    def __exit__(self, *exc):
        loop.jit_train_step, loop.make_train_loader, jax.device_get = self._saved

    def medians(self, skip: int) -> dict:
        return {f"host_{k}_ms": float(np.median(v[skip:])) for k, v in self.ms.items() if len(v) > skip}


def run_once(config: str, overrides: list[str], steps: int, ahead: bool, run_dir: Path, trace: bool = False,
             host_split: bool = False) -> dict:
    """One train() run; with `trace`, under the JAX profiler, and the step's device windows added (step_windows); with
    `host_split`, the host's time per call of the loop's parts (HostClock)."""
    loop.FETCH_AHEAD = ahead
    cfg = load_config(config, [f"schedule.total_steps={steps}", "schedule.warmup_steps=2", "schedule.decay_steps=2",
                               "data.val_sequences=0", "checkpoint.every=0", "logging.progress_bar=false",
                               f"logging.log_every={steps}", f"logging.run_dir={run_dir}", *overrides])
    if trace:
        jax.profiler.start_trace(str(run_dir / "trace"))
    clock = HostClock() if host_split else contextlib.nullcontext()
    try:
        with clock:
            hist = loop.train(cfg, log=lambda *a: None)
    finally:
        if trace:
            jax.profiler.stop_trace()
    tps = [m["tokens_per_s"] for m in hist[5:]]
    tokens = cfg.train.global_batch * cfg.model.context
    res = {"fetch_ahead": ahead, "step_ms": 1e3 * tokens / float(np.median(tps)), "tokens_per_s": float(np.median(tps)),
           "losses": [m["loss"] for m in hist]}
    if trace:
        res["trace"] = step_windows(str(run_dir / "trace"), steps)
    if host_split:
        res["trace"] = {**res.get("trace", {}), **clock.medians(5)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=None, help="a config file (default: the two runs above)")
    ap.add_argument("--set", action="append", default=[], help="override for every run")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--host-split", action="store_true", help="one more round per setting with the host's time per "
                    "call of the loop's parts (dispatch, metrics fetch, next batch) recorded")
    ap.add_argument("--trace", action="store_true", help="one more round per setting under the JAX profiler: the "
                    "step's device span and busy time and the idle time between steps (GPU)")
    args = ap.parse_args()
    if args.steps <= 5:
        ap.error(f"--steps {args.steps}: the median is over the steps after the first 5, so at least 6")
    if args.trace and any(x.startswith("logging.profile_start=") for x in args.set):
        ap.error("--trace runs the profiler itself: leave logging.profile_start out")
    runs = ([(Path(c).stem, c, []) for c in args.config] if args.config else DEFAULT_RUNS)
    out = open(args.out, "a") if args.out else None
    device, date = jax.devices()[0].device_kind, datetime.date.today().isoformat()
    rows = []
    for name, config, overrides in runs:
        results = {False: [], True: []}
        with tempfile.TemporaryDirectory() as tmp:
            extra = [kind for kind, on in (("trace", args.trace), ("host_split", args.host_split)) if on]
            for r in range(args.rounds + len(extra)):
                kind = extra[r - args.rounds] if r >= args.rounds else None
                traced = kind is not None
                for ahead in (False, True):
                    res = run_once(config, overrides + args.set, args.steps, ahead, Path(tmp) / f"{r}_{ahead}",
                                   kind == "trace", kind == "host_split")
                    if not traced:
                        results[ahead].append(res)
                    rec = {"bench": "loop_overlap", "impl": "fetch_ahead" if ahead else "fetch_first",
                           "device": device, "date": date,
                           "params": {"run": name, "config": config, "overrides": overrides + args.set,
                                      "steps": args.steps, "round": r, "traced": kind},
                           "ms": res["step_ms"], "tokens_per_s": res["tokens_per_s"], "loss_last": res["losses"][-1],
                           **res.get("trace", {})}
                    emit(rec, out)
        same = all(a["losses"] == results[False][0]["losses"] for a in results[False] + results[True])
        summary = {"bench": "loop_overlap", "impl": "summary", "device": device, "date": date,
                   "params": {"run": name}, "losses_bitwise_equal": same,
                   "ms_fetch_first": [round(a["step_ms"], 3) for a in results[False]],
                   "ms_fetch_ahead": [round(a["step_ms"], 3) for a in results[True]]}
        emit(summary, out)
        rows.append(summary)
    print(f"{'run':<12} {'fetch first ms':>24} {'fetch ahead ms':>24} bitwise")
    for s in rows:
        print(f"{s['params']['run']:<12} {str(s['ms_fetch_first']):>24} {str(s['ms_fetch_ahead']):>24} "
              f"{s['losses_bitwise_equal']}")
    if out:
        out.close()
    if not all(s["losses_bitwise_equal"] for s in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
