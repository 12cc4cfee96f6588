"""The LM head loss's chunk step on one GPU: from a chunk's fp32 logits to its NLL and the logits' gradient in bf16
(`mhl_jax.model.loss.head_loss`), XLA's three passes (`xla_xent`) against the Triton kernel (`KernelXent`), and
optionally the kernel's tiles swept.

    python -m bench.loss [--rows 4096] [--vocab 50304] [--sweep] [--out FILE]

One JSON line per implementation (and per swept setting): ms, GB/s of the byte floor (the logits read once, d written
once) against the time, and the largest differences from XLA's d (in bf16 ulps of d's scale) and nll. The train
step runs 4 chunks of 4096 tokens per micro-batch of 8 x 2048.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from bench.common import JsonLines, error_text, parser, time_jax, today
from kernels.tuning import XENT_TILES


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's tiles around XENT_TILES")
    args = ap.parse_args(argv)
    from mhl_jax.model import cross_entropy as ce
    from mhl_jax.model.loss import xla_xent

    k1, k2 = jax.random.split(jax.random.key(0))
    logits = jax.random.normal(k1, (args.rows, args.vocab), jnp.float32) * 4.0
    tgt = jax.random.randint(k2, (args.rows,), 0, args.vocab, jnp.int32)
    scale = 1.0 / (4 * args.rows)
    floor_gb = args.rows * args.vocab * (4 + 2) / 1e9
    base = {"bench": "loss", "rows": args.rows, "vocab": args.vocab, "device": jax.devices()[0].device_kind,
            "date": today(), "jax": jax.__version__, "floor_gb": floor_gb}
    ref = jax.jit(lambda a, b: xla_xent(a, b, scale, jnp.bfloat16))(logits, tgt)

    def record(impl, fn, **extra):
        rec = dict(base, impl=impl, **extra)
        try:
            f = jax.jit(fn)
            rec["ms"] = time_jax(f, [(logits, tgt)])
            rec["gbs"] = floor_gb / rec["ms"] * 1e3
            d, nll = f(logits, tgt)
            rec["d_max_diff_ulps"] = float(jnp.max(jnp.abs(d.astype(jnp.float32) - ref[0].astype(jnp.float32)))
                                           / (scale * 2**-8))
            rec["nll_max_diff"] = float(jnp.max(jnp.abs(nll - ref[1])))
        except Exception as e:
            rec["error"] = error_text(e)
        return rec

    def kernel(tiles):
        return lambda a, b: ce.xent_rows(a, b, scale, jnp.bfloat16, tiles)

    with JsonLines(args.out) as emit:
        rows = [emit(record("xla", lambda a, b: xla_xent(a, b, scale, jnp.bfloat16))),
                emit(record("triton", kernel(XENT_TILES), tiles=XENT_TILES._asdict()))]
        if args.sweep:
            for block, warps, per_sm in itertools.product((2048, 4096, 8192), (4, 8, 16), (1, 2, 4, 8)):
                tiles = XENT_TILES._replace(block=block, warps=warps, programs_per_sm=per_sm)
                rows.append(emit(record("triton_sweep", kernel(tiles), tiles=tiles._asdict())))
    best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    for r in rows[:2] + [best]:
        print(f"{r['impl']:>13} {r.get('ms', float('nan')):8.3f} ms {r.get('gbs', float('nan')):7.0f} GB/s "
              f"{r.get('tiles', '')} {r.get('error', '')}")


if __name__ == "__main__":
    main()
