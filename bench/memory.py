"""Device memory of a run: how the train state is created, and which configs fit how many GPUs (JSON lines out).

    python -m bench.memory init --config configs/mh_latent_moe_hp_4.2b.yaml --set parallel.hp=2 [--out FILE]
    python -m bench.memory fit --config configs/mh_latent_moe_hp_4.2b.yaml [--set key=value ...] [--steps 4]
    python -m bench.memory state --config configs/mh_latent_moe_hp_4.2b.yaml --devices 8 [--set parallel.hp=2 ...]

init: the state (parameters, AdamW moments, biases) created two ways, each in a fresh process over every visible GPU:
`eager` (the whole model and its optimizer state built on the first GPU, then placed with `jax.device_put`: what
sharded creation saves) and `sharded`, `mhl_jax.runtime.state.init_state` (created under jit in its shardings).
Per mode: the largest per-GPU peak (`peak_bytes_in_use`), the time, or the error (out of memory).

fit: `train.py` with the config for `--steps` steps (built-in byte corpus, global batch 32, no evaluation or
checkpoint) in a fresh process with JAX's default allocator settings (as a user runs it, unless the environment sets
XLA_PYTHON_CLIENT_*): its memory line (XLA's estimate and the limit), its refusal if it has one, the measured peak
and the steady-state tokens/s from the summary line.

state: the train state's bytes on one device (the largest share), counted from its shapes and shardings on
`--devices` CPU host devices (no GPU, nothing created or compiled), with parallel.shard_optimizer off and on: the
parameters, AdamW's moments and the rest. A floor of the step's memory (XLA adds the gradients, activations and
temporaries); the GPU runs' "state and batch" figure is this plus the batch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import JsonLines, parser, today, user_env
from mhl_jax.config import load_config
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh, state_shardings
from mhl_jax.runtime.memory import GIB, device_limit, is_out_of_memory, peak_in_use, per_device_bytes
from mhl_jax.runtime.state import init_state, state_creator
from mhl_jax.train.optimizer import make_optimizer

ROOT = Path(__file__).resolve().parents[1]

BUILTIN = ["data.source=builtin", "data.path=", "data.val_path=", "data.tokenizer=byte", "data.eval_every=0",
           "checkpoint.every=0", "train.global_batch=32", "logging.progress_bar=false", "logging.log_every=1",
           "schedule.warmup_steps=1", "schedule.decay_steps=1"]


def eager_state(cfg, mesh, tx):
    """(graphdef, state): the whole model and its optimizer state built eagerly on the default device (not yet
    placed). The baseline of `init`, and tests/unit/test_memory.py's reference."""

    model = build_model(cfg, executor=make_executor(cfg, mesh), mesh=mesh)
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    return graphdef, {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0),
                      "rng": jax.random.key_data(jax.random.key(cfg.train.seed))}


def create(config: str, sets: list[str], mode: str) -> dict:
    """One mode of `init`, in this process."""

    cfg = load_config(config, sets)
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg)
    t0 = time.perf_counter()
    rec = {"mode": mode, "devices": mesh.size, "mesh": dict(mesh.shape)}
    try:
        if mode == "eager":
            _, state = eager_state(cfg, mesh, tx)
            state = jax.device_put(state, state_shardings(cfg, mesh, state))
        else:
            _, state, _ = init_state(cfg, mesh, tx)
        jax.block_until_ready(state)
        rec["state_gib_total"] = sum(a.nbytes for a in jax.tree.leaves(state)) / GIB
        rec["ok"] = True
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        rec.update(ok=False, error=str(e).splitlines()[0][:300])
    rec["s"] = time.perf_counter() - t0
    devices = jax.local_devices()
    rec["peak_gib_per_device"] = [round((peak_in_use([d]) or 0) / GIB, 2) for d in devices]
    rec["peak_gib_max"] = (peak_in_use(devices) or 0) / GIB
    rec["limit_gib"] = (device_limit(devices) or (0,))[0] / GIB
    return rec


def state_bytes(config: str, sets: list[str]) -> list[dict]:
    """`state`, in this process (its host devices set by the caller): per shard_optimizer setting, the bytes one
    device holds of each part of the state (the device holding the most)."""

    recs = []
    for on in (False, True):
        cfg = load_config(config, [*sets, f"parallel.shard_optimizer={str(on).lower()}"])
        mesh = make_mesh(cfg)
        abstract = state_creator(cfg, mesh, make_optimizer(cfg))[2]
        parts = {part: per_device_bytes(abstract[part]) for part in ("params", "opt_state")}
        total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
        recs.append({"shard_optimizer": on, "devices": mesh.size, "mesh": dict(mesh.shape),
                     "state_gib_total": round(total / GIB, 2), "params_gib_per_device": round(parts["params"] / GIB, 2),
                     "moments_gib_per_device": round(parts["opt_state"] / GIB, 2),
                     "state_gib_per_device": round((parts["params"] + parts["opt_state"]) / GIB, 2)})
    return recs


