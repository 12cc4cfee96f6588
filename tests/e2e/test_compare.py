"""`python -m mhl_jax.compare`: the table of runs and their loss curves, from run directories written here by hand
(config.yaml as train.py writes it, metrics.jsonl records with known values)."""

import json
from pathlib import Path

import pytest

from mhl_jax.compare import main, moving_average, summarize, table
from mhl_jax.config import dump_config, load_config

ROOT = Path(__file__).resolve().parents[2]


def make_run(d: Path, kind: str, losses: list[float], rates: list[float], vals: dict[int, float], partial=False):
    cfg = load_config(str(ROOT / f"configs/tiny_{kind}.yaml"), [f"logging.run_dir={d}", "schedule.total_steps=100"])
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(dump_config(cfg))
    lines = []
    for i, (loss, rate) in enumerate(zip(losses, rates), 1):
        r = {"step": i, "loss": loss, "tokens_per_s": rate, "mfu": None}
        if kind != "mlp":
            r.update({"load_max/1": 1.0 + i / 10, "load_max/2": 1.5, "load_min/1": 0.5})
        if i in vals:
            r.update(val_loss=vals[i], val_ppl=2.718281828 ** vals[i])
        lines.append(json.dumps(r))
    text = "\n".join(lines) + "\n"
    if partial:
        text += '{"step": 99, "lo'  # a record being written
    (d / "metrics.jsonl").write_text(text)
    return cfg


def test_summary_of_a_run(tmp_path):
    cfg = make_run(tmp_path / "a", "mh_latent_moe", [5.0, 4.0, 3.0, 2.0, 1.0], [10.0, 100.0, 300.0, 200.0, 250.0],
                   {2: 3.5, 4: 2.5}, partial=True)
    r = summarize(tmp_path / "a", smooth=3)
    assert (r["kind"], r["step"], r["total_steps"]) == ("mh_latent_moe", 5, 100)
    assert r["tokens"] == 5 * cfg.train.global_batch * cfg.model.context
    assert r["loss"] == pytest.approx(2.0) and r["loss_steps"] == 3  # mean of the last 3
    assert (r["val_loss"], r["val_step"]) == (2.5, 4) and r["val_ppl"] == pytest.approx(2.718281828 ** 2.5)
    assert r["tokens_per_s"] == 225.0  # median of steps 2-5: the first step's compilation left out
    assert r["mfu"] is None and r["load_max"] == pytest.approx(1.5)
    assert r["active_params"] < r["total_params"]
    line = table([r]).splitlines()[2]
    for part in ("| mh_latent_moe (tiny_mh_latent_moe) |", "| 5/100 |", "| 2.0000 (mean of 3) |", "| 2.5000 (4) |",
                 "| 12.18 |", "| - |", "| 1.50 |"):
        assert part in line, (part, line)


def test_dense_run_without_validation(tmp_path):
    make_run(tmp_path / "m", "mlp", [3.0], [50.0], {})
    r = summarize(tmp_path / "m")
    assert (r["loss"], r["loss_steps"], r["val_loss"], r["load_max"], r["tokens_per_s"]) == (3.0, 1, None, None, 50.0)
    assert r["active_params"] == r["total_params"]


def test_resumed_run_with_a_changed_batch_and_a_repeated_step(tmp_path):
    d = tmp_path / "r"
    cfg = make_run(d, "moe", [5.0, 4.0, 3.0, 2.0, 1.0], [1.0] * 5, {})
    before = load_config(str(d / "config.yaml"), ["train.global_batch=4", "train.micro_batch=4"])
    (d / "config-until-step2.yaml").write_text(dump_config(before))  # steps 1-2 ran at global batch 4
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 0.5, "tokens_per_s": 1.0}) + "\n\n\n")  # step 5 again, the last kept
    r = summarize(d, smooth=2)
    per = cfg.model.context
    assert r["tokens"] == (2 * 4 + 3 * cfg.train.global_batch) * per
    assert r["step"] == 5 and r["loss"] == pytest.approx((2.0 + 0.5) / 2)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo\n\n')  # cut short, then blank lines: left out
    assert summarize(d)["step"] == 5


def test_moving_average():
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    assert moving_average([2.0, 4.0], 10) == [2.0, 3.0]


def test_cli_table_json_and_plot(tmp_path, capsys):
    make_run(tmp_path / "a", "mh_latent_moe", [5.0, 4.0, 3.0], [1.0, 2.0, 3.0], {3: 3.2})
    make_run(tmp_path / "b", "moe", [6.0, 5.0, 4.0], [1.0, 2.0, 3.0], {2: 4.5, 3: 4.2})
    png = tmp_path / "curves.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--smooth", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and "| moe (tiny_moe) |" in rows[2] and f"curves: {png}" in out
    assert "| 2 | - |" in rows[2]  # tokens/s below 1000 as a plain number
    import matplotlib.pyplot as plt

    image = plt.imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 1000 and image[..., :3].std() > 0.05  # drawn, not blank
    assert main([str(tmp_path / "a"), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["val_loss"] == 3.2 and row["loss"] == pytest.approx(4.0)  # the mean of the last 20 (all 3)


def test_a_run_directory_that_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main([str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: run directory '{tmp_path / 'afile'}' is a file, not a "
                                                    "directory (expected a logging.run_dir written by train.py)"]
