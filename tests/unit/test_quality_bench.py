"""bench/quality.py: its models are valid configs with the paper's ratios, the Bible splits by book, the plot draws."""

from __future__ import annotations

import argparse
import base64
import json
import os
import stat
from pathlib import Path

import pytest

from bench import quality
from mhl_jax.config import dump_config, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(quality.MODELS))
def test_every_model_is_its_paper_config_scaled_down(name, tmp_path):
    tokens = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in range(64) for b in range(256)][:16383 - 256]
    (tmp_path / "tokenizer.tiktoken").write_text(  # 16383 ranks: every byte, then byte pairs
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    args = argparse.Namespace(steps=700, evals=10, seed=0, batch=32, lr=1e-3, val_sequences=480)
    sets = quality.run_settings(name, tmp_path, tmp_path / "run", args)
    cfg = load_config(str(ROOT / "configs" / f"{quality.MODELS[name][0]}.yaml"), [f"{k}={v}" for k, v in sets.items()])
    d, f = cfg.model.d_model, cfg.ffn
    assert d == 512 and cfg.model.context == 512 and cfg.train.global_batch == 32
    assert cfg.model.vocab_size == 16384 and cfg.data.eval_every == 70  # the tokenizer's ids and EOT; 10 evaluations
    assert (f.stem_layers, f.stem_hidden) == (2, 4 * d)
    assert f.routing_tokens == ("separate" if name == "mh_separate_routing" else "shared")
    if f.kind == "mlp":
        assert f.hidden == d
        return
    paper = load_config(str(ROOT / "configs" / f"{quality.MODELS[name][0]}.yaml"))
    # the experts' active hidden width per token is the MLP's; Ne, k and Nh are the paper's; dh = d / Nh
    assert f.top_k * f.expert_hidden == d * paper.ffn.top_k * paper.ffn.expert_hidden // paper.model.d_model
    assert (f.num_experts, f.top_k) == (paper.ffn.num_experts, paper.ffn.top_k)
    if f.kind == "mh_latent_moe":
        assert f.num_heads == paper.ffn.num_heads and f.num_heads * f.head_dim == f.latent_dim == d


def test_bible_books_are_split_by_book_without_references(tmp_path, monkeypatch):
    fake = tmp_path / "bible"
    fake.write_text("#!/bin/sh\nprintf 'Ge1:1 In the beginning.\\nGe1:2 And the earth.\\nEx1:1 Now these.\\n"
                    "Re22:21 Amen.\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert quality.bible_books() == ["In the beginning.\nAnd the earth.", "Now these.", "Amen."]


def test_plot_draws_the_curves(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"model": m, "seed": s, "lr": 1e-3, "overrides": [], "tokens": 700 * 16384, "step": 700,
             "val_curve": [[70, 6.9], [700, 4.0 + s / 10]]}
            for m in ("mlp", "mh_latent_moe", "mh_4x128") for s in (0, 1)]
    quality.plot(rows, str(tmp_path / "q.png"))
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_result_reads_a_run(tmp_path):
    """A hand-written run: the last step's smallest load over the layers, the validation points, the settings."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(str(ROOT / "configs" / "tiny_moe.yaml"))))
    recs = [{"step": 1, "loss": 5.0, "tokens_per_s": 10.0, "load_max/1": 3.0, "load_min/1": 0.0},
            {"step": 2, "loss": 4.0, "tokens_per_s": 20.0, "val_loss": 4.5, "val_ppl": 90.0,
             "load_max/1": 2.0, "load_min/1": 0.5, "load_max/2": 1.5, "load_min/2": 0.25}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = argparse.Namespace(seed=3, lr=2e-3, extra_sets=["ffn.balance_gamma=0.01"])
    row = quality.result("moe", run, args)
    assert (row["load_max"], row["load_min"], row["val_curve"]) == (2.0, 0.25, [[2, 4.5]])
    assert (row["seed"], row["lr"], row["overrides"], row["model"]) == (3, 2e-3, ["ffn.balance_gamma=0.01"], "moe")
    assert quality.label(row) == "moe lr 0.002 ffn.balance_gamma=0.01"
