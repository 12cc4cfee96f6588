"""The whole MH-LatentMoE layer, forward and forward+backward, at the shapes of DESIGN §7's table,
against the authors' figures (shared/anchors/ref_layer_h100_2026-11-22.jsonl, one H100).

    python bench/layer.py [--tokens 8192 81920] [--configs 384/4/256 768/8/128 ...]
                          [--experts triton reference] [--router reference|triton|auto] [--out FILE]
                          [--variants v2 new ...] [--dwt-tile 64,128,8,2] [--breakdown]
                          [--expert-weights float32|bfloat16]

Layer (the model's MoE core `moe_core.moe_heads` between two projections written here):
    x (N, d=1024) bf16 -> W_in (d, Nh*dh) -> (N, Nh=8, dh=128) -> route_topk per head (fp32 scores,
    bias in the selection) -> gates = softmax(values) fp32 -> expert_ffn (N, Nh, dh) -> W_out -> (N, d)
With router and experts both triton this is the model's path: the router packs the indices once for
the expert op and for its own dW_r. With different router / expert impls the two ops run separately.
Parameters are fp32 masters (cast to bf16 for the matmuls, fp32 gradients), as in training;
--expert-weights bfloat16 passes W1 / W2 in bf16 instead (no cast pass, bf16 gradients: the byte floor
at 8192 tokens drops from ~3.2 GB to ~1.6 GB at Ne 384, bench/NOTES.md "Layer").
fwd+bwd = jax.grad w.r.t. every parameter and x. TFLOP/s counts the model FLOPs (3 x forward of
W_in, W_out, router scores and experts; our backward's recomputation is not counted) against the
~800 TFLOP/s measured bf16 rate. Memory: XLA's buffer assignment of the compiled step
(arguments + outputs + temporaries = the step's peak), beside the authors' torch peak.

--variants: expert configs of the triton path (`mhl_jax.moe.gpu.experts.VARIANTS`, "v2" = the
measured default; "fwd_tile:M,E,W,S" the default with that Triton forward tile) or LAYER_VARIANTS (a switch of the
MoE core flipped, e.g. "apart_dx"), one record each; a
variant that fails is recorded and the next one runs.
--breakdown: also time the layer's parts alone under jit at each shape (one `layer_breakdown` record
per variant): the router alone fwd+bwd (its own slot sort), packing (sort, counting sort, Triton
kernels), the expert op alone fwd and fwd+bwd (its own packing), router + experts as the layer runs them
(`moe_fwd_bwd`: one packing), the two dense projections fwd+bwd, and the rest (layer minus moe_fwd_bwd
(or router + experts when the impls differ) minus the projections: casts, launch gaps). The parts
alone overlap (each packs), so only moe_fwd_bwd + dense + rest adds up to the layer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.timing import dispatch_ms, emit, time_jax  # noqa: E402

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


def expert_cfg(variant: str | None, tokens: int, ne: int, k: int, de: int, dwt_tile=None):
    """ExpertsConfig of a named variant (None: the binding's default); "fwd_tile:M,E,W,S": the default with the Triton
    forward's tile (block_m, block_e, warps, stages) replaced, the converting forward's (`fwd_cast`) too (tile sweeps
    in the layer)."""
    if variant is None:
        return None
    from mhl_jax.moe.gpu.experts import variant_config

    if variant.startswith("fwd_tile:"):
        from dataclasses import replace

        from kernels.triton.experts import Tile

        cfg = variant_config("default", tokens * NH * k, NH * ne, DH, de)
        tile = Tile(*(int(v) for v in variant.split(":", 1)[1].split(",")))
        return replace(cfg, fwd=tile, fwd_cast=tile).fit(de)  # the converting forward's too
    return variant_config(variant, tokens * NH * k, NH * ne, DH, de, dwt_tile)


# Layer-level variants: the default experts with a switch of the MoE core flipped while the layer is traced.
# "triton_router_fwd": the Triton router forward where the default runs the warp-specialised Gluon one
# (kernels.triton.router.WS_MAX_K = 0); "apart_dx": the router's and the experts' ops apart, their dx added by XLA, instead
# of one custom_vjp whose dx comes out of one combine kernel (moe_core.FUSE_ROUTER_DX = False: the default until the
# 2026-11-25 session 20); "xla_combine": the forward's combine of the expert output rows by XLA instead of the Triton
# kernel (experts_triton.OUT_COMBINE_KERNEL = False: the default until the 2026-11-26 session 23); "fwd_all_heads":
# the Gluon expert forward's programs each on a contiguous share of all heads' blocks at every k, instead of each
# head's in turn from k 8 (experts_triton.FWD_HEAD_MAJOR_MIN_K: as until the 2026-11-26 session 26); "router_networks":
# the Gluon router forward selecting by sorting networks in every block, without the threshold rounds
# (gluon_router.WS_ROUTER_THR = 0: as until the 2026-11-26 session 27); "bare_gates": the gates by a bare
# softmax, without the optimisation barriers of `router.router_gates` (router.GATES_BARRIER = False: as until
# session 27); "pack_4warps": the packing's scatter programs at 4 warps (packing.PACK_SORT_WARPS = 4: as until the
# 2026-11-26 session 28); "nocast": the expert weights cast by XLA, not by the router's caster warp group
# (moe_core.ROUTER_CASTS_WEIGHTS = False); "nocast_nc3": that, with the router's three consumer warp groups at every k
# (gluon_router.ws_router_consumers; two at k > 4 by default); "bwd_pad_blocks": the Gluon backward over every 32-row
# block of a group's packing blocks, the padding-only ones too (experts_triton.BWD_SKIP_PADDING = False: as until
# the 2026-11-26 session 28); "fwd_pad_halves": the Gluon forward computing (and zeroing) the padding-only second halves
# of packing blocks too (experts_triton.FWD_SKIP_PADDING = False: as until the 2026-11-26 session 29);
# "router_dw_lanes": the router's dW partial kernel with a (SUB, DHP) accumulator at SUB 64, 4 warps, instead of its
# row sums at SUB 128, 2 warps (kernels.triton.router.DW_ROWSUM = False: as until the 2026-11-26 session 29); "xla_meta": the
# per-group block arrays of the expert op and the router's dW blocks by XLA's scans instead of Triton launches
# (packing_triton.META_KERNELS = False: as until the 2026-11-27 session 32); "xla_cast": the expert weights cast by
# XLA before the Triton forward instead of converted in its loads (experts_triton.FWD_CASTS_WEIGHTS = False: as until
# session 32).
LAYER_VARIANTS = ("triton_router_fwd", "apart_dx", "xla_combine", "fwd_all_heads", "router_networks", "bare_gates",
                  "pack_4warps", "nocast", "nocast_nc3", "bwd_pad_blocks", "fwd_pad_halves", "router_dw_lanes",
                  "xla_meta", "xla_cast")


@contextlib.contextmanager
def layer_switches(variant: str | None):
    """The switches of a LAYER_VARIANTS name flipped inside the context (None or an expert variant: none). The context
    covers the layer's forward only: jax.grad traces a custom_vjp's backward after the forward has returned, so a
    switch read only by a backward rule must be read in the forward and carried into the residuals (as
    experts_triton.BWD_SKIP_PADDING is, by `packed_meta`); else the variant's backward runs the default."""
    import kernels.gluon.router as gr
    import kernels.triton.packing as kp
    import kernels.triton.router as kr
    import mhl_jax.moe.core as mc
    import mhl_jax.moe.gpu.experts as et
    import mhl_jax.moe.gpu.packing as pt
    import mhl_jax.moe.router as ro

    switches = {  # variant -> the (module, attribute, value) it sets
        "triton_router_fwd": [(kr, "WS_MAX_K", 0)],
        "apart_dx": [(mc, "FUSE_ROUTER_DX", False)],
        "xla_combine": [(et, "OUT_COMBINE_KERNEL", False)],
        "fwd_all_heads": [(et, "FWD_HEAD_MAJOR_MIN_K", 1 << 30)],
        "router_networks": [(gr, "WS_ROUTER_THR", 0)],
        "bare_gates": [(ro, "GATES_BARRIER", False)],
        "pack_4warps": [(kp, "PACK_SORT_WARPS", 4)],
        "nocast": [(mc, "ROUTER_CASTS_WEIGHTS", False)],
        "nocast_nc3": [(mc, "ROUTER_CASTS_WEIGHTS", False), (gr, "ws_router_consumers", lambda k: 3)],
        "bwd_pad_blocks": [(et, "BWD_SKIP_PADDING", False)],
        "fwd_pad_halves": [(et, "FWD_SKIP_PADDING", False)],
        "router_dw_lanes": [(kr, "DW_ROWSUM", False)],
        "xla_meta": [(pt, "META_KERNELS", False)],
        "xla_cast": [(et, "FWD_CASTS_WEIGHTS", False)],
    }
    assert set(switches) == set(LAYER_VARIANTS), "layer_switches: a LAYER_VARIANTS name without its switches"
    flips = switches.get(variant, [])
    saved = [(m, name, getattr(m, name)) for m, name, _ in flips]
    for m, name, value in flips:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def layer(params, x, k: int, expert_impl: str, router_impl: str, cfg=None, switch: str | None = None):
    """x: (N, d) bf16 -> (N, d) bf16. cfg: the expert op's ExpertsConfig (triton only). switch: a LAYER_VARIANTS
    name (`layer_switches`)."""
    with layer_switches(switch):
        return _layer(params, x, k, expert_impl, router_impl, cfg)


def _layer(params, x, k: int, expert_impl: str, router_impl: str, cfg=None):
    from mhl_jax.moe.core import moe_heads
    from mhl_jax.moe.experts import expert_ffn
    from mhl_jax.moe.router import route_topk

    n = x.shape[0]
    sub = jnp.dot(x, params["w_in"].astype(x.dtype)).reshape(n, NH, DH)
    if router_impl == expert_impl:  # the model's path (triton: one packing shared by router and experts)
        y, _ = moe_heads(sub, sub, params["w_r"], params["bias"], params["w1"], params["w2"], k, expert_impl,
                         cfg=cfg if expert_impl == "triton" else None)
    else:
        vals, idx = route_topk(sub, params["w_r"], params["bias"], k, router_impl)
        gates = jax.nn.softmax(vals, axis=-1)
        y, _ = expert_ffn(sub, idx, gates, params["w1"], params["w2"], expert_impl,
                          cfg=cfg if expert_impl == "triton" else None)
    return jnp.dot(y.reshape(n, NH * DH), params["w_out"].astype(x.dtype))


def breakdown(params, xs, k: int, router_impl: str, cfg, ms_layer: float) -> dict:
    """Each part of the layer alone under jit (same shapes, inputs from the layer's own forward)."""
    from mhl_jax.moe import packing as pk
    from mhl_jax.moe.gpu.experts import expert_ffn_triton
    from mhl_jax.moe.router import route_topk

    ne = params["w1"].shape[1]
    subs = [jnp.dot(x, params["w_in"].astype(x.dtype)).reshape(x.shape[0], NH, DH) for x in xs]
    route = jax.jit(lambda s: route_topk(s, params["w_r"], params["bias"], k, router_impl))
    routed = [route(s) for s in subs]
    out = {}

    def router_loss(s, w_r):
        vals, _ = route_topk(s, w_r, params["bias"], k, router_impl)
        return jnp.sum(jax.nn.softmax(vals, axis=-1) * jnp.arange(k, dtype=jnp.float32))

    out["router_fwd"] = time_jax(route, [(s,) for s in subs])
    out["router_fwd_bwd"] = time_jax(jax.jit(jax.grad(router_loss, argnums=(0, 1))),
                                     [(s, params["w_r"]) for s in subs])
    for method in ("argsort", "count", "triton"):
        def pack(i, m=method):
            p = pk.pack(i, ne, cfg.pack_block, m)
            return p, pk.group_blocks(p.group_sizes, cfg.pack_block)

        try:
            out[f"pack_{method}"] = time_jax(jax.jit(pack), [(r[1],) for r in routed])
        except Exception as e:  # the Triton packing is new: its failure must not lose the other parts
            print(f"pack_{method} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    gw = [jax.nn.softmax(r[0], axis=-1) for r in routed]

    def ffn(s, i, g, w1, w2):
        return expert_ffn_triton(s, i, g, w1, w2, cfg=cfg)[0]

    def ffn_loss(s, g, w1, w2, i):
        return jnp.sum(ffn(s, i, g, w1, w2).astype(jnp.float32) ** 2)

    sets = [(s, r[1], g, params["w1"], params["w2"]) for s, r, g in zip(subs, routed, gw)]
    out["experts_fwd"] = time_jax(jax.jit(ffn), sets)
    out["experts_fwd_bwd"] = time_jax(jax.jit(jax.grad(ffn_loss, argnums=(0, 1, 2, 3))),
                                      [(s, g, w1, w2, i) for s, i, g, w1, w2 in sets])

    def dense_loss(w_in, w_out, x):  # W_in then W_out (bypassing the experts), both gradients and dx
        sub = jnp.dot(x, w_in.astype(x.dtype))
        return jnp.sum(jnp.dot(sub, w_out.astype(x.dtype)).astype(jnp.float32) ** 2)

    out["dense_fwd_bwd"] = time_jax(jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2))),
                                    [(params["w_in"], params["w_out"], x) for x in xs])
    if router_impl == "triton":  # router + experts as the layer runs them: one packing for both
        from mhl_jax.moe.core import moe_heads

        def moe_loss(s, w_r, g_w1, g_w2):
            y, _ = moe_heads(s, s, w_r, params["bias"], g_w1, g_w2, k, "triton", cfg=cfg)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        out["moe_fwd_bwd"] = time_jax(jax.jit(jax.grad(moe_loss, argnums=(0, 1, 2, 3))),
                                      [(s, params["w_r"], params["w1"], params["w2"]) for s in subs])
    moe = out.get("moe_fwd_bwd", out["router_fwd_bwd"] + out["experts_fwd_bwd"])
    out["rest"] = ms_layer - moe - out["dense_fwd_bwd"]
    return out


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
        import mhl_jax.moe.gpu.router  # noqa: F401
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
    ap.add_argument("--variants", nargs="+", default=[None],
                    help="expert configs (experts_triton.VARIANTS) or LAYER_VARIANTS")
    ap.add_argument("--dwt-tile", default=None, help="block_m,block_e,warps,stages of the transposed dW kernel")
    ap.add_argument("--breakdown", action="store_true", help="also time the layer's parts (see above)")
    ap.add_argument("--inner", type=int, nargs="+", default=[3],
                    help="back-to-back calls per timed batch (time_jax's inner; the first value gives ms_fwd / ms, "
                         "each further one an extra fwd+bwd timing in ms_by_inner: the host's dispatch of a batch's "
                         "first call is idle device time that more calls per batch amortise)")
    ap.add_argument("--fallback", default="v2", help="variant run when a --variants run fails at a shape")
    ap.add_argument("--expert-weights", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of W1 / W2 as passed to the layer (float32: master weights, cast to bf16 in every "
                         "call and fp32 gradients, ~1.2 GB + 0.4 GB more HBM traffic at Ne 384; bfloat16: weights "
                         "held in the compute dtype, bf16 gradients)")
    args = ap.parse_args()
    if any(n < 1 for n in args.inner):
        ap.error(f"--inner {' '.join(map(str, args.inner))}: expected calls per batch >= 1")
    dwt_tile = None
    if args.dwt_tile:
        from kernels.triton.experts import Tile

        dwt_tile = Tile(*(int(v) for v in args.dwt_tile.split(",")))

    router = resolve_router(args.router)
    device = jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    outf = open(args.out, "a") if args.out else None
    rows = []
    for tokens in args.tokens:
        for cfg in args.configs:
            ne, k, de = (int(v) for v in cfg.split("/"))
            params = init_params(jax.random.key(0), ne, de)
            params.update({w: params[w].astype(args.expert_weights) for w in ("w1", "w2")})
            xs = [jax.random.normal(jax.random.key(s + 1), (tokens, D), jnp.bfloat16) for s in range(2)]
            runs = [(i, v) for i in args.experts for v in (args.variants if i == "triton" else [None])]
            for impl, variant in runs:
                if variant == "fallback":
                    variant = args.fallback
                sw = variant if variant in LAYER_VARIANTS else None
                cfg = None if impl != "triton" else expert_cfg(variant if sw is None else "default", tokens, ne, k,
                                                               de, dwt_tile)
                fwd = jax.jit(lambda p, x, impl=impl, k=k, cfg=cfg, sw=sw: layer(p, x, k, impl, router, cfg, sw))
                grad = jax.jit(jax.grad(lambda p, x, impl=impl, k=k, cfg=cfg, sw=sw: jnp.sum(
                    layer(p, x, k, impl, router, cfg, sw).astype(jnp.float32) ** 2), argnums=(0, 1)))
                rec = dict(bench="layer", impl=impl, router=router, device=device, date=date,
                           params=dict(tokens=tokens, d=D, nh=NH, dh=DH, ne=ne, k=k, de=de,
                                       expert_weights=args.expert_weights))
                if variant:
                    rec["variant"] = variant
                try:
                    rec["ms_fwd"] = time_jax(fwd, [(params, x) for x in xs], inner=args.inner[0])
                    rec["ms"] = time_jax(grad, [(params, x) for x in xs], inner=args.inner[0])
                    if len(args.inner) > 1 or args.inner[0] != 3:
                        rec["inner"] = args.inner[0]
                        rec["ms_by_inner"] = {str(n): time_jax(grad, [(params, x) for x in xs], inner=n)
                                              for n in args.inner[1:]}
                    rec["ms_bwd"] = rec["ms"] - rec["ms_fwd"]
                    rec["dispatch_ms"] = dispatch_ms(grad, [(params, x) for x in xs])  # host enqueue of one fwd+bwd
                    rec["peak_gib"] = peak_gib(grad, params, xs[0])
                    rec["tflops"] = model_flops(tokens, ne, k, de) / rec["ms"] / 1e9
                    rec["frac_of_measured_peak"] = rec["tflops"] / MEASURED_BF16_TFLOPS
                    a = AUTHORS.get((tokens, ne, k, de))
                    if a:
                        rec["authors"] = dict(ms_fwd=a[0], ms=a[1], peak_gib=a[2])
                        rec["speedup_vs_authors"] = a[1] / rec["ms"]
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                emit(rec, outf)
                rows.append(rec)
                if "error" in rec and variant and args.fallback not in args.variants and (impl, "fallback") not in runs:
                    runs.append((impl, "fallback"))
                if args.breakdown and impl == "triton" and "ms" in rec:
                    b = dict(rec, bench="layer_breakdown")
                    try:
                        with layer_switches(sw):  # the parts are traced and timed with the row's switches
                            b["parts_ms"] = breakdown(params, xs, k, router, cfg or expert_cfg(
                                "default", tokens, ne, k, de), rec["ms"])
                    except Exception as e:
                        b["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    emit(b, outf)
            del params, xs
    print(f"\n{'tokens':>6} {'Ne/k/de':>11} {'impl':>11} {'fwd ms':>8} {'f+b ms':>8} {'GiB':>6} {'TF/s':>6} "
          f"{'authors f+b':>11} {'GiB':>5} {'x':>6}")
    for r in rows:
        p, a = r["params"], r.get("authors", {})
        name = r["impl"] + (f":{r['variant']}" if "variant" in r else "")
        if "ms" not in r:
            print(f"{p['tokens']:>6} {p['ne']}/{p['k']}/{p['de']:<5} {name:>11} error")
            continue
        print(f"{p['tokens']:>6} {p['ne']:>5}/{p['k']}/{p['de']:<3} {name:>11} {r['ms_fwd']:8.2f} {r['ms']:8.2f} "
              f"{r['peak_gib']:6.2f} {r['tflops']:6.1f} {a.get('ms', float('nan')):11.1f} "
              f"{a.get('peak_gib', float('nan')):5.1f} {r.get('speedup_vs_authors', float('nan')):6.1f}")


if __name__ == "__main__":
    main()
