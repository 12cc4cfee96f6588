"""The warp-specialised Gluon expert kernels (`kernels/gluon/experts.py`) against the Triton ones on the same
packed inputs, in one process, each kernel alone (do_bench, CUDA events, 3 rotating input sets; top-k routing
uniform at random, or with --routing layer as uneven as bench/layer.py's: `bench.kernel_tiles.input_set`). Hopper only.

    python bench/gluon_kernels.py [--kinds fwd dw dw_options] [--shapes 81920/384/4/256 ...] [--routing layer]
                                  [--out FILE]

fwd: the Gluon forward vs `expert_fwd_kernel` (default tile); fwd_probe: the Gluon forward with its output stores
(probe bit 1) and / or its gelu (bit 2) left out (`ws_constexprs`' probe). dw: the Gluon weight gradients vs the
transposed Triton dW kernel at the tile default_config picks for a split backward, and, where the default backward
is the fused one (de 128), that kernel too (it also makes the dX rows and gate gradients). dw_options: the Gluon
weight gradients at each of DW_OPTIONS' launch options (row block, weight buffers, ring stages, registers) vs the
same Triton dW kernel. bwd: the warp-specialised fused backward (weight gradients, dX rows, gate gradients; partials
per 128 de, summed for the comparison) at each of BWD_OPTIONS vs the fused Triton kernel (de 128) or the split
backward default_config picks (the dX kernel and the Gluon or Triton dW kernel), output buffers allocated once (rel
over dW1, dW2 and the dX rows and gate gradients of routed rows). router: the warp-specialised Gluon router forward
(kernels/gluon/router.py) at each of ROUTER_OPTIONS vs `router_fwd_kernel` at its default tiles (bf16x3, 8 heads; de
is ignored; rel: the fraction of indices that differ from the Triton kernel's, max_abs: the values' largest
difference). router_cast: the Gluon router forward with two consumers, without the caster warp group and with it
(casting two fp32 arrays of 8 x Ne x 128 x de elements, the layer's w1 / w2, to bf16; and a 64th of them), and
torch's two casts alone (rel: indices that differ from the no-cast launch's; cast_equal: the casts bitwise torch's).
One JSON line per (shape, kernel): ms (median), TFLOP/s of the kernel's matmuls (fwd 2 units, dW 4, fused 5 of 2 *
rows * dh * de), and rel / max_abs: the difference of the outputs to the first (Triton) kernel's (0 when bitwise
equal; for dW the larger of dW1's and dW2's). """

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import replace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.kernel_tiles import ROUTINGS, expert_weights, input_set, rotating  # noqa: E402
from bench.timing import emit  # noqa: E402

SHAPES = [f"{t}/{c}" for t in (81920, 8192) for c in ("384/4/256", "768/8/128", "768/4/256", "1536/8/128")]
KINDS = ("fwd", "fwd_probe", "dw", "dw_options", "bwd", "bwd_probe", "router", "router_cast")
# `gluon_experts_bwd_ws` launch options (`bwd_ws_constexprs`' / `bwd_xw_constexprs`' options; deal=False: tiles
# strided in group order; xw: the dX warp group), named gluon_bwd_ws + "_option[value]" (results before 2026-11-25
# named the first gluon_bwd_ws_wb2_st3_r232_40); the first is the fused kernel's default
BWD_OPTIONS = [{}, dict(xw=True), dict(xw=True, hb=2)]
# bwd_probe: the default backward (dX warp group) with its traffic masked off part by part (`bwd_xw_constexprs`'
# probe bits: 1 dW loads / stores, 2 dX / gate-gradient stores, 4 the gathered rows; 8 / 16 leave the consumers' gate
# gradient / gelu math out (session 25); outputs wrong, rel meaningless; --probe-options picks other sets),
# and with ACCUM (the training step's in-place sum of the weight gradients): where its time goes (bench/NOTES.md,
# Layer, Session 24); and with a 2-stage X / dy ring (the shared memory an epilogue staging ring would need)
BWD_PROBE_OPTIONS = [dict(xw=True), *(dict(xw=True, probe=b) for b in (1, 2, 4, 3, 7)), dict(xw=True, accum=True),
                     dict(xw=True, accum=True, probe=1), dict(xw=True, stages=2), dict(xw=True, stages=2, accum=True)]
