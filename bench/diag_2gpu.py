"""Diagnose a 1- vs 2-device difference: per-leaf gradients of one micro-batch and the state after
one whole train step, for the small HP and EP models of bench/train_2gpu.py (fp32, highest precision).

    python bench/diag_2gpu.py [--kinds mh_latent_moe moe]

Prints, per model, the loss of both and the 8 leaves with the largest relative difference (max |a-b|
over max |b|) for (1) the gradients of one micro-batch and (2) the params after one train step.
"""

from __future__ import annotations

import argparse
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

from bench.train_2gpu import ACCUM, BATCH, SEQ, small_config  # noqa: E402
from mhl_jax.model.balancing import RouterBias  # noqa: E402
from mhl_jax.model.gpt import build_model  # noqa: E402
from mhl_jax.parallel.executors import make_executor  # noqa: E402
from mhl_jax.parallel.mesh import batch_spec, make_mesh, state_shardings  # noqa: E402
from mhl_jax.train.optimizer import make_optimizer  # noqa: E402
from mhl_jax.train.schedule import make_schedule  # noqa: E402
from mhl_jax.train.step import jit_train_step, loss_fn  # noqa: E402


def run(kind: str, n: int, batch: np.ndarray):
    cfg = small_config(kind, n)
    mesh = make_mesh(cfg, jax.devices()[:n])
    graphdef, params, biases = nnx.split(build_model(cfg, seed=0, executor=make_executor(cfg, mesh), mesh=mesh),
                                         nnx.Param, RouterBias)
    tx = make_optimizer(cfg)
    state = {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0)}
    sh = state_shardings(cfg, mesh, state)
    bsh = NamedSharding(mesh, batch_spec(mesh))
    state = jax.device_put(state, sh)
    grad = jax.jit(jax.value_and_grad(lambda p, b, t: loss_fn(graphdef, p, b, t), has_aux=True))
    micro = NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    (loss, _), g = grad(state["params"], state["biases"], jax.device_put(batch[0], micro))
    step = jit_train_step(graphdef, tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule), sh, bsh)
    new, _ = step(state, jax.device_put(batch, bsh))
    return float(loss), jax.device_get(g), jax.device_get(new["params"])


def worst(a, b, top: int = 8) -> list[str]:
    fa, _ = jax.tree_util.tree_flatten_with_path(a)
    fb = jax.tree_util.tree_leaves(b)
    rows = []
    for (path, x), y in zip(fa, fb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        rows.append((float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)), jax.tree_util.keystr(path)))
    rows.sort(reverse=True)
    return [f"{d:.2e} {p}" for d, p in rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kinds", nargs="+", default=["mh_latent_moe", "moe"])
    args = ap.parse_args()
    batch = np.random.default_rng(0).integers(0, 512, (ACCUM, BATCH, SEQ + 1), dtype=np.int32)
    with jax.default_matmul_precision("highest"):
        for kind in args.kinds:
            l1, g1, p1 = run(kind, 1, batch)
            l2, g2, p2 = run(kind, 2, batch)
            print(f"== {kind}: loss 1 dev {l1:.9f}, 2 dev {l2:.9f}", flush=True)
            print("  grads (one micro-batch), worst leaves:\n    " + "\n    ".join(worst(g2, g1)), flush=True)
            print("  params after one step, worst leaves:\n    " + "\n    ".join(worst(p2, p1)), flush=True)


if __name__ == "__main__":
    main()
