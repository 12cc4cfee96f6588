"""Where a training step's time goes: one traced step of a config split by category, each against its floor.

    python -m bench.step_profile [--config FILE ...] [--devices 1] [--steps 4] [--calls 2] [--set key=value ...]
                                 [--peak-tflops 989] [--peak-tbs 4.8] [--out FILE]

For each config (default: the four of the paper's comparison, configs/mlp_0.2b.yaml, mh_latent_moe_hp_2.2b,
moe_ep_2.2b and latent_moe_ep_2.2b) the real train step is compiled as `bench.train_scale` compiles it
(`compile_step`: `jit_train_step`, AdamW, gradient accumulation, balancing) on `--devices` devices, fed the same
synthetic Zipf tokens. Defaults before `--set`: train.global_batch=32 train.micro_batch=8 (32 x 2048 tokens a step,
4 micro-batches on 1 GPU).

Categories come from the program itself: the model and the step run each part under a `jax.named_scope`, and
`bench.tools.hlo_scopes` maps every HLO instruction of the compiled step to one (embed, norm, attention, residual,
mlp, moe_proj, moe, router, packing, experts, combine, lm_head_loss, grad_accum, optimizer, balancing, collectives,
other) and to the forward or the backward. A fusion spanning categories counts as its root's (the last op it
computes).

On a GPU: after `--steps` timed steps (the median is the step's wall time; each closed by block_until_ready), `--calls`
more run inside one JAX profiler trace; every kernel of GPU 0 that names its HLO op (`bench.tools.trace.op_events`)
adds its time to the op's category, per call. `busy_ms` is the union of the kernels' intervals and `host_gap_ms` =
wall - busy: the time the GPU waits for the host (launches, the loop's bookkeeping); `gaps_top` names the kernels
on either side of the longest idle stretches, and `kernels_top` each category's ops with the most time (printed for
every category too), `kernels_info` what each of those ops is (opcode, custom-call target, shapes, scope), and
`kernels_by_kind` each category's time by kind of op (`bench.tools.kernel_kinds`: the same computation in every layer
summed; its largest kinds printed too). Kernels whose op is not in the compiled module's text are `unmapped` (listed,
with their time: a GPU run checks first that this is ~0).

Each category's floor, the whole step's work split evenly over the devices (exact for 1): FLOPs at `--peak-tflops`
(the H200's dense bf16, 989) for the matmul categories (attention: projections + causal scores and values; mlp;
moe_proj; router; experts; lm_head_loss: 3 x the forward's 2 x FLOPs, the formulas of
`mhl_jax.model.params.train_flops_per_token` split by part), bytes at `--peak-tbs` (the H200's 4.8 TB/s) for the
memory-bound ones: the optimizer (per parameter: the gradient read twice, norm and update, the parameter and both
moments read and written), the gradient accumulation ((accum - 1) adds of a parameter-sized fp32 sum), the
embedding, norms, residual adds, packing (the slots' indices) and combine (the k expert rows read, the output
written, forward and backward). The moe executor's glue, balancing, collectives and other have no floor. Each line:
measured ms, floor ms, measured / floor.

Without a GPU (CPU) no time is measured: the record says so (`times: null`), and holds the categorisation only: per
category the kernels, their executions per step and the dot FLOPs of the compiled HLO (`hlo`), which the floors'
FLOPs can be checked against.

Output: one JSON line per config (`bench: step_profile`) and a Markdown table per config, ready for
docs/performance.md. CPU smoke test:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python -m bench.step_profile \\
        --config configs/tiny_mh_latent_moe.yaml --set model.compute_dtype=float32 --set train.global_batch=16
"""

from __future__ import annotations

import sys
import time
import traceback

import jax
import numpy as np

