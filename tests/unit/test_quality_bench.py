"""bench/quality.py: its models are valid configs with the paper's ratios, the Bible splits by book, the plot draws."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from bench import quality
from mhl_jax.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(quality.MODELS))
def test_every_model_is_its_paper_config_scaled_down(name, tmp_path):
    args = argparse.Namespace(steps=700, evals=10, vocab=16384, seed=0, batch=32, lr=1e-3, val_sequences=480)
    sets = quality.overrides(name, tmp_path / "data", tmp_path / "run", args)
    cfg = load_config(str(ROOT / "configs" / f"{quality.MODELS[name][0]}.yaml"), [f"{k}={v}" for k, v in sets.items()])
    d, f = cfg.model.d_model, cfg.ffn
    assert d == 512 and cfg.model.context == 512 and cfg.train.global_batch == 32
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