# `gluon_router_fwd_ws` launch options (consumers, ring stages); the default is one of them, by k
ROUTER_OPTIONS = [dict(nc=3, stages=2), dict(nc=2, stages=3)]
# `gluon_experts_dw_ws` launch options (block_m, wbuf, stages, (worker consumer regs, producer regs)); the first is
# the kernel's default (H100 2026-11-24: results/gluon_dw_variants-h100-2026-11-24.jsonl, measured by the probe
# this kind replaced)
DW_OPTIONS = [(32, 2, 6, (240, 32)), (32, 2, 4, (240, 32)), (32, 1, 4, (240, 32)), (32, 2, 6, (232, 40)),
              (64, 1, 4, (240, 32))]


def option_name(base: str, opts: dict) -> str:
    """base + "_option[value]" per launch option (no value for a True flag)."""
    return base + "".join(f"_{o}" + ("" if v is True else "_".join(map(str, np.ravel(v)))) for o, v in opts.items())


def _diff(outs, refs) -> tuple[float, float]:
    """(relative norm, max abs) difference of outs to refs, the larger over the outputs."""
    rel = max(float((o.double() - r.double()).norm() / r.double().norm()) for o, r in zip(outs, refs))
    return rel, max(float((o.double() - r.double()).abs().max()) for o, r in zip(outs, refs))


def run_shape(kind: str, tokens: int, ne: int, k: int, de: int, date: str, device: str, outf, nh: int = 8,
              dh: int = 128, routing: str = "uniform", probe_options: list[dict] | None = None) -> list[dict]:
    """The `kind` kernels at one shape (the Gluon one where supported): one record per kernel. probe_options:
    bwd_probe's option dicts (default BWD_PROBE_OPTIONS), or router's `gluon_router_fwd_ws` ones (ROUTER_OPTIONS)."""
    import torch

    from bench.kernel_tiles import launch
    from kernels.gluon.experts import (
        DW_WS_BLOCK_M,
        dw_ws_supported,
        gluon_experts_dw_ws,
        gluon_experts_fwd_ws,
        ws_supported,
    )
    from kernels.triton.experts import Tile, default_config

    if kind == "router":
        return run_router(tokens, ne, k, date, device, outf, nh, dh, router_options=probe_options)
    if kind == "router_cast":
        return run_router_cast(tokens, ne, k, de, date, device, outf, nh, dh)
    if kind in ("bwd", "bwd_probe"):
        probe = (probe_options or BWD_PROBE_OPTIONS) if kind == "bwd_probe" else None
        return run_bwd(tokens, ne, k, de, date, device, outf, nh, dh, routing, probe=probe)
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = default_config(tokens * nh * k, nh * ne, dh, de)
    sets = [input_set(tokens, ne, k, cfg.pack_block, g, nh, dh, routing) for _ in range(3)]
    w1, w2 = expert_weights(ne, de, g, nh, dh)
    unit = 2 * tokens * nh * k * dh * de
    if kind == "fwd":
        kernels = {"triton": (2, lambda s: launch("fwd", cfg, s, w1, w2, k))}
        if ws_supported(dh, de, cfg.pack_block):
            # each head's blocks in turn (the JAX binding's default from k 8) vs a contiguous share of all heads'
            # blocks; "_pad": the padding-only second halves computed and zeroed (skip_padding=False, session 29)
            for name, heads in (("gluon_ws", 1), ("gluon_ws_head_major", nh)):
                for suffix, skip in (("", True), ("_pad", False)):
                    kernels[name + suffix] = (2, lambda s, h=heads, sk=skip: (gluon_experts_fwd_ws(
                        s[0], s[3], w1, w2, k, cfg.pack_block, heads=h, skip_padding=sk),))
    elif kind == "fwd_probe":  # the Gluon forward with its output stores (1) or gelu (2) left out (session 26)
        kernels = {f"gluon_ws_probe{p}": (2, lambda s, p=p: (gluon_experts_fwd_ws(s[0], s[3], w1, w2, k,
                                                                                  cfg.pack_block, probe=p),))
                   for p in range(4) if ws_supported(dh, de, cfg.pack_block)}
    else:
        split = replace(cfg, dw=Tile(min(64, cfg.pack_block), 64, 4, 3), dw_form="t")
        kernels = {"triton_dwt": (4, lambda s: launch("dwt", split, s, w1, w2, k))}
        if kind == "dw" and cfg.dw.block_e == de:
            kernels["triton_fused"] = (5, lambda s: launch("dwt", cfg, s, w1, w2, k)[:2])
        # dw: the kernel's defaults (DW_WS_*); dw_options: each launch option
        options = {"gluon_dw_ws": {}} if kind == "dw" else {
            f"ws_bm{bm}_wb{wb}_st{st}_r{r[0]}_{r[1]}": dict(block_m=bm, wbuf=wb, stages=st, regs=r)
            for bm, wb, st, r in DW_OPTIONS}
        for name, opt in options.items():
            if dw_ws_supported(dh, de, cfg.pack_block) and cfg.pack_block % opt.get("block_m", DW_WS_BLOCK_M) == 0:
                kernels[name] = (4, lambda s, o=opt: gluon_experts_dw_ws(s[0], s[1], s[2], s[3], w1, w2, k,
                                                                         cfg.pack_block, heads=nh, **o))
    params = dict(tokens=tokens, nh=nh, dh=dh, k=k, ne=ne, de=de, pack_block=cfg.pack_block, routing=routing)
    outputs = None
    if kind in ("fwd", "fwd_probe"):  # the routed rows only (the Gluon forward leaves padding-only halves unwritten)
        valid = sets[0][3].row_slot >= 0
        outputs = lambda fn: [o[valid] for o in fn(sets[0])]  # noqa: E731
    return _time_kernels(kind, kernels, sets, params, unit, date, device, outf, outputs)


