"""A picture of `bench.step_profile`'s records: per config, each category's measured time beside its floor.

    python -m bench.step_plot RECORDS.jsonl [--out step_profile.png] [--dpi 120]

One panel per timed record (a config), categories largest first as horizontal bars: the measured ms (forward and
backward stacked for the model's parts, grey for the step's own) with the floor drawn as a tick on the same bar
(black: a FLOP floor, purple: a byte floor), host gaps as a bar of their own. The LM head's loss makes its gradients
inside its forward (`mhl_jax.model.loss`), so its whole time shows as forward. All panels share the time axis, so
configs compare at a glance. Records without times (a CPU run) are left out; a file with none is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mhl_jax import plots
from mhl_jax.config import ConfigError

MIN_MS = 0.5  # categories below this are left off the picture (they are in the record and the table)
FLOOR_COLORS = {"flop": "black", "byte": "#7b3294"}


def timed_records(path: str) -> list[dict]:
    """The step_profile records of `path` that carry times, in file order; a one-line ConfigError otherwise."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path!r}: cannot read it ({e.strerror or e})") from e
    recs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path!r} line {n}: not JSON ({e.msg})") from e
        if rec.get("bench") == "step_profile" and rec.get("times"):
            recs.append(rec)
    if not recs:
        raise ConfigError(f"{path!r}: no timed step_profile records (write them with `python -m bench.step_profile "
                          "--out FILE` on a GPU)")
    return recs


def bars(rec: dict) -> list[tuple[str, float, float, float, float | None, str]]:
    """(category, fwd ms, bwd ms, unsplit ms, floor ms or None, floor kind "flop" / "byte" / "") per category of at
    least MIN_MS, largest first, then host gaps. Parts of the model split into forward and backward; the step's own
    parts (optimizer, accumulation, what no scope covers) do not."""
    out = []
    for c, ln in rec["lines"].items():
        if ln["ms"] < MIN_MS:
            continue
        fwd, bwd = ln["fwd_ms"], ln["ms"] - ln["fwd_ms"]
        kind = ln["floor_kind"] if ln["floor_ms"] else ""
        out.append((c, fwd, bwd, 0.0, ln["floor_ms"], kind) if ln["fwd_ms"] + ln["bwd_ms"] > 0 else
                   (c, 0.0, 0.0, ln["ms"], ln["floor_ms"], kind))
    out.sort(key=lambda b: -sum(b[1:4]))
    gap = rec["times"]["host_gap_ms"]
    if gap >= MIN_MS:
        out.append(("host gaps", 0.0, 0.0, gap, None, ""))
    return out


def plot(recs: list[dict], out: str, dpi: int = 120) -> None:
    plt = plots.pyplot("bench.step_plot")
    rows = [bars(r) for r in recs]
    fig, axes = plt.subplots(1, len(recs), figsize=(5.2 * len(recs), 0.36 * max(map(len, rows)) + 1.6), sharex=True,
                             squeeze=False)
    for ax, rec, bs in zip(axes[0], recs, rows):
        y = range(len(bs))
        names, fwd, bwd, whole, floor, kind = zip(*bs)
        ax.barh(y, fwd, color="#4c72b0", label="forward")
        ax.barh(y, bwd, left=fwd, color="#dd8452", label="backward")
        ax.barh(y, whole, color="#8c8c8c", label="the step's own (no fwd / bwd)")
        labelled = set()
        for i, (f, k) in enumerate(zip(floor, kind)):
            if f:
                ax.plot([f, f], [i - 0.4, i + 0.4], color=FLOOR_COLORS[k], lw=2,
                        label=None if k in labelled else f"{k.upper() if k == 'flop' else k} floor")
                labelled.add(k)
        ax.set_yticks(list(y), names)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step")
        wall = rec["times"]["wall_ms"]
        ax.set_title(f"{rec['config']}: {wall:.1f} ms a step\n{rec['devices']} x {rec['device']}, {rec['date']}",
                     fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    plots.save(fig, out, "bench.step_plot --out", dpi)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", help="JSON lines of bench.step_profile")
    ap.add_argument("--out", default="step_profile.png", help="PNG to write")
    ap.add_argument("--dpi", type=int, default=120)
    args = ap.parse_args(argv)
    try:
        recs = timed_records(args.records)
        plot(recs, args.out, args.dpi)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out}: {', '.join(r['config'] for r in recs)}")


if __name__ == "__main__":
    main()
