"""The run directory's files: config.yaml (and the earlier config when a resumed run changed settings), run.json
(what this launch ran on, and its kernel plan), metrics.jsonl (one JSON record per step), loads.jsonl (the per-expert
loads every logging.loads_every steps) and the TensorBoard events.

Process 0 alone writes them. A relaunch or resume first drops the records past the step it restarts from, so that
metrics.jsonl holds exactly one record per step whatever the run went through.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import yaml

from mhl_jax.config import Config, ConfigError, config_to_dict, dump_config
from mhl_jax.runtime.checkpoint_tree import changed_leaves
from mhl_jax.runtime.distributed import agree
from mhl_jax.train.metrics import TensorBoardLog


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old or the new file whole."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def truncate_metrics(path: Path, step: int, what: str = "metrics record") -> None:
    """Drop records past `step` (written by a run killed after its last checkpoint), atomically; a last line cut
    short (the run killed while writing it) goes too. ConfigError for a malformed line before the last (`what`: the
    kind of record the error names)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            n = rec["step"]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            if i == len(lines) - 1:
                break
            raise ConfigError(f"{path}: line {i + 1} is not a {what} ({type(e).__name__}: {e}); remove it, "
                              "or the file") from e
        if n <= step:
            keep.append(line)
    write_atomic(path, "".join(line + "\n" for line in keep))


def config_changes(old: dict, new: dict) -> str:
    """'key: old -> new; ...' over the leaves of two config dicts that differ ('' when none)."""
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed_leaves(old, new))


class Records:
    """Where each step's metrics go: metrics.jsonl and TensorBoard (process 0), nothing on the others; and every
    logging.loads_every steps the per-expert loads, to loads.jsonl."""

    def __init__(self, metrics_file=None, board: TensorBoardLog | None = None, loads_file=None) -> None:
        self.metrics_file, self.board, self.loads_file = metrics_file, board, loads_file

    def write(self, m: dict) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(m) + "\n")
            self.metrics_file.flush()
        if self.board is not None:
            self.board.write(m)

    def write_loads(self, step: int, loads: dict) -> None:
        """{layer: (H, Ne) routed-slot counts} of `step` as one line {"step": n, "loads": {layer: [[...], ...]}}."""
        if self.loads_file is not None:
            self.loads_file.write(json.dumps({"step": step, "loads": {k: v.tolist() for k, v in loads.items()}})
                                  + "\n")
            self.loads_file.flush()

    def close(self) -> None:
        for f in (self.metrics_file, self.board, self.loads_file):
            if f is not None:
                f.close()


def open_records(cfg: Config, run_dir: Path, lead: bool, restoring: bool, start: int, info: dict, log) -> Records:
    """Write the run's config (once it is known to fit the checkpoint it resumes: a refused run leaves the old one)
    and run.json (`info`), and open its records from step `start` on. A resumed run whose settings changed keeps the
    earlier config beside it and names the changes. The other processes wait in `agree`: a failure on process 0
    stops every process, not only that one."""
    saved, text = run_dir / "config.yaml", dump_config(cfg)
    before = saved.read_text() if restoring and saved.is_file() else text
    changes = config_changes(yaml.safe_load(before) or {}, config_to_dict(cfg)) if before != text else ""
    kept = run_dir / f"config-until-step{start}.yaml"
    records, failed = Records(), None
    if lead:
        try:
            if changes:
                write_atomic(kept, before)
            write_atomic(saved, text)
            write_atomic(run_dir / "run.json", json.dumps(info, indent=1) + "\n")
            truncate_metrics(run_dir / "metrics.jsonl", start)
            records.metrics_file = open(run_dir / "metrics.jsonl", "a")
            truncate_metrics(run_dir / "loads.jsonl", start, "loads record")
            if cfg.logging.loads_every:
                records.loads_file = open(run_dir / "loads.jsonl", "a")
            if cfg.logging.tensorboard:
                records.board = TensorBoardLog(run_dir / "tensorboard")
        except (OSError, ConfigError) as e:
            failed = e
    agree(failed is None, "to write the run directory's files")
    if isinstance(failed, OSError):
        raise ConfigError(f"logging.run_dir={cfg.logging.run_dir!r}: cannot write the run's files ({failed})") \
            from failed
    if failed is not None:
        raise failed
    if changes:
        log(f"resuming with changed settings: {changes} (the earlier config.yaml is kept as {kept.name})")
    return records


def run_info(plan: dict, start: int) -> dict:
    """run.json: the launch's devices, processes, JAX version and kernel plan (`mhl_jax.moe.plan.KernelPlan`, with the
    attention's and the LM-head loss's implementations: `mhl_jax.model.gpt.implementations`)."""
    return {"start_step": start, "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
            "processes": jax.process_count(), "jax": jax.__version__, "kernel_plan": plan}
