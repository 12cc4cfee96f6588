"""Expert-load maps: how each MoE layer's routed slots spread over its experts as a run trains.

A run writes every MoE layer's routed-slot counts per (head, expert) to `loads.jsonl` every `logging.loads_every`
steps (and at its last step). `python -m mhl_jax.compare --plot-load RUN` draws them: per layer, a heatmap of each
expert's load relative to uniform (1.0: its fair share of its head's slots) over the recorded steps, experts grouped
by head; and beside it the largest and smallest relative load over every step (from metrics.jsonl). Balancing at
work shows as a map that fades to white (every expert at its share) and a spread that closes towards 1; a collapse as
rows that stay dark blue (experts never picked) or red, and a maximum that stays far above 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mhl_jax.config import ConfigError
from mhl_jax.plots import pyplot, save

LOADS = "loads.jsonl"


def read_loads(run_dir: str | Path) -> tuple[list[int], dict[int, np.ndarray]]:
    """(the recorded steps, {layer: counts (steps, H, Ne)}) of a run's loads.jsonl, in step order (the last line of
    a step, should one repeat). ConfigError for a missing file or a line that is not a loads record."""
    path = Path(run_dir) / LOADS
    if not path.is_file():
        raise ConfigError(f"run {str(run_dir)!r} holds no {LOADS} (it records per-expert loads every "
                          "logging.loads_every steps; was that 0, or has the run not reached the first?)")
    by_step: dict[int, dict] = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            by_step[int(rec["step"])] = {int(k): np.asarray(v, dtype=np.int64) for k, v in rec["loads"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{path}: line {i} is not a loads record ({type(e).__name__}: {e})") from e
    if not by_step:
        raise ConfigError(f"{path} holds no records yet")
    steps = sorted(by_step)
    layers = sorted(by_step[steps[-1]])
    for s in steps:
        if sorted(by_step[s]) != layers or any(by_step[s][k].shape != by_step[steps[-1]][k].shape for k in layers):
            raise ConfigError(f"{path}: step {s} records other layers or shapes than step {steps[-1]} (a run whose "
                              "model changed? a model change starts a new run directory)")
    return steps, {k: np.stack([by_step[s][k] for s in steps]) for k in layers}


def relative_loads(counts: np.ndarray) -> np.ndarray:
    """counts (..., Ne) -> each expert's share of its head's slots times Ne (1.0: uniform), as `load_stats` does."""
    counts = counts.astype(np.float64)
    return counts / np.maximum(counts.sum(-1, keepdims=True), 1.0) * counts.shape[-1]


def plot_loads(run_dir: str | Path, out: str | Path, records: list[dict]) -> None:
    """Draw the load maps of `run_dir` into the image file `out`; `records`: its metrics records (the spreads)."""
    steps, loads = read_loads(run_dir)
    if not loads:  # a dense run records {"loads": {}} at each step
        raise ConfigError(f"run {str(run_dir)!r} has no MoE layers: no expert loads to plot")
    plt = pyplot("--plot-load")
    from matplotlib.colors import TwoSlopeNorm

    # column i covers steps (steps[i-1], steps[i]]: the last ends at the last record, as the spreads beside it do
    edges = np.asarray([steps[0] - (steps[1] - steps[0] if len(steps) > 1 else 1), *steps], dtype=np.float64)
    fig, axes = plt.subplots(len(loads), 2, figsize=(13, 2.6 * len(loads)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for (ax_map, ax_spread), (layer, counts) in zip(axes, loads.items()):
        _, heads, experts = counts.shape
        rel = relative_loads(counts).reshape(len(steps), heads * experts).T  # rows: head-major experts
        # white at a fair share, red above it, blue below (dark blue: never picked)
        norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(rel.max())))
        im = ax_map.pcolormesh(edges, np.arange(heads * experts + 1), rel, cmap="RdBu_r", norm=norm)
        ax_map.set_ylim(heads * experts, 0)
        for h in range(1, heads):
            ax_map.axhline(h * experts, color="black", linewidth=0.5)
        ax_map.set_yticks([(h + 0.5) * experts for h in range(heads)], [f"head {h}" for h in range(heads)])
        ax_map.set_title(f"layer {layer}: expert load / uniform ({heads} x {experts} experts)")
        ax_map.set_xlabel("step")
        fig.colorbar(im, ax=ax_map, fraction=0.03)
        spread = [(r["step"], r[f"load_max/{layer}"], r[f"load_min/{layer}"]) for r in records
                  if f"load_max/{layer}" in r]
        if spread:
            s, hi, lo = zip(*spread)
            ax_spread.plot(s, hi, label="max")
            ax_spread.plot(s, lo, label="min")
            ax_spread.legend()
        ax_spread.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax_spread.set_title(f"layer {layer}: largest and smallest load / uniform")
        ax_spread.set_xlabel("step")
        ax_spread.grid(alpha=0.3)
    fig.tight_layout()
    save(fig, out, "--out", dpi=100)
