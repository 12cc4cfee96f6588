"""Compare training runs: a table of where each run stands, and optionally their loss curves.

    python -m mhl_jax.compare runs/mlp runs/moe runs/mh_latent_moe [--smooth 20] [--plot curves.png] [--json]
    python -m mhl_jax.compare --plot-load runs/mh_latent_moe [--out loads.png]

Each RUN_DIR is a `logging.run_dir` written by train.py; only its `config.yaml` and `metrics.jsonl` are read (a run
still training can be compared). Per run: the model (ffn.kind, active / total parameters, counted from the config's
shapes), the last step and the tokens seen by then (each step's train.global_batch x model.context, from the configs
a resumed run with changed settings kept), the training loss averaged over the last `--smooth` recorded steps, the
last validation loss and perplexity and their step, the median tokens/s and MFU over the records after the first
(which includes compilation; a resumed launch's first records include its own, which the median mostly leaves out),
and the largest expert load relative to uniform at the last step (1.00: perfect balance; MoE runs only). `--plot
FILE` draws the training loss (a moving average over `--smooth` steps) and the validation loss against tokens seen,
one line per run (needs matplotlib). `--plot-load RUN_DIR` draws one run's expert-load maps instead
(`mhl_jax.load_maps`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from mhl_jax.config import Config, ConfigError, load_config, saved_config
from mhl_jax.load_maps import plot_loads
from mhl_jax.model.params import count_params
from mhl_jax.plots import pyplot, save
from mhl_jax.runtime.errors import EXIT_BAD_INPUT, EXIT_OK


def _load(path: Path, run_dir) -> Config:
    if not path.read_text().strip():
        raise ConfigError(f"run {str(run_dir)!r}: {path.name} is empty")
    try:
        return load_config(str(path))
    except ConfigError as e:
        raise ConfigError(f"run {str(run_dir)!r}: {path.name}: {e}") from e


def read_run(run_dir: str | Path) -> tuple[Config, list[dict], list[tuple[int, Config]]]:
    """(config, metric records in step order (the last record of a step, should one repeat), earlier configs): the
    earlier configs are those a resumed run with changed settings kept (`config-until-stepN.yaml`, the config of steps
    up to N), as (N, config) in step order."""
    saved = saved_config(run_dir)
    run = saved.parent
    cfg = _load(saved, run_dir)
    earlier = sorted((int(p.stem[len("config-until-step"):]), _load(p, run_dir))
                     for p in run.glob("config-until-step*.yaml") if p.stem[len("config-until-step"):].isdigit())
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"run directory {str(run_dir)!r} holds no metrics.jsonl (has the run taken a step yet?)")
    lines = path.read_text().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    by_step = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # the last record, being written as we read: left out
                break
            raise ConfigError(f"{path}: line {n} is not JSON ({e.msg})") from e
        if not (isinstance(r, dict) and isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))
                and math.isfinite(r["loss"])):
            raise ConfigError(f"{path}: line {n} is not a train.py metrics record (an integer step and a finite loss "
                              "expected)")
        by_step[r["step"]] = r
    if not by_step:
        raise ConfigError(f"{path} holds no records yet")
    return cfg, [by_step[k] for k in sorted(by_step)], earlier


def tokens_through(step: int, cfg: Config, earlier: list[tuple[int, Config]]) -> int:
    """Tokens trained on by the end of `step`, each step at the global batch and context of its own config."""
    total, done = 0, 0
    for until, c in [*earlier, (step, cfg)]:
        upto = min(until, step)
        if upto > done:
            total += (upto - done) * c.train.global_batch * c.model.context
            done = upto
    return total


def summarize(run_dir: str | Path, smooth: int = 20) -> dict:
    """One run's row of the table (module docstring)."""
    cfg, recs, earlier = read_run(run_dir)
    counts = count_params(cfg)
    last = recs[-1]
    tail = recs[-smooth:]
    vals = [r for r in recs if r.get("val_loss") is not None]
    steady = recs[1:] or recs
    rates = [r["tokens_per_s"] for r in steady if r.get("tokens_per_s")]
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    loads = [v for k, v in last.items() if k.startswith("load_max/")]
    return {
        "run": str(run_dir), "name": cfg.name, "kind": cfg.ffn.kind, "active_params": counts.active,
        "total_params": counts.total, "step": last["step"], "total_steps": cfg.schedule.total_steps,
        "tokens": tokens_through(last["step"], cfg, earlier),
        "loss": sum(r["loss"] for r in tail) / len(tail), "loss_steps": len(tail),
        "val_loss": vals[-1]["val_loss"] if vals else None, "val_ppl": vals[-1].get("val_ppl") if vals else None,
        "val_step": vals[-1]["step"] if vals else None,
        "tokens_per_s": statistics.median(rates) if rates else None, "mfu": statistics.median(mfus) if mfus else None,
        "load_max": max(loads) if loads else None,
    }


