"""Trapezoidal learning-rate schedule (paper appendix A): linear warmup, constant, linear decay."""

from __future__ import annotations

import jax.numpy as jnp

from mhl_jax.config import OptimizerConfig, ScheduleConfig


def trapezoidal(step, peak: float, warmup: int, decay: int, total: int):
    """LR used by optimizer step `step` (0-based).

    warmup: peak * (step + 1) / warmup for step < warmup (so step warmup - 1 reaches the peak);
    constant peak until total - decay; then peak * (total - step) / decay (step total - 1: peak / decay).
    """
    step = jnp.asarray(step, jnp.float32)
    up = jnp.minimum(1.0, (step + 1.0) / max(warmup, 1)) if warmup > 0 else 1.0
    down = jnp.clip((total - step) / max(decay, 1), 0.0, 1.0) if decay > 0 else 1.0
    return peak * jnp.minimum(up, down)


def make_schedule(opt: OptimizerConfig, sched: ScheduleConfig):
    return lambda step: trapezoidal(step, opt.lr, sched.warmup_steps, sched.decay_steps, sched.total_steps)
