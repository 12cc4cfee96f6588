"""The tensor rate an attention-class fused kernel reaches on this GPU: cuDNN's flash attention (through
`jax.nn.dot_product_attention(implementation="cudnn")`), forward and forward+backward, bf16, head dim 128, no mask.
The expert backward has an attention backward's structure (bench/NOTES.md, Layer, Session 35): this measures the
rate that structure reaches in a vendor kernel on the same machine, for the layer's bound.

    python bench/attn_rate.py [--seq 4096 8192] [--batch 4] [--heads 16] [--out FILE]

FLOPs counted as FlashAttention's papers do: forward 4 B H S S_kv D, backward 2.5 x the forward (recomputation of the
scores included: 5 matmuls against the forward's 2).
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


def attn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--kv-seq", type=int, default=0, help="keys per sequence (0: --seq); e.g. the expert layer's "
                    "analogue: --seq 864 --kv-seq 256 --batch 96 --heads 16 (1536 groups of ~850 rows, de 256)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    outf = open(args.out, "a") if args.out else None
    dev = jax.devices()[0].device_kind
    for s in args.seq:
        b, h, d = args.batch, args.heads, args.dim
        ks = jax.random.split(jax.random.key(0), 3)
        sk = args.kv_seq or s
        q = jax.random.normal(ks[0], (b, s, h, d), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (b, sk, h, d), jnp.bfloat16) for kk in ks[1:])
        fwd = jax.jit(attn)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
        flops_fwd = 4 * b * h * s * sk * d
        ms_fwd = time_jax(fwd, [(q, k, v)])
        ms = time_jax(grad, [(q, k, v)])
        ms_bwd = ms - ms_fwd
        emit(dict(bench="attn_rate", impl="cudnn", device=dev, date=datetime.date.today().isoformat(),
                  params=dict(batch=b, seq=s, kv_seq=sk, heads=h, dim=d), ms_fwd=ms_fwd, ms=ms, ms_bwd=ms_bwd,
                  tflops_fwd=flops_fwd / ms_fwd / 1e9, tflops_bwd=2.5 * flops_fwd / ms_bwd / 1e9,
                  tflops_fwd_bwd=3.5 * flops_fwd / ms / 1e9), outf)


if __name__ == "__main__":
    main()