def fit(config: str, sets: list[str], steps: int, check: bool = False) -> dict:
    """One `fit` run: train.py in a fresh process (with `--check`: only its memory check), its lines read back."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "train.py", "--config", config,
                *sum((["--set", s] for s in [*BUILTIN, f"schedule.total_steps={steps}", *sets,
                                             f"logging.run_dir={tmp}/run"]), []), *(["--check"] if check else [])]
        t0 = time.perf_counter()
        r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                           env={**user_env(), "JAX_LOG_COMPILES": "1"})
        written = sorted(str(p.relative_to(tmp)) for p in Path(tmp).rglob("*"))
    out = r.stdout + r.stderr
    rec = {"config": Path(config).name, "sets": sets, "steps": steps, "check": check, "exit": r.returncode,
           "wall_s": round(time.perf_counter() - t0, 1)}
    if check:
        rec["written"] = written  # --check writes nothing
    m = re.search(r"train step memory per device \(XLA's estimate\): ([\d.]+) GiB = state and batch ([\d.]+) \+ "
                  r"activations and other temporaries ([\d.]+).*?(?:of ([\d.]+) GiB that JAX may allocate on each "
                  r"(.+?)(?: \(its allocator's limit.*)?)?$", out, re.M)
    if m:
        rec.update(estimate_gib=float(m[1]), state_gib=float(m[2]), temporaries_gib=float(m[3]),
                   limit_gib=float(m[4]) if m[4] else None, limit_device=m[5])
    rec["train_step_compiles"] = len(re.findall(r"Compiling jit\(train_step\)", out))
    m = re.search(r"peak device memory ([\d.]+) GiB", out)
    rec["peak_gib"] = float(m[1]) if m else None
    m = re.search(r"^done: .*?\| ([\d.]+)k tok/s", out, re.M)  # the summary line (JAX's compile log may follow)
    rec["tokens_per_s"] = float(m[1]) * 1e3 if m and r.returncode == 0 else None
    errors = [line for line in out.splitlines() if re.match(r"(config error|training stopped|\w+Error)", line)]
    rec["error"] = errors[-1][:600] if errors else None
    if r.returncode not in (0, 1, 2):
        rec["tail"] = out[-1500:]
    return rec


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("what", choices=["init", "fit", "state", "_create", "_state"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--devices", type=int, default=8, help="(state only) CPU host devices of the mesh")
    ap.add_argument("--mode", choices=["eager", "sharded"], default="sharded", help="(_create only)")
    ap.add_argument("--check", action="store_true", help="(fit only) train.py --check: the memory line alone")
    args = ap.parse_args(argv)
    if args.what == "_create":
        print("RESULT " + json.dumps(create(args.config, args.sets, args.mode)), flush=True)
        return
    if args.what == "_state":
        print("RESULT " + json.dumps(state_bytes(args.config, args.sets)), flush=True)
        return
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.split("\n")
    except FileNotFoundError:  # no NVIDIA driver: the CPU
        gpus = []
    gpus = [g.strip() for g in gpus if g.strip()] or ["cpu"]
    base = {"bench": f"memory_{args.what}", "device": f"{len(gpus)} x {gpus[0]}", "date": today(),
            "config": Path(args.config).name, "sets": args.sets,
            "env": {k: v for k, v in user_env().items() if k.startswith("XLA_PYTHON_CLIENT")}}
    recs = []
    if args.what == "init":
        for mode in ("eager", "sharded"):
            r = subprocess.run([sys.executable, "-m", "bench.memory", "_create", "--config", args.config, "--mode",
                                mode, *sum((["--set", s] for s in args.sets), [])], cwd=ROOT, capture_output=True,
                               text=True, env=user_env())
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            recs.append({**base, **(json.loads(line[7:]) if line else
                                    {"mode": mode, "ok": False, "exit": r.returncode, "tail": r.stderr[-1500:]})})
    elif args.what == "state":  # in a child process with that many host devices
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
        r = subprocess.run([sys.executable, "-m", "bench.memory", "_state", "--config", args.config,
                            *sum((["--set", s] for s in [f"parallel.devices={args.devices}", *args.sets]), [])],
                           cwd=ROOT, capture_output=True, text=True, env=env)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"state failed (exit {r.returncode}): {r.stderr[-1500:]}")
        base["device"] = "cpu (counted, nothing allocated)"
        recs += [{**base, **rec} for rec in json.loads(line[7:])]
    else:
        recs.append({**base, **fit(args.config, args.sets, args.steps, args.check)})
    with JsonLines(args.out) as emit:
        for rec in recs:
            emit(rec)


if __name__ == "__main__":
    main()
