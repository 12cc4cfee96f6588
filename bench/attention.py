"""Causal attention of the 2.2B configs on one GPU: cuDNN, XLA and Pallas flash attention, fwd+bwd time, run-to-run
repeatability of the gradients and their error against an fp32 reference.

    python bench/attention.py [--batch 8] [--seq 2048] [--heads 8] [--head-dim 128] [--blocks 32 64 128] [--out FILE]

`model.attention_impl` picks one of these in the model (mhl_jax/model/attention.py). Per implementation one JSON line:
fwd and fwd+bwd ms (bf16 q, k, v; the gradient of sum(o * g) for a fixed random g), `repeat_bitwise` (dq, dk, dv of
five calls on the same inputs all bitwise equal), and the max |d - d_ref| / max |d_ref| of each gradient against XLA's
attention in fp32 (highest matmul precision). `pallas_bN`: the Pallas kernel with backward blocks N (forward 128).
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

import mhl_jax.model.attention as att  # noqa: E402
from bench.timing import emit, time_jax  # noqa: E402


def attention_fn(impl: str):
    if impl.startswith("pallas"):
        b = int(impl.split("_b")[1]) if "_b" in impl else att.PALLAS_BLOCKS["block_q_dq"]
        blocks = dict(att.PALLAS_BLOCKS, block_q_dkv=b, block_kv_dkv=b, block_q_dq=b, block_kv_dq=b)

        def fn(q, k, v):
            old = att.PALLAS_BLOCKS
            att.PALLAS_BLOCKS = blocks
            try:
                return att.pallas_attention(q, k, v)
            finally:
                att.PALLAS_BLOCKS = old
        return fn
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128], help="Pallas backward blocks to try")
    ap.add_argument("--out", default="")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    dev = jax.devices()[0]
    out = args.out or os.path.join(ROOT, "bench", "results", f"attention-{dev.device_kind.lower().replace(' ', '-')}-"
                                                             f"{args.date}.jsonl")
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(x, shape, jnp.float32) for x in ks)
    ref_fn = attention_fn("xla")
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ref_fn(q, k, v) * g), (0, 1, 2)))(q, k, v)
    qb, kb, vb, gb = (x.astype(jnp.bfloat16) for x in (q, k, v, g))
    impls = ["cudnn", "xla"] + [f"pallas_b{b}" for b in args.blocks]
    with open(out, "a") as outf:
        for impl in impls:
            rec = {"bench": "attention", "impl": impl, "shape": list(shape), "device": dev.device_kind,
                   "date": args.date, "jax": jax.__version__}
            try:
                fn = attention_fn(impl)
                fwd = jax.jit(fn)
                fb = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * gb),
                                      (0, 1, 2)))
                rec["fwd_ms"] = time_jax(fwd, [(qb, kb, vb)])
                rec["fwd_bwd_ms"] = time_jax(fb, [(qb, kb, vb)])
                runs = [jax.device_get(fb(qb, kb, vb)) for _ in range(5)]
                rec["repeat_bitwise"] = all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
                                            for r in runs[1:] for a, b in zip(runs[0], r))
                rec["rel_err"] = [float(jnp.max(jnp.abs(d.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                                  for d, r in zip(runs[0], ref)]
            except Exception as e:  # keep going: the other implementations are still worth measuring
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            emit(rec, outf)


if __name__ == "__main__":
    main()
