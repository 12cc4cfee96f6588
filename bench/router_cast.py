"""The layer (bench/layer.py) with the expert weights cast by the router's Gluon kernel (its caster warp group,
`mhl_jax.model.moe_core.ROUTER_CASTS_WEIGHTS`) against the XLA cast, in one process: every gradient compared
bitwise, then fwd+bwd timed (bench.timing.time_jax) for both; --cast-options: the caster's (registers, chunks per
step) to time, each (kernels.gluon_router.WS_ROUTER_CAST_REGS / _U; its default first).

    python bench/router_cast.py [--tokens 81920] [--configs 1536/8/128 768/8/128] [--cast-options 40,1 72,4]
                                [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.timing import emit, time_jax  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[81920])
    ap.add_argument("--configs", nargs="+", default=["1536/8/128", "768/8/128"])
    ap.add_argument("--cast-options", nargs="+", default=None, help="registers,chunks (default: the kernel's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import kernels.gluon_router as gr
    import mhl_jax.model.moe_core as mc
    from bench.layer import D, init_params, layer

    outf = open(args.out, "a") if args.out else None
    for tokens in args.tokens:
        for config in args.configs:
            ne, k, de = (int(v) for v in config.split("/"))
            params = init_params(jax.random.key(0), ne, de)
            x = jax.random.normal(jax.random.key(1), (tokens, D), jnp.bfloat16)
            options = [tuple(int(v) for v in o.split(",")) for o in args.cast_options or
                       [f"{gr.WS_ROUTER_CAST_REGS},{gr.WS_ROUTER_CAST_U}"]]
            default = (gr.WS_ROUTER_CAST_REGS, gr.WS_ROUTER_CAST_U)
            res, fns = {}, {}
            for name, on, opt in [("xla_cast", False, default)] + [(f"router_cast_r{r}_u{u}", True, (r, u))
                                                                   for r, u in options]:
                mc.ROUTER_CASTS_WEIGHTS = on
                gr.WS_ROUTER_CAST_REGS, gr.WS_ROUTER_CAST_U = opt
                fns[name] = jax.jit(jax.grad(
                    lambda p, x, kk=k: jnp.sum(layer(p, x, kk, "triton", "triton").astype(jnp.float32) ** 2),
                    argnums=(0, 1)))
                res[name] = jax.tree.leaves(jax.block_until_ready(fns[name](params, x)))
            mc.ROUTER_CASTS_WEIGHTS = False
            gr.WS_ROUTER_CAST_REGS, gr.WS_ROUTER_CAST_U = default
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for r in res.values()
                       for a, b in zip(res["xla_cast"], r))
            times = {name: time_jax(fn, [(params, x)]) for name, fn in fns.items()}
            emit(dict(bench="router_cast", device=jax.devices()[0].device_kind, date=datetime.date.today().isoformat(),
                      params=dict(tokens=tokens, ne=ne, k=k, de=de), grads_bitwise_equal=same,
                      ms=times), outf)


if __name__ == "__main__":
    main()
