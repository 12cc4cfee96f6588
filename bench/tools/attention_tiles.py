"""The Pallas attention kernel's tiles, warps and (forward) stages on one GPU: its forward and its backward timed apart
(the backward from saved residuals through the module's `_mha_backward`, so each pass gets its own launch settings),
then the best forward with the best backward beside cuDNN and the model's `PALLAS_CONFIG`.

    python -m bench.tools.attention_tiles [--batch 8] [--seq 2048] [--heads 8] [--head-dim 128] [--out FILE]

One JSON line per configuration and pass (`attention_sweep`), the best of each, then `bench.attention`'s records for
cudnn, pallas (PALLAS_CONFIG) and pallas_best.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas.ops.gpu import attention as pallas_mha

from bench.attention import add_shape_args, inputs, measure
from bench.common import JsonLines, parser, time_jax, today


def _blocks(bwd=(64, 64, 64), fwd=(128, 128)):
    a, b, c = bwd
    return pallas_mha.BlockSizes(block_q=fwd[0], block_k=fwd[1], block_q_dkv=a, block_kv_dkv=b, block_q_dq=b,
                                 block_kv_dq=c)


def pallas_split(fwd_cfg: dict, bwd_cfg: dict, interpret: bool = False):
    """Causal Pallas attention whose forward runs with fwd_cfg (blocks (bq, bk), warps, stages) and backward with
    bwd_cfg (blocks (q_dkv, kv_dkv = q_dq, kv_dq), warps): the module's own kernels, split by a custom_vjp."""
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


def sweep(shape, emit, qb, kb, vb, gb) -> tuple[dict, dict]:
    """Forward configs timed alone, backward configs timed alone from fixed residuals; returns the best of each."""
    scale = qb.shape[-1] ** -0.5
    base = {"bench": "attention_sweep", "shape": list(shape), "device": jax.devices()[0].device_kind, "date": today(),
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
            emit(rec)
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


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_shape_args(ap)
    args = ap.parse_args(argv)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    ref, (qb, kb, vb, gb) = inputs(shape)
    with JsonLines(args.out) as emit:
        best_f, best_b = sweep(shape, emit, qb, kb, vb, gb)
        emit({"bench": "attention_sweep", "best_fwd": best_f, "best_bwd": best_b})
        for impl, fn in (("cudnn", None), ("pallas", None), ("pallas_best", pallas_split(best_f, best_b))):
            emit(measure(impl, shape, ref, (qb, kb, vb, gb), fn))


if __name__ == "__main__":
    main()
