"""Each expert kernel alone (torch launcher, CUDA events), over launch tiles: which tile runs each kernel
fastest at the layer's shapes. Unlike a sweep of whole backward passes (which times the dX and dW kernels
together), every line here is one kernel launch.

    python -m bench.tools.kernel_tiles [--tokens 81920 8192] [--ne 384] [--de 256] [--out FILE]
        [--fwd 128,32,4,3 ...] [--dx ...] [--dwt ...] [--dw ...] [--fwd_cast 64,64,4,3 ...]

One JSON line per (shape, kernel, tile): ms (median, several input sets), TFLOP/s of the kernel's own
matmuls (fwd 2, dX 3, dW 4 units of 2 * rows * dh * de), and rel_vs_first: the relative difference of the
kernel's output to the first tile's (a wrong tile shows up there). Short table last.
"""

from __future__ import annotations

import argparse
import functools

from bench.common import JsonLines, today

DEFAULT_TILES = {
    "fwd": ["128,32,4,3", "64,32,4,2", "128,32,4,2", "64,64,4,2", "64,32,4,3"],
    "dx": ["128,32,4,3", "64,32,4,2", "64,32,4,3", "128,32,4,2", "64,64,4,2", "128,64,8,2"],
    "dwt": ["64,64,4,3", "64,64,4,2", "64,32,4,2", "64,32,4,3", "32,64,4,3"],
    "dw": [],  # the row-form dW kernel (dw_form "rows"), none by default
    "fwd_cast": [],  # the converting forward (fp32 weights), none by default
}
UNITS = {"fwd": 2, "dx": 3, "dwt": 4, "dw": 4, "fwd_cast": 2}


def launch(kind: str, cfg, s, w1, w2, k: int):
    """One launch of kernel `kind` (tile from cfg) on input set s = (x, dy, gates, packing); its outputs."""
    import torch

    from kernels.torch.experts import experts_dw, experts_dx, experts_fwd

    x, dy, gates, pk = s
    if kind == "fwd":
        return (experts_fwd(x, pk.row_slot, pk.block_group, w1, w2, k, cfg),)
    if kind == "fwd_cast":  # the converting forward on fp32 masters (w1 / w2 here: fp32; its launcher also zero-fills
        # the two bf16 copies it returns, as many bytes again as the copies: every tile pays that alike)
        from kernels.torch.experts import experts_fwd_cast

        return experts_fwd_cast(x, pk, w1, w2, k, cfg)
    if kind == "dx":  # as the binding runs it: with the gate gradients (DGATES)
        return experts_dx(x, dy, gates, pk, w1, w2, k, cfg)
    # fp32 masters' gradients; a de-wide tile (block_e == de) fuses dX into the dW kernel: its rows go to `dx`
    # (rows of all-padding blocks are never written by a fused kernel: dx starts at zero, and its gate gradient
    # rows are left out of the outputs compared)
    fused = cfg.dw.block_e == w1.shape[2]
    dx = torch.zeros(pk.row_slot.shape[0], x.shape[1], dtype=x.dtype, device=x.device) if fused else None
    dw1, dw2, _ = experts_dw(x, dy, gates, pk, w1, w2, k, cfg, torch.float32, dx)
    return (dw1, dw2) + ((dx,) if fused else ())


ROUTINGS = ("uniform", "layer")


def input_set(tokens: int, ne: int, k: int, pack_block: int, g, nh: int = 8, dh: int = 128, routing: str = "uniform"):
    """One input set (x, dy, gates, packing) on CUDA: bf16 x / dy rows (tokens * nh, dh), fp32 gates, a top-k routing
    packed with `pack_block`: "uniform" (k distinct experts uniformly at random: groups of nearly equal size) or
    "layer" (`bench.layer`'s first step: x = a (tokens, 1024) normal batch through W_in, routed by W_r and a bias
    drawn as `bench.layer.init_params` draws them, in fp32: groups as uneven as the layer's, ~0.4 coefficient of
    variation)."""
    import torch

    from kernels.torch.experts import pack_torch

    if routing not in ROUTINGS:
        raise ValueError(f"input_set: routing={routing!r}, expected one of {ROUTINGS}")
    if routing == "layer":
        d = 1024
        xin = torch.randn(tokens, d, device="cuda", generator=g).bfloat16()
        w_in = (torch.randn(d, nh * dh, device="cuda", generator=g) * 0.02).bfloat16()
        w_r = torch.randn(nh, dh, ne, device="cuda", generator=g) * 0.02
        bias = torch.randn(nh, ne, device="cuda", generator=g) * 1e-3
        sub = (xin @ w_in).reshape(tokens, nh, dh)
        idx = (torch.einsum("nhd,hde->nhe", sub.float(), w_r) + bias).topk(k, dim=-1).indices
        x = sub.reshape(tokens * nh, dh).contiguous()
    else:
        x = torch.randn(tokens * nh, dh, device="cuda", generator=g).bfloat16()
        idx = None
    dy = torch.randn(tokens * nh, dh, device="cuda", generator=g).bfloat16()
    gates = torch.rand(tokens * nh * k, device="cuda", generator=g)
    if idx is None:
        idx = torch.rand(tokens, nh, ne, device="cuda", generator=g).topk(k, dim=-1).indices
    return x, dy, gates, pack_torch(idx, ne, pack_block)