from bench import train_scale
from bench.common import JsonLines, parser, routing_summary, today
from bench.tools.hlo_scopes import CATEGORIES, STEP_SCOPES, hlo_map, summary
from bench.tools.kernel_kinds import kernels_by_kind, kernels_info, kinds_line
from bench.tools.trace import traced_op_events, union_ms
from mhl_jax.config import Config, ConfigError
from mhl_jax.model.context import executor_says
from mhl_jax.model.gpt import implementations
from mhl_jax.model.params import count_params
from mhl_jax.moe.plan import expert_width
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.train.metrics import PEAK_BF16_FLOPS

DEFAULT_CONFIGS = ["configs/mlp_0.2b.yaml", "configs/mh_latent_moe_hp_2.2b.yaml", "configs/moe_ep_2.2b.yaml",
                   "configs/latent_moe_ep_2.2b.yaml"]
DEFAULT_SETS = ["train.global_batch=32", "train.micro_batch=8"]
H200_PEAK_TFLOPS = PEAK_BF16_FLOPS["H200"] / 1e12  # dense bf16, datasheet (the MFU table's figure)
H200_PEAK_TBS = 4.8  # HBM3e, datasheet
FLOP_CATEGORIES = ("attention", "mlp", "moe_proj", "router", "experts", "lm_head_loss")


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize if dtype != "bfloat16" else 2


