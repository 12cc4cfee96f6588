"""Training throughput and loss agreement of a config on 1, 2, 4, ... devices.

    python -m bench.train_scale [--config FILE ...] [--devices 1 2 4] [--data 1] [--ep 1] [--steps 4] [--warmup 1]
                                [--set key=value ...] [--tol 1e-2] [--profile] [--repeat] [--out FILE]

For each config (default: configs/mh_latent_moe_hp_2.2b.yaml and configs/moe_ep_2.2b.yaml) and each
device count P, a ('data', 'hp'|'ep') mesh is built over the first P devices with parallel.hp = P
(MH-LatentMoE) or parallel.ep = P (MoE / LatentMoE), data = 1, and `--steps` real training steps run:
`make_train_step` (AdamW, gradient accumulation over global_batch / (micro_batch x P) micro-batches,
balancing-bias update), jitted with the state donated, as `train.py` runs it. Every run starts from the
same initial state (built once per config and kept on the host, so bitwise equal) and sees the same
synthetic batches (numpy seed `--seed`; no dataset is read): tokens drawn i.i.d. with Zipf(1) unigram
frequencies, as in text, so the routing is as skewed as text's unigram statistics make it (uniform
tokens would balance the experts perfectly and flatter EP) and the loss falls in the first steps as
the model learns the unigram distribution (uniform tokens start at the optimum ln V and barely move).

`--data D --ep E`: data D x hp P / (D E) x ep E (ep: MH-LatentMoE only); chunks: `--set parallel.hp_chunks=C`.

Defaults applied before `--set` (so `--set` can undo them):
    train.global_batch=32  train.micro_batch=4  schedule.warmup_steps=1
32 x 2048 = 65k tokens per step instead of the paper's 0.66M keeps a 1-GPU step of a 2.2B model in
seconds, and 32 is a multiple of micro_batch x P for P = 1, 2, 4, 8 (accumulation 8, 4, 2, 1).
warmup_steps=1 runs every step at the peak LR, so the loss check covers the update as well as the
forward (with the paper's 8000-step warmup the first steps barely move the weights). The batch does not
change the work per token; the peak LR does in the MoE layers: their routing collapses onto a few experts
within a few steps (`routing`, and the table's empty groups), where the expert backward skips most tiles.
`--set schedule.warmup_steps=8000` keeps the configs' schedule: the weights barely move, while the balancing bias
(its step not scaled by the warmup) evens the loads.

Per run, one JSON line (to stdout, and appended to --out): mesh, batch, per-step losses and times,
the median step time over the steps after --warmup (each step closed by block_until_ready; the
compile is timed separately, ahead of time), tokens/s in total and per device, MFU (6 x active matmul
params + attention FLOPs per token, `train_flops_per_token`, against `device_peak_flops`: the bf16
datasheet peak of a known GPU or logging.peak_tflops; null on CPU), memory and the loss check.
`routing`: the last step's routing per MoE layer (`routing_summary`; docs/performance.md, The training step).
Memory: `mem_compiled_gib` is XLA's buffer assignment of the step per device (arguments + outputs +
temporaries - donated aliases); `mem_peak_gib` is the runtime peak (`peak_bytes_in_use`, max over the
run's devices). That counter only rises over a process, so device counts run largest first (fewer
devices hold more experts each: the peak rises run after run) and `mem_peak_exact` says whether the
value is this run's (false: an upper bound left by an earlier run; one --config per process for exact
values).

Loss check: per config, every run's losses against those of the run on the fewest devices;
`loss_max_rel_diff` = max over steps of |L_P - L_ref| / |L_ref| (per step: `loss_rel_diffs`) must be
<= --tol. The runs compute the same sums in a different order (micro-batch split, all-to-all layout,
gradient reductions), so in fp32 they agree to rounding (~1e-7). With bf16 compute a different order
can move a matmul output by 4e-3, flip a near-tie routing choice and, with Adam at the peak LR, the sign
of a near-zero gradient element, so the losses drift apart step by step (~2e-4 after 4 steps on CPU,
while the loss falls by 15%). The default tol 1e-2 leaves GPU GEMMs (other tilings, split-K) room for
50x that drift and is still well under the loss's fall, so a forward or update that differs in
substance (a shard's tokens or gradient dropped or counted twice) fails it.

Exit status 1 when a run fails or the loss check fails, 2 when fewer devices are present than asked.
CPU smoke test (tiny configs, fp32):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python -m bench.train_scale \\
        --config configs/tiny_mh_latent_moe.yaml --config configs/tiny_moe.yaml --devices 1 2 4 \\
        --steps 3 --set model.compute_dtype=float32 --tol 1e-4 --out /tmp/train_scale.jsonl

On a GPU machine, one config per process keeps the memory peaks exact:
    python -m bench.train_scale --config configs/moe_ep_2.2b.yaml --devices 1 2 4
--profile traces one more step and splits its device time into communication and compute (`bench.tools.trace`).
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from bench.common import GIB, JsonLines, memory_gib, parser, routing_summary, today
from bench.tools.trace import device_time_split
from mhl_jax.config import Config, ConfigError, load_config
from mhl_jax.model.attention import attention_impl
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model, implementations
from mhl_jax.model.params import train_flops_per_token
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import batch_spec, make_mesh, mesh_shape, model_axis, state_shardings
from mhl_jax.runtime.autotune import autotune_file
from mhl_jax.train.loop import accumulation_steps
from mhl_jax.train.metrics import device_peak_flops, mfu
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.schedule import make_schedule
from mhl_jax.train.step import jit_train_step

DEFAULT_CONFIGS = ["configs/mh_latent_moe_hp_2.2b.yaml", "configs/moe_ep_2.2b.yaml"]
DEFAULT_SETS = ["train.global_batch=32", "train.micro_batch=4", "schedule.warmup_steps=1"]


def run_config(path: str, overrides: list[str], devices: int, data: int = 1, ep: int = 1) -> Config:
    """The config at `path` with the overrides, on `devices` devices: `data` of them data-parallel, `ep` (MH-LatentMoE)
    splitting each head's experts, the rest on the model axis; ConfigError when the mesh or the batch does not fit."""
    axis = model_axis(load_config(path, overrides))
    if ep > 1 and axis != "hp":
        raise ConfigError(f"--ep {ep} splits MH-LatentMoE heads' experts (data x hp x ep); {path} puts its devices on "
                          "ep already")
    if data < 1 or ep < 1 or devices % (data * ep):
        raise ConfigError(f"--data {data} x --ep {ep} does not divide {devices} devices")
    cfg = load_config(path, [*overrides, f"parallel.{axis}={devices // (data * ep)}", f"parallel.data={data}",
                             f"parallel.devices={devices}", *([f"parallel.ep={ep}"] if ep > 1 else [])])
    mesh_shape(cfg, devices)
    accumulation_steps(cfg, devices)  # ConfigError when the batch does not split
    return cfg


