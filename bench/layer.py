"""The whole MH-LatentMoE layer, forward and forward+backward, at the shapes of DESIGN §7's table,
against the authors' figures (shared/anchors/ref_layer_h100_2026-11-22.jsonl, one H100).

    python bench/layer.py [--tokens 8192 81920] [--configs 384/4/256 768/8/128 ...]
                          [--experts triton reference] [--router reference|triton|auto] [--out FILE]

Layer (built from the ops, independent of the model module):
    x (N, d=1024) bf16 -> W_in (d, Nh*dh) -> (N, Nh=8, dh=128) -> route_topk per head (fp32 scores,
    bias in the selection) -> gates = softmax(values) fp32 -> expert_ffn (N, Nh, dh) -> W_out -> (N, d)
Parameters are fp32 masters (cast to bf16 for the matmuls, fp32 gradients), as in training.
fwd+bwd = jax.grad w.r.t. every parameter and x. TFLOP/s counts the model FLOPs (3 x forward of
W_in, W_out, router scores and experts; our backward's recomputation is not counted) against the
~800 TFLOP/s measured bf16 rate. Memory: XLA's buffer assignment of the compiled step
(arguments + outputs + temporaries = the step's peak), beside the authors' torch peak.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.timing import time_jax  # noqa: E402

D, NH, DH = 1024, 8, 128
MEASURED_BF16_TFLOPS = 800.0


def init_params(key, ne: int, de: int):
    ks = jax.random.split(key, 6)
    return dict(
        w_in=jax.random.normal(ks[0], (D, NH * DH)) * 0.02,
        w_r=jax.random.normal(ks[1], (NH, DH, ne)) * 0.02,
        bias=jax.random.normal(ks[2], (NH, ne)) * 1e-3,
        w1=jax.random.normal(ks[3], (NH, ne, DH, de)) * 0.02,
        w2=jax.random.normal(ks[4], (NH, ne, de, DH)) * 0.02,
        w_out=jax.random.normal(ks[5], (NH * DH, D)) * 0.02,
    )


def layer(params, x, k: int, expert_impl: str, router_impl: str):
    """x: (N, d) bf16 -> (N, d) bf16."""
    from mhl_jax.ops.experts import expert_ffn
    from mhl_jax.ops.router import route_topk

    n = x.shape[0]
    sub = jnp.dot(x, params["w_in"].astype(x.dtype)).reshape(n, NH, DH)
    vals, idx = route_topk(sub, params["w_r"], params["bias"], k, router_impl)
    gates = jax.nn.softmax(vals, axis=-1)
    y, _ = expert_ffn(sub, idx, gates, params["w1"], params["w2"], expert_impl)
    return jnp.dot(y.reshape(n, NH * DH), params["w_out"].astype(x.dtype))


def model_flops(tokens: int, ne: int, k: int, de: int) -> float:
    fwd = tokens * (2 * D * NH * DH * 2 + NH * 2 * DH * ne + NH * k * 4 * DH * de)
    return 3.0 * fwd




def peak_gib(jitted, *args) -> float:
    m = jitted.lower(*args).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return total / 2 ** 30


def resolve_router(choice: str) -> str:
    if choice != "auto":
        return choice
    try:
        import mhl_jax.ops.router_triton  # noqa: F401
    except Exception:
        return "reference"
    return "triton"


# The authors' layer (torch.compile, their Triton router + FlexAttention experts), one H100, 2026-11-22
# (shared/anchors/ref_layer_h100_2026-11-22.jsonl): (tokens, Ne, k, de) -> (fwd ms, fwd+bwd ms, peak GiB)
AUTHORS = {
    (8192, 384, 4, 256): (7.649, 13.776, 2.601), (8192, 768, 8, 128): (7.133, 17.469, 2.936),
    (8192, 768, 4, 256): (8.225, 20.240, 4.963), (8192, 1536, 8, 128): (12.003, 27.726, 5.687),
    (81920, 384, 4, 256): (18.869, 52.585, 9.270), (81920, 768, 8, 128): (36.264, 87.275, 8.896),
    (81920, 768, 4, 256): (27.418, 65.215, 8.222), (81920, 1536, 8, 128): (59.432, 113.784, 11.719),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 81920])
    ap.add_argument("--configs", nargs="+", default=["384/4/256", "768/8/128", "768/4/256", "1536/8/128"])
    ap.add_argument("--experts", nargs="+", default=["triton"])
    ap.add_argument("--router", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    router = resolve_router(args.router)
    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    outf = open(args.out, "a") if args.out else None
    rows = []
    for tokens in args.tokens:
        for cfg in args.configs:
            ne, k, de = (int(v) for v in cfg.split("/"))
            params = init_params(jax.random.key(0), ne, de)
            xs = [jax.random.normal(jax.random.key(s + 1), (tokens, D), jnp.bfloat16) for s in range(2)]
            for impl in args.experts:
                fwd = jax.jit(lambda p, x, impl=impl, k=k: layer(p, x, k, impl, router))
                grad = jax.jit(jax.grad(lambda p, x, impl=impl, k=k: jnp.sum(
                    layer(p, x, k, impl, router).astype(jnp.float32) ** 2), argnums=(0, 1)))
                rec = dict(bench="layer", impl=impl, router=router, device=device, date=date,
                           params=dict(tokens=tokens, d=D, nh=NH, dh=DH, ne=ne, k=k, de=de))
                try:
                    rec["ms_fwd"] = time_jax(fwd, [(params, x) for x in xs])
                    rec["ms"] = time_jax(grad, [(params, x) for x in xs])
                    rec["ms_bwd"] = rec["ms"] - rec["ms_fwd"]
                    rec["peak_gib"] = peak_gib(grad, params, xs[0])
                    rec["tflops"] = model_flops(tokens, ne, k, de) / rec["ms"] / 1e9
                    rec["frac_of_measured_peak"] = rec["tflops"] / MEASURED_BF16_TFLOPS
                    a = AUTHORS.get((tokens, ne, k, de))
                    if a:
                        rec["authors"] = dict(ms_fwd=a[0], ms=a[1], peak_gib=a[2])
                        rec["speedup_vs_authors"] = a[1] / rec["ms"]
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(rec), flush=True)
                if outf:
                    outf.write(json.dumps(rec) + "\n")
                    outf.flush()
                rows.append(rec)
            del params, xs
    print(f"\n{'tokens':>6} {'Ne/k/de':>11} {'impl':>9} {'fwd ms':>8} {'f+b ms':>8} {'GiB':>6} {'TF/s':>6} "
          f"{'authors f+b':>11} {'GiB':>5} {'x':>6}")
    for r in rows:
        p, a = r["params"], r.get("authors", {})
        if "ms" not in r:
            print(f"{p['tokens']:>6} {p['ne']}/{p['k']}/{p['de']:<5} {r['impl']:>9} error")
            continue
        print(f"{p['tokens']:>6} {p['ne']:>5}/{p['k']}/{p['de']:<3} {r['impl']:>9} {r['ms_fwd']:8.2f} {r['ms']:8.2f} "
              f"{r['peak_gib']:6.2f} {r['tflops']:6.1f} {a.get('ms', float('nan')):11.1f} "
              f"{a.get('peak_gib', float('nan')):5.1f} {r.get('speedup_vs_authors', float('nan')):6.1f}")


if __name__ == "__main__":
    main()
