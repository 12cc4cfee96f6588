"""Item 5 of issue 4: a few training steps on 1 device and on 2 devices give the same losses.

    python bench/train_2gpu.py [--steps 5] [--tol 1e-4] [--gamma 0] [--options default none det nopass]

For a small MH-LatentMoE model (Head Parallel, hp = 2) and a small MoE model (Expert Parallel,
ep = 2; ragged_all_to_all on GPU), the same initial state and one random token batch (every step) go
through the train step (`jit_train_step`: AdamW, gradient accumulation, bias update) on a 1-device mesh
(LocalMoE) and on a 2-device mesh. Prints both loss lists and their max difference; exits non-zero
when a difference exceeds --tol, the loss does not fall, or fewer than 2 devices are present. fp32
compute with the highest matmul precision, so a difference is reduction order (e.g. the EP router
gradient's reduce-scatter), amplified a little by Adam's normalisation, never tf32 rounding.

--options picks the XLA compiler options of the step, one run per name: `default` (what train.py
uses: `train_step_compiler_options()`), `none` (XLA's defaults), `det` (only
xla_gpu_exclude_nondeterministic_ops), `nopass` (only the `while-loop-all-reduce-code-motion` pass off);
bench/NOTES.md, "Correctness on the GPUs", says what each gave.
--gamma sets the balancing bias step (default 0: off). With it on, one routing flip at a near-tie
changes an integer load by one and a bias by a whole gamma, so small differences can grow; the
balancing itself is checked on CPU (tests/parallel/test_parallel.py, loads exactly equal).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from mhl_jax.config import Config, load_config  # noqa: E402
from mhl_jax.model.attention import attention_impl  # noqa: E402
from mhl_jax.model.balancing import RouterBias  # noqa: E402
from mhl_jax.model.gpt import build_model  # noqa: E402
from mhl_jax.parallel.executors import make_executor  # noqa: E402
from mhl_jax.parallel.mesh import batch_spec, make_mesh, state_shardings  # noqa: E402
from mhl_jax.train.optimizer import make_optimizer  # noqa: E402
from mhl_jax.train.schedule import make_schedule  # noqa: E402
from mhl_jax.train.step import (  # noqa: E402
    DETERMINISTIC_OPTIONS,
    TRAIN_STEP_COMPILER_OPTIONS,
    jit_train_step,
    train_step_compiler_options,
)

SEQ, BATCH, ACCUM = 128, 8, 2
OPTIONS = {"default": None, "none": {}, "det": DETERMINISTIC_OPTIONS, "nopass": TRAIN_STEP_COMPILER_OPTIONS}


def small_config(kind: str, model_axis: int, gamma: float = 0.0, kernels: str = "reference",
                 attention: str = "xla", dtype: str = "float32") -> Config:
    par = f"parallel.hp={model_axis}" if kind == "mh_latent_moe" else f"parallel.ep={model_axis}"
    return load_config(None, [
        "model.vocab_size=512", "model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.head_dim=64",
        f"model.context={SEQ}", f"model.compute_dtype={dtype}", f"model.attention_impl={attention}",
        f"ffn.kind={kind}", "ffn.stem_layers=0", "ffn.num_heads=8", "ffn.head_dim=32", "ffn.latent_dim=256",
        "ffn.num_experts=16", "ffn.top_k=4", "ffn.expert_hidden=128", f"ffn.kernels={kernels}",
        par, f"train.global_batch={BATCH * ACCUM}", f"train.micro_batch={BATCH}", "optimizer.lr=3e-3",
        "schedule.warmup_steps=2", "schedule.decay_steps=2", "schedule.total_steps=100", f"ffn.balance_gamma={gamma}"])


def train_losses(cfg: Config, devices: list, batches: np.ndarray,
                 compiler_options: dict | None = None, grad_norms: list | None = None) -> tuple[list[float], str]:
    """Losses of len(batches) train steps of `cfg` on `devices`; batches (steps, ACCUM, BATCH, SEQ+1).
    grad_norms: a list that gets each step's gradient norm."""
    mesh = make_mesh(cfg, devices)
    executor = make_executor(cfg, mesh)
    graphdef, params, biases = nnx.split(build_model(cfg, seed=0, executor=executor, mesh=mesh), nnx.Param,
                                         RouterBias)
    tx = make_optimizer(cfg)
    state = {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0)}
    sh = state_shardings(cfg, mesh, state)
    bsh = NamedSharding(mesh, batch_spec(mesh))
    step = jit_train_step(graphdef, tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule), sh, bsh,
                          deterministic=cfg.train.xla_deterministic_ops,
                          cudnn_attention=attention_impl(cfg.model.attention_impl) == "cudnn",
                          compiler_options=compiler_options)
    state = jax.device_put(state, sh)
    losses = []
    for b in batches:
        state, metrics = step(state, jax.device_put(b, bsh))
        losses.append(float(metrics["loss"]))
        if grad_norms is not None:
            grad_norms.append(float(metrics["grad_norm"]))
    return losses, repr(executor)


def run(steps: int = 5, tol: float = 1e-4, gamma: float = 0.0, options: str = "default", log=print) -> list[dict]:
    """Both models on 1 and 2 devices, compiled with OPTIONS[options]; returns one record per model;
    raises if they disagree."""
    devices = jax.devices()
    if len(devices) < 2:
        raise RuntimeError(f"train_2gpu needs 2 devices, found {len(devices)}: {devices}")
    records, failures = [], []
    with jax.default_matmul_precision("highest"):
        for kind in ("mh_latent_moe", "moe"):
            # one random batch, every step: the model can fit it, so the losses must fall
            batch = np.random.default_rng(0).integers(0, 512, (ACCUM, BATCH, SEQ + 1), dtype=np.int32)
            batches = np.broadcast_to(batch, (steps,) + batch.shape)
            opts = OPTIONS[options]
            g1, g2 = [], []
            one, ex1 = train_losses(small_config(kind, 1, gamma), devices[:1], batches, opts, g1)
            two, ex2 = train_losses(small_config(kind, 2, gamma), devices[:2], batches, opts, g2)
            diff = float(np.max(np.abs(np.asarray(one) - np.asarray(two))))
            used = train_step_compiler_options() if opts is None else opts
            rec = {"bench": "train_2gpu", "kind": kind, "executor_1": ex1, "executor_2": ex2,
                   "device": devices[0].device_kind, "gamma": gamma, "options": options, "compiler_options": used,
                   "losses_1": one, "losses_2": two, "max_abs_diff": diff, "grad_norms_1": g1, "grad_norms_2": g2,
                   "ok": bool(diff <= tol and all(np.isfinite(one)) and all(np.isfinite(two)) and one[-1] < one[0])}
            log(json.dumps(rec))
            records.append(rec)
            if not rec["ok"]:
                failures.append(f"{kind}: max |loss_1 - loss_2| = {diff:.3g} (tol {tol:g}); losses {one} / {two}")
    if failures:
        raise AssertionError("; ".join(failures))
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--gamma", type=float, default=0.0)
    ap.add_argument("--options", nargs="+", choices=sorted(OPTIONS), default=["default"])
    args = ap.parse_args()
    failed = []
    for name in args.options:
        try:
            run(args.steps, args.tol, args.gamma, name)
        except AssertionError as e:
            print(f"options {name}: {e}", file=sys.stderr)
            failed.append(name)
    if failed:
        sys.exit(f"1 vs 2 devices disagree with options {failed}")


if __name__ == "__main__":
    main()