def state_init(tx):
    """(params, biases) -> the train state `train.py` builds: AdamW moments, step 0."""
    return lambda p, b: {"params": p, "opt_state": tx.init(p), "biases": b, "step": jnp.zeros((), jnp.int32)}


def synthetic_tokens(seed: int, vocab: int, shape: tuple[int, ...], zipf: float = 1.0) -> np.ndarray:
    """i.i.d. tokens with Zipf(`zipf`) unigram frequencies (text-like), over a seeded random id order."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** zipf
    ids = rng.permutation(vocab).astype(np.int32)
    return ids[rng.choice(vocab, size=shape, p=p / p.sum())]


def host_state(cfg: Config, seed: int):
    """Initial (params, biases) as numpy trees: built once on device 0 (seconds; the host CPU takes
    ~1 min for 2.2B) and copied out, so every run starts from the same bits."""
    _, params, biases = nnx.split(build_model(cfg, seed=seed), nnx.Param, RouterBias)
    out = jax.device_get((params, biases))
    del params, biases
    gc.collect()  # the device copies go now, not at some later collection
    return out


def device_peaks(devices) -> list[int] | None:
    stats = [d.memory_stats() for d in devices]
    if any(not s or "peak_bytes_in_use" not in s for s in stats):
        return None
    return [int(s["peak_bytes_in_use"]) for s in stats]


def traced_step(compiled, state, batch) -> tuple[dict, dict]:
    """One more step of `compiled` from `state`, traced -> (its device time split, the state after it)."""
    held = {"state": state}

    def one_step():
        held["state"], metrics = compiled(held["state"], batch)
        return metrics

    split = device_time_split(one_step, calls=1)
    split.pop("per_device", None)
    return split, held.pop("state")


def run_peak(before: list[int] | None, after: list[int] | None) -> tuple[float | None, bool | None]:
    """(the runtime peak in GiB over the run's devices, whether it is this run's own): the counter only rises over a
    process, so a device whose peak did not rise holds an earlier run's."""
    if after is None:
        return None, None
    risen = [a for a, b0 in zip(after, before) if a > b0]
    stale = [a for a, b0 in zip(after, before) if a <= b0]
    return max(after) / GIB, bool(risen) and max(risen) >= max(stale, default=0)