def floors(cfg: Config, accum: int, devices: int = 1, cast: bool = False,
           in_place: bool = False) -> dict[str, dict[str, float]]:
    """Per category {flops, bytes}: the least work a step of `cfg` (accum micro-batches) must do there, per device
    (the step's work split evenly over `devices`). cast, in_place: whether the expert weights are cast once a step
    and their gradients added into the fp32 sums in place (the step context: `step_context`). Module docstring:
    which work counts."""
    m, f = cfg.model, cfg.ffn
    n = cfg.train.global_batch * m.context  # tokens a step
    cb = _itemsize(m.compute_dtype)
    attn = m.n_heads * m.head_dim
    moe_layers = 0 if f.kind == "mlp" else m.n_layers - f.stem_layers
    # the dense layers' hidden widths summed: the stems', and in the MLP baseline every other layer's
    mlp_width = f.stem_layers * f.stem_hidden + (m.n_layers - f.stem_layers) * f.hidden * (f.kind == "mlp")
    heads, width = (f.num_heads, f.head_dim) if f.kind == "mh_latent_moe" else (1, m.d_model)
    route_width = width
    if f.kind == "latent_moe":
        width = f.latent_dim  # the experts compute on the latent
    projections = {"mlp": 0, "moe": 0, "latent_moe": 2 * m.d_model * f.latent_dim,
                   "mh_latent_moe": (2 + (f.routing_tokens == "separate")) * m.d_model * f.num_heads * f.head_dim}
    slots = n * heads * f.top_k * moe_layers  # routed (token, head, choice) slots of every MoE layer
    params = count_params(cfg).total
    moment = _itemsize(cfg.optimizer.moment_dtype)
    expert_params = moe_layers * heads * f.num_experts * 2 * width * f.expert_hidden
    # the expert weights' bytes: cast once (fp32 read, copy written), then every micro-batch the forward and the
    # backward read them and the gradient is added into its fp32 sum (read and written) or written
    w_read = cb if cast else 4
    expert_bytes = expert_params * ((4 + cb) * cast + accum * (2 * w_read + (8 if in_place else 4)))
    summed_apart = params - expert_params * in_place  # gradients the accumulation adds outside the kernels
    out = {
        # x 6: forward 2 FLOPs a multiply-add, backward twice the forward
        "attention": {"flops": m.n_layers * n * 6 * (4 * m.d_model * attn + m.context * attn)},
        "mlp": {"flops": n * 6 * 2 * m.d_model * mlp_width},
        "moe_proj": {"flops": n * 6 * projections[f.kind] * moe_layers},
        "router": {"flops": n * 6 * heads * route_width * f.num_experts * moe_layers},
        "experts": {"flops": slots * 6 * 2 * width * f.expert_hidden, "bytes": expert_bytes},
        "lm_head_loss": {"flops": n * 6 * m.d_model * m.vocab_size},
        # gather forward (row read + write), its gradient (row read, table row write)
        "embed": {"bytes": n * m.d_model * 4 * 3 + m.vocab_size * m.d_model * 4},
        # 2 norms a layer and the final one; forward reads fp32, writes the compute dtype; backward reads x and dy,
        # writes dx
        "norm": {"bytes": (2 * m.n_layers + 1) * n * m.d_model * (4 + cb + 4 + cb + 4)},
        # 2 adds a layer: read the stream and the branch, write the stream; backward: the branch's cast of dy
        "residual": {"bytes": 2 * m.n_layers * n * m.d_model * (4 + cb + 4 + 4 + cb)},
        # each slot's index and row number written and read, forward (the backward reuses them)
        "packing": {"bytes": slots * 4 * 4},
        # forward: k rows read per sub-token, its output written; backward: dy read k times, the gate gradients
        "combine": {"bytes": 2 * slots * width * cb + 2 * (slots // f.top_k) * width * cb},
        "grad_accum": {"bytes": (accum - 1) * summed_apart * 12},
        "optimizer": {"bytes": params * (4 + 4 + 4 + 4 + 4 * moment)},
    }
    return {c: {k: v / devices for k, v in w.items()} for c, w in out.items()}


def step_context(cfg: Config, mesh, accum: int) -> tuple[bool, bool]:
    """(cast, in_place) of the MoE layers' executor on `mesh`, asked as `mhl_jax.model.context` asks it: whether the
    step casts the expert weights once and whether the micro-batches add their gradients in place (only with
    accumulation)."""
    if cfg.ffn.kind == "mlp":
        return False, False
    ex, shape = make_executor(cfg, mesh), (cfg.model.compute_dtype, "float32", expert_width(cfg))
    cast = executor_says(ex, "reads_weights_cast", shape)
    return cast, accum > 1 and executor_says(ex, "accumulates_in_place", shape)


def floor_ms(work: dict[str, float] | None, peak_tflops: float, peak_tbs: float) -> tuple[float | None, str]:
    """(ms at the peaks, "flop" or "byte"): the larger of the two times; (None, "") for no floor (or a zero one, as
    the gradient accumulation's without accumulation)."""
    if not work or not any(work.values()):
        return None, ""
    t_flop = work.get("flops", 0.0) / (peak_tflops * 1e12) * 1e3
    t_byte = work.get("bytes", 0.0) / (peak_tbs * 1e12) * 1e3
    return (t_flop, "flop") if t_flop >= t_byte else (t_byte, "byte")


def category_times(events: list[tuple[int, int, str, str]], ops: dict, calls: int, module: str = "") -> dict:
    """Traced op events (start ns, duration ns, HLO op, HLO module) of `calls` calls -> per call: `ms`, `fwd_ms`,
    `bwd_ms` per category, `busy_ms` (the union of the kernels' intervals), `unmapped_ms` and the `unmapped` ops with
    the most time, and per category the ops with the most time (`kernels_top`: op, ms and runs per call; its "other"
    entry is what no scope covers) and all of them (`per_op`: {op: (ms, runs)} per call, for `kernels_by_kind`;
    thousands of ops, not for the record). Events of another module than `module` (when both
    name one) are left out, and so are those of ops that launch nothing themselves (a loop or a call: the kernels
    inside it have their own events)."""
    ms = {c: {"ms": 0.0, "fwd_ms": 0.0, "bwd_ms": 0.0} for c in CATEGORIES}
    unmapped, per_op, spans, named = {}, {c: {} for c in CATEGORIES}, [], []
    for start, dur, name, mod in events:
        if module and mod and mod != module:
            continue
        op = ops.get(name)
        if op is not None and not op.kernel:
            continue
        spans.append((start, start + dur))
        named.append((start, start + dur, name if op is None else f"{op.category}:{name}"))
        if op is None:
            unmapped[name] = unmapped.get(name, 0.0) + dur / 1e6 / calls
            continue
        ms[op.category]["ms"] += dur / 1e6 / calls
        t_runs = per_op[op.category].setdefault(name, [0.0, 0])
        t_runs[0] += dur / 1e6 / calls
        t_runs[1] += 1
        if op.phase:
            ms[op.category][f"{op.phase}_ms"] += dur / 1e6 / calls
    def top(d):
        return [(k, round(v, 4)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:10]]

    def ranked(d):
        return [(k, round(t, 6), round(n / calls, 2)) for k, (t, n) in sorted(d.items(), key=lambda kv: -kv[1][0])[:8]]

    kernels_top = {c: ranked(d) for c, d in per_op.items() if d}
    every_op = {c: {k: (t, n / calls) for k, (t, n) in d.items()} for c, d in per_op.items() if d}
    return {"categories": ms, "busy_ms": union_ms(spans) / calls, "unmapped_ms": sum(unmapped.values()),
            "unmapped": top(unmapped), "kernels_top": kernels_top, "per_op": every_op, "events": len(spans),
            "gaps_top": idle_gaps(named, calls)}


def idle_gaps(events: list[tuple[int, int, str]], calls: int, n: int = 10) -> list[tuple[str, str, float, int]]:
    """Where the device sat idle between kernels: (start ns, end ns, label) events -> the n (kernel before, kernel
    after) pairs with the most idle time between them, each (before, after, ms per call, gaps per call). The gaps sum
    to the traced span less the busy time (host time before the first and after the last kernel is not in them)."""
    gaps, end, last = {}, None, ""
    for start, stop, label in sorted(events):
        if end is not None and start > end:
            g = gaps.setdefault((last, label), [0.0, 0])
            g[0] += (start - end) / 1e6 / calls
            g[1] += 1
        if end is None or stop > end:
            end, last = stop, label
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:n]
    return [(a, b, round(t, 6), round(c / calls, 2)) for (a, b), (t, c) in ranked]


def module_name(hlo_text: str) -> str:
    """The module's name from the first line of its text ("HloModule jit_train_step, ...")."""
    return hlo_text.split(None, 2)[1].rstrip(",") if hlo_text.startswith("HloModule") else ""


def measure_times(cs, tokens: np.ndarray, ops: dict, module: str, steps: int, calls: int,
                  plane: str = "/device:GPU:0") -> dict:
    """`steps` timed steps of the compiled step (wall ms: their median), then `calls` traced ones -> the wall time,
    the trace's source (`bench.tools.trace.op_events`), `category_times` and the last step's routing
    (`bench.common.routing_summary`: the expert kernels' work depends on it)."""
    held = {"state": cs.fresh_state()}
    batch = jax.block_until_ready(jax.device_put(cs.batches(tokens[None])[0], cs.batch_sharding))

    def one_step():
        held["state"], held["metrics"] = cs.compiled(held["state"], batch)
        return held["metrics"]

    jax.block_until_ready(one_step())  # warm
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(one_step())
        walls.append((time.perf_counter() - t0) * 1e3)
    source, events = traced_op_events(one_step, calls, plane)
    del held["state"]
    wall = float(np.median(walls))
    times = category_times(events, ops, calls, module)
    return {"wall_ms": wall, "step_ms": walls, "source": source, "host_gap_ms": wall - times["busy_ms"],
            "routing": routing_summary(jax.device_get(held.pop("metrics"))), **times}


def lines(rec: dict, peak_tflops: float, peak_tbs: float) -> dict[str, dict]:
    """Per category: the HLO's figures, the floor and (with times) measured ms and measured / floor."""
    times = rec.get("times")
    out = {}
    for c in CATEGORIES:
        hlo = rec["hlo"][c]
        floor, kind = floor_ms(rec["floors"].get(c), peak_tflops, peak_tbs)
        line = {"kernels": hlo["kernels"], "runs": hlo["runs"], "dot_flops": hlo["dot_flops"], "floor_ms": floor,
                "floor_kind": kind}
        if times is not None:
            t = times["categories"][c]
            line.update(t)
            line["x_floor"] = t["ms"] / floor if floor else None
        out[c] = line
    return out


def profile_config(path: str, overrides: list[str], devices: int, steps: int = 4, calls: int = 2, seed: int = 0,
                   peak_tflops: float = H200_PEAK_TFLOPS, peak_tbs: float = H200_PEAK_TBS,
                   plane: str | None = None) -> dict:
    """One config's record (module docstring). plane: where the trace's ops are read (None: GPU 0 on a GPU backend,
    no times elsewhere; a test passes "/host:CPU" to read the CPU's thunks)."""
    cfg = train_scale.run_config(path, [*DEFAULT_SETS, *overrides], devices)
    m = cfg.model
    params, biases = train_scale.host_state(cfg, cfg.train.seed)
    tokens = train_scale.synthetic_tokens(seed, m.vocab_size, (cfg.train.global_batch, m.context + 1))
    mesh = make_mesh(cfg, jax.devices()[:devices])
    cs = train_scale.compile_step(cfg, mesh, params, biases, cfg.train.seed, tokens)
    text = cs.compiled.as_text()
    ops = hlo_map(text)
    hlo = summary(ops)
    kernels = sum(s["kernels"] for s in hlo.values())
    runs = sum(s["runs"] for s in hlo.values())
    rec = {"bench": "step_profile", "config": cfg.name, "config_file": path, "kind": cfg.ffn.kind, "devices": devices,
           "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
           "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch, "accum": cs.accum,
           "context": m.context, "compute_dtype": m.compute_dtype, "kernels": cfg.ffn.kernels,
           **implementations(cfg), "executor": cs.executor, "compile_s": cs.compile_s,
           "overrides": overrides, "peak_tflops": peak_tflops, "peak_tbs": peak_tbs, "hlo": hlo,
           "floors": floors(cfg, cs.accum, devices, *step_context(cfg, mesh, cs.accum)),
           "other_share": {"kernels": hlo["other"]["kernels"] / max(kernels, 1),
                           "runs": hlo["other"]["runs"] / max(runs, 1)}}
    if plane is None and jax.default_backend() == "gpu":
        plane = "/device:GPU:0"
    rec["times"] = None if plane is None else measure_times(cs, tokens, ops, module_name(text), steps, calls, plane)
    if rec["times"] is None:
        rec["note"] = "no GPU: no time measured; the HLO's categories only"
    else:
        per_op = rec["times"].pop("per_op")  # every op of the step: the grouping's input, too long for the record
        rec["kernels_info"] = kernels_info(text, rec["times"]["kernels_top"])
        rec["kernels_by_kind"] = kernels_by_kind(text, per_op, ops)
    rec["lines"] = lines(rec, peak_tflops, peak_tbs)
    return rec


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rec: dict) -> str:
    """A record as a Markdown table: one row per category, largest first."""
    times = rec.get("times")
    head = (f"{rec['config']} on {rec['devices']} x {rec['device']}, {rec['global_batch']} x {rec['context']} tokens "
            f"(micro-batch {rec['micro_batch']} x {rec['accum']})")
    if times is None:
        rows = ["| category | kernels | runs / step | dot GFLOP (HLO) | floor GFLOP | floor ms |", "|" + "---|" * 6]
        for c, ln in sorted(rec["lines"].items(), key=lambda kv: -kv[1]["runs"]):
            work = rec["floors"].get(c, {})
            rows.append(f"| {c} | {ln['kernels']} | {ln['runs']} | {ln['dot_flops'] / 1e9:.3f} | "
                        f"{_fmt(work.get('flops') and work['flops'] / 1e9, '.3f')} | {_fmt(ln['floor_ms'], '.3f')} |")
        return "\n".join([f"{head}: no time measured (no GPU)", "", *rows])
    rows = ["| category | ms | fwd / bwd ms | share | floor ms | x floor |", "|" + "---|" * 6]
    for c, ln in sorted(rec["lines"].items(), key=lambda kv: -kv[1]["ms"]):
        split = "" if c in STEP_SCOPES or c in ("collectives", "other") else f"{ln['fwd_ms']:.2f} / {ln['bwd_ms']:.2f}"
        floor = "" if ln["floor_ms"] is None else f"{ln['floor_ms']:.2f} ({ln['floor_kind']})"
        rows.append(f"| {c} | {ln['ms']:.2f} | {split} | {100 * ln['ms'] / times['wall_ms']:.1f}% | {floor} | "
                    f"{_fmt(ln.get('x_floor'), '.1f')} |")
    rows.append(f"| host gaps | {times['host_gap_ms']:.2f} | | {100 * times['host_gap_ms'] / times['wall_ms']:.1f}% "
                "| | |")
    if times["unmapped_ms"]:
        rows.append(f"| unmapped | {times['unmapped_ms']:.2f} | | | | |")
    rows.append(f"| **step (wall)** | **{times['wall_ms']:.2f}** | | 100% | | |")
    return "\n".join([head, "", *rows])


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", action="append", default=None, help="YAML config (repeatable)")
    ap.add_argument("--devices", type=int, default=1, help="devices the step runs on (all on the model axis)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps, after one warm-up (GPU)")
    ap.add_argument("--calls", type=int, default=2, help="steps inside the trace (GPU)")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="config override, applied after the defaults " + " ".join(DEFAULT_SETS))
    ap.add_argument("--seed", type=int, default=0, help="numpy seed of the synthetic tokens")
    ap.add_argument("--peak-tflops", type=float, default=H200_PEAK_TFLOPS, help="the floors' FLOP rate")
    ap.add_argument("--peak-tbs", type=float, default=H200_PEAK_TBS, help="the floors' memory bandwidth, TB/s")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.calls < 1:
        ap.error(f"--steps {args.steps} and --calls {args.calls} must be at least 1")
    devs = jax.devices()
    print(f"# {len(devs)} x {devs[0].device_kind}, jax {jax.__version__}, backend {jax.default_backend()}", flush=True)
    if args.devices > len(devs):
        print(f"# FAILED: --devices {args.devices} asked, only {len(devs)} visible", flush=True)
        sys.exit(2)
    configs = args.config or DEFAULT_CONFIGS
    try:
        for path in configs:  # every config valid before any device time is spent
            train_scale.run_config(path, [*DEFAULT_SETS, *args.overrides], args.devices)
    except ConfigError as e:
        print(f"# FAILED: {e}", flush=True)
        sys.exit(2)
    failed = []
    with JsonLines(args.out) as emit:
        for path in configs:
            try:
                rec = profile_config(path, args.overrides, args.devices, args.steps, args.calls, args.seed,
                                     args.peak_tflops, args.peak_tbs)
            except Exception as e:  # keep going: the other configs are still worth measuring
                traceback.print_exc()
                failed.append(f"{path}: {type(e).__name__}: {str(e)[:300]}")
                continue
            rec["date"] = today()
            emit(rec)
            print(table(rec) + "\n", flush=True)
            times = rec["times"] or {}
            for before, after, ms, count in times.get("gaps_top", [])[:5]:
                print(f"# idle {ms:.2f} ms in {count:g} gaps: {before} -> {after}", flush=True)
            for cat, ops in times.get("kernels_top", {}).items():
                print(f"# {cat}: " + ", ".join(f"{op} {ms:.2f} ms x{runs:g}" for op, ms, runs in ops[:3]), flush=True)
            for cat, kinds in rec.get("kernels_by_kind", {}).items():
                print(kinds_line(cat, kinds), flush=True)
    if failed:
        print("# FAILED: " + " | ".join(failed), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
