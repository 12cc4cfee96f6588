"""W_in / W_out of the MH-LatentMoE layer in the layouts Head Parallel can use, on one GPU.

    python bench/hp_proj.py [--tokens 81920] [--groups 2 4] [--out FILE]

Under Head Parallel the sub-tokens go to P devices by head group. The token-major projection
(x (n, d) -> (n, Nh, dh)) is one matmul each way, but its head groups are strided, so the
all_to_all needs a transpose on each side. The head-group-major variants emit (P, n, Nh/P, dh):
- `grouped_sum_out`: one einsum 'nd,dghc->gnhc' in, a sum of P per-group matmuls out (the model's
  first version);
- `grouped_stack`: P per-group matmuls stacked in, the same sum out;
- `grouped`: the einsum in, one einsum 'gnhc,ghcd->nd' out (`mhl_jax.model.moe`, chosen from this
  bench; called `grouped_einsum_out` in the first results file).
No exchange here: the difference to `token` is what each layout costs in the projections, to add
to the exchange measured by bench/a2a.py --hp-layer. bf16, fwd and fwd+bwd (grads of x, W_in, W_out).
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

from bench.timing import emit, time_jax  # noqa: E402
from mhl_jax.model.moe import grouped_project_in, grouped_project_out  # noqa: E402


def variant(name: str, groups: int):
    def f(x, w_in, w_out):
        d, heads, dh = w_in.shape
        if name == "token":
            return jnp.einsum("nhc,hcd->nd", jnp.einsum("nd,dhc->nhc", x, w_in), w_out)
        hl = heads // groups
        if name == "grouped":
            return grouped_project_out(grouped_project_in(x, w_in, groups), w_out)
        if name == "grouped_stack":
            sub = jnp.stack([x @ w_in[:, g * hl:(g + 1) * hl].reshape(d, hl * dh) for g in range(groups)])
            sub = sub.reshape(groups, -1, hl, dh)
        else:
            sub = grouped_project_in(x, w_in, groups)
        return sum(jnp.einsum("nhc,hcd->nd", sub[g], w_out[g * hl:(g + 1) * hl]) for g in range(groups))
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default="")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    n, d, heads = args.tokens, args.d, args.heads
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (n, d), jnp.bfloat16)
    w_in = (0.02 * jax.random.normal(ks[1], (d, heads, d // heads))).astype(jnp.bfloat16)
    w_out = (0.02 * jax.random.normal(ks[2], (heads, d // heads, d))).astype(jnp.bfloat16)
    outf = open(args.out, "w") if args.out else None
    device = jax.devices()[0].device_kind
    ref = jax.jit(variant("token", 1))(x, w_in, w_out).astype(jnp.float32)
    for groups in args.groups:
        for name in ("token", "grouped", "grouped_sum_out", "grouped_stack"):
            f = variant(name, groups)
            err = float(jnp.max(jnp.abs(jax.jit(f)(x, w_in, w_out).astype(jnp.float32) - ref)))
            fwd = jax.jit(f)
            bwd = jax.jit(jax.grad(lambda a, b, c, f=f: jnp.sum(f(a, b, c).astype(jnp.float32) * 1e-3),
                                   argnums=(0, 1, 2)))
            rec = {"bench": "hp_proj", "device": device, "date": args.date, "variant": name,
                   "params": {"tokens": n, "d": d, "heads": heads, "groups": groups, "dtype": "bfloat16"},
                   "fwd_ms": time_jax(fwd, [(x, w_in, w_out)]), "fwd_bwd_ms": time_jax(bwd, [(x, w_in, w_out)]),
                   "max_abs_diff_vs_token": err}
            emit(rec, outf)
    if outf:
        outf.close()


if __name__ == "__main__":
    main()
