"""Per-expert loads: what a run records (loads.jsonl), and the maps `python -m mhl_jax.compare --plot-load` draws."""

import json

import numpy as np
import pytest

from mhl_jax import load_maps
from mhl_jax.compare import main as compare_main
from mhl_jax.config import dump_config, load_config
from mhl_jax.load_maps import read_loads, relative_loads
from mhl_jax.train.loop import train
from tests.runs import ROOT


def _cfg(run_dir, *extra):
    """The tiny MH-LatentMoE, a dense stem layer and one MoE layer (4 heads x 16 experts, top 2), 4 steps of 8 x 32
    tokens; loads recorded every 3 steps (and at the last)."""
    return load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "model.n_layers=2", "model.context=32", "train.global_batch=8", "train.micro_batch=4",
        "schedule.total_steps=4", "schedule.warmup_steps=1", "schedule.decay_steps=1", "data.val_sequences=0",
        "checkpoint.every=2", "checkpoint.async_save=false", "logging.progress_bar=false", "logging.loads_every=3",
        "parallel.devices=1", f"logging.run_dir={run_dir}", *extra])


def test_a_run_records_every_experts_load(tmp_path):
    """loads.jsonl at steps 3 and 4 (the last): per head, the counts add up to the step's routed slots (8 x 32 tokens
    x top 2), and their spread is the load_max / load_min of the step's metrics record. (A resumed run writes the
    lines a straight one does: tests/e2e/test_resume.py.)"""
    hist = train(_cfg(tmp_path / "straight"), log=lambda *a, **k: None)
    steps, loads = read_loads(tmp_path / "straight")
    assert steps == [3, 4] and list(loads) == [1] and loads[1].shape == (2, 4, 16)
    assert (loads[1].sum(-1) == 8 * 32 * 2).all()
    for i, step in enumerate(steps):
        rel, rec = relative_loads(loads[1][i]), hist[step - 1]
        assert (rel.max(), rel.min()) == pytest.approx((rec["load_max/1"], rec["load_min/1"]), rel=1e-6)


def _hand_run(tmp_path, kind="mh_latent_moe", counts=None):
    """tmp_path/hand: the config of configs/tiny_<kind>.yaml at 3 layers (a dense stem layer), metrics.jsonl of steps
    1-20, and loads.jsonl of `counts` ({step: {layer: (H, Ne) counts}}; default: two MoE layers of 2 heads x 4
    experts at steps 10 and 20)."""
    run = tmp_path / "hand"
    run.mkdir()
    cfg = load_config(str(ROOT / f"configs/tiny_{kind}.yaml"), ["model.n_layers=3", "ffn.stem_layers=1"])
    (run / "config.yaml").write_text(dump_config(cfg))
    if counts is None:
        counts = {10: {"1": [[8, 0, 0, 0], [2, 2, 2, 2]], "2": [[1, 1, 1, 1], [4, 4, 0, 0]]},
                  20: {"1": [[3, 2, 2, 1], [2, 2, 2, 2]], "2": [[1, 1, 1, 1], [2, 2, 2, 2]]}}
    (run / "loads.jsonl").write_text("".join(json.dumps({"step": s, "loads": c}) + "\n" for s, c in counts.items()))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, "load_max/1": 1.0 + 3 / s, "load_min/1": 0.0,
                    "load_max/2": 2.0, "load_min/2": 0.0}) + "\n" for s in range(1, 21)))
    return run


def test_plot_load_draws_a_hand_written_run(tmp_path, capsys):
    """A run written by hand: two MoE layers (2 heads x 4 experts), loads at steps 10 and 20. read_loads gives the
    counts back by layer and step, relative to uniform per head; --plot-load writes a PNG of one map row per layer."""
    run = _hand_run(tmp_path)
    steps, loads = read_loads(run)
    assert steps == [10, 20] and sorted(loads) == [1, 2]
    np.testing.assert_array_equal(loads[2][0], [[1, 1, 1, 1], [4, 4, 0, 0]])
    np.testing.assert_array_equal(relative_loads(loads[1][0]), [[4, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(relative_loads(loads[1][1]), [[1.5, 1, 1, 0.5], [1, 1, 1, 1]])

    out = tmp_path / "maps.png"
    assert compare_main(["--plot-load", str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"load maps: {out}"
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1300, 520)  # 13 x 2.6 inches per layer at 100 dpi, two layers


def test_load_map_columns_end_at_their_steps(tmp_path, monkeypatch):
    """Column i of a map covers steps (steps[i-1], steps[i]] (the first as wide as the second): the last ends at the
    last record, on the step axis the spreads beside it use."""
    counts = {s: {"1": [[1, 1, 1, 1], [2, 2, 0, 0]]} for s in (100, 200, 300)}
    drawn = []
    monkeypatch.setattr(load_maps, "save", lambda fig, *a, **k: drawn.append(fig))
    load_maps.plot_loads(_hand_run(tmp_path, counts=counts), tmp_path / "maps.png", [])
    assert drawn[0].axes[0].get_xlim() == (0.0, 300.0)


def test_plot_load_of_a_dense_run(tmp_path, capsys):
    """A dense-MLP run records no expert loads ({"loads": {}}): one line, exit 2, no image."""
    run = _hand_run(tmp_path, "mlp", counts={100: {}, 200: {}})
    out = tmp_path / "maps.png"
    assert compare_main(["--plot-load", str(run), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: run '{run}' has no MoE layers: no expert loads to plot"]
    assert not out.exists()
