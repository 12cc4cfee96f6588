"""Paper Figure 3 on however many GPUs are present: HP vs EP dispatch + combine, time and memory.

    python bench/a2a.py [--tokens 81920] [--d 1024] [--heads 8] [--ks 1 2 4 8] [--skews 0 1 2]
                        [--ep-impls ragged padded] [--repeats 20] [--unroll 8] [--ragged-unroll 1]
                        [--out FILE]
                        [--train-check] [--hp-layer] [--date YYYY-MM-DD]

Per device: `tokens` tokens of width d, bf16 (81920 x 1024 by default, as in DESIGN §7's anchors).
- HP: the sub-tokens head-group-major, (P, n, Nh/P, dh) per device as the model's W_in emits them
  under Head Parallel, -> contiguous all_to_all -> reverse all_to_all (the exchange of
  `mhl_jax/parallel/head_parallel.py`; the same bytes a plain NCCL all_to_all_single moves).
  Independent of k and of the routing by construction; it is still measured once per (k, skew) cell
  on fresh inputs, to show it flat. `hp_token_major`: from the token-major (n, Nh, dh) layout, split
  on heads (XLA transposes each destination's heads into a block first, and back after).
- EP: the k-duplicated send buffer (n * k, d), rows sorted by destination; destinations drawn per
  slot from a Zipf law over devices, P(p) ~ 1 / (p + 1)^skew (device 0 receives most, as in the
  anchors). Timed: count metadata all_gather + dispatch + combine of `expert_parallel.py`
  (`ragged`: lax.ragged_all_to_all; `padded`: all_to_all of static worst-case buffers, which sends
  the whole buffer whatever the counts: measured at skew 0 only).
Timing: `unroll` round trips inside one jit (optimization barriers keep them apart and keep the count
exchange inside), median over `repeats` calls after warm-up, divided by `unroll`: device time per
dispatch + combine with launch overhead amortised. `ms_single`: one round trip per call, host-timed.
ragged EP: `ragged_unroll` (1) round trip per call (XLA keeps each round's collective buffers apart).
Memory: XLA's buffer assignment of the compiled exchange per device (arguments + outputs +
temporaries; shapes are static, so this is the peak). EP's receive buffer is the static worst case
(P * n * k rows); `recv_rows_used_max` is what the skew actually filled on the busiest device.
Every timed exchange is checked to return its input bit for bit.
--hp-layer also times the exchange inside the layer (W_in and W_out included, forward and fwd+bwd)
in the model's token-major layout and in the head-group-major layout the model uses under HP.
--train-check also runs bench/train_2gpu.py (1 vs 2 device training losses) and an EP layer check
(ragged vs padded vs one device, values and gradients). Any failed stage makes the exit status 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench import timing  # noqa: E402
from mhl_jax.model.moe import grouped_project_in, grouped_project_out  # noqa: E402
from mhl_jax.parallel import traffic  # noqa: E402
from mhl_jax.parallel.expert_parallel import combine, dispatch, make_plan  # noqa: E402
from mhl_jax.parallel.head_parallel import (  # noqa: E402
    grouped_to_local_heads,
    grouped_to_local_tokens,
    to_local_heads,
    to_local_tokens,
)

GIB = 2.0 ** 30


def zipf_counts(tokens: int, k: int, peers: int, skew: float, seed: int) -> np.ndarray:
    """(P, P) int: rows each device sends each destination; per slot P(p) ~ 1 / (p + 1)^skew."""
    prob = 1.0 / np.arange(1, peers + 1, dtype=np.float64) ** skew
    prob /= prob.sum()
    rng = np.random.default_rng(seed)
    return np.stack([rng.multinomial(tokens * k, prob) for _ in range(peers)]).astype(np.int32)


def memory_gib(compiled) -> float:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return total / GIB


def time_calls(fn, args_list: list, repeats: int) -> float:
    """Median ms of one call over `repeats` calls (after one warm-up call per input set)."""
    for a in args_list:
        jax.block_until_ready(fn(*a))
    ts = []
    for r in range(repeats):
        a = args_list[r % len(args_list)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def hp_exchange(mesh: Mesh, unroll: int, contiguous: bool = False):
    """jit of `unroll` HP round trips on x (P * n, Nh, dh) split over 'hp' (the model's layout:
    token-major, so XLA moves each destination's heads into a contiguous block first).

    contiguous: x (P * P, Nh / P, n, dh) split over 'hp' on dim 0, already grouped by destination
    head block (head-major, as W_in could emit it): the pure exchange, as NCCL's all_to_all_single."""

    def body(x):
        for _ in range(unroll):
            if contiguous:
                y = lax.optimization_barrier(lax.all_to_all(x, "hp", 0, 0, tiled=True))
                x = lax.all_to_all(y, "hp", 0, 0, tiled=True)
            else:
                y = lax.optimization_barrier(to_local_heads(x))
                x = to_local_tokens(y)
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("hp"), out_specs=P("hp"), check_vma=False))


