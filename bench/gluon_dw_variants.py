"""Probe: variants of the warp-specialised Gluon dW kernel (kernels/gluon_experts.py) against the transposed Triton
dW kernel, kernel alone, 81920 tokens (Hopper). One JSON line per variant.

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

# (both, block_m, wbuf, stages, (consumer regs, producer regs))
VARIANTS = [(False, 64, 2, 4, None), (True, 32, 2, 6, (240, 32)), (True, 32, 1, 4, (240, 32)),
            (True, 64, 1, 4, (240, 32)), (True, 32, 2, 6, (232, 40))]


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
    split = replace(cfg, dw=Tile(64, 64, 4, 3), dw_form="t")
    ref = launch("dwt", split, sets[0], w1, w2, k)[:2]
    fns = {"triton_dwt": lambda s: launch("dwt", split, s, w1, w2, k)[:2]}
    for both, bm, wb, nst, regs in VARIANTS:
        if de % (128 if both else 64) == 0:
            fns[f"ws_both{int(both)}_bm{bm}_wb{wb}_st{nst}_r{regs}"] = (
                lambda s, a=(both, bm, wb, nst, regs): gluon_experts_dw_ws(
                    s[0], s[1], s[2], s[3], w1, w2, k, cfg.pack_block, stages=a[3], wbuf=a[2], both=a[0], regs=a[4],
                    block_m=a[1]))
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
