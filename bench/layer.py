"""One MH-LatentMoE layer, forward and forward+backward, at the shapes of the layer table, beside the authors' figures.

    python -m bench.layer [--tokens 8192 81920] [--configs 384/4/256 768/8/128 768/4/256 1536/8/128]
                          [--impl triton|reference] [--expert-weights float32|bfloat16] [--routing random|collapsed]
                          [--authors DIR] [--out FILE]

The layer is the model's MoE core (`mhl_jax.moe.core.moe_heads`) between two dense projections:
    x (N, d=1024) bf16 -> W_in -> (N, Nh=8, dh=128) -> top-k routing per head (fp32 scores, bias in the selection)
    -> softmax gates -> expert FFN (Ne experts of width de per head) -> W_out -> (N, d)
Parameters are fp32 masters cast to bf16 for the matmuls, with fp32 gradients, as in training (`--expert-weights
bfloat16` passes W1 / W2 in bf16 instead: no cast, bf16 gradients). fwd+bwd is jax.grad with respect to every
parameter and x. Per shape one JSON line: ms_fwd, ms (fwd+bwd), ms_bwd (batches of 3 calls, `bench.common.time_jax`),
ms_stream (fwd+bwd in batches of >= 20 ms of calls, `time_jax`'s batch_ms), dispatch_ms (host enqueue of one fwd+bwd),
peak_gib (XLA's buffer assignment of the compiled step), tflops (model FLOPs: 3 x the forward's matmuls, the
backward's recomputation not counted) and its fraction of the measured bf16 rate, and the authors' figures on one
H100 with our speedup over them (`authors_h100`, `speedup_vs_authors_h100`: another GPU's figures unless this is an
H100; `--authors` times theirs on this GPU). A table follows.

--routing collapsed: the routing bias sends every token to the same k experts of each head (a model's first steps
can route nearly so: docs/performance.md, The expert FFN alone), where the expert backward sums each long tile in
chunks; random (the table's): random router weights, a tiny random bias.

--authors DIR: also time the authors' released PyTorch layer (their `src/` folder under DIR, imported from there at
run time; needs torch with CUDA) at each shape, on this GPU: `authors_here` in each record.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench.common import JsonLines, compiled_gib, dispatch_ms, error_text, parser, time_jax, today
from mhl_jax.moe.core import moe_heads

D, NH, DH = 1024, 8, 128
MEASURED_BF16_TFLOPS = 800.0  # a dense bf16 matmul's rate on an H100 / H200, the ceiling `frac_of_measured_peak` uses
TABLE_CONFIGS = ["384/4/256", "768/8/128", "768/4/256", "1536/8/128"]  # Ne/k/de

# The authors' layer (torch.compile, their Triton router and FlexAttention experts) on one H100:
# (tokens, Ne, k, de) -> (fwd ms, fwd+bwd ms, peak GiB)
AUTHORS = {
    (8192, 384, 4, 256): (7.649, 13.776, 2.601), (8192, 768, 8, 128): (7.133, 17.469, 2.936),
    (8192, 768, 4, 256): (8.225, 20.240, 4.963), (8192, 1536, 8, 128): (12.003, 27.726, 5.687),
    (81920, 384, 4, 256): (18.869, 52.585, 9.270), (81920, 768, 8, 128): (36.264, 87.275, 8.896),
    (81920, 768, 4, 256): (27.418, 65.215, 8.222), (81920, 1536, 8, 128): (59.432, 113.784, 11.719),
}


def init_params(key, ne: int, de: int, collapse_k: int = 0) -> dict:
    """The layer's parameters; collapse_k > 0: a bias of 10 on each head's first collapse_k experts, far above the
    scores (~0.1), so every token picks them."""
    ks = jax.random.split(key, 6)
    return dict(
        w_in=jax.random.normal(ks[0], (D, NH * DH)) * 0.02,
        w_r=jax.random.normal(ks[1], (NH, DH, ne)) * 0.02,
        bias=(jax.random.normal(ks[2], (NH, ne)) * 1e-3).at[:, :collapse_k].add(10.0),
        w1=jax.random.normal(ks[3], (NH, ne, DH, de)) * 0.02,
        w2=jax.random.normal(ks[4], (NH, ne, de, DH)) * 0.02,
        w_out=jax.random.normal(ks[5], (NH * DH, D)) * 0.02,
    )


def layer(params: dict, x: jax.Array, k: int, impl: str) -> jax.Array:
    """x: (N, d) bf16 -> (N, d) bf16, through the MoE core on `impl` ("triton": the GPU kernels, "reference")."""
    n = x.shape[0]
    sub = jnp.dot(x, params["w_in"].astype(x.dtype)).reshape(n, NH, DH)
    y, _ = moe_heads(sub, sub, params["w_r"], params["bias"], params["w1"], params["w2"], k, impl)
    return jnp.dot(y.reshape(n, NH * DH), params["w_out"].astype(x.dtype))


def layer_fns(k: int, impl: str):
    """(forward, forward+backward) of the layer, jitted."""
    fwd = jax.jit(lambda p, x: layer(p, x, k, impl))
    loss = lambda p, x: jnp.sum(layer(p, x, k, impl).astype(jnp.float32) ** 2)  # noqa: E731
    return fwd, jax.jit(jax.grad(loss, argnums=(0, 1)))


def model_flops(tokens: int, ne: int, k: int, de: int) -> float:
    """3 x the forward's matmul FLOPs: W_in and W_out, the router's scores, the experts' two matmuls."""
    fwd = tokens * (2 * D * NH * DH * 2 + NH * 2 * DH * ne + NH * k * 4 * DH * de)
    return 3.0 * fwd


