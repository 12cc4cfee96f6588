"""Head Parallel against Expert Parallel dispatch + combine (the paper's Figure 3) on however many GPUs are present:
time and memory per device.

    python -m bench.a2a [--tokens 81920] [--d 1024] [--heads 8] [--ks 1 2 4 8] [--skews 0 1 2]
                        [--ep-impls ragged padded] [--repeats 20] [--unroll 8] [--ragged-unroll 1] [--out FILE]
    python -m bench.a2a --layer [--mesh DATA HP EP] [--chunks 1 2 4] [--layer-tokens 16384]
                        [--config configs/mh_latent_moe_hp_2.2b.yaml] [--set key=value ...] [--out FILE]

Per device: `tokens` tokens of width d, bf16 (81920 x 1024 by default, the layer table's larger shape).
- HP: the sub-tokens head-group-major, (P, n, Nh/P, dh) per device as the model's W_in emits them under Head Parallel,
  -> contiguous all_to_all -> reverse all_to_all (the exchange of `mhl_jax.parallel.head_parallel`; the bytes a
  plain NCCL all_to_all_single moves). It does not depend on k or the routing; it is still measured once per
  (k, skew) cell on fresh inputs, to show it flat. `hp_token_major`: from the token-major (n, Nh, dh) layout, split
  on heads (XLA moves each destination's heads into a block first, and back after).
- EP: the k-duplicated send buffer (n * k, d), rows sorted by destination; destinations drawn per slot from a Zipf
  law over devices, P(p) ~ 1 / (p + 1)^skew (device 0 receives most). Timed: the count metadata all_gather +
  dispatch + combine of `mhl_jax.parallel.expert_parallel` (`ragged`: lax.ragged_all_to_all, GPU only; `padded`:
  all_to_all of static worst-case buffers, which sends the whole buffer whatever the counts: skew 0 only).
Timing: `unroll` round trips inside one jit (optimisation barriers keep them apart and keep the count exchange in
each), median over `repeats` calls after warm-up, divided by `unroll`: device time per dispatch + combine with launch
overhead amortised. `ms_single`: one round trip per call. Ragged EP runs `ragged_unroll` (1) round trips per call:
XLA gives each ragged_all_to_all's buffers their own collective memory, not reused across unrolled rounds.
Memory: XLA's buffer assignment of the compiled exchange per device (shapes are static: this is the peak). EP's
receive buffer is the static worst case (P * n * k rows); `recv_rows_used_max` is what the skew filled on the busiest
device. Every timed exchange is checked to return its input bit for bit. A table last.

--layer times the MoE layer's executor instead (exchanges, router and experts: what `parallel.hp_chunks` splits),
forward + backward on the sub-tokens head-group-major as the model emits them, on a data x hp (x ep) mesh of the
config's MH-LatentMoE shapes (default: the 2.2B model, `--layer-tokens` per device = micro-batch 8 x 2048), once per
`--chunks` count. One record per count: `ms`, the unchunked `ms_unchunked` and `overhead` = ms / ms_unchunked - 1,
whether the outputs are bitwise the unchunked ones, and the bytes each device sends (`traffic.comm_bytes_per_layer`).
On one GPU, `--mesh 1 1 1 --chunks 1 2 4` measures what the chunks cost where there is nothing to overlap (a mesh of
one device still runs the Head Parallel executor here; a training run there takes the local one and ignores chunks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench.common import JsonLines, compiled_gib, memory_gib, parser, time_calls, time_jax, today
from mhl_jax.config import Config, load_config
from mhl_jax.moe.plan import resolve_kernels
from mhl_jax.parallel import traffic
from mhl_jax.parallel.expert_parallel import combine, dispatch, make_plan
from mhl_jax.parallel.head_expert_parallel import HeadExpertParallelMoE
from mhl_jax.parallel.head_parallel import HeadParallelMoE, to_local_heads, to_local_tokens
from mhl_jax.parallel.mesh import expert_leaf_spec, make_mesh

LAYER_CONFIG = "configs/mh_latent_moe_hp_2.2b.yaml"


def zipf_counts(tokens: int, k: int, peers: int, skew: float, seed: int) -> np.ndarray:
    """(P, P) int: rows each device sends each destination; per slot P(p) ~ 1 / (p + 1)^skew."""
    prob = 1.0 / np.arange(1, peers + 1, dtype=np.float64) ** skew
    prob /= prob.sum()
    rng = np.random.default_rng(seed)
    return np.stack([rng.multinomial(tokens * k, prob) for _ in range(peers)]).astype(np.int32)


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
        hp_mem = compiled_gib(hp_one, x0)
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
                    compiled_mem = compiled_gib(fn, x, cnt)
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


# ----------------------------------------------------------------------------- the chunked layer (--layer)


def layer_config(path: str, overrides: list[str], mesh: tuple[int, int, int]) -> Config:
    """The MH-LatentMoE config at `path` with the overrides, on a data x hp (x ep) mesh of sizes `mesh`."""
    data, hp, ep = mesh
    cfg = load_config(path, [*overrides, f"parallel.data={data}", f"parallel.hp={hp}", f"parallel.ep={ep}",
                             f"parallel.devices={data * hp * ep}"])
    if cfg.ffn.kind != "mh_latent_moe":
        raise SystemExit(f"--layer times the Head Parallel executors: {path} has ffn.kind={cfg.ffn.kind!r}, expected "
                         "mh_latent_moe")
    return cfg


def layer_executor(cfg: Config, mesh: Mesh, chunks: int):
    """The executor `make_executor` picks for the mesh, with `chunks`; Head Parallel on one device too."""
    impl = resolve_kernels(cfg.ffn.kernels)
    if "ep" in mesh.axis_names:
        return HeadExpertParallelMoE(mesh, impl, cfg.parallel.ep_impl, chunks=chunks)
    return HeadParallelMoE(mesh, impl, chunks=chunks)


def layer_inputs(cfg: Config, mesh: Mesh, tokens: int, seed: int) -> tuple:
    """(x, w_r, bias, w1, w2, g) on the mesh: bf16 sub-tokens (hp, N, Nh / hp, dh) split over every device on the
    token axis (N = tokens x devices) and their cotangent g; fp32 router (unit variance: no ties), bias and experts
    split as the training state holds them (`expert_leaf_spec`)."""
    f, hp = cfg.ffn, mesh.shape["hp"]
    dtype = jnp.dtype(cfg.model.compute_dtype)
    n = tokens * mesh.size
    shapes = {"x": ((hp, n, f.num_heads // hp, f.head_dim), P(None, tuple(mesh.axis_names)), dtype, 1.0),
              "w_router": ((f.num_heads, f.head_dim, f.num_experts), None, jnp.float32, 1.0),
              "bias": ((f.num_heads, f.num_experts), None, jnp.float32, 0.0),
              "w1": ((f.num_heads, f.num_experts, f.head_dim, f.expert_hidden), None, jnp.float32, 0.02),
              "w2": ((f.num_heads, f.num_experts, f.expert_hidden, f.head_dim), None, jnp.float32, 0.02)}
    shapes["g"] = shapes["x"]
    out = []
    for i, (name, (shape, spec, dt, std)) in enumerate(shapes.items()):
        spec = spec or expert_leaf_spec(cfg, name, len(shape))
        make = jax.jit(lambda key, shape=shape, dt=dt, std=std: (std * jax.random.normal(key, shape)).astype(dt),
                       out_shardings=NamedSharding(mesh, spec))
        out.append(make(jax.random.key(seed + i)))
    return tuple(out)


def layer_step(executor, k: int, inputs: tuple):
    """Forward + backward, compiled for `inputs`: inputs -> (gradients of sum(y * g) for x, w_r, w1, w2; y)."""
    def loss(x, w_r, bias, w1, w2, g):
        y, _ = executor(x, x, w_r, bias, w1, w2, k)
        return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32)), y

    return jax.jit(jax.grad(loss, argnums=(0, 1, 3, 4), has_aux=True)).lower(*inputs).compile()


def bench_layer(args, device: str, date: str, emit) -> list[dict]:
    """--layer: the executor's forward + backward at each chunk count (the unchunked one first, the reference)."""
    mesh_sizes = tuple(args.mesh) if args.mesh else (1, len(jax.devices()), 1)
    cfg = layer_config(args.config, args.overrides, mesh_sizes)
    mesh = make_mesh(cfg, jax.devices()[:int(np.prod(mesh_sizes))])
    inputs = layer_inputs(cfg, mesh, args.layer_tokens, seed=0)
    f = cfg.ffn
    comm = traffic.comm_bytes_per_layer(cfg, mesh, args.layer_tokens)
    recs, ref = [], None
    for chunks in sorted(set([1, *args.chunks])):
        executor = layer_executor(cfg, mesh, chunks)
        step = layer_step(executor, f.top_k, inputs)
        y = step(*inputs)[1]
        ms = time_jax(step, [inputs], args.repeats)
        if ref is None:
            ref = (y, ms)
        rec = {"bench": "a2a", "impl": "layer_chunks", "device": device, "date": date,
               "params": {"mesh": dict(zip(mesh.axis_names, mesh.devices.shape)), "tokens_per_device":
                          args.layer_tokens, "chunks": chunks, "heads": f.num_heads, "head_dim": f.head_dim,
                          "experts": f.num_experts, "k": f.top_k, "expert_hidden": f.expert_hidden,
                          "dtype": cfg.model.compute_dtype, "kernels": executor.impl, "config": cfg.name},
               "executor": repr(executor), "ms": ms, "ms_unchunked": ref[1], "overhead": ms / ref[1] - 1.0,
               "bitwise_vs_unchunked": bool(jnp.array_equal(y, ref[0])),
               "peak_gib": memory_gib(step.memory_analysis()), "comm_bytes": comm}
        emit(rec)
        recs.append(rec)
        del y
    return recs


