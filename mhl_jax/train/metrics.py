"""Throughput, MFU and the progress line."""

from __future__ import annotations

import jax

from mhl_jax.config import ConfigError

# Dense bf16 tensor-core peak (datasheet, FLOP/s per device), for MFU. Override: logging.peak_tflops.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def device_peak_flops(override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (CPU): MFU is then not reported."""
    if override_tflops is not None:
        return override_tflops * 1e12
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_BF16_FLOPS.items():
        if name in kind:
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_s: float, num_devices: int, peak: float | None) -> float | None:
    if peak is None:
        return None
    return flops_per_token * tokens_per_s / (peak * num_devices)


class StepClock:
    """Tokens/s from the times at which the host finishes steps (fetches their metrics), with fetch-ahead.

    A step is finished either *ahead* (after the next step was dispatched) or *drained* (before: the steps that
    evaluate, checkpoint, end the run or end a profile). The two kinds see the device in different phases: on a GPU
    the host's dispatch of a large step returns only shortly before that step ends (~30 ms before, for the 2.2B
    MH-LatentMoE step on an H100: CUDA's launch queue is full), so an ahead finish of step n happens near the end
    of step n + 1, while a drained one happens at the end of step n.
    Rates are therefore read over spans from one finish to the previous finish of the same kind, which hold whole
    steps in either phase: the span's training time (pauses left out) over its steps. Only local spans are read (at
    most one finish of the other kind between: 1 or 2 steps). A step's reading is its own span's, or else the latest
    reading; a progress line's is over the spans that ended since the previous line. Before any span, the mean since
    the start (which includes compilation).

    `pause(now)` marks time that is not training (evaluation, checkpoint, trace writing): it is left out of the
    spans."""

    def __init__(self, tokens_per_step: int, now: float):
        self.tokens = tokens_per_step
        self.last = now
        self.steps, self.train_s = 0, 0.0  # steps finished and training seconds since the start (pauses left out)
        self.marks: dict[bool, tuple[int, float]] = {}  # kind (ahead) -> (steps, train_s) at its latest finish
        self.window_steps, self.window_s = 0, 0.0  # the spans that ended since the previous line
        self.run_steps, self.run_s = 0, 0.0  # all spans read
        self.latest: float | None = None  # the latest span's reading

    def _mean(self) -> float:
        return self.tokens * self.steps / max(self.train_s, 1e-9)

    def finish(self, now: float, ahead: bool) -> float:
        """Step finished at `now` (`ahead`: after the next step's dispatch); returns its tokens/s reading."""
        self.train_s += max(now - self.last, 0.0)
        self.last = now
        self.steps += 1
        mark = self.marks.get(ahead)
        self.marks[ahead] = (self.steps, self.train_s)
        if mark is not None and self.steps - mark[0] <= 2:
            steps, secs = self.steps - mark[0], max(self.train_s - mark[1], 1e-9)
            self.window_steps += steps
            self.window_s += secs
            self.run_steps += steps
            self.run_s += secs
            self.latest = self.tokens * steps / secs
        return self.latest if self.latest is not None else self._mean()

    def pause(self, now: float) -> None:
        self.last = now

    def line(self) -> float:
        """Tokens/s for a progress line: over the spans that ended since the previous line."""
        if self.window_steps:
            rate = self.tokens * self.window_steps / self.window_s
        else:
            rate = self.latest if self.latest is not None else self._mean()
        self.window_steps, self.window_s = 0, 0.0
        return rate

    def overall(self) -> tuple[float, bool]:
        """(tokens/s, steady): over every span read so far (the run's summary), steady True; before any span, the
        mean since the start (compilation included), steady False."""
        if self.run_steps:
            return self.tokens * self.run_steps / self.run_s, True
        return self._mean(), False


def duration(seconds: float) -> str:
    """45s, 3m12s, 1h02m, 2d03h."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_line(step: int, total: int, m: dict) -> str:
    """One progress line: loss, lr, grad norm, tokens/s, MFU, the training time left (`eta_s`, when given), expert
    load (max/min vs uniform) per layer."""
    parts = [f"step {step}/{total}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}",
             f"{m['tokens_per_s'] / 1e3:.1f}k tok/s"]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if m.get("eta_s") is not None:
        parts.append(f"ETA {duration(m['eta_s'])}")
    layers = sorted(int(k.split("/")[1]) for k in m if k.startswith("load_max/"))
    if layers:
        loads = " ".join(f"L{i} {m[f'load_max/{i}']:.2f}/{m[f'load_min/{i}']:.2f}" for i in layers)
        parts.append(f"load max/min {loads}")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} val_ppl {m['val_ppl']:.2f}")
    return " | ".join(parts)


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics record's key: val_loss -> val/loss, load_max/3 -> load_max/3 (grouped by
    TensorBoard at the slash), the rest under train/."""
    if key.startswith("val_"):
        return "val/" + key[len("val_"):]
    return key if "/" in key else "train/" + key


def require_tensorboard():
    """The tensorboardX module, or a ConfigError saying how to get it (checked before a run writes anything)."""
    try:
        import tensorboardX
    except ImportError as e:
        raise ConfigError("logging.tensorboard=true needs the tensorboardX package (pip install tensorboardX, or "
                          "pip install -e '.[tensorboard]')") from e
    return tensorboardX


class TensorBoardLog:
    """Every step's numeric metrics as TensorBoard scalars (event files under `directory`, one per launch: a resumed
    run adds a file, and TensorBoard shows the steps it repeats from both)."""

    def __init__(self, directory) -> None:
        self._writer = require_tensorboard().SummaryWriter(str(directory), flush_secs=10)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tensorboard_tag(key), float(value), step)

    def close(self) -> None:
        self._writer.close()
