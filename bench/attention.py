"""Causal attention at the 2.2B configs' shape on one GPU: cuDNN, XLA and our Triton flash attention, fwd+bwd time,
run-to-run repeatability of the gradients and their error against an fp32 reference.

    python -m bench.attention [--batch 8] [--seq 2048] [--heads 8] [--head-dim 128] [--impls cudnn xla triton]
                              [--out FILE]

`model.attention_impl` picks one of these in the model (`mhl_jax.model.attention`; triton runs the tiles of
`kernels.tuning.ATTENTION_TILES`).
Per implementation one JSON line: fwd and fwd+bwd ms (bf16 q, k, v; the gradient of sum(o * g) for a fixed random
g), `repeat_bitwise` (dq, dk, dv of five calls on the same inputs all bitwise equal), and `rel_err`: per gradient,
max |d - d_ref| / max |d_ref| against XLA's attention in fp32 at the highest matmul precision.
`python -m bench.tools.attention_tiles` sweeps the Triton kernels' tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import JsonLines, error_text, parser, time_jax, today


def attention_fn(impl: str):
    """(q, k, v) -> causal attention output, by `impl`: "triton" (the model's kernels and tiles), "cudnn" or "xla"."""
    if impl == "triton":
        from mhl_jax.model.flash_attention import flash_attention

        return flash_attention
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def inputs(shape: tuple[int, ...]):
    """(the fp32 reference gradients, (q, k, v, g) in bf16) at `shape` (batch, seq, heads, head_dim)."""
    q, k, v, g = (jax.random.normal(key, shape, jnp.float32) for key in jax.random.split(jax.random.key(0), 4))
    ref_fn = attention_fn("xla")
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ref_fn(q, k, v) * g), (0, 1, 2)))(q, k, v)
    return ref, tuple(x.astype(jnp.bfloat16) for x in (q, k, v, g))


def measure(impl: str, shape, ref, bf16_inputs, fn=None) -> dict:
    """One implementation's record (`fn` overrides `attention_fn(impl)`)."""
    qb, kb, vb, gb = bf16_inputs
    rec = {"bench": "attention", "impl": impl, "shape": list(shape), "device": jax.devices()[0].device_kind,
           "date": today(), "jax": jax.__version__}
    try:
        fn = fn or attention_fn(impl)
        fb = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * gb), (0, 1, 2)))
        rec["fwd_ms"] = time_jax(jax.jit(fn), [(qb, kb, vb)])
        rec["fwd_bwd_ms"] = time_jax(fb, [(qb, kb, vb)])
        runs = [jax.device_get(fb(qb, kb, vb)) for _ in range(5)]
        rec["repeat_bitwise"] = all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
                                    for r in runs[1:] for a, b in zip(runs[0], r))
        rec["rel_err"] = [float(jnp.max(jnp.abs(d.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                          for d, r in zip(runs[0], ref)]
    except Exception as e:  # keep going: the other implementations are still worth measuring
        rec["error"] = error_text(e)
    return rec


def add_shape_args(ap) -> None:
    """The attention shape options (the model's configuration by default), shared with bench.tools.attention_tiles."""
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_shape_args(ap)
    ap.add_argument("--impls", nargs="+", default=["cudnn", "xla", "triton"],
                    choices=["cudnn", "xla", "triton"])
    args = ap.parse_args(argv)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    ref, bf16_inputs = inputs(shape)
    with JsonLines(args.out) as emit:
        rows = [emit(measure(impl, shape, ref, bf16_inputs)) for impl in args.impls]
    print(f"\n{'impl':>8} {'fwd ms':>8} {'f+b ms':>8} {'bitwise':>8} {'max rel err':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:>8} error: {r['error'][:80]}")
        else:
            print(f"{r['impl']:>8} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} {str(r['repeat_bitwise']):>8} "
                  f"{max(r['rel_err']):12.2e}")


if __name__ == "__main__":
    main()