class CompiledStep(NamedTuple):
    """`compile_step`'s: the executable, the mesh, and what a call of it takes."""
    compiled: Any  # (state, batch) -> (state, metrics), the state donated
    mesh: Mesh
    executor: str  # the MoE executor's repr
    fresh_state: Callable[[], dict]  # the initial state on the mesh, from the host-built params
    batch_sharding: NamedSharding
    accum: int  # micro-batches per step
    compile_s: float

    def batches(self, tokens: np.ndarray) -> np.ndarray:
        """(steps, global_batch, T + 1) tokens -> (steps, accum, micro_batch x devices, T + 1): the step's layout."""
        return tokens.reshape(len(tokens), self.accum, -1, tokens.shape[-1])


def compile_step(cfg: Config, mesh: Mesh, params, biases, seed: int, tokens: np.ndarray) -> CompiledStep:
    """The train step of `cfg` on `mesh` as `train.py` builds it (`jit_train_step`, the state donated, XLA's
    autotuning file), compiled ahead of time for one step's tokens (global_batch, T + 1); params, biases: the
    host-built initial state (`host_state`)."""
    accum = accumulation_steps(cfg, mesh.size)
    executor = make_executor(cfg, mesh)
    graphdef, p_abs, b_abs = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed=seed, executor=executor,
                                                                           mesh=mesh)),
                                       nnx.Param, RouterBias)
    if jax.tree.structure((p_abs, b_abs)) != jax.tree.structure((params, biases)):
        raise ValueError(f"{executor!r}: the model's parameter tree differs from the host-built one")
    tx = make_optimizer(cfg)
    init_state = state_init(tx)
    sh = state_shardings(cfg, mesh, jax.eval_shape(init_state, params, biases))
    bsh = NamedSharding(mesh, batch_spec(mesh))

    def fresh_state():
        return jax.jit(init_state, out_shardings=sh, donate_argnums=(0, 1))(
            *jax.device_put((params, biases), (sh["params"], sh["biases"])))

    # train.xla_autotune_file as a path: XLA's autotuning results loaded from it if it exists, written to it (this
    # bench has no run directory: "auto" is off here, as "")
    setting = cfg.train.xla_autotune_file
    tuned = autotune_file("" if setting == "auto" else setting, Path("."), backend=jax.default_backend())
    step = jit_train_step(graphdef, tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule), sh, bsh,
                          donate=True, deterministic=cfg.train.xla_deterministic_ops,
                          cudnn_attention=attention_impl(cfg.model.attention_impl, cfg.model.compute_dtype) == "cudnn",
                          autotune_options=tuned.compiler_options())
    state = jax.eval_shape(init_state, params, biases)
    t0 = time.perf_counter()
    compiled = step.lower(state, jax.device_put(tokens.reshape(accum, -1, tokens.shape[-1]), bsh)).compile()
    compile_s = time.perf_counter() - t0
    tuned.commit()
    return CompiledStep(compiled, mesh, repr(executor), fresh_state, bsh, accum, compile_s)


