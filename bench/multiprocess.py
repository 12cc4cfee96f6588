"""One run of train.py over a machine's GPUs as one process, and as one process per GPU (or per group of GPUs):
steady-state tokens/s and the losses side by side, one JSON line per launch and a comparison line.

    python -m bench.multiprocess --config configs/mh_latent_moe_hp_2.2b.yaml --processes 1 2 --steps 10 \
        [--set key=value ...] [--out FILE]

Every launch trains `--steps` steps from the same seed in a fresh run directory (no checkpoints, no evaluation);
the processes of a launch share the machine's GPUs evenly (`--local-device-ids`). tokens_per_s is the median of the
per-step readings from step 4 on (StepClock, compilation left out); the losses of every launch are compared with the
first launch's.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import JsonLines, parser, today

ROOT = Path(__file__).resolve().parents[1]


def gpu_count() -> tuple[int, str]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, check=True).stdout.split("\n")
    names = [n.strip() for n in out if n.strip()]
    return len(names), names[0]


def launch(config: str, sets: list[str], steps: int, processes: int, gpus: int, run_dir: Path) -> list[dict]:
    args = [sys.executable, "train.py", "--config", config, *sum((["--set", s] for s in sets), []),
            "--set", f"schedule.total_steps={steps}", "--set", "schedule.warmup_steps=2",
            "--set", "schedule.decay_steps=2", "--set", "checkpoint.every=0", "--set", "data.eval_every=0",
            "--set", "logging.progress_bar=false", "--set", "logging.log_every=1",
            "--set", f"logging.run_dir={run_dir}"]
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if processes == 1:
        procs = [subprocess.Popen(args, cwd=ROOT, env=env)]
    else:
        if gpus % processes:
            raise SystemExit(f"--processes {processes} does not divide the {gpus} GPUs")
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        per = gpus // processes
        procs = [subprocess.Popen([*args, "--coordinator", f"localhost:{port}", "--num-processes", str(processes),
                                   "--process-id", str(i), "--local-device-ids",
                                   ",".join(str(i * per + j) for j in range(per))], cwd=ROOT, env=env,
                                  stdout=None if i == 0 else subprocess.DEVNULL)
                 for i in range(processes)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a launch of {processes} process(es) failed: exit codes {codes}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args(argv)
    gpus, device = gpu_count()
    first, rows = None, []
    with JsonLines(a.out) as emit:
        for n in a.processes:
            with tempfile.TemporaryDirectory() as tmp:
                recs = launch(a.config, a.sets, a.steps, n, gpus, Path(tmp) / "run")
            tps = (statistics.median(r["tokens_per_s"] for r in recs[3:]) if len(recs) > 3
                   else recs[-1]["tokens_per_s"])
            losses = [r["loss"] for r in recs]
            first = first or losses
            rows.append(emit({"bench": "multiprocess", "impl": f"{n}_process", "device": device, "date": today(),
                              "params": {"config": a.config, "sets": a.sets, "gpus": gpus, "processes": n,
                                         "steps": a.steps},
                              "tokens_per_s": tps, "losses": losses,
                              "max_rel_loss_diff": max(abs(x - y) / abs(y) for x, y in zip(losses, first))}))
    print(f"{'processes':>10} {'tok/s':>10} {'rel loss diff':>14}")
    for r in rows:
        print(f"{r['params']['processes']:>10} {r['tokens_per_s']:>10.0f} {r['max_rel_loss_diff']:>14.2e}")


if __name__ == "__main__":
    main()
