"""When does the host see a step's metrics, with the next step already dispatched? (train loop's fetch-ahead)

A jitted "step" (a chain of bf16 matmuls, ~T ms on the device, state donated) returns (state, metrics). The probe
dispatches step 1 and step 2 back to back, then fetches step 1's metrics in one of several ways and records when
the host got them, relative to the dispatch of step 1, in units of T (a lone step's time, measured first):
  device_get          jax.device_get(m1)
  ready_then_get      jax.block_until_ready(m1), then device_get
  copy_async          m1's copy_to_host_async() called right after step 1's dispatch, before step 2's
A fetch that returns at ~1 T sees step 1's end; ~2 T means it waited for step 2 as well.
JSON lines out (bench, impl, device, date, t_fetch_in_T, ...).
"""
import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    def body(_, x):
        return jnp.tanh(x @ x) * 0.5

    def step(x):
        x = jax.lax.fori_loop(0, a.iters, body, x)
        return x, {"sum": jnp.sum(x, dtype=jnp.float32), "max": jnp.max(x).astype(jnp.float32)}

    step = jax.jit(step, donate_argnums=0)
    x = jax.random.normal(jax.random.key(0), (a.n, a.n), jnp.bfloat16) * 0.01
    x, m = step(x)
    jax.block_until_ready((x, m))
    t0 = time.perf_counter()
    for _ in range(3):
        x, m = step(x)
        jax.block_until_ready((x, m))
    lone = (time.perf_counter() - t0) / 3
    dev = jax.devices()[0]
    rows = []
    for r in range(a.rounds):
        for impl in ("device_get", "ready_then_get", "copy_async"):
            jax.block_until_ready(x)
            t0 = time.perf_counter()
            x, m1 = step(x)
            if impl == "copy_async":
                for v in m1.values():
                    v.copy_to_host_async()
            x, m2 = step(x)
            t_disp = time.perf_counter() - t0
            if impl == "ready_then_get":
                jax.block_until_ready(m1)
                t_ready = time.perf_counter() - t0
            else:
                t_ready = None
            jax.device_get(m1)
            t1 = time.perf_counter() - t0
            jax.device_get(m2)
            t2 = time.perf_counter() - t0
            row = {"bench": "fetch_probe", "impl": impl, "round": r, "device": dev.device_kind,
                   "date": datetime.date.today().isoformat(), "jax": jax.__version__, "lone_step_ms": lone * 1e3,
                   "dispatch_in_T": t_disp / lone, "ready_in_T": None if t_ready is None else t_ready / lone,
                   "t_fetch1_in_T": t1 / lone, "t_fetch2_in_T": t2 / lone}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
