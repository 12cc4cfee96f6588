"""Plot bench/a2a.py results (paper Figure 3 layout) beside the plain torch+NCCL anchors.

    python bench/plot_a2a.py RESULTS.jsonl [--anchors shared/anchors/a2a_2xh200_2026-11-22.jsonl.txt]
                             [--out RESULTS.png]

Left: dispatch + combine ms against k, one line per (implementation, skew); HP is flat by
construction (`hp`: the exchange the model runs, head-group-major sub-tokens; `hp_token_major`: the
same bytes from the token-major layout, which XLA transposes first). Right: per-device peak memory
of the compiled exchange (static shapes), with the rows EP's busiest receiver actually filled as
dashed lines. Prints a markdown table: ours vs the anchors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

GIB = 2.0 ** 30


def load(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def normalise_names(recs: list[dict]) -> list[dict]:
    """Files written before the model emitted head-group-major sub-tokens call the model-layout
    exchange `hp_contiguous` and the token-major one `hp`; rename them to today's `hp` (the exchange
    the model runs under Head Parallel) and `hp_token_major`."""
    if not any(r.get("impl") == "hp_contiguous" for r in recs):
        return recs
    names = {"hp": "hp_token_major", "hp_contiguous": "hp"}
    return [dict(r, impl=names.get(r.get("impl"), r.get("impl"))) for r in recs]


def anchors(path: str, tokens: int) -> dict:
    """{('HP', 0, 0): ms, ('EP', k, skew): ms} of the anchor block with `tokens` tokens per GPU.

    The anchor file holds two 14-line blocks (8192 then 81920 tokens per GPU), each starting with a
    'physical' line; pick the one whose HP receives `tokens` rows."""
    out, block = {}, {}
    for rec in load(path):
        if rec["kind"] == "physical":
            block = {}
            continue
        if rec["kind"] == "HP":
            block[("HP", 0, 0.0)] = rec["ms"]
            block["rows"] = rec["peak_recv_rows"]
        else:
            block[("EP", rec["k"], rec["skew"])] = rec["ms"]
        if block.get("rows") == tokens:
            out = block
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--anchors", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    recs = [r for r in normalise_names(load(args.results)) if r.get("bench") == "a2a" and "ms" in r]
    if not recs:
        raise SystemExit(f"{args.results}: no a2a measurements")
    p0 = recs[0]["params"]
    ref = anchors(args.anchors, p0["tokens"]) if args.anchors else {}
    ks = sorted({r["params"]["k"] for r in recs})
    skews = sorted({r["params"]["skew"] for r in recs})
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {0.0: "tab:blue", 1.0: "tab:orange", 2.0: "tab:red"}
    for impl, style in (("hp", "-o"), ("hp_token_major", "--o"), ("ep_ragged", "-s"), ("ep_padded", ":^")):
        for skew in skews:
            pts = sorted((r["params"]["k"], r) for r in recs if r["impl"] == impl and r["params"]["skew"] == skew)
            if not pts:
                continue
            kk = [k for k, _ in pts]
            label = f"{impl} skew={skew:g}"
            color = {"hp": "black", "hp_token_major": "dimgray"}.get(impl, colors.get(skew))
            ax_t.plot(kk, [r["ms"] for _, r in pts], style, color=color, label=label, alpha=0.8 if impl == "hp" else 1)
            unroll = pts[0][1]["params"].get("unroll", 1)
            mem_label = label + (f" ({unroll} rounds' buffers)" if impl == "ep_ragged" and unroll > 1 else "")
            ax_m.plot(kk, [r["peak_gib"] for _, r in pts], style, color=color, label=mem_label)
            if impl == "ep_ragged":
                ax_m.plot(kk, [r["recv_rows_used_max"] * p0["d"] * 2 / GIB for _, r in pts], "--", color=color,
                          label=f"EP rows filled, skew={skew:g}")
    for skew in skews:
        pts = [(k, ref[("EP", k, skew)]) for k in ks if ("EP", k, skew) in ref]
        if pts:
            ax_t.plot(*zip(*pts), "x--", color=colors.get(skew), alpha=0.5, label=f"NCCL anchor EP skew={skew:g}")
    if ("HP", 0, 0.0) in ref:
        ax_t.axhline(ref[("HP", 0, 0.0)], color="gray", ls="--", label="NCCL anchor HP")
    dev = f"{p0['devices']} x {recs[0]['device']}"
    ax_t.set(xlabel="k (experts per token)", ylabel="dispatch + combine, ms (log)", xscale="log", yscale="log",
             xticks=ks,
             xticklabels=[str(k) for k in ks], title=f"All-to-all latency, {p0['tokens']} tok x d={p0['d']} bf16/GPU")
    ax_m.set(xlabel="k (experts per token)", ylabel="GiB per device", xscale="log", xticks=ks,
             xticklabels=[str(k) for k in ks], title=f"Peak memory of the exchange ({dev})")
    for ax in (ax_t, ax_m):
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_t.legend(fontsize=7)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    out = args.out or str(Path(args.results).with_suffix(".png"))
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")

    by = {(r["impl"], r["params"]["k"], r["params"]["skew"]): r for r in recs}
    print("| k | skew | HP ms (anchor) | EP ragged ms (anchor) | EP/HP | EP padded ms | HP GiB | EP GiB "
          "| EP rows filled / HP rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in ks:
        for skew in skews:
            h, e, pd = by.get(("hp", k, skew)), by.get(("ep_ragged", k, skew)), by.get(("ep_padded", k, skew))
            a_hp, a_ep = ref.get(("HP", 0, 0.0)), ref.get(("EP", k, skew))
            cells = [str(k), f"{skew:g}",
                     f"{h['ms']:.3f} ({a_hp:.3f})" if h and a_hp else (f"{h['ms']:.3f}" if h else "-"),
                     f"{e['ms']:.3f} ({a_ep:.3f})" if e and a_ep else (f"{e['ms']:.3f}" if e else "-"),
                     f"{e['ms'] / h['ms']:.2f}" if e and h else "-",
                     f"{pd['ms']:.3f}" if pd else "-",
                     f"{h['peak_gib']:.2f}" if h else "-", f"{e['peak_gib']:.2f}" if e else "-",
                     f"{e['recv_rows_used_max'] / p0['tokens']:.2f}" if e else "-"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