def layer_table(recs: list[dict]) -> str:
    lines = [f"{'mesh':>16} {'chunks':>6} | {'fwd+bwd ms':>10} {'overhead':>8} {'bitwise':>7} {'GiB':>6}"]
    for r in recs:
        mesh = "x".join(str(v) for v in r["params"]["mesh"].values())
        lines.append(f"{mesh:>16} {r['params']['chunks']:>6} | {r['ms']:10.3f} {100 * r['overhead']:7.1f}% "
                     f"{str(r['bitwise_vs_unchunked']):>7} {r['peak_gib'] or 0:6.2f}")
    return "\n".join(lines)


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


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--skews", type=float, nargs="+", default=[0.0, 1.0, 2.0])
    ap.add_argument("--ep-impls", nargs="+", default=["ragged", "padded"], choices=["ragged", "padded"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--ragged-unroll", type=int, default=1)
    ap.add_argument("--layer", action="store_true", help="time the MoE layer's executor at each --chunks count "
                    "instead of the bare exchanges")
    ap.add_argument("--mesh", type=int, nargs=3, metavar=("DATA", "HP", "EP"), default=None,
                    help="--layer's mesh (default: 1, every device, 1)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4], help="--layer's chunk counts "
                    "(parallel.hp_chunks); 1 is always run, as the reference")
    ap.add_argument("--layer-tokens", type=int, default=16384, help="--layer's tokens per device (8 x 2048)")
    ap.add_argument("--config", default=LAYER_CONFIG, help="--layer's MH-LatentMoE config (its ffn shapes, dtype, "
                    "kernels)")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="--layer's config overrides")
    args = ap.parse_args(argv)
    devs = jax.devices()
    print(f"# {len(devs)} x {devs[0].device_kind}, jax {jax.__version__}, backend {jax.default_backend()}", flush=True)
    with JsonLines(args.out) as emit:
        if args.layer:
            print(layer_table(bench_layer(args, devs[0].device_kind, today(), emit)), flush=True)
            return
        recs = bench(args, devs[0].device_kind, today(), emit)
    print(table(recs), flush=True)
    if jax.default_backend() == "gpu":
        print("# process peak GiB per device:",
              [round(dv.memory_stats().get("peak_bytes_in_use", 0) / 2 ** 30, 2) for dv in devs], flush=True)


if __name__ == "__main__":
    main()
