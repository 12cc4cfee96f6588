"""Device memory of the train step: XLA's buffer assignment of the compiled step against what JAX may allocate.

`train.py` compiles the step before its first run and, before anything in the run directory is written, refuses a
step that cannot fit (ConfigError naming the figures and what to change) and logs the estimate; the run's summary
line gives the measured peak. A step that runs out of memory anyway (fragmentation; an estimate just under the
limit) stops with `out_of_memory_message`'s one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from mhl_jax.config import Config, ConfigError

GIB = 2**30


@dataclass(frozen=True)
class StepMemory:
    """Bytes per device of one compiled step (XLA's memory analysis)."""

    arguments: int  # the state and the batch
    outputs: int
    temporaries: int  # activations kept for the backward, gradients, workspace
    aliased: int  # outputs written into donated arguments (the new state over the old)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased


def step_memory(compiled) -> StepMemory | None:
    """The memory analysis of a compiled (`jax.jit(...).lower(...).compile()`) function; None where XLA gives none."""
    try:
        a = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if a is None:
        return None
    return StepMemory(int(a.argument_size_in_bytes), int(a.output_size_in_bytes), int(a.temp_size_in_bytes),
                      int(a.alias_size_in_bytes))


def _stats(device) -> dict:
    """The allocator's figures of `device` ({} where the platform reports none)."""
    return (device.memory_stats() if hasattr(device, "memory_stats") else None) or {}


def device_limit(devices) -> tuple[int, str] | None:
    """(bytes, device kind): the smallest allocation limit of `devices` (this process's), as JAX's allocator reports
    it (`memory_stats()['bytes_limit']`: on GPUs by default a fraction of the memory, XLA_PYTHON_CLIENT_MEM_FRACTION);
    None where the platform reports none (the CPU)."""
    best = None
    for d in devices:
        limit = _stats(d).get("bytes_limit")
        if limit and (best is None or limit < best[0]):
            best = (int(limit), d.device_kind)
    return best


def peak_in_use(devices) -> int | None:
    """The largest `peak_bytes_in_use` over `devices` (the allocator's high-water mark of this process); None on
    platforms that report none."""
    peaks = [p for p in (_stats(d).get("peak_bytes_in_use") for d in devices) if p]
    return max(peaks) if peaks else None


def describe(m: StepMemory, limit: tuple[int, str] | None) -> str:
    """The start-up line: the step's memory per device and, where known, the limit it must fit."""
    text = (f"train step memory per device (XLA's estimate): {m.total / GIB:.2f} GiB = state and batch "
            f"{m.arguments / GIB:.2f} + activations and other temporaries {m.temporaries / GIB:.2f}"
            + (f" + outputs not written in place {(m.outputs - m.aliased) / GIB:.2f}"
               if m.outputs - m.aliased >= 0.005 * GIB else ""))
    if limit is not None:
        text += (f", of {limit[0] / GIB:.2f} GiB that JAX may allocate on each {limit[1]} (its allocator's limit: "
                 "XLA_PYTHON_CLIENT_MEM_FRACTION)")
    return text


def amount(nbytes: int) -> str:
    """A byte count as the memory lines print it: GiB from 0.1 GiB up, MiB below."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / 2**20:.1f} MiB"


def per_device_bytes(tree) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs (with shardings) on the device that holds the most of it."""
    held: dict = {}
    for a in jax.tree.leaves(tree):
        shard = a.dtype.itemsize
        for n in a.sharding.shard_shape(a.shape):
            shard *= n
        for d in a.sharding.device_set:
            held[d] = held.get(d, 0) + shard
    return max(held.values(), default=0)


def check_fits(m: StepMemory, limit: tuple[int, str] | None, cfg: Config, devices: int,
               shard_saving: int = 0, moment_saving: int = 0) -> None:
    """ConfigError when the step cannot fit the limit (it would run out of memory at its first run), naming the
    figures and what to change. shard_saving: the bytes per device that parallel.shard_optimizer would save
    (`mhl_jax.train.state.shard_optimizer_saving`; 0: none, or it is on); moment_saving: those that
    optimizer.moment_dtype=bfloat16 would (`mhl_jax.train.state.moment_dtype_saving`)."""
    if limit is None or m.total <= limit[0]:
        return
    # MH-LatentMoE splits its experts by head first; once hp has reached the head count, ep splits each head's
    # experts further (the data x hp x ep mesh)
    heads_split = cfg.ffn.kind == "mh_latent_moe" and cfg.parallel.hp < cfg.ffn.num_heads
    axis = "hp" if heads_split else "ep"
    inner = cfg.parallel.hp if axis == "hp" else cfg.parallel.ep
    state_fits = m.arguments + m.outputs - m.aliased <= limit[0]
    hints = []
    if cfg.ffn.kind != "mlp":
        hints.append(f"more devices with a larger parallel.{axis} (now {inner}: it splits the expert weights and "
                     "their optimizer state)")
    if shard_saving > 0:
        hints.append(f"parallel.shard_optimizer=true ({amount(shard_saving)} less per device: it splits AdamW's "
                     "moments over the devices that now hold copies of them)")
    if moment_saving > 0:
        hints.append(f"optimizer.moment_dtype=bfloat16 ({amount(moment_saving)} less per device: AdamW's moments "
                     "stored in bf16 between steps)")
    if state_fits and cfg.train.micro_batch > 1:
        hints.append(f"a smaller train.micro_batch (now {cfg.train.micro_batch}; the activations scale with it)")
    if state_fits and cfg.model.remat == "none":
        hints.append("model.remat=block (the backward keeps only each block's input and recomputes the block: fewer "
                     "activations kept, one more forward pass)")
    hints.append("a higher allocation limit if the device has more memory (XLA_PYTHON_CLIENT_MEM_FRACTION, e.g. 0.95)")
    raise ConfigError(f"the train step needs {m.total / GIB:.2f} GiB per device on {devices} device(s) (XLA's "
                      f"estimate: state and batch {m.arguments / GIB:.2f} GiB, activations and other temporaries "
                      f"{m.temporaries / GIB:.2f} GiB), more than the {limit[0] / GIB:.2f} GiB that JAX may "
                      f"allocate on each {limit[1]}; try " + ", or ".join(hints))


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is XLA's out-of-memory error (a JaxRuntimeError saying RESOURCE_EXHAUSTED: out of memory)."""
    text = str(e)
    return (isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in text
            and "out of memory" in text.lower())


def out_of_memory_message(e: BaseException, estimate: StepMemory | None, phase: str) -> str:
    """One line for an out-of-memory error: what the run was doing, the step's estimate and XLA's first line."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    est = f"; the train step was estimated at {estimate.total / GIB:.2f} GiB per device" if estimate is not None else ""
    return (f"out of memory on the device while {phase}{est}: {first[:300]} (a smaller train.micro_batch or more "
            "devices, parallel.hp / parallel.ep, lower the step's memory; memory other processes hold on the device "
            "counts too)")


class DeviceMemoryError(RuntimeError):
    """The run ran out of device memory (train.py prints its one line and exits with status 1)."""
