"""Where one Gluon kernel's warps wait (an expert kernel or the router forward), instruction by instruction: Nsight
Compute's warp-state sampling per SASS instruction (SourceCounters), the kernel launched alone from torch at one
shape (the router: uniform random x, W_r and bias).

    python -m bench.tools.profile_sass [--kernel bwd_ws|dw_ws|router_ws] [--tokens 81920] [--ne 768] [--k 8] [--de 128]
                                 [--top 40] [--out FILE] [--csv FILE]

The parent runs itself under `ncu --section SourceCounters --page source --print-source sass --csv` (the last
launch of the kernel is profiled: the child launches it twice); it prints the `--top` instructions by stall
samples with their neighbourhood's share, and emits one JSON line (`bench: profile_sass`): total samples, and
per top instruction its address, SASS text, samples and share. `--csv` keeps ncu's raw table. Needs a GPU and ncu.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys

from bench.common import JsonLines, today

NAMES = {"bwd_ws": "gluon_expert_bwd_ws_kernel", "bwd_xw": "gluon_expert_bwd_xw_kernel",
         "dw_ws": "gluon_expert_dw_ws_kernel", "fwd_ws": "gluon_expert_fwd_ws_kernel",
         "router_ws": "gluon_router_fwd_ws_kernel"}


def child(kernel: str, tokens: int, ne: int, k: int, de: int) -> None:
    import torch

    from bench.tools.kernel_tiles import expert_weights, input_set
    from kernels.torch.experts import gluon_experts_bwd_ws, gluon_experts_dw_ws, gluon_experts_fwd_ws
    from kernels.tuning import default_config

    nh, dh = 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    if kernel == "router_ws":
        from kernels.torch.router import gluon_router_fwd_ws

        x = torch.randn(tokens, nh, dh, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(nh, dh, ne, device="cuda", generator=g) * dh ** -0.5
        b = 0.1 * torch.randn(nh, ne, device="cuda", generator=g)
        for _ in range(2):
            gluon_router_fwd_ws(x, w, b, k)
        torch.cuda.synchronize()
        return
    cfg = default_config(tokens * nh * k, nh * ne, dh, de)
    s = input_set(tokens, ne, k, cfg.pack_block, g, nh, dh)
    w1, w2 = expert_weights(ne, de, g, nh, dh)
    for _ in range(2):
        if kernel == "fwd_ws":
            gluon_experts_fwd_ws(s[0], s[3], w1, w2, k, cfg.pack_block)
        elif kernel == "dw_ws":
            gluon_experts_dw_ws(s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, heads=nh)
        else:
            gluon_experts_bwd_ws(s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, heads=nh, xw=kernel == "bwd_xw")
    torch.cuda.synchronize()


def table(text: str) -> list[dict]:
    """ncu's CSV source page -> rows (the lines from the header that names the SASS source column on)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Address,"))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="bwd_ws", choices=sorted(NAMES))
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--ne", type=int, default=768)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--de", type=int, default=128)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--csv", default=None, help="also write ncu's raw CSV here")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    shape = ["--kernel", args.kernel, "--tokens", str(args.tokens), "--ne", str(args.ne), "--k", str(args.k),
             "--de", str(args.de)]
    if args.child:
        child(args.kernel, args.tokens, args.ne, args.k, args.de)
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--csv", "--section", "SourceCounters", "--page", "source", "--print-source", "sass", "-k",
           NAMES[args.kernel], "-s", "1", "-c", "1", sys.executable, "-m", "bench.tools.profile_sass", "--child",
           *shape]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(p.stdout)
    if p.returncode:
        raise SystemExit(f"ncu rc={p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    rows = table(p.stdout)
    col = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
    src = next(c for c in rows[0] if c == "Source")

    def samples(r: dict) -> float:
        try:
            return float(r[col] or 0)
        except ValueError:
            return 0.0

    total = sum(samples(r) for r in rows)
    top = sorted(rows, key=samples, reverse=True)[:args.top]
    import torch

    rec = dict(bench="profile_sass", kernel=NAMES[args.kernel], device=torch.cuda.get_device_name(),
               date=today(),
               params=dict(tokens=args.tokens, ne=args.ne, k=args.k, de=args.de, nh=8, dh=128), samples=total,
               top=[dict(address=r.get("Address", ""), sass=r[src].strip(), samples=samples(r),
                         share=round(samples(r) / max(total, 1), 4)) for r in top])
    JsonLines(args.out)(rec)
    for t in rec["top"]:
        print(f"{t['address']:>8} {t['share'] * 100:5.1f}%  {t['sass'][:100]}")


if __name__ == "__main__":
    main()