def _time_kernels(kind: str, kernels: dict, sets, params: dict, unit: float, date: str, device: str, outf,
                  outputs=None) -> list[dict]:
    """One record per kernel {name: (matmul units, fn(input set) -> outputs)}: its outputs on the first input set
    (`outputs(fn)`, default fn(sets[0])) against the first kernel's, its median time over the rotating sets and
    units * unit FLOPs per call as TFLOP/s."""
    from triton.testing import do_bench

    refs, recs = None, []
    for name, (units, fn) in kernels.items():
        rec = dict(bench="gluon_kernels", kind=kind, kernel=name, device=device, date=date, params=params)
        outs = outputs(fn) if outputs else fn(sets[0])
        refs = outs if refs is None else refs
        rec["rel"], rec["max_abs"] = _diff(outs, refs)
        rec["ms"] = float(do_bench(rotating(fn, sets), warmup=25, rep=200, return_mode="median"))
        rec["tflops"] = units * unit / rec["ms"] / 1e9
        emit(rec, outf)
        recs.append(rec)
    return recs


def run_bwd(tokens: int, ne: int, k: int, de: int, date: str, device: str, outf, nh: int = 8,
            dh: int = 128, routing: str = "uniform", probe: list[dict] | None = None) -> list[dict]:
    """The whole backward: the fused Triton kernel at default_config's tile (de 128) or the split backward
    default_config picks (larger de), and the Gluon one at BWD_OPTIONS (probe: the Gluon one at these options
    alone)."""
    import torch

    from kernels.gluon.experts import bwd_ws_supported, gluon_experts_bwd_ws, gluon_experts_dw_ws
    from kernels.torch.experts import experts_dw, experts_dx
    from kernels.triton.experts import default_config

    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = default_config(tokens * nh * k, nh * ne, dh, de)
    if not bwd_ws_supported(dh, de, cfg.pack_block):
        return []
    sets = [input_set(tokens, ne, k, cfg.pack_block, g, nh, dh, routing) for _ in range(3)]
    w1, w2 = expert_weights(ne, de, g, nh, dh)
    p = sets[0][3].row_slot.shape[0]
    dx = torch.zeros(p, dh, dtype=torch.bfloat16, device="cuda")
    out = (torch.empty(w1.shape, device="cuda"), torch.empty(w2.shape, device="cuda"),
           torch.zeros(p, de // 128, dh, dtype=torch.bfloat16, device="cuda"),
           torch.zeros(p, de // 128, device="cuda"))

    def triton_fused(s):
        dw1, dw2, dgate = experts_dw(s[0], s[1], s[2], s[3], w1, w2, k, cfg, torch.float32, dx)
        return dw1, dw2, dx, dgate

    def triton_split(s):  # the split backward as default_config picks it (dX kernel; Gluon dW where chosen)
        dxs, dgate = experts_dx(s[0], s[1], s[2], s[3], w1, w2, k, cfg)
        if cfg.dw_ws:
            dw1, dw2 = gluon_experts_dw_ws(s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, heads=nh)
        else:
            dw1, dw2, _ = experts_dw(s[0], s[1], s[2], s[3], w1, w2, k, cfg, torch.float32)
        return dw1, dw2, dxs, dgate

    fused = cfg.dw.block_e == de
    kernels = {} if probe is not None else {"triton_fused" if fused else "split_default":
                                            (5, triton_fused if fused else triton_split)}
    for opts in probe or BWD_OPTIONS:
        kernels[option_name("gluon_bwd_ws", opts)] = (5, (
            lambda s, o=opts: gluon_experts_bwd_ws(
                s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, out=out, heads=nh, **o)))
    valid = sets[0][3].row_slot >= 0

    def outputs(fn):  # dW1, dW2, and the dX rows and gate gradients of the routed rows (partials summed)
        dx.zero_()
        outs = [o.clone() for o in fn(sets[0])]
        if outs[2].dim() == 3:  # the Gluon kernel's partials per 128 de
            outs[2:] = [outs[2].float().sum(1), outs[3].sum(1)]
        return outs[:2] + [outs[2][valid], outs[3][valid]]

    params = dict(tokens=tokens, nh=nh, dh=dh, k=k, ne=ne, de=de, pack_block=cfg.pack_block, routing=routing)
    # TFLOP/s of the fused form's 5 units
    return _time_kernels("bwd_probe" if probe is not None else "bwd", kernels, sets, params,
                         2 * tokens * nh * k * dh * de, date, device, outf, outputs)


def _router_sets(tokens: int, ne: int, nh: int, dh: int, cast_de: int | None = None) -> list[tuple]:
    """Three router input sets (x bf16, W_r fp32, its three bf16 terms, bias; cast_de: and two fp32 arrays of
    nh x ne x dh x cast_de elements to cast)."""
    import torch

    from kernels.torch.router import split_bf16

    g = torch.Generator(device="cuda").manual_seed(0)
    sets = []
    for _ in range(3):
        x = torch.randn(tokens, nh, dh, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(nh, dh, ne, device="cuda", generator=g) * dh ** -0.5
        b = 0.1 * torch.randn(nh, ne, device="cuda", generator=g)
        c = cast_de and tuple(torch.randn(nh * ne, dh, cast_de, device="cuda", generator=g) for _ in range(2))
        sets.append((x, w, split_bf16(w, 3).contiguous(), b, c))
    return sets


def run_router(tokens: int, ne: int, k: int, date: str, device: str, outf, nh: int = 8, dh: int = 128,
               router_options: list[dict] | None = None) -> list[dict]:
    """The router forward: Triton kernel (default tiles) and the Gluon one at ROUTER_OPTIONS, same inputs."""
    from triton.testing import do_bench

    from kernels.gluon.router import gluon_router_fwd_ws, ws_router_supported
    from kernels.torch.router import router_fwd

    sets = _router_sets(tokens, ne, nh, dh)
    kernels = {"triton": lambda s: router_fwd(s[0], s[1], s[3], k)}
    if ws_router_supported(dh, ne, k, 3):
        for o in router_options or ROUTER_OPTIONS:
            kernels["gluon_ws_" + ("_".join(f"{a}{v}" for a, v in o.items()) or "default")] = (
                lambda s, o=o: gluon_router_fwd_ws(s[0], s[2], s[3], k, **o))
    refs, recs = None, []
    for name, fn in kernels.items():
        rec = dict(bench="gluon_kernels", kind="router", kernel=name, device=device, date=date,
                   params=dict(tokens=tokens, nh=nh, dh=dh, k=k, ne=ne))
        vals, idx = fn(sets[0])
        refs = (vals, idx) if refs is None else refs
        rec["rel"] = float((idx != refs[1]).double().mean())
        rec["max_abs"] = float((vals.double() - refs[0].double()).abs().max())
        rec["ms"] = float(do_bench(rotating(fn, sets), warmup=25, rep=200, return_mode="median"))
        rec["tflops"] = 2 * 3 * tokens * nh * dh * ne / rec["ms"] / 1e9  # the bf16x3 products executed
        emit(rec, outf)
        recs.append(rec)
    return recs


def run_router_cast(tokens: int, ne: int, k: int, de: int, date: str, device: str, outf, nh: int = 8,
                    dh: int = 128) -> list[dict]:
    """The Gluon router forward (two consumers) alone, with the caster and without, and torch's casts."""
    import torch
    from triton.testing import do_bench

    from kernels.gluon.router import gluon_router_fwd_ws

    sets = _router_sets(tokens, ne, nh, dh, cast_de=de)
    kernels = {"gluon_ws_nc2": lambda s: gluon_router_fwd_ws(s[0], s[2], s[3], k, nc=2),
               "torch_cast": lambda s: tuple(c.to(torch.bfloat16) for c in s[4])}
    kernels["gluon_ws_nc2_cast"] = lambda s: gluon_router_fwd_ws(s[0], s[2], s[3], k, cast=s[4])
    # a 64th of the bytes: what the caster warp group costs the router beside its HBM traffic
    kernels["gluon_ws_nc2_cast_small"] = lambda s: gluon_router_fwd_ws(
        s[0], s[2], s[3], k, cast=tuple(c[: c.shape[0] // 64] for c in s[4]))
    ref, recs = kernels["gluon_ws_nc2"](sets[0]), []
    casts = kernels["torch_cast"](sets[0])
    for name, fn in kernels.items():
        rec = dict(bench="gluon_kernels", kind="router_cast", kernel=name, device=device, date=date,
                   params=dict(tokens=tokens, nh=nh, dh=dh, k=k, ne=ne, de=de))
        out = fn(sets[0])
        if name != "torch_cast":
            rec["rel"] = float((out[1] != ref[1]).double().mean())
        if "cast" in name and "small" not in name:
            rec["cast_equal"] = all(torch.equal(a, b) for a, b in zip(out[-2:], casts))
        rec["ms"] = float(do_bench(rotating(fn, sets), warmup=25, rep=200, return_mode="median"))
        emit(rec, outf)
        recs.append(rec)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["fwd", "dw"], choices=KINDS)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="tokens/Ne/k/de (Nh 8, dh 128)")
    ap.add_argument("--routing", default="uniform", choices=ROUTINGS,
                    help="uniform (nearly equal groups) or layer (groups as uneven as bench/layer.py's)")
    ap.add_argument("--probe-options", default=None,
                    help="bwd_probe: a JSON list of `gluon_experts_bwd_ws` option dicts instead of BWD_PROBE_OPTIONS, "
                         'e.g. \'[{"xw": false, "accum": 1}, {"xw": false, "accum": 2}]\'; router: of '
                         '`gluon_router_fwd_ws` ones instead of ROUTER_OPTIONS, e.g. \'[{"nc": 2, "thr": 8}]\'')
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    probe_options = None
    if args.probe_options is not None:
        try:
            probe_options = json.loads(args.probe_options)
        except json.JSONDecodeError as e:
            ap.error(f"--probe-options {args.probe_options!r}: not JSON ({e})")
        if not probe_options or not isinstance(probe_options, list) or not all(
                isinstance(o, dict) for o in probe_options):
            ap.error(f"--probe-options {args.probe_options!r}: expected a non-empty JSON list of option dicts")
    shapes = []
    for spec in args.shapes:
        try:
            shapes.append(tuple(int(v) for v in spec.split("/")))
        except ValueError:
            shapes.append(())
        if len(shapes[-1]) != 4:
            ap.error(f"--shapes {spec!r}: expected tokens/Ne/k/de, e.g. 81920/384/4/256")

    import torch

    date, device = datetime.date.today().isoformat(), torch.cuda.get_device_name()
    outf = open(args.out, "a") if args.out else None
    rows = []
    for kind in args.kinds:
        for shape in shapes:
            rows += run_shape(kind, *shape, date=date, device=device, outf=outf, routing=args.routing,
                              probe_options=probe_options)
    print(f"\n{'shape':>17} {'kernel':>12} {'ms':>7} {'TF/s':>6} rel")
    for r in rows:
        p = r["params"]
        shape = f"{p['tokens']}/{p['ne']}/{p['k']}/{p.get('de', '-')}"
        print(f"{shape:>17} {r['kernel']:>12} {r['ms']:7.3f} {r.get('tflops', float('nan')):6.1f} "
              f"{r.get('rel', float('nan')):.1e}")


if __name__ == "__main__":
    main()
