"""Throughput, MFU and the progress line."""

from __future__ import annotations

import jax

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
    """Tokens/s from the times at which the host finishes steps (fetches their metrics), robust to fetch-ahead.

    A step is finished either *ahead* (after the next step was dispatched) or *drained* (before: the steps that
    evaluate, checkpoint or end the run). The two kinds see the device in different phases: on a GPU the host's
    dispatch of a large step returns only shortly before that step ends (~30 ms for the 2.2B MH-LatentMoE step on an
    H100, 2026-11-27; CUDA's launch queue full, we infer: bench/NOTES.md "Progress-line throughput"), so an ahead
    finish of step n happens near the end of step n + 1, while a drained one happens at the end of step n. The
    interval between two finishes of one kind is one step; an interval between kinds is not (it misses or adds up to
    a step), so it is left out of the rates: a step's own rate and a progress line's are taken over the like-kind
    intervals only, falling back to the latest such rate (or, before the first, to the raw interval, which then
    includes compilation).

    `pause(now)` marks time that is not training (evaluation, checkpoint, trace writing): the next interval starts
    there and keeps the kind of the step before it."""

    def __init__(self, tokens_per_step: int, now: float):
        self.tokens = tokens_per_step
        self.last = now
        self.kind: bool | None = None  # ahead (True) / drained (False) of the last finish; None before the first
        self.window_steps, self.window_s = 0, 0.0  # like-kind intervals since the last progress line
        self.latest: float | None = None  # the latest like-kind interval's rate
        self.raw: float | None = None  # the latest interval's rate, whatever its kind

    def finish(self, now: float, ahead: bool) -> float:
        """Step finished at `now` (`ahead`: after the next step's dispatch); returns its tokens/s estimate."""
        dt = max(now - self.last, 1e-9)
        self.raw = self.tokens / dt
        if self.kind is not None and self.kind == ahead:
            self.window_steps += 1
            self.window_s += dt
            self.latest = self.raw
        self.kind, self.last = ahead, now
        return self.latest if self.latest is not None else self.raw

    def pause(self, now: float) -> None:
        self.last = now

    def line(self) -> float:
        """Tokens/s over the like-kind intervals since the previous call (the progress line's), then a new window."""
        rate = self.tokens * self.window_steps / self.window_s if self.window_steps else (
            self.latest if self.latest is not None else self.raw)
        self.window_steps, self.window_s = 0, 0.0
        return rate


def format_line(step: int, total: int, m: dict) -> str:
    """One progress line: loss, lr, grad norm, tokens/s, MFU, expert load (max/min vs uniform) per layer."""
    parts = [f"step {step}/{total}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}",
             f"{m['tokens_per_s'] / 1e3:.1f}k tok/s"]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    layers = sorted(int(k.split("/")[1]) for k in m if k.startswith("load_max/"))
    if layers:
        loads = " ".join(f"L{i} {m[f'load_max/{i}']:.2f}/{m[f'load_min/{i}']:.2f}" for i in layers)
        parts.append(f"load max/min {loads}")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} val_ppl {m['val_ppl']:.2f}")
    return " | ".join(parts)