def measure(cfg: Config, devices: list, params, biases, batches: np.ndarray, warmup: int, seed: int,
            profile: bool = False, repeat: bool = False) -> dict:
    """Compile and run len(batches) train steps of `cfg` on `devices`; batches (steps, global_batch, T + 1).
    repeat: then the same steps again from the same initial state with the same executable (run-to-run determinism
    in one process: `repeat_losses`, `repeat_bitwise`)."""
    mesh = make_mesh(cfg, devices)
    n = mesh.size
    before = device_peaks(mesh.devices.flat)
    cs = compile_step(cfg, mesh, params, biases, seed, batches[0])
    compiled, bsh, accum, compile_s = cs.compiled, cs.batch_sharding, cs.accum, cs.compile_s
    state = cs.fresh_state()
    shaped = cs.batches(batches)
    mem_compiled = memory_gib(compiled.memory_analysis())
    losses, gnorms, times = [], [], []
    for b in shaped:
        b = jax.block_until_ready(jax.device_put(b, bsh))
        t0 = time.perf_counter()
        state, m = compiled(state, b)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
        gnorms.append(float(m["grad_norm"]))
    routing = routing_summary(jax.device_get(m))
    split = None
    if profile:  # one more step (after the losses are taken), traced: communication vs compute kernels
        split, state = traced_step(compiled, state, b)
    after = device_peaks(mesh.devices.flat)
    del state
    again = None
    if repeat:
        state = cs.fresh_state()
        again = []
        for b in shaped:
            state, m = compiled(state, jax.device_put(b, bsh))
            again.append(float(m["loss"]))
        del state
    executor = cs.executor
    del compiled, cs
    mem_peak, exact = run_peak(before, after)
    step_s = float(np.median(times[warmup:]))
    tokens = cfg.train.global_batch * cfg.model.context
    flops_tok = train_flops_per_token(cfg)
    peak = device_peak_flops(cfg.logging.peak_tflops)
    return {"mesh": dict(zip(mesh.axis_names, mesh.devices.shape)), "mesh_shape": list(mesh.devices.shape),
            "executor": executor, "accum": accum, "losses": losses, "grad_norms": gnorms,
            "step_times_s": times, "step_s": step_s, "routing": routing, "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_device": tokens / step_s / n, "flops_per_token": flops_tok,
            "peak_tflops": None if peak is None else peak / 1e12, "mfu": mfu(flops_tok, tokens / step_s, n, peak),
            "compile_s": compile_s, "mem_compiled_gib": mem_compiled, "mem_peak_gib": mem_peak,
            "mem_peak_exact": exact, "profile_split": split,
            **({} if again is None else {"repeat_losses": again, "repeat_bitwise": again == losses})}


def loss_check(records: list[dict], tol: float) -> None:
    """Fill each record's loss diffs against the successful run on the fewest devices, and `ok`."""
    done = [r for r in records if "losses" in r]
    ref = min(done, key=lambda r: r["devices"]) if done else None
    for r in records:
        if "losses" not in r:
            r["ok"] = False
            continue
        a, b = np.asarray(r["losses"]), np.asarray(ref["losses"])
        r["loss_ref_devices"] = ref["devices"]
        rel = np.abs(a - b) / np.abs(b)
        r["loss_max_abs_diff"] = float(np.max(np.abs(a - b)))
        r["loss_rel_diffs"] = [float(x) for x in rel]
        r["loss_max_rel_diff"] = float(np.max(rel))
        r["loss_tol"] = tol
        r["ok"] = bool(np.all(np.isfinite(a)) and r["loss_max_rel_diff"] <= tol)