def measure(tokens: int, ne: int, k: int, de: int, impl: str, expert_weights: str = "float32",
            routing: str = "random") -> dict:
    """One shape: the record described in the module's docstring."""
    params = init_params(jax.random.key(0), ne, de, k if routing == "collapsed" else 0)
    params.update({w: params[w].astype(expert_weights) for w in ("w1", "w2")})
    xs = [jax.random.normal(jax.random.key(s + 1), (tokens, D), jnp.bfloat16) for s in range(2)]
    sets = [(params, x) for x in xs]
    rec = dict(bench="layer", impl=impl, router=impl, device=jax.devices()[0].device_kind, date=today(),
               params=dict(tokens=tokens, d=D, nh=NH, dh=DH, ne=ne, k=k, de=de, expert_weights=expert_weights,
                           routing=routing))
    try:
        fwd, grad = layer_fns(k, impl)
        rec["ms_fwd"] = time_jax(fwd, sets)
        rec["ms"] = time_jax(grad, sets)
        rec["ms_bwd"] = rec["ms"] - rec["ms_fwd"]
        rec["ms_stream"] = time_jax(grad, sets, reps=10, batch_ms=20.0)
        rec["dispatch_ms"] = dispatch_ms(grad, sets)
        rec["peak_gib"] = compiled_gib(grad, params, xs[0])
        rec["tflops"] = model_flops(tokens, ne, k, de) / rec["ms"] / 1e9
        rec["frac_of_measured_peak"] = rec["tflops"] / MEASURED_BF16_TFLOPS
        a = AUTHORS.get((tokens, ne, k, de)) if routing == "random" else None
        if a:
            rec["authors_h100"] = dict(ms_fwd=a[0], ms=a[1], peak_gib=a[2])  # same-GPU: --authors (authors_here)
            rec["speedup_vs_authors_h100"] = a[1] / rec["ms"]
    except Exception as e:  # recorded: the other shapes are still worth measuring
        rec["error"] = error_text(e)
    return rec


def table(rows: list[dict]) -> str:
    lines = [f"{'tokens':>6} {'Ne/k/de':>11} {'impl':>9} {'fwd ms':>8} {'f+b ms':>8} {'GiB':>6} {'TF/s':>6} "
             f"{'H100 auth':>11} {'GiB':>5} {'x':>6}"]
    for r in rows:
        p, a = r["params"], r.get("authors_h100", {})
        shape = f"{p['ne']:>5}/{p['k']}/{p['de']:<3}"
        if "ms" not in r:
            lines.append(f"{p['tokens']:>6} {shape} {r['impl']:>9} error: {r.get('error', '')[:60]}")
            continue
        peak = float("nan") if r["peak_gib"] is None else r["peak_gib"]
        lines.append(f"{p['tokens']:>6} {shape} {r['impl']:>9} {r['ms_fwd']:8.2f} {r['ms']:8.2f} {peak:6.2f} "
                     f"{r['tflops']:6.1f} {a.get('ms', float('nan')):11.1f} {a.get('peak_gib', float('nan')):5.1f} "
                     f"{r.get('speedup_vs_authors_h100', float('nan')):6.1f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 81920])
    ap.add_argument("--configs", nargs="+", default=TABLE_CONFIGS, metavar="NE/K/DE")
    ap.add_argument("--impl", default="triton", choices=["triton", "reference"])
    ap.add_argument("--expert-weights", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of W1 / W2 as passed to the layer (float32: master weights cast in every call)")
    ap.add_argument("--routing", default="random", choices=["random", "collapsed"],
                    help="collapsed: every token on the same k experts of each head (the routing bias)")
    ap.add_argument("--authors", default=None, metavar="DIR", help="the authors' code (DIR/src), timed beside ours")
    args = ap.parse_args(argv)
    if args.authors and args.routing != "random":
        raise SystemExit(f"--authors times the authors' layer at the table's random routing, not --routing "
                         f"{args.routing}")
    if args.authors:
        from bench.authors import AuthorsLayer  # torch: an optional dependency, only for --authors

        authors = AuthorsLayer(args.authors)
    rows = []
    with JsonLines(args.out) as emit:
        for tokens in args.tokens:
            for shape in args.configs:
                ne, k, de = (int(v) for v in shape.split("/"))
                rec = measure(tokens, ne, k, de, args.impl, args.expert_weights, args.routing)
                if args.authors:
                    rec["authors_here"] = authors.measure(tokens, ne, k, de)
                    if "ms" in rec and "ms" in rec["authors_here"]:
                        rec["speedup_vs_authors_here"] = rec["authors_here"]["ms"] / rec["ms"]
                rows.append(emit(rec))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