def _count(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    head = ["run", "model", "params (active / total)", "step", "tokens", "loss", "val_loss (step)", "val_ppl",
            "tokens/s", "MFU", "max load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        val = f"{r['val_loss']:.4f} ({r['val_step']})" if r["val_loss"] is not None else "-"
        lines.append("| " + " | ".join([
            r["run"], f"{r['kind']} ({r['name']})", f"{_count(r['active_params'])} / {_count(r['total_params'])}",
            f"{r['step']}/{r['total_steps']}", _count(r["tokens"]),
            f"{r['loss']:.4f}" + (f" (mean of {r['loss_steps']})" if r["loss_steps"] > 1 else ""), val,
            f"{r['val_ppl']:.2f}" if r["val_ppl"] is not None else "-",
            _count(r["tokens_per_s"]) if r["tokens_per_s"] else "-",
            f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-",
            f"{r['load_max']:.2f}" if r["load_max"] is not None else "-"]) + " |")
    return "\n".join(lines)


def moving_average(xs: list[float], n: int) -> list[float]:
    """The mean of each value and the up to n - 1 before it."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= n:
            total -= xs[i - n]
        out.append(total / min(i + 1, n))
    return out


def plot(run_dirs: list[str], path: str | Path, smooth: int = 20) -> None:
    """Training loss (moving average) and validation loss against tokens seen, one line per run, into `path`."""
    plt = pyplot("--plot")
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in run_dirs:
        cfg, recs, earlier = read_run(run)
        label = f"{Path(run).name} ({cfg.ffn.kind})"
        line, = ax_t.plot([tokens_through(r["step"], cfg, earlier) for r in recs],
                          moving_average([r["loss"] for r in recs], smooth), label=label)
        vals = [r for r in recs if r.get("val_loss") is not None]
        if vals:
            ax_v.plot([tokens_through(r["step"], cfg, earlier) for r in vals], [r["val_loss"] for r in vals], "o-",
                      label=label, color=line.get_color())
    for ax, title in ((ax_t, f"training loss (moving average of {smooth} steps)"), (ax_v, "validation loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss (nats / token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    save(fig, path, "--plot", dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mhl_jax.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", metavar="RUN_DIR", help="logging.run_dir of a train.py run")
    ap.add_argument("--smooth", type=int, default=20, help="steps averaged for the loss (default 20)")
    ap.add_argument("--plot", default=None, metavar="FILE", help="write the loss curves to FILE (e.g. curves.png)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per run instead of the table")
    ap.add_argument("--plot-load", default=None, metavar="RUN_DIR",
                    help="draw this run's expert-load maps (mhl_jax/load_maps.py) instead of the table")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="--plot-load's image (default: <run name>-loads.png)")
    args = ap.parse_args(argv)
    if args.smooth < 1:
        ap.error(f"--smooth {args.smooth}: must be >= 1")
    if bool(args.runs) == bool(args.plot_load):
        ap.error("give RUN_DIRs to compare, or --plot-load RUN_DIR")
    try:
        if args.plot_load:
            out = args.out or f"{Path(args.plot_load).resolve().name}-loads.png"
            plot_loads(args.plot_load, out, read_run(args.plot_load)[1])
            print(f"load maps: {out}")
            return EXIT_OK
        rows = [summarize(r, args.smooth) for r in args.runs]
        if args.plot:
            plot(args.runs, args.plot, args.smooth)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        for r in rows:
            print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                              for k, v in r.items()}))
    else:
        print(table(rows))
    if args.plot:
        print(f"curves: {args.plot}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