def run(configs: list[str], device_counts: list[int], steps: int = 4, warmup: int = 1, overrides=(),
        tol: float = 1e-2, seed: int = 0, date: str = "", emit=print, log=print, profile: bool = False,
        repeat: bool = False, data: int = 1, ep: int = 1) -> list[dict]:
    """Every (config, device count); returns the records (each with `ok`). Device counts run largest first; data, ep:
    as `run_config`."""
    avail = jax.devices()
    if max(device_counts) > len(avail):
        raise SystemExit(f"--devices {max(device_counts)} asked, but only {len(avail)} devices are visible: {avail}")
    if not 0 <= warmup < steps:
        raise SystemExit(f"--warmup {warmup} must be in [0, --steps {steps})")
    overrides = [*DEFAULT_SETS, *overrides]
    for path in configs:  # every (config, device count) is valid before any device time is spent
        for n in device_counts:
            run_config(path, overrides, n, data, ep)
    out = []
    for path in configs:
        base = load_config(path, overrides)
        m = base.model
        batches = synthetic_tokens(seed, m.vocab_size, (steps, base.train.global_batch, m.context + 1))
        t0 = time.perf_counter()
        params, biases = host_state(base, base.train.seed)
        log(f"# {base.name}: initial state built in {time.perf_counter() - t0:.1f} s")
        records = []
        for n in sorted(set(device_counts), reverse=True):
            cfg = run_config(path, overrides, n, data, ep)
            rec = {"bench": "train_scale", "config": cfg.name, "config_file": path, "kind": cfg.ffn.kind,
                   "devices": n, "device": avail[0].device_kind, "date": date, "jax": jax.__version__,
                   "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch,
                   "context": m.context, "compute_dtype": m.compute_dtype, "kernels": cfg.ffn.kernels,
                   "hp_chunks": cfg.parallel.hp_chunks, **implementations(cfg),
                   "steps": steps, "warmup": warmup, "seed": seed, "overrides": overrides}
            try:
                rec.update(measure(cfg, avail[:n], params, biases, batches, warmup, base.train.seed,
                                   profile=profile, repeat=repeat))
                log(f"# {cfg.name} x{n}: mesh {rec['mesh']}, compile {rec['compile_s']:.1f} s, "
                    f"step {rec['step_s']:.3f} s, {rec['tokens_per_s']:.0f} tok/s, memory "
                    f"{fmt(rec['mem_compiled_gib'], '.1f')} GiB compiled / {fmt(rec['mem_peak_gib'], '.1f')} "
                    f"peak, losses {rec['losses']}, step times {[round(t, 4) for t in rec['step_times_s']]}"
                    + (f", again {rec['repeat_losses']} (bitwise: {rec['repeat_bitwise']})" if repeat else ""))
            except Exception as e:  # keep going: the other device counts are still worth measuring
                traceback.print_exc()
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            records.append(rec)
            jax.clear_caches()
            gc.collect()
        loss_check(records, tol)
        for r in sorted(records, key=lambda r: r["devices"]):
            emit(r)
        out += records
        del params, biases
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(records: list[dict]) -> str:
    lines = ["| config | devices | mesh | batch (micro x accum) | step s | tok/s | tok/s/dev | MFU | peak GiB "
             "(compiled) | compile s | empty expert groups | max loss diff abs / rel | ok |", "|" + "---|" * 13]
    for r in sorted(records, key=lambda r: (r["config"], r["devices"])):
        if "losses" not in r:
            lines.append(f"| {r['config']} | {r['devices']} | failed: {r.get('error', '?')[:80]} |" + " |" * 10)
            continue
        mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
        peak = fmt(r["mem_peak_gib"], ".1f") + ("" if r["mem_peak_exact"] in (True, None) else " (<=)")
        empty = [v["empty_groups"] for v in (r.get("routing") or {}).values()]  # over the MoE layers
        routing = f"{min(empty)}-{max(empty)} of {next(iter(r['routing'].values()))['groups']}" if empty else "-"
        lines.append(
            f"| {r['config']} | {r['devices']} | {mesh} | {r['global_batch']} ({r['micro_batch']} x {r['accum']}) | "
            f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_device']:.0f} | "
            f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' if r['mfu'] else ''} | "
            f"{peak} ({fmt(r['mem_compiled_gib'], '.1f')}) | {r['compile_s']:.1f} | {routing} | "
            f"{r['loss_max_abs_diff']:.2e} / {r['loss_max_rel_diff']:.2e} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", action="append", default=None, help="YAML config (repeatable)")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4], help="device counts to run")
    ap.add_argument("--data", type=int, default=1, help="data-parallel devices of each run (the rest: model axes)")
    ap.add_argument("--ep", type=int, default=1, help="MH-LatentMoE: ep devices splitting each head's experts "
                    "(mesh data x hp x ep)")
    ap.add_argument("--steps", type=int, default=4, help="train steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the median step time")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="config override, applied after the defaults " + " ".join(DEFAULT_SETS))
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative loss difference to the fewest devices")
    ap.add_argument("--seed", type=int, default=0, help="numpy seed of the synthetic tokens")
    ap.add_argument("--profile", action="store_true", help="trace one extra step: communication vs compute "
                    "kernel time and the ops with the most time")
    ap.add_argument("--repeat", action="store_true", help="run the steps again from the same initial state with the "
                    "same executable and report whether the losses are bitwise equal")
    args = ap.parse_args(argv)
    devs = jax.devices()
    print(f"# {len(devs)} x {devs[0].device_kind}, jax {jax.__version__}, backend {jax.default_backend()}", flush=True)
    if max(args.devices) > len(devs):
        print(f"# FAILED: --devices {max(args.devices)} asked, only {len(devs)} visible", flush=True)
        sys.exit(2)
    with JsonLines(args.out) as emit:
        try:
            recs = run(args.config or DEFAULT_CONFIGS, args.devices, args.steps, args.warmup, args.overrides,
                       args.tol, args.seed, today(), emit, log=lambda s: print(s, flush=True),
                       profile=args.profile, repeat=args.repeat, data=args.data, ep=args.ep)
        except ConfigError as e:
            print(f"# FAILED: {e}", flush=True)
            sys.exit(1)
    print(table(recs), flush=True)
    bad = [f"{r['config']} x{r['devices']}: " + (r.get("error") or f"loss rel diff {r['loss_max_rel_diff']:.3g} "
                                                 f"> tol {r['loss_tol']:g}") for r in recs if not r["ok"]]
    if bad:
        print("# FAILED: " + " | ".join(bad), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
