"""Learning-rate schedule: linear warmup, constant, decay (paper appendix A: the trapezoid, a linear decay to 0);
the decay may be a cosine, and may end above 0."""

from __future__ import annotations

import math

import jax.numpy as jnp

from mhl_jax.config import OptimizerConfig, ScheduleConfig


def trapezoidal(step, peak: float, warmup: int, decay: int, total: int, shape: str = "linear",
                final_ratio: float = 0.0):
    """LR used by optimizer step `step` (0-based).

    warmup: peak * (step + 1) / warmup for step < warmup (so step warmup - 1 reaches the peak);
    constant peak until total - decay; then the decay d = (total - step) / decay, from 1 to 0 (step total - 1:
    1 / decay): peak * (final_ratio + (1 - final_ratio) * f(d)) with f(d) = d (linear) or (1 - cos(pi d)) / 2
    (cosine). With the defaults (linear, 0) it is the paper's trapezoid.
    """
    step = jnp.asarray(step, jnp.float32)
    up = jnp.minimum(1.0, (step + 1.0) / max(warmup, 1)) if warmup > 0 else 1.0
    if decay <= 0:
        return peak * jnp.minimum(up, 1.0)
    down = jnp.clip((total - step) / max(decay, 1), 0.0, 1.0)
    if shape == "cosine":
        down = 0.5 * (1.0 - jnp.cos(math.pi * down))
    elif shape != "linear":
        raise ValueError(f"schedule.decay={shape!r}: expected 'linear' or 'cosine'")
    return peak * jnp.minimum(up, final_ratio + (1.0 - final_ratio) * down)


def make_schedule(opt: OptimizerConfig, sched: ScheduleConfig):
    return lambda step: trapezoidal(step, opt.lr, sched.warmup_steps, sched.decay_steps, sched.total_steps,
                                    sched.decay, sched.final_lr_ratio)
