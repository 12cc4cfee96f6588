"""A run directory as train.py leaves it, made in a second: config.yaml and one checkpoint of a freshly built tiny
model with random weights (for the tests of what reads a run: export, lm-eval)."""

import jax
import numpy as np
from flax import nnx

from mhl_jax.config import dump_config, load_config
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from tests.runs import ROOT


def saved_random_run(tmp_path, kind: str, *sets: str, step: int = 3):
    """tmp_path/kind holding config.yaml and a checkpoint of `step` of configs/tiny_<kind>.yaml cut to 2 layers (a
    dense stem layer, then the FFN of `kind`) and context 32, with `sets`; its balancing biases random so that they
    change which experts are chosen. Returns (run directory, the model, its config)."""
    run = tmp_path / kind
    cfg = load_config(str(ROOT / f"configs/tiny_{kind}.yaml"), [
        "model.n_layers=2", "model.context=32", "parallel.devices=1", f"logging.run_dir={run}", *sets])
    # random weights, drawn in numpy: building the model eagerly would compile each of its initialisers
    graphdef, params, biases = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, RouterBias)
    rng = np.random.default_rng(1)

    def draw(part, scale):
        return jax.tree.map(lambda a: (scale * rng.standard_normal(a.shape)).astype(np.float32), part)

    params, biases = draw(params, 0.1), draw(biases, 0.05)
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    with Checkpointer(run / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ck:
        ck.save(step, {"params": params, "biases": biases, "step": np.int32(step)}, None)
    return run, nnx.merge(graphdef, params, biases), cfg
