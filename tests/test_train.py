"""End to end on CPU: the tiny default trains and its loss falls; the CLI rejects bad configs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mhl_jax.config import load_config
from mhl_jax.train.loop import train

ROOT = Path(__file__).resolve().parents[1]


def tiny(tmp_path, *extra):
    return load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "schedule.total_steps=40", "schedule.warmup_steps=5", "schedule.decay_steps=10", "data.eval_every=20",
        "model.context=64",
        "data.val_sequences=16", "logging.progress_bar=false", "logging.log_every=20", "checkpoint.every=0",
        f"logging.run_dir={tmp_path / 'run'}", "parallel.devices=1", *extra])


def test_tiny_run_loss_falls_and_logs(tmp_path, capsys):
    hist = train(tiny(tmp_path))
    losses = [m["loss"] for m in hist]
    assert len(losses) == 40
    assert losses[0] > 5.0  # ~ln(320) at init
    assert sum(losses[-10:]) / 10 < losses[0] - 2.0, losses
    # validation ran at step 20 and at the end, and improved
    vals = [m["val_loss"] for m in hist if "val_loss" in m]
    assert len(vals) == 2 and vals[1] < vals[0]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "load_max/1", "load_min/3", "val_ppl"):
        assert key in rec
    out = capsys.readouterr().out
    assert "active" in out and "total parameters" in out
    assert "loss" in out and "tok/s" in out and "load max/min L1" in out


def test_cli_rejects_bad_config_with_named_error():
    r = subprocess.run([sys.executable, "train.py", "--set", "ffn.top_k=99"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert "ffn.top_k=99 > ffn.num_experts=16" in r.stderr


def test_cli_rejects_unknown_key():
    r = subprocess.run([sys.executable, "train.py", "--set", "optimizer.learning_rate=1"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown config key 'optimizer.learning_rate'" in r.stderr


@pytest.mark.parametrize("kind", ["tiny_moe", "tiny_latent_moe", "tiny_mlp"])
def test_other_variants_train(tmp_path, kind):
    cfg = load_config(str(ROOT / f"configs/{kind}.yaml"), [
        "schedule.total_steps=10", "schedule.warmup_steps=2", "schedule.decay_steps=2", "data.val_sequences=0",
        "model.context=64",
        "logging.progress_bar=false", "checkpoint.every=0", f"logging.run_dir={tmp_path / kind}",
        "parallel.devices=1"])
    losses = [m["loss"] for m in train(cfg)]
    assert losses[-1] < losses[0] - 0.5
