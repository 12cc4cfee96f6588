"""Determinism of the train step: the same steps twice in one process (run-to-run), and on 1 against 2 devices.

    python -m bench.determinism [--kinds mh_latent_moe moe] [--kernels reference triton]
                                [--options default xladet none] [--attention xla cudnn] [--dtype float32]
                                [--steps 3] [--devices 1|2] [--out FILE]

Small fp32 models (`small_config`: 2 layers, d_model 256, 16 experts of 128, k 4; the same random batch every step,
so the loss must fall) through the train step as train.py compiles it (`jit_train_step`: AdamW, gradient
accumulation, bias update).
--devices 1 (default): per (kind, kernels, attention, options) one JSON line with the losses of two runs in this
process as float32 bit patterns (hex) and whether they are equal; compare the printed bits of two invocations for
repeatability across processes. options: `default` = `jit_train_step`'s (all-reduce code motion off); `xladet` =
those plus xla_gpu_exclude_nondeterministic_ops (train.xla_deterministic_ops); `none` = XLA's defaults.
--devices 2: per kind, the losses on one device against those under Head Parallel (hp = 2, MH-LatentMoE) or Expert
Parallel (ep = 2, MoE; ragged_all_to_all on GPU), highest matmul precision: a difference is reduction order only
(e.g. EP's router-gradient reduce-scatter), amplified a little by Adam; `ok` when within --tol.
"""

from __future__ import annotations

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from bench.common import JsonLines, error_text, parser
from mhl_jax.config import Config, load_config
from mhl_jax.model.attention import attention_impl
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import batch_spec, make_mesh, state_shardings
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.schedule import make_schedule
from mhl_jax.train.step import jit_train_step, train_step_compiler_options

SEQ, BATCH, ACCUM = 128, 8, 2
OPTIONS = {"default": None, "xladet": train_step_compiler_options(deterministic=True), "none": {}}


def small_config(kind: str, model_axis: int, gamma: float = 0.0, kernels: str = "reference",
                 attention: str = "xla", dtype: str = "float32") -> Config:
    """A small `kind` model with `model_axis` devices on its model axis (hp for MH-LatentMoE, ep otherwise)."""
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
    """(losses of len(batches) train steps of `cfg` on `devices`, the executor's repr); batches (steps, ACCUM, BATCH,
    SEQ + 1). grad_norms: a list that gets each step's gradient norm."""
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
                          cudnn_attention=attention_impl(cfg.model.attention_impl, cfg.model.compute_dtype) == "cudnn",
                          compiler_options=compiler_options)
    state = jax.device_put(state, sh)
    losses = []
    for b in batches:
        state, metrics = step(state, jax.device_put(b, bsh))
        losses.append(float(metrics["loss"]))
        if grad_norms is not None:
            grad_norms.append(float(metrics["grad_norm"]))
    return losses, repr(executor)


def one_batch(steps: int, seed: int) -> np.ndarray:
    """One random token batch, every step: the model can fit it, so the losses must fall."""
    batch = np.random.default_rng(seed).integers(0, 512, (ACCUM, BATCH, SEQ + 1), dtype=np.int32)
    return np.broadcast_to(batch, (steps,) + batch.shape)


def one_vs_two_devices(steps: int = 5, tol: float = 1e-4, gamma: float = 0.0, log=print) -> list[dict]:
    """Both models on 1 and 2 devices; one record per model; raises AssertionError when they disagree."""
    devices = jax.devices()
    if len(devices) < 2:
        raise RuntimeError(f"1 vs 2 devices needs 2 devices, found {len(devices)}: {devices}")
    records, failures = [], []
    with jax.default_matmul_precision("highest"):
        for kind in ("mh_latent_moe", "moe"):
            batches = one_batch(steps, 0)
            g1, g2 = [], []
            one, ex1 = train_losses(small_config(kind, 1, gamma), devices[:1], batches, None, g1)
            two, ex2 = train_losses(small_config(kind, 2, gamma), devices[:2], batches, None, g2)
            diff = float(np.max(np.abs(np.asarray(one) - np.asarray(two))))
            rec = {"bench": "determinism_devices", "kind": kind, "executor_1": ex1, "executor_2": ex2,
                   "device": devices[0].device_kind, "gamma": gamma, "losses_1": one, "losses_2": two,
                   "max_abs_diff": diff, "grad_norms_1": g1, "grad_norms_2": g2,
                   "ok": bool(diff <= tol and all(np.isfinite(one)) and all(np.isfinite(two)) and one[-1] < one[0])}
            log(rec)
            records.append(rec)
            if not rec["ok"]:
                failures.append(f"{kind}: max |loss_1 - loss_2| = {diff:.3g} (tol {tol:g}); losses {one} / {two}")
    if failures:
        raise AssertionError("; ".join(failures))
    return records


def run_to_run(args, emit) -> None:
    """Per (kind, kernels, attention, options): the same steps twice in this process."""
    batches = one_batch(args.steps, 1)
    for kind in args.kinds:
        for kernels, attention, opt in itertools.product(args.kernels, args.attention, args.options):
            cfg = small_config(kind, 1, kernels=kernels, attention=attention, dtype=args.dtype)
            options = OPTIONS[opt]  # None: what jit_train_step picks for this config
            shown = train_step_compiler_options(False, attention == "cudnn") if options is None else options
            rec = dict(bench="determinism", kind=kind, kernels=kernels, attention=attention, dtype=args.dtype,
                       options=opt, compiler_options=shown, device=jax.devices()[0].device_kind)
            try:
                runs = [train_losses(cfg, jax.devices()[:1], batches, options)[0] for _ in range(2)]
                rec["losses_hex"] = [[np.float32(v).tobytes().hex() for v in r] for r in runs]
                rec["losses"] = runs[0]
                rec["equal_in_process"] = runs[0] == runs[1]
            except Exception as e:  # recorded, the next case runs
                rec["error"] = error_text(e)
            emit(rec)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--kinds", nargs="+", default=["mh_latent_moe", "moe"])
    ap.add_argument("--kernels", nargs="+", default=["reference"])
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--attention", nargs="+", default=["xla"], choices=["xla", "cudnn"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (cudnn: bf16)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--devices", type=int, default=1, choices=[1, 2], help="2: losses on 1 against 2 devices")
    ap.add_argument("--tol", type=float, default=1e-4, help="--devices 2: max |loss difference|")
    args = ap.parse_args(argv)
    with JsonLines(args.out) as emit:
        if args.devices == 1:
            run_to_run(args, emit)
            return
        try:
            one_vs_two_devices(max(args.steps, 2), args.tol, log=emit)
        except AssertionError as e:
            sys.exit(f"1 vs 2 devices disagree: {e}")


if __name__ == "__main__":
    main()
