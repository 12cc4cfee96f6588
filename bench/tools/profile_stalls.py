"""Why a kernel waits: Nsight Compute's warp stall reasons for the three expert kernels and the router forward,
each launched alone from torch (no JAX computation in the process: ncu under JAX has segfaulted on the router).

    python -m bench.tools.profile_stalls [--tokens 81920] [--ne 384] [--de 256] [--k 4] [--gluon] [--out FILE]

The parent runs itself under `ncu --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
(+ issue-active and duration)`; the child launches each kernel twice (compile, then the profiled launch: the
last launch of each kernel name is kept). Per kernel, one JSON line: ms, issue_active_pct (share of cycles a
scheduler issued), and `stalls`: for each reason, warps stalled per issued instruction (the sum over reasons
is the mean cycles between two issues of one warp), largest first. Needs a GPU and ncu.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from bench.common import JsonLines, today
from bench.tools.profile_layer import MS_PER_UNIT, csv_rows, metric_value

STALL = "smsp__average_warps_issue_stalled_"
METRICS = [f"regex:{STALL}.*_per_issue_active\\.ratio", "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "gpu__time_duration.sum", "regex:sm__pipe_tensor_op_.*cycles_active\\.avg\\.pct_of_peak_sustained_active"]
KERNELS = "regex:expert_fwd_kernel|expert_dx_kernel|expert_dwt_kernel|router_fwd_kernel|gluon_expert_|gluon_router_"


def child(tokens: int, ne: int, de: int, k: int, gluon: bool = False) -> None:
    """Launch the router forward (default tiles, bf16x3) and the expert kernels with `default_config`'s tiles
    (the forward, then the dX and dW kernels, or at de = 128 the one fused backward kernel) on uniform random
    routing (`kernel_tiles.input_set`) at the layer's shapes, twice each; gluon: also the Gluon kernels (the
    expert forward, dW and fused backward where they take the shape, and the Gluon router forward)."""
    import torch

    from bench.tools.kernel_tiles import expert_weights, input_set, launch
    from kernels.gluon.router import ws_router_supported
    from kernels.torch.experts import gluon_experts_bwd_ws, gluon_experts_dw_ws, gluon_experts_fwd_ws
    from kernels.torch.router import gluon_router_fwd_ws, router_fwd
    from kernels.tuning import default_config, gluon_bwd_supported, gluon_dw_supported, gluon_fwd_supported

    nh, dh = 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = default_config(tokens * nh * k, nh * ne, dh, de)
    s = input_set(tokens, ne, k, cfg.pack_block, g, nh, dh)
    w1, w2 = expert_weights(ne, de, g, nh, dh)
    wr = torch.randn(nh, dh, ne, device="cuda", generator=g) * dh ** -0.5
    bias = torch.randn(nh, ne, device="cuda", generator=g) * 0.01
    kinds = ("fwd", "dwt") if cfg.dw.block_e == de else ("fwd", "dx", "dwt")  # de-wide dW tile: dX fused
    for _ in range(2):
        router_fwd(s[0].view(tokens, nh, dh), wr, bias, k)
        for kind in kinds:
            launch(kind, cfg, s, w1, w2, k)
        if gluon:  # the warp-specialised forward and weight gradients, and the fused backward where it takes the shape
            if gluon_fwd_supported(dh, de, cfg.pack_block):
                gluon_experts_fwd_ws(s[0], s[3], w1, w2, k, cfg.pack_block)
            if gluon_dw_supported(dh, de, cfg.pack_block):
                gluon_experts_dw_ws(s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, heads=nh)
            if gluon_bwd_supported(dh, de, cfg.pack_block):
                gluon_experts_bwd_ws(s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, heads=nh)
            if ws_router_supported(dh, ne, k):
                gluon_router_fwd_ws(s[0].view(tokens, nh, dh), wr, bias, k)
    torch.cuda.synchronize()


def parse(text: str) -> dict:
    """ncu --csv (details page) -> {kernel name: {metric: value}} for the last launch of each kernel (times in
    nanoseconds whatever unit a row carries)."""
    last: dict = {}
    for r in csv_rows(text):
        name = r["Kernel Name"].split("(")[0]
        launch = int(r["ID"])
        if name not in last or last[name][0] < launch:
            last[name] = (launch, {})
        if last[name][0] == launch:
            scale = MS_PER_UNIT.get(r.get("Metric Unit", ""), 1e-6) * 1e6  # durations -> nanoseconds
            last[name][1][r["Metric Name"]] = metric_value(r) * scale
    return {n: m for n, (_, m) in last.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--ne", type=int, default=384)
    ap.add_argument("--de", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gluon", action="store_true",
                    help="also the Gluon kernels (expert forward, dW, fused backward, router forward)")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args.tokens, args.ne, args.de, args.k, args.gluon)
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--csv", "--print-units", "base", "-k", KERNELS, "--metrics", ",".join(METRICS), sys.executable,
           "-m", "bench.tools.profile_stalls", "--child", "--tokens", str(args.tokens), "--ne", str(args.ne),
           "--de", str(args.de), "--k", str(args.k)] + (["--gluon"] if args.gluon else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode or '"ID"' not in p.stdout:
        raise SystemExit(f"ncu rc={p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    import torch

    emit = JsonLines(args.out)
    base = dict(bench="profile_stalls", device=torch.cuda.get_device_name(), date=today(),
                params=dict(tokens=args.tokens, ne=args.ne, de=args.de, nh=8, dh=128, k=args.k))
    for name, m in parse(p.stdout).items():
        tensor = {k: round(v, 1) for k, v in m.items() if k.startswith("sm__pipe_tensor_op_")}
        stalls = {k[len(STALL):].replace("_per_issue_active.ratio", ""): v for k, v in m.items() if k.startswith(STALL)}
        stalls = dict(sorted(((k, round(v, 3)) for k, v in stalls.items() if v >= 0.01), key=lambda kv: -kv[1]))
        rec = dict(base, kernel=name, ms=m.get("gpu__time_duration.sum", 0) / 1e6,
                   issue_active_pct=m.get("smsp__issue_active.avg.pct_of_peak_sustained_active"),
                   tensor_pipe_pct=tensor, stalls=stalls)
        emit(rec)
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(stalls.items())[:6])
        print(f"{name:>20} {rec['ms']:7.3f} ms  issue {rec['issue_active_pct'] or 0:5.1f}%  {top}")


if __name__ == "__main__":
    main()
