"""What the end-to-end tests share: tiny runs of train.py (in this process or a fresh one), and reading back what a
run wrote (its records, its checkpoints' parameters, its directory's files)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from mhl_jax.config import load_config
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.runtime.state import state_creator
from mhl_jax.train.optimizer import make_optimizer

ROOT = Path(__file__).resolve().parents[1]


def common(run_dir, *extra):
    """train.py's arguments for the tiny MH-LatentMoE, 2 layers, 8 steps, evaluations and checkpoints every few."""
    return ["--config", "configs/tiny_mh_latent_moe.yaml",
            "--set", "schedule.total_steps=8", "--set", "schedule.warmup_steps=2", "--set", "schedule.decay_steps=2",
            "--set", "model.n_layers=2", "--set", "model.context=32", "--set", "train.global_batch=8",
            "--set", "train.micro_batch=4", "--set", "data.val_sequences=8", "--set", "data.eval_every=4",
            "--set", "checkpoint.every=2", "--set", "checkpoint.async_save=false",
            "--set", "logging.progress_bar=false", "--set", f"logging.run_dir={run_dir}", *extra]


def run(args, gpu=False, **kw):
    """`python train.py ARGS` in a fresh process, which must succeed (on the CPU unless `gpu`)."""
    env = {**os.environ, "XLA_FLAGS": "", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if gpu:
        env.pop("JAX_PLATFORMS", None)
        env.pop("TRITON_INTERPRET", None)
    else:
        env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, env=env, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(run_dir):
    """[(step, loss, val_loss or None)] of a run's metrics.jsonl."""
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in recs]


def final_params(run_dir, step=None):
    """Parameters of the newest checkpoint (or of `step`'s), read back through the library (flattened, as numpy)."""
    cfg = load_config(str(Path(run_dir) / "config.yaml"))
    _, params, biases = nnx.split(build_model(cfg), nnx.Param, RouterBias)
    tx = make_optimizer(cfg)
    template = {"params": params, "opt_state": tx.init(params), "biases": biases, "step": np.int32(0),
                "rng": jax.random.key_data(jax.random.key(0))}
    ck = Checkpointer(Path(run_dir) / "checkpoints", cfg.checkpoint, model_fingerprint(cfg))
    step, state = ck.restore(template, None, step=step)
    ck.close()
    return step, [np.asarray(x) for x in jax.tree.leaves(state)]


def final_state(run_dir):
    """(step, every leaf as numpy) of the run's newest checkpoint, restored on one device into the state's shapes
    (`state_creator`'s abstract state: no model is built, which, op by op, takes seconds)."""
    cfg = load_config(str(Path(run_dir) / "config.yaml"), ["parallel.devices=1"])
    _, _, abstract = state_creator(cfg, make_mesh(cfg), make_optimizer(cfg))
    with Checkpointer(Path(run_dir) / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ckpt:
        step, state = ckpt.restore(abstract)
    return step, [np.asarray(x) for x in jax.tree.leaves(state)]


def assert_same_state(a, b):
    """The newest checkpoints of runs `a` and `b`: the same step, every leaf bitwise equal."""
    (sa, la), (sb, lb) = final_params(a), final_params(b)
    assert sa == sb and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def tiny(tmp_path, *extra, config="tiny_mh_latent_moe"):
    """configs/<config>.yaml for an in-process `train`, 40 steps on one device, in tmp_path/run: 2 layers (the dense
    stem and one MoE layer), context 32, batch 8. The schedule has no decay, so the train step's program does not
    depend on total_steps: the tests that differ only in steps, evaluations, checkpoints or logging share one
    compilation (JAX's persistent cache)."""
    return load_config(str(ROOT / f"configs/{config}.yaml"), [
        "schedule.total_steps=40", "schedule.warmup_steps=2", "schedule.decay_steps=0", "model.n_layers=2",
        "model.context=32", "train.global_batch=8", "train.micro_batch=8", "data.eval_every=20",
        "data.val_sequences=8", "logging.progress_bar=false", "logging.log_every=20", "checkpoint.every=0",
        f"logging.run_dir={tmp_path / 'run'}", "parallel.devices=1", *extra])


def records(run_dir):
    """metrics.jsonl without the wall-clock fields."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in recs]


def dir_snapshot(path: Path) -> dict:
    """Every file under `path` -> its bytes (what a refused run must leave as it was)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}

