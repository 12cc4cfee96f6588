"""bench.step_plot: the timed records of a step_profile file, each category's bars (forward, backward, the step's own,
floor) in order, small ones left out, the picture written, and bad files refused in one line."""

import json

import pytest

from bench import step_plot as sp
from mhl_jax.config import ConfigError


def _record(config, gap=2.0):
    """A timed record as bench.step_profile writes it, with the fields the picture reads."""
    lines = {"attention": dict(ms=30.0, fwd_ms=10.0, bwd_ms=20.0, floor_ms=12.0, floor_kind="flop"),
             "experts": dict(ms=40.0, fwd_ms=8.0, bwd_ms=32.0, floor_ms=20.0, floor_kind="byte"),
             "optimizer": dict(ms=6.0, fwd_ms=0.0, bwd_ms=0.0, floor_ms=5.0, floor_kind="byte"),
             "other": dict(ms=3.0, fwd_ms=0.0, bwd_ms=0.0, floor_ms=None, floor_kind=""),
             "embed": dict(ms=0.1, fwd_ms=0.0, bwd_ms=0.1, floor_ms=0.05, floor_kind="byte")}
    return {"bench": "step_profile", "config": config, "devices": 1, "device": "GPU", "date": "d",
            "times": {"host_gap_ms": gap, "wall_ms": 81.1}, "lines": lines}


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_bars_match_the_record(tmp_path):
    cpu = {"bench": "step_profile", "config": "cpu", "times": None}
    recs = sp.timed_records(_write(tmp_path / "r.jsonl", [_record("a"), cpu, {"bench": "other"}, _record("b", 0.1)]))
    assert [r["config"] for r in recs] == ["a", "b"]  # the timed step_profile records, in order
    assert sp.bars(recs[0]) == [("experts", 8.0, 32.0, 0.0, 20.0, "byte"), ("attention", 10.0, 20.0, 0.0, 12.0, "flop"),
                                ("optimizer", 0.0, 0.0, 6.0, 5.0, "byte"), ("other", 0.0, 0.0, 3.0, None, ""),
                                ("host gaps", 0.0, 0.0, 2.0, None, "")]  # embed and b's gaps: under MIN_MS
    assert [b[0] for b in sp.bars(recs[1])][-1] == "other"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    sp.main([_write(tmp_path / "r.jsonl", [_record("a"), _record("b")]), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        sp.timed_records(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"bench": "step_profile"}\n{not json\n')
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        sp.timed_records(str(bad))
    untimed = tmp_path / "cpu.jsonl"
    untimed.write_text(json.dumps({"bench": "step_profile", "times": None}) + "\n")
    with pytest.raises(ConfigError, match="no timed step_profile records"):
        sp.timed_records(str(untimed))
