"""Probe: launch options of the warp-specialised Gluon dW kernel (kernels/gluon_experts.py) against the transposed
Triton dW kernel (tile (64, 64, 4, 3), rows clamped to the packing block), kernel alone, uniform random routing
(Hopper). One JSON line per variant: ms (median, 3 rotating input sets), rel = the larger relative difference of
dW1 / dW2 to the Triton kernel's (it rounds gate * dy to bf16 first: ~3e-3).

    python bench/gluon_dw_variants.py 81920/384/4/256 ...
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.kernel_tiles import expert_weights, input_set, launch, rotating  # noqa: E402
from bench.timing import emit  # noqa: E402

# (block_m, wbuf, stages, (consumer regs, producer regs)); the first is the kernel's default
VARIANTS = [(32, 2, 6, (240, 32)), (32, 2, 4, (240, 32)), (32, 1, 4, (240, 32)), (32, 2, 6, (232, 40)),
            (64, 1, 4, (240, 32))]


def probe(spec: str, date: str, device: str) -> None:
    """Every variant and the Triton kernel at one shape tokens/Ne/k/de (Nh 8, dh 128), same inputs."""
    import torch
    from triton.testing import do_bench

    from kernels.experts import Tile, default_config
    from kernels.gluon_experts import gluon_experts_dw_ws

    tokens, ne, k, de = (int(v) for v in spec.split("/"))
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = default_config(tokens * 8 * k, 8 * ne, 128, de)
    sets = [input_set(tokens, ne, k, cfg.pack_block, g) for _ in range(3)]
    w1, w2 = expert_weights(ne, de, g)
    split = replace(cfg, dw=Tile(min(64, cfg.pack_block), 64, 4, 3), dw_form="t")
    ref = launch("dwt", split, sets[0], w1, w2, k)[:2]
    fns = {"triton_dwt": lambda s: launch("dwt", split, s, w1, w2, k)[:2]}
    for bm, wb, nst, regs in VARIANTS:
        fns[f"ws_bm{bm}_wb{wb}_st{nst}_r{regs[0]}_{regs[1]}"] = (
            lambda s, a=(bm, wb, nst, regs): gluon_experts_dw_ws(
                s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, block_m=a[0], wbuf=a[1], stages=a[2], regs=a[3]))
    for name, fn in fns.items():
        try:
            out = fn(sets[0])
            rel = max(float((o.double() - r.double()).norm() / r.double().norm()) for o, r in zip(out, ref))
            ms = float(do_bench(rotating(fn, sets), warmup=25, rep=200, return_mode="median"))
            emit(dict(bench="gluon_dw_variants", kernel=name, shape=spec, device=device, date=date, ms=ms, rel=rel),
                 None)
        except Exception as e:  # a variant that does not compile or launch is reported, not fatal
            emit(dict(bench="gluon_dw_variants", kernel=name, shape=spec, error=str(e)[-400:]), None)


def main() -> None:
    import torch

    date, device = datetime.date.today().isoformat(), torch.cuda.get_device_name()
    for spec in sys.argv[1:] or ["81920/384/4/256"]:
        probe(spec, date, device)


if __name__ == "__main__":
    main()