def ep_exchange(mesh: Mesh, cap: int, impl: str, unroll: int):
    """jit of `unroll` EP round trips: x (P * n * k, d) split over 'ep', counts (P, P) split by row."""

    def body(x, cnt):
        me = lax.axis_index("ep")
        for _ in range(unroll):
            x, cnt = lax.optimization_barrier((x, cnt))  # the count exchange stays in every round
            plan = make_plan(lax.all_gather(cnt[0], "ep"), me)
            recv = lax.optimization_barrier(dispatch(x, plan, cap, impl))
            x = combine(recv, plan, cap, x.shape[0], impl)
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"),
                                 check_vma=False))


def random_rows(mesh: Mesh, axis: str, shape: tuple[int, ...], seed: int) -> jax.Array:
    """Fresh N(0, 1) bf16 rows, generated already split over `axis` (never zeros)."""
    spec = P(axis)
    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16),
                   out_shardings=NamedSharding(mesh, spec))(jax.random.key(seed))


def check_identity(fn, args, name: str) -> None:
    out = fn(*args)
    if not bool(jnp.array_equal(out, args[0])):
        raise AssertionError(f"{name}: the round trip did not return its input")


def bench(args, device: str, date: str, emit) -> list[dict]:
    devs = jax.devices()
    peers = len(devs)
    n, d, heads = args.tokens, args.d, args.heads
    if d % heads or heads % peers:
        raise ValueError(f"--d={d} must be divisible by --heads={heads}, and heads by the {peers} devices")
    recs = []
    hp_mesh = Mesh(np.asarray(devs), ("hp",))
    ep_mesh = Mesh(np.asarray(devs), ("ep",))
    sent_hp = traffic.hp_bytes(n, heads, d // heads, peers, 2)
    seed = 1
    for impl, contiguous, shape in (("hp", True, (peers * peers, heads // peers, n, d // heads)),
                                    ("hp_token_major", False, (peers * n, heads, d // heads))):
        hp_fn, hp_one = hp_exchange(hp_mesh, args.unroll, contiguous), hp_exchange(hp_mesh, 1, contiguous)
        x0 = random_rows(hp_mesh, "hp", shape, 0)
        hp_mem = memory_gib(hp_one.lower(x0).compile())
        check_identity(hp_fn, (x0,), impl)
        ms_single = time_calls(hp_one, [(x0,)], args.repeats)
        del x0
        for k in args.ks:
            for skew in args.skews:
                x = random_rows(hp_mesh, "hp", shape, seed)
                seed += 1
                ms = time_calls(hp_fn, [(x,)], args.repeats) / args.unroll
                rec = {"bench": "a2a", "impl": impl, "device": device, "date": date,
                       "params": {"devices": peers, "tokens": n, "d": d, "heads": heads, "k": k, "skew": skew,
                                  "dtype": "bfloat16", "unroll": args.unroll},
                       "ms": ms, "ms_single": ms_single, "peak_gib": hp_mem, "recv_rows_used_max": n,
                       "recv_rows_alloc": n, "sent_bytes_per_device": sent_hp,
                       "gbps": 2 * sent_hp / (ms * 1e6)}
                emit(rec)
                recs.append(rec)
                del x
    for impl in args.ep_impls:
        if impl == "ragged" and jax.default_backend() != "gpu":
            emit({"bench": "a2a", "impl": "ep_ragged", "skipped": "ragged_all_to_all is not supported on "
                  f"{jax.default_backend()}"})
            continue
        # XLA allocates each ragged_all_to_all's buffers in collective memory, not reused across
        # unrolled rounds (8 rounds at k=8 asked for 30 GiB): time ragged one round per call
        unroll = args.ragged_unroll if impl == "ragged" else args.unroll
        for k in args.ks:
            cap = n * k  # worst case from one sender (k distinct experts all on one device)
            fn = ep_exchange(ep_mesh, cap, impl, unroll)
            compiled_mem = None
            for skew in (args.skews if impl == "ragged" else args.skews[:1]):
                counts = zipf_counts(n, k, peers, skew, seed=100 * k + int(10 * skew))
                x = random_rows(ep_mesh, "ep", (peers * n * k, d), seed)
                seed += 1
                cnt = jax.device_put(jnp.asarray(counts), NamedSharding(ep_mesh, P("ep")))
                if compiled_mem is None:
                    compiled_mem = memory_gib(fn.lower(x, cnt).compile())
                check_identity(fn, (x, cnt), f"ep_{impl} k={k} skew={skew}")
                ms = time_calls(fn, [(x, cnt)], args.repeats) / unroll
                sent = max(traffic.ep_bytes_from_counts(counts[p], p, d, 2) for p in range(peers))
                rec = {"bench": "a2a", "impl": f"ep_{impl}", "device": device, "date": date,
                       "params": {"devices": peers, "tokens": n, "d": d, "k": k, "skew": skew,
                                  "dtype": "bfloat16", "unroll": unroll},
                       "ms": ms, "peak_gib": compiled_mem,
                       "recv_rows_used_max": int(counts.sum(axis=0).max()), "recv_rows_alloc": peers * cap,
                       "sent_bytes_per_device": sent if impl == "ragged" else (peers - 1) * cap * d * 2,
                       "gbps": 2 * (sent if impl == "ragged" else (peers - 1) * cap * d * 2) / (ms * 1e6)}
                emit(rec)
                recs.append(rec)
                del x, cnt
    return recs


def hp_layer_fn(mesh: Mesh, layout: str, exchange: bool, unroll: int, backward: bool):
    """jit of `unroll` HP layers without experts, per device: x (n, d) -> W_in -> [exchange there and
    back] -> W_out -> (n, d), in the model's two layouts: `token` (sub-tokens (n, Nh, dh), split on
    heads) or `grouped` (W_in emits (P, n, Nh/P, dh), what the model does under HP). Without the
    exchange it is the projections alone, so layer - projections = what the exchange costs in the
    layer, layout changes included. backward: value and gradient of sum(out * cos(x)) instead."""
    peers = mesh.shape["hp"]

    def one(x, w_in, w_out):
        if layout == "token":
            sub = jnp.einsum("nd,dhc->nhc", x, w_in)
            if exchange:
                sub = to_local_tokens(lax.optimization_barrier(to_local_heads(sub)))
            return jnp.einsum("nhc,hcd->nd", sub, w_out)
        sub = grouped_project_in(x, w_in, peers)
        if exchange:
            sub = grouped_to_local_tokens(lax.optimization_barrier(grouped_to_local_heads(sub)))
        return grouped_project_out(sub, w_out)

    def body(x, w_in, w_out):
        for _ in range(unroll):
            if backward:
                out, grads = jax.value_and_grad(lambda a, b, c: jnp.sum(one(a, b, c).astype(jnp.float32)
                                                                       * jnp.cos(a.astype(jnp.float32))),
                                                argnums=(0, 1, 2))(x, w_in, w_out)
                x = lax.optimization_barrier(grads[0] + x)
            else:
                x = lax.optimization_barrier(one(x, w_in, w_out))
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("hp"), P(), P()), out_specs=P("hp"),
                                 check_vma=False))


def bench_hp_layer(args, device: str, date: str, emit) -> None:
    """In-layer cost of the HP exchange in both layouts (see `hp_layer_fn`), forward and fwd+bwd."""
    devs = jax.devices()
    peers = len(devs)
    mesh = Mesh(np.asarray(devs), ("hp",))
    n, d, heads = args.tokens, args.d, args.heads
    x = random_rows(mesh, "hp", (peers * n, d), 11)
    w_in = (0.02 * jax.random.normal(jax.random.key(1), (d, heads, d // heads))).astype(jnp.bfloat16)
    w_out = (0.02 * jax.random.normal(jax.random.key(2), (heads, d // heads, d))).astype(jnp.bfloat16)
    for backward in (False, True):
        for layout in ("token", "grouped"):
            ms = {}
            for exchange in (False, True):
                fn = hp_layer_fn(mesh, layout, exchange, args.unroll, backward)
                ms[exchange] = time_calls(fn, [(x, w_in, w_out)], args.repeats) / args.unroll
            emit({"bench": "a2a_hp_layer", "device": device, "date": date, "layout": layout,
                  "pass": "fwd+bwd" if backward else "fwd",
                  "params": {"devices": peers, "tokens": n, "d": d, "heads": heads, "dtype": "bfloat16",
                             "unroll": args.unroll},
                  "ms_projections": ms[False], "ms_layer": ms[True], "ms_exchange_in_layer": ms[True] - ms[False]})


def check_ep_layer(emit) -> None:
    """EP layer on all devices (ragged on GPU, padded) vs the local layer on one: values, gradients,
    loads; ragged run twice must be bitwise identical."""
    from mhl_jax.moe.core import moe_heads
    from mhl_jax.parallel.expert_parallel import ExpertParallelMoE

    devs = jax.devices()
    peers = len(devs)
    rng = np.random.default_rng(7)
    n, c, de, ne, k = 2048 * peers, 256, 128, 8 * peers, 4
    x = jnp.asarray(rng.standard_normal((n, 1, c)), jnp.float32)
    w_r = jnp.asarray(rng.standard_normal((1, c, ne)) / np.sqrt(c), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, ne)), jnp.float32).at[0, :4].add(2.0)  # skewed
    w1 = jnp.asarray(rng.standard_normal((1, ne, c, de)) / np.sqrt(c), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((1, ne, de, c)) / np.sqrt(de), jnp.float32)

    def loss(run, x, w_r, w1, w2):
        y, load = run(x, x, w_r, bias, w1, w2, k)
        return jnp.sum(y * jnp.cos(x)), load

    grad = lambda run: jax.jit(jax.value_and_grad(lambda *a: loss(run, *a), argnums=(0, 1, 2, 3),  # noqa: E731
                                                  has_aux=True))
    with jax.default_matmul_precision("highest"):
        (ref_l, ref_load), ref_g = grad(lambda *a: moe_heads(*a, "reference"))(x, w_r, w1, w2)
        mesh = Mesh(np.asarray(devs).reshape(1, peers), ("data", "ep"))
        impls = ["padded"] + (["ragged"] if jax.default_backend() == "gpu" else [])
        for impl in impls:
            fn = grad(ExpertParallelMoE(mesh, "reference", impl))
            (lv, load), g = fn(x, w_r, w1, w2)
            (lv2, _), g2 = fn(x, w_r, w1, w2)
            bitwise = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves((lv, g)),
                                                                       jax.tree.leaves((lv2, g2))))
            diffs = [float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-12))
                     for a, b in zip(g, ref_g)]
            rec = {"bench": "a2a_check", "impl": f"ep_{impl}", "devices": peers, "tokens": n, "k": k,
                   "loss_rel_diff": float(abs(lv - ref_l) / abs(ref_l)), "grad_rel_diff_max": max(diffs),
                   "loads_equal": bool(jnp.array_equal(load, ref_load)), "bitwise_repeatable": bitwise,
                   "max_load_share": float(ref_load.max() / ref_load.sum())}
            rec["ok"] = rec["loss_rel_diff"] < 1e-5 and rec["grad_rel_diff_max"] < 1e-4 and rec["loads_equal"] \
                and bitwise
            emit(rec)
            if not rec["ok"]:
                raise AssertionError(f"EP layer check failed: {rec}")


def table(recs: list[dict]) -> str:
    hp = {(r["params"]["k"], r["params"]["skew"]): r for r in recs if r.get("impl") == "hp"}
    ep = {(r["params"]["k"], r["params"]["skew"]): r for r in recs if r.get("impl") == "ep_ragged"}
    pad = {r["params"]["k"]: r for r in recs if r.get("impl") == "ep_padded"}
    cont = {(r["params"]["k"], r["params"]["skew"]): r for r in recs if r.get("impl") == "hp_token_major"}
    lines = [f"{'k':>2} {'skew':>4} | {'HP ms':>7} {'GiB':>5} {'tokmaj':>7} | {'EP ms':>7} {'GiB':>5} "
             f"{'rows used':>10} | {'EP/HP':>6} | {'EPpad ms':>8}"]
    for key in sorted(hp):
        h, e, p = hp[key], ep.get(key), pad.get(key[0])
        c = f"{cont[key]['ms']:7.3f}" if key in cont else f"{'-':>7}"
        lines.append(f"{key[0]:>2} {key[1]:>4} | {h['ms']:7.3f} {h['peak_gib']:5.2f} {c} | "
                     + (f"{e['ms']:7.3f} {e['peak_gib']:5.2f} {e['recv_rows_used_max']:>10} | {e['ms'] / h['ms']:6.2f}"
                        if e else f"{'-':>7} {'-':>5} {'-':>10} | {'-':>6}")
                     + (f" | {p['ms']:8.3f}" if p else " |        -"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--skews", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    ap.add_argument("--ep-impls", nargs="+", default=["ragged", "padded"], choices=["ragged", "padded"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--ragged-unroll", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--train-check", action="store_true")
    ap.add_argument("--skip-bench", action="store_true", help="only the checks / --hp-layer stages")
    ap.add_argument("--hp-layer", action="store_true", help="also time the HP exchange inside the layer "
                    "(W_in / W_out included) in both sub-token layouts")
    args = ap.parse_args()

    devs = jax.devices()
    device = devs[0].device_kind
    slug = device.lower().replace(" ", "-") + (f"-x{len(devs)}" if len(devs) > 1 else "")
    out_path = args.out or os.path.join(ROOT, "bench", "results", f"a2a-{slug}-{args.date}.jsonl")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    outf = open(out_path, "w")

    def emit(rec: dict) -> None:
        timing.emit(rec, outf)

    print(f"# {len(devs)} x {device}, jax {jax.__version__}, backend {jax.default_backend()}, out {out_path}",
          flush=True)
    failed, recs = [], []
    stages = []
    if args.train_check:  # the pass/fail checks first: they are short and must not be cut off
        from bench import train_2gpu

        stages.append(("ep_layer_check", lambda: check_ep_layer(emit)))
        stages.append(("train_2gpu", lambda: [emit(r) for r in train_2gpu.run(log=lambda s: None)]))
    if args.hp_layer:
        stages.append(("hp_layer", lambda: bench_hp_layer(args, device, args.date, emit)))
    if not args.skip_bench:
        stages.append(("bench", lambda: recs.extend(bench(args, device, args.date, emit))))
    for name, stage in stages:
        t0 = time.perf_counter()
        try:
            stage()
            print(f"# stage {name}: ok ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:  # keep going: the other stages' results are still worth having
            traceback.print_exc()
            failed.append(f"{name}: {type(e).__name__}: {e}")
            emit({"bench": "a2a_stage_failed", "stage": name, "error": f"{type(e).__name__}: {e}"[:2000]})
    outf.close()
    if recs:
        print(table(recs), flush=True)
    if jax.default_backend() == "gpu":
        print("# process peak GiB per device:",
              [round(dv.memory_stats().get("peak_bytes_in_use", 0) / GIB, 2) for dv in devs], flush=True)
    if failed:
        print("# FAILED: " + " | ".join(failed), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
