"""Fresh processes of one config: do they give the same losses, and what does sharing XLA's autotuning cost?

    python -m bench.fresh_runs [--config configs/mh_latent_moe_hp_2.2b.yaml] [--steps 8] [--set key=value ...]
                               [--out FILE]

Three fresh `python train.py` processes of the config, each in a run directory of its own: `first` and `second`
share one autotuning cache (`MHL_CACHE_DIR`, empty before `first`; mhl_jax/runtime/autotune.py), so `second` loads
the kernels `first` tuned; `alone` has an empty cache of its own and tunes afresh, as every run did before the cache
was shared. One JSON line per pair: whether the per-step losses are bitwise equal (as float32 bit patterns), and the
median throughput after the first two steps of each process (tokens/s, from its metrics.jsonl), so the cost of
loading the tuned kernels is seen beside the run that tuned them.

Defaults applied before `--set`: the built-in corpus with the byte tokenizer (no data files needed), micro-batch 16,
global batch 32, no evaluation, no checkpoints, warmup 1 step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from bench.common import JsonLines, parser, today, user_env

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ["data.source=builtin", "data.path=", "data.val_path=", "data.tokenizer=byte", "data.eval_every=0",
            "data.val_sequences=0", "train.micro_batch=16", "train.global_batch=32", "checkpoint.every=0",
            "schedule.warmup_steps=1", "schedule.decay_steps=1", "logging.progress_bar=false", "logging.log_every=1"]


def run(config: str, steps: int, overrides: list[str], run_dir: Path, cache: Path) -> list[dict]:
    """One fresh train.py process; its per-step records."""
    args = [sys.executable, str(ROOT / "train.py"), "--config", config]
    for o in [*DEFAULTS, f"schedule.total_steps={steps}", *overrides, f"logging.run_dir={run_dir}"]:
        args += ["--set", o]
    env = {**user_env(), "MHL_CACHE_DIR": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each process compiles (a cached executable would skip the tuning)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def compare(a: str, b: str, runs: dict[str, list[dict]]) -> dict:
    bits = {k: [np.float32(r["loss"]).tobytes().hex() for r in runs[k]] for k in (a, b)}
    rate = {k: statistics.median(r["tokens_per_s"] for r in runs[k][2:]) for k in (a, b)}
    return {"pair": f"{a}/{b}", "losses_equal": bits[a] == bits[b],
            "first_differing_step": next((i + 1 for i, (x, y) in enumerate(zip(bits[a], bits[b])) if x != y), None),
            "losses": {k: [r["loss"] for r in runs[k]] for k in (a, b)},
            "tokens_per_s": rate, "throughput_ratio": rate[b] / rate[a]}


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", default="configs/mh_latent_moe_hp_2.2b.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, JsonLines(args.out) as emit:
        tmp = Path(tmp)
        shared, own = tmp / "shared_cache", tmp / "own_cache"
        runs = {name: run(args.config, args.steps, args.overrides, tmp / name, cache)
                for name, cache in (("first", shared), ("second", shared), ("alone", own))}
        base = {"bench": "fresh_runs", "config": args.config, "steps": args.steps, "overrides": args.overrides,
                "device": jax.devices()[0].device_kind, "date": today()}
        for a, b in (("first", "second"), ("first", "alone")):
            emit({**base, **compare(a, b, runs)})


if __name__ == "__main__":
    main()
