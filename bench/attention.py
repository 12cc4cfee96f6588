"""Causal attention of the 2.2B configs on one GPU: cuDNN, XLA and Pallas flash attention, fwd+bwd time, run-to-run
repeatability of the gradients and their error against an fp32 reference.

    python bench/attention.py [--batch 8] [--seq 2048] [--heads 8] [--head-dim 128] [--blocks 32 64 128] [--out FILE]
    python bench/attention.py --sweep [...]

`--sweep`: the Pallas kernel's tiles, warps and (forward) stages, its forward and its backward timed apart (the
backward from saved residuals through the module's `_mha_backward`, so each pass gets its own warps), then the best
forward with the best backward (`pallas_best`) beside cuDNN and the current PALLAS_CONFIG, fwd+bwd, repeatability and
error as above.

`model.attention_impl` picks one of these in the model (mhl_jax/model/attention.py). Per implementation one JSON line:
fwd and fwd+bwd ms (bf16 q, k, v; the gradient of sum(o * g) for a fixed random g), `repeat_bitwise` (dq, dk, dv of
five calls on the same inputs all bitwise equal), and the max |d - d_ref| / max |d_ref| of each gradient against XLA's
attention in fp32 (highest matmul precision). `pallas_bN`: the Pallas kernel with backward blocks N (the rest as
PALLAS_CONFIG).
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
        b = int(impl.split("_b")[1]) if "_b" in impl else None
        config = (att.PALLAS_CONFIG if b is None else
                  dict(att.PALLAS_CONFIG, block_q_dkv=b, block_kv_dkv=b, block_q_dq=b, block_kv_dq=b))
        return lambda q, k, v: att.pallas_attention(q, k, v, config=config)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def _blocks(bwd=(64, 64, 64), fwd=(128, 128)):
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha
    a, b, c = bwd
    return pallas_mha.BlockSizes(block_q=fwd[0], block_k=fwd[1], block_q_dkv=a, block_kv_dkv=b, block_q_dq=b,
                                 block_kv_dq=c)


def pallas_split(fwd_cfg: dict, bwd_cfg: dict, interpret: bool = False):
    """Causal Pallas attention whose forward runs with fwd_cfg (blocks (bq, bk), warps, stages) and backward with
    bwd_cfg (blocks (q_dkv, kv_dkv = q_dq, kv_dq), warps): the module's own kernels, split by a custom_vjp."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha

    def fwd_call(q, k, v):
        scale = q.shape[-1] ** -0.5
        return pallas_mha.mha(q, k, v, None, sm_scale=scale, causal=True,
                              block_sizes=_blocks(bwd_cfg["blocks"], fwd_cfg["blocks"]), num_warps=fwd_cfg["warps"],
                              num_stages=fwd_cfg["stages"], return_residuals=True,
                              interpret=interpret)

    @jax.custom_vjp
    def f(q, k, v):
        return fwd_call(q, k, v)[0]

    def f_fwd(q, k, v):
        o, lse = fwd_call(q, k, v)
        return o, (q, k, v, o, lse)

    def f_bwd(res, do):
        q, k, v, o, lse = res
        dq, dk, dv, _ = pallas_mha._mha_backward(
            q.shape[-1] ** -0.5, True, _blocks(bwd_cfg["blocks"], fwd_cfg["blocks"]), "triton", bwd_cfg["warps"], 2,
            None, interpret, False, False, (q, k, v, None, o, lse), do)
        return dq, dk, dv

    f.defvjp(f_fwd, f_bwd)
    return f


def sweep(args, dev, outf, qb, kb, vb, gb) -> tuple[dict, dict]:
    """Forward configs timed alone, backward configs timed alone from fixed residuals; returns the best of each."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha
    scale = qb.shape[-1] ** -0.5
    base = {"bench": "attention_sweep", "shape": list(qb.shape), "device": dev.device_kind, "date": args.date,
            "jax": jax.__version__}

    def best_of(pass_name, cfgs, make, inputs):
        """Time jit(make(cfg)) on inputs for every cfg (one JSON line each; a config that fails is reported and
        skipped) -> the fastest cfg."""
        best = None
        for cfg in cfgs:
            rec = dict(base, **{"pass": pass_name}, **cfg)
            try:
                rec["ms"] = time_jax(jax.jit(make(cfg)), [inputs])
                if best is None or rec["ms"] < best[0]:
                    best = (rec["ms"], cfg)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit(rec, outf)
        return best[1]

    best_f = best_of("fwd", [{"blocks": (bq, bk), "warps": w, "stages": st} for bq in (128, 64) for bk in (128, 64)
                             for w in (4, 8) for st in (2, 3, 4)],
                     lambda cfg: lambda q, k, v: pallas_mha.mha(
                         q, k, v, None, sm_scale=scale, causal=True, block_sizes=_blocks(fwd=cfg["blocks"]),
                         num_warps=cfg["warps"], num_stages=cfg["stages"]), (qb, kb, vb))
    o, lse = jax.jit(lambda q, k, v: pallas_mha.mha(q, k, v, None, sm_scale=scale, causal=True,
                                                    block_sizes=_blocks(), return_residuals=True))(qb, kb, vb)
    best_b = best_of("bwd", [{"blocks": (a, b, c), "warps": w} for a in (32, 64, 128) for b in (64, 128)
                             for c in (32, 64, 128) for w in (4, 8)],
                     lambda cfg: lambda q, k, v, o, lse, do: pallas_mha._mha_backward(
                         scale, True, _blocks(cfg["blocks"]), "triton", cfg["warps"], 2, None, False, False, False,
                         (q, k, v, None, o, lse), do)[:3], (qb, kb, vb, o, lse, gb))
    return best_f, best_b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128], help="Pallas backward blocks to try")
    ap.add_argument("--sweep", action="store_true", help="sweep the Pallas kernel's tiles, warps and stages first")
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
        fns = {}
        if args.sweep:
            best_f, best_b = sweep(args, dev, outf, qb, kb, vb, gb)
            emit({"bench": "attention_sweep", "best_fwd": best_f, "best_bwd": best_b}, outf)
            impls = ["cudnn", "pallas", "pallas_best"]
            fns["pallas_best"] = pallas_split(best_f, best_b)
        for impl in impls:
            rec = {"bench": "attention", "impl": impl, "shape": list(shape), "device": dev.device_kind,
                   "date": args.date, "jax": jax.__version__}
            try:
                fn = fns.get(impl) or attention_fn(impl)
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
