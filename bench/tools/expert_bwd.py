"""The Gluon expert backward alone at the train step's shape: each kernel's device time per call, accumulating into
fp32 gradient sums (as the train step's micro-batches do) or not, on random, skewed or collapsed routing.

    python -m bench.tools.expert_bwd [--tokens 16384] [--ne 384] [--k 4] [--de 256] [--routing random zipf collapsed]
                                     [--accum on off] [--form auto ws xw] [--calls 20] [--reps 3] [--out FILE]

The kernels are launched from torch (`kernels.torch.experts.gluon_experts_bwd_ws`), 8 heads x dh 128, bf16 x / dy /
W1 / W2, fp32 gates and dW. --form: the kernel with the dX warp group (xw), without (ws), or the one the JAX binding
picks at this shape (auto: `kernels.tuning.default_config`'s bwd_xw; ws at the 2.2B step's 16384 tokens). Routing
random: each row's top k of random scores; collapsed: every token on the same k experts of each head (the benchmark
step's routing after its first steps, docs/performance.md); zipf: each head's experts ranked at random, a row's k
drawn without replacement with weight 1 / rank (at Ne 384, k 4 a head's largest group holds ~48x the mean, within the
2.2B step's 22-74x on the configs' schedule). Per case one JSON line: `ms`, each kernel's device time per call
(torch.profiler over `calls` calls, the median of `reps` such traces, all of them in `runs`; the schedule's few torch
ops left out).
"""

from __future__ import annotations

from bench.common import JsonLines, parser, today

NH, DH = 8, 128


def inputs(tokens: int, ne: int, k: int, de: int, routing: str, seed: int = 0):
    """CUDA tensors: x, dy (tokens * NH, DH) bf16, gates (tokens * NH * k,) fp32, W1 (NH * ne, DH, de), W2 (NH * ne,
    de, DH) bf16, and the routing (tokens, NH, k) int32."""
    import torch

    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(tokens * NH, DH, device="cuda", generator=g).bfloat16()
    dy = torch.randn(tokens * NH, DH, device="cuda", generator=g).bfloat16()
    gates = torch.rand(tokens * NH * k, device="cuda", generator=g)
    w1 = (0.05 * torch.randn(NH * ne, DH, de, device="cuda", generator=g)).bfloat16()
    w2 = (0.05 * torch.randn(NH * ne, de, DH, device="cuda", generator=g)).bfloat16()
    if routing == "random":
        idx = torch.rand(tokens, NH, ne, device="cuda", generator=g).topk(k, dim=2).indices
    elif routing == "zipf":  # k draws without replacement (Gumbel top-k), expert of rank r (per head) ~ 1 / r
        rank = torch.stack([torch.randperm(ne, device="cuda", generator=g) for _ in range(NH)]) + 1
        gumbel = -torch.log(-torch.log(torch.rand(tokens, NH, ne, device="cuda", generator=g).clamp_min(1e-20)))
        idx = (gumbel - torch.log(rank.float())[None]).topk(k, dim=2).indices
    else:
        same = torch.stack([torch.randperm(ne, device="cuda", generator=g)[:k] for _ in range(NH)])
        idx = same[None].expand(tokens, NH, k)
    return x, dy, gates, w1, w2, idx.contiguous().int()


def kernel_times(call, calls: int, reps: int) -> dict[str, list[float]]:
    """{kernel name: device ms per call in each of `reps` traces of `calls` calls}."""
    import torch

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.key.startswith(("gluon_", "dw_chunks")):  # the backward and its chunk sum, not the schedule's ops
                times.setdefault(e.key, []).append(e.device_time / 1000)
    return {name: [round(t, 4) for t in v] for name, v in times.items()}


def run(tokens: int, ne: int, k: int, de: int, routing: str, accum: bool, form: str, calls: int, reps: int) -> dict:
    import torch

    from kernels.torch.experts import gluon_experts_bwd_ws, pack_torch
    from kernels.tuning import default_config

    x, dy, gates, w1, w2, idx = inputs(tokens, ne, k, de, routing)
    cfg = default_config(tokens * NH * k, NH * ne, DH, de)
    xw = cfg.bwd_xw if form == "auto" else form == "xw"
    pk = pack_torch(idx, ne, cfg.pack_block)
    p = pk.row_slot.shape[0]
    out = (torch.zeros(w1.shape, device="cuda"), torch.zeros(w2.shape, device="cuda"),
           torch.empty(p, de // 128, DH, dtype=x.dtype, device="cuda"),
           torch.empty(p, de // 128, dtype=torch.float32, device="cuda"))

    def call():
        gluon_experts_bwd_ws(x, dy, gates, pk, w1, w2, k, cfg.pack_block, out=out, heads=NH, xw=xw, accum=accum)

    runs = kernel_times(call, calls, reps)
    return dict(bench="expert_bwd", device=torch.cuda.get_device_name(), date=today(), tokens=tokens, nh=NH, dh=DH,
                ne=ne, k=k, de=de, pack_block=cfg.pack_block, xw=xw, routing=routing, accum=accum,
                ms={name: sorted(v)[len(v) // 2] for name, v in runs.items()}, runs=runs)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--ne", type=int, default=384)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--de", type=int, default=256)
    ap.add_argument("--routing", nargs="+", choices=["random", "zipf", "collapsed"], default=["random", "collapsed"])
    ap.add_argument("--accum", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--form", nargs="+", choices=["auto", "ws", "xw"], default=["auto"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with JsonLines(args.out) as out:
        for form in args.form:
            for routing in args.routing:
                for accum in args.accum:
                    out(run(args.tokens, args.ne, args.k, args.de, routing, accum == "on", form, args.calls,
                            args.reps))


if __name__ == "__main__":
    main()
