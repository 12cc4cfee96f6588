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