def expert_weights(ne: int, de: int, g, nh: int = 8, dh: int = 128):
    """bf16 W1 (nh * ne, dh, de) and W2 (nh * ne, de, dh) on CUDA."""
    import torch

    w1 = (torch.randn(nh * ne, dh, de, device="cuda", generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(nh * ne, de, dh, device="cuda", generator=g) * 0.05).bfloat16()
    return w1, w2


def rotating(fn, sets: list):
    """A no-argument callable for do_bench that runs fn on the next input set each call."""
    state = {"i": 0}

    def step():
        state["i"] += 1
        fn(sets[state["i"] % len(sets)])

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[81920, 8192])
    ap.add_argument("--ne", type=int, default=384)
    ap.add_argument("--de", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--pack-block", type=int, default=None, help="override default_config's packing block")
    ap.add_argument("--out", default=None)
    ap.add_argument("--once", action="store_true", help="launch each tile once, untimed (for ncu)")
    for kind, tiles in DEFAULT_TILES.items():
        ap.add_argument(f"--{kind}", nargs="*", default=tiles)
    args = ap.parse_args()
    if args.pack_block is not None and (args.pack_block < 16 or args.pack_block & (args.pack_block - 1)):
        ap.error(f"--pack-block={args.pack_block}: expected a power of 2 >= 16")

    import torch
    from triton.testing import do_bench

    from kernels.tuning import ExpertsConfig, Tile, default_config

    nh, dh, k, ne, de = 8, 128, args.k, args.ne, args.de
    dev = "cuda"
    date = today()
    device = torch.cuda.get_device_name()
    emit = JsonLines(args.out)
    rows = []
    for tokens in args.tokens:
        g = torch.Generator(device=dev).manual_seed(0)
        pack_block = args.pack_block or default_config(tokens * nh * k, nh * ne, dh, de).pack_block
        sets = [input_set(tokens, ne, k, pack_block, g, nh, dh) for _ in range(3)]
        w1, w2 = expert_weights(ne, de, g, nh, dh)
        rows_total = tokens * nh * k
        for kind in ("fwd", "dx", "dwt", "dw", "fwd_cast"):
            first = None
            # the converting forward reads fp32 masters: converted once per kind, not per tile
            wk = (w1.float(), w2.float()) if kind == "fwd_cast" and getattr(args, kind) else (w1, w2)
            for spec in getattr(args, kind):
                t = Tile(*(int(v) for v in spec.split(",")))
                t = Tile(min(t.block_m, pack_block), min(t.block_e, de), t.num_warps, t.num_stages)
                cfg = ExpertsConfig(pack_block, t, t, t, dw_form="rows" if kind == "dw" else "t")
                rec = dict(bench="kernel_tiles", kernel=kind, device=device, date=date,
                           params=dict(tokens=tokens, nh=nh, dh=dh, k=k, ne=ne, de=de, pack_block=pack_block,
                                       tile=[t.block_m, t.block_e, t.num_warps, t.num_stages]))
                try:
                    cfg.check(dh, de)
                    outs = launch(kind, cfg, sets[0], *wk, k)
                    if first is None:
                        first = outs
                    rec["rel_vs_first"] = [float((a.double() - b.double()).norm() / b.double().norm())
                                           for a, b in zip(outs, first)]
                    if args.once:
                        continue
                    step = rotating(functools.partial(launch, kind, cfg, w1=wk[0], w2=wk[1], k=k), sets)
                    rec["ms"] = float(do_bench(step, warmup=25, rep=200, return_mode="median"))
                    rec["tflops"] = UNITS[kind] * 2 * rows_total * dh * de / rec["ms"] / 1e9
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                emit(rec)
                rows.append(rec)
    print(f"\n{'tokens':>6} {'kernel':>5} {'tile':>16} {'ms':>7} {'TF/s':>6} rel_vs_first")
    for r in rows:
        p = r["params"]
        if "ms" in r:
            print(f"{p['tokens']:>6} {r['kernel']:>5} {str(p['tile']):>16} {r['ms']:7.3f} {r['tflops']:6.1f} "
                  f"{max(r['rel_vs_first']):.1e}")
        else:
            print(f"{p['tokens']:>6} {r['kernel']:>5} {str(p['tile']):>16} error {r['error'][:60]}")


if __name__ == "__main__":
    main()
