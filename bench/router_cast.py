"""The layer (bench/layer.py) with the expert weights cast by the router's Gluon kernel (its caster warp group,
`mhl_jax.moe.core.ROUTER_CASTS_WEIGHTS`) against the XLA cast, in one process: every gradient compared
bitwise, then fwd+bwd timed (bench.timing.time_jax) for both. The caster is forced on at every token count
(moe_core.ROUTER_CAST_MIN_TOKENS_PER_WEIGHT = 0); `rule` says whether the default would run it at that shape.

    python bench/router_cast.py [--tokens 81920] [--configs 1536/8/128 768/8/128] [--out FILE]
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import mhl_jax.moe.core as mc
    from bench.layer import DH, D, init_params, layer

    outf = open(args.out, "a") if args.out else None
    for tokens in args.tokens:
        for config in args.configs:
            ne, k, de = (int(v) for v in config.split("/"))
            params = init_params(jax.random.key(0), ne, de)
            x = jax.random.normal(jax.random.key(1), (tokens, D), jnp.bfloat16)
            res, fns, saved = {}, {}, (mc.ROUTER_CASTS_WEIGHTS, mc.ROUTER_CAST_MIN_TOKENS_PER_WEIGHT)
            rule = saved[1] * DH * de <= tokens
            mc.ROUTER_CAST_MIN_TOKENS_PER_WEIGHT = 0
            for on in (False, True):
                mc.ROUTER_CASTS_WEIGHTS = on
                fns[on] = jax.jit(jax.grad(
                    lambda p, x, kk=k: jnp.sum(layer(p, x, kk, "triton", "triton").astype(jnp.float32) ** 2),
                    argnums=(0, 1)))
                res[on] = jax.tree.leaves(jax.block_until_ready(fns[on](params, x)))
            mc.ROUTER_CASTS_WEIGHTS, mc.ROUTER_CAST_MIN_TOKENS_PER_WEIGHT = saved
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(res[False], res[True]))
            times = {("router_cast" if on else "xla_cast"): time_jax(fns[on], [(params, x)]) for on in (False, True)}
            emit(dict(bench="router_cast", device=jax.devices()[0].device_kind, date=datetime.date.today().isoformat(),
                      params=dict(tokens=tokens, ne=ne, k=k, de=de), grads_bitwise_equal=same, rule=rule,
                      ms=times), outf)


if __name__ == "__main__":
    main()
