"""A trained run's model read back from its run directory: the config.yaml, with overrides, and the parameters and
balancing biases of one checkpoint (never its optimizer state), placed on the config's mesh.

Nothing in the run directory is written or cleaned up (the checkpoint is opened read-only), so a run that is still
training there is not disturbed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from mhl_jax.config import Config, ConfigError, load_config, saved_config
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.autotune import autotune_file
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.runtime.errors import CheckpointError
from mhl_jax.runtime.state import state_creator


@dataclasses.dataclass
class Loaded:
    """A checkpoint's model, placed on the config's mesh."""

    cfg: Config
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    params: nnx.State
    biases: nnx.State
    step: int
    compiler_options: dict = dataclasses.field(default_factory=dict)  # the run's autotuning results (GPU)
    # generate's jitted functions per sampler (`mhl_jax.generation._generation_fns`): they compile once for this model
    jitted: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


def run_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of run `run_dir` (its config.yaml) with `overrides`."""
    saved = saved_config(run_dir)
    pairs = [[part.strip() for part in o.split("=", 1)] for o in overrides if "=" in o]
    micro = [value for key, value in pairs if key == "train.micro_batch"]
    if micro and micro[-1].isdigit() and all(key != "train.global_batch" for key, _ in pairs):
        # the evaluation's batch is micro_batch x devices and the run's global batch means nothing here; the config
        # must still be consistent (global a multiple of micro), so it gets a global batch of one micro-batch
        overrides = [*overrides, f"train.global_batch={micro[-1]}"]
    return load_config(str(saved), overrides)


def load_run(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), step: int | None = None,
             checkpoint: str | Path | None = None, cfg: Config | None = None) -> Loaded:
    """The model of run `run_dir` (its config.yaml with `overrides`, or `cfg` as `run_config` read it already) at
    checkpoint `step` (default: the latest) of its checkpoints/ directory, or at the explicit `checkpoint` path (a
    step directory or a directory of them)."""
    if jax.process_count() > 1:
        raise ConfigError(f"mhl_jax.infer runs as one process; this is one of {jax.process_count()}")
    run = Path(run_dir).expanduser()
    cfg = run_config(run_dir, overrides) if cfg is None else cfg
    mesh = make_mesh(cfg)
    graphdef, _, abstract = state_creator(cfg, mesh)  # shapes only: nothing is created
    if checkpoint is not None:
        where = Path(checkpoint).expanduser()
        if not where.is_dir():
            raise CheckpointError(f"checkpoint path {str(checkpoint)!r} does not exist (or is not a directory)")
        directory = where.parent
    else:
        directory = run / "checkpoints"
        if not directory.is_dir():
            raise CheckpointError(f"run directory {str(run_dir)!r} holds no checkpoints/ directory (did the run save "
                                  "one? checkpoint.every)")
    with Checkpointer(directory, cfg.checkpoint, model_fingerprint(cfg), read_only=True) as ckpt:
        at, parts = ckpt.restore_parts({"params": abstract["params"], "biases": abstract["biases"]}, step=step,
                                       path=checkpoint)
    # the run's XLA autotuning results, loaded (never written): the kernels its own processes compiled with
    tuned = autotune_file(cfg.train.xla_autotune_file, run.resolve(), None, jax.default_backend())
    options = {"xla_gpu_load_autotune_results_from": str(tuned.load)} if tuned.load is not None else {}
    return Loaded(cfg, mesh, graphdef, parts["params"], parts["biases"], at, options)
