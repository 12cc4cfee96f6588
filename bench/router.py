"""IO-aware router forward and forward+backward: ours (Triton via jax-triton, and the same kernels from
torch) against the pure-JAX naive router (fp32 matmul + lax.top_k), one process, one GPU.

    python bench/router.py [--tokens 81920] [--ne 128 256 384 512 1024 2048] [--k 4]
                           [--impls ours reference ours_torch] [--sweep] [--precision] [--out FILE]

Shape (paper section 4.2, DESIGN §7): 81920 tokens (B=40 x T=2048) x 8 heads x dh 128, k = 4.
Inputs: x (N, H, dh) bf16, w_r (H, dh, Ne) fp32, bias (H, Ne) fp32 (fresh normal draws per Ne, two
input sets rotated); fwd+bwd = value and gradients of sum(values * dv) w.r.t. x and w_r.

--sweep      forward tiles (torch launcher, do_bench) at a few Ne; the main table then uses the best
             tiles for the nearest swept Ne. Also times the backward's parts.
--precision  index agreement with a float64 top-k for each dot precision (ieee, tf32, tf32x3,
             bf16x3, bf16x2) and for a cuBLAS fp32 matmul, plus each precision's forward time.
On Hopper the JAX "ours" forward is the warp-specialised Gluon kernel (kernels/gluon/router.py) at k <= 8, which
the swept Triton tiles do not change; the torch launcher and --sweep time the Triton kernel.
Peak memory: JAX: the compiled executable's arguments + outputs + temporaries (memory_analysis);
torch: max_memory_allocated over one fwd+bwd, inputs included (the authors' convention).
Output: one JSON line per measurement (DESIGN §8), a table last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import timing  # noqa: E402

NH, DH = 8, 128
AUTHORS_FB_MS = {128: 8.0, 256: 9.8, 512: 12.7, 1024: 17.8, 2048: 27.4}  # DESIGN §7, their router, H100
FWD_TILES = [  # block_n, block_e, warps, stages, select[, row_tiles]
    (64, 64, 4, 3, 2, 1), (64, 64, 4, 3, 2, 2), (64, 128, 4, 3, 2, 1), (64, 64, 4, 3, 1, 1), (128, 64, 8, 3, 2, 1),
    (64, 128, 4, 3, 0, 1),
]
BWD_TILES = [  # dx_block_n, dx_warps, dw_block, dw_sub, dw_warps
    (16, 4, 512, 64, 4), (32, 8, 512, 64, 4), (16, 4, 1024, 64, 8),
]


TAG = None


def emit(rec: dict, outf) -> None:
    if TAG:
        rec = dict(rec, tag=TAG)
    timing.emit(rec, outf)


def make_inputs(seed: int, tokens: int, ne: int, k: int):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (tokens, NH, DH), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (NH, DH, ne), jnp.float32) * DH ** -0.5
    b = 0.1 * jax.random.normal(ks[2], (NH, ne), jnp.float32)
    dv = jax.random.normal(ks[3], (tokens, NH, k), jnp.float32)
    return x, w, b, dv


def to_torch(a):
    import torch

    return torch.from_dlpack(a).clone()


# -------------------------------------------------------------------------------------------- timing

time_jax = functools.partial(timing.time_jax, reps=15)


DRY = False  # --dry-cpu: interpreter kernels, one untimed-quality call, tiny shapes (checks the script)


def bench_torch(fn, warmup: int = 10, rep: int = 60) -> float:
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def jax_peak_gib(jitted, *args) -> float:
    m = jitted.lower(*args).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return total / 2**30


# ------------------------------------------------------------------------------------------- impls

def jax_fns(impl: str, k: int, tiles=None):
    from mhl_jax.moe.gpu.router import route_topk_triton
    from mhl_jax.moe.router import route_topk_reference

    if impl == "ours":
        backend = "emulate" if DRY else "triton"
        route = lambda x, w, b: route_topk_triton(x, w, b, k, tiles=tiles, backend=backend)  # noqa: E731
    else:
        route = lambda x, w, b: route_topk_reference(x, w, b, k)  # noqa: E731

    def loss(x, w, b, dv):
        return jnp.vdot(route(x, w, b)[0], dv)

    fwd = jax.jit(lambda x, w, b, dv: route(x, w, b))
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return fwd, fb


def sweep(tokens: int, nes: list[int], k: int, device: str, date: str, outf, fwd_only: bool = False) -> dict:
    """Forward tiles and backward parts on the torch launcher. Returns {ne: best RouterTiles}."""
    best = {}
    for ne in nes:
        t = sweep_one(tokens, ne, k, device, date, outf, fwd_only)
        if t is not None:
            best[ne] = t
        empty_cache()
    return best


def sweep_one(tokens: int, ne: int, k: int, device: str, date: str, outf, fwd_only: bool = False):
    import torch

    from kernels.torch import router as ktr
    from kernels.triton.router import router_tiles

    x, w, b, dv = (to_torch(a) for a in make_inputs(100 + ne, tokens, ne, k))
    res = []
    for t in FWD_TILES:
        tiles = router_tiles(ne, k, block_n=t[0], block_e=t[1], fwd_warps=t[2], fwd_stages=t[3], select=t[4],
                             row_tiles=t[5] if len(t) > 5 else 1)
        rec = dict(bench="router_sweep", kernel="fwd", device=device, date=date,
                   params=dict(tokens=tokens, nh=NH, dh=DH, ne=ne, k=k, tile=list(t)))
        try:
            ref = ktr.router_fwd(x, w, b, k, "bf16x3", tiles)
            rec["ms"] = bench_torch(functools.partial(ktr.router_fwd, x, w, b, k, "bf16x3", tiles))
            if res:  # every tile must select the same experts
                rec["same_idx_as_first"] = bool(torch.equal(ref[1], res[0][2][1]))
            res.append((rec["ms"], tiles, ref))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        emit(rec, outf)
    best = min(res, key=lambda r: r[0])[1] if res else None
    if fwd_only or best is None:
        return best
    # backward parts with the default tiles, then whole-backward tiles
    _, idx = ktr.router_fwd(x, w, b, k, "bf16x3", best)
    t0 = router_tiles(ne, k)
    parts = {"meta_torch_sort": functools.partial(ktr.dw_metadata, idx, ne, t0.dw_block),
             "bwd_total_torch": functools.partial(ktr.router_bwd, x, w, idx, dv, t0)}
    for name, fn in parts.items():
        emit(dict(bench="router_bwd_parts", part=name, device=device, date=date,
                  params=dict(tokens=tokens, ne=ne, k=k), ms=bench_torch(fn)), outf)
    for t in BWD_TILES:
        tiles = router_tiles(ne, k, dx_block_n=t[0], dx_warps=t[1], dw_block=t[2], dw_sub=t[3], dw_warps=t[4])
        meta = ktr.dw_metadata(idx, ne, tiles.dw_block)
        rec = dict(bench="router_sweep", kernel="bwd_kernels", device=device, date=date,
                   params=dict(tokens=tokens, ne=ne, k=k, tile=list(t)))
        try:
            rec["ms"] = bench_torch(functools.partial(ktr.router_bwd, x, w, idx, dv, tiles, meta=meta))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        emit(rec, outf)
    time_meta(jnp.asarray(idx.cpu().numpy()), ne, device, date, outf)
    return best


def time_meta(idx, ne: int, device: str, date: str, outf) -> None:
    """The JAX backward's slot sort + block metadata alone: flat / per-head uint32 key sort vs stable argsort."""
    from kernels.triton.router import router_tiles
    from mhl_jax.moe.gpu.router import dw_metadata

    n, h, k = idx.shape
    for sort, bounds in (("flat", "scatter"), ("packed", "scatter"), ("packed", "search"), ("argsort", "scatter")):
        f = jax.jit(functools.partial(dw_metadata, ne=ne, block=router_tiles(ne, k).dw_block, sort=sort,
                                      bounds=bounds))
        emit(dict(bench="router_bwd_parts", part=f"meta_jax_{sort}_{bounds}", device=device, date=date,
                  params=dict(tokens=n, ne=ne, k=k), ms=time_jax(f, [(idx,)])), outf)
    key = jnp.swapaxes(idx, 0, 1).reshape(h, n * k).astype(jnp.uint32)
    emit(dict(bench="router_bwd_parts", part="sort_only_uint32", device=device, date=date,
              params=dict(tokens=n, ne=ne, k=k), ms=time_jax(jax.jit(lambda t: jnp.sort(t, axis=-1)), [(key,)])), outf)


def precision_check(tokens: int, nes: list[int], k: int, device: str, date: str, outf, tiles_for) -> None:
    for ne in nes:
        precision_one(tokens, ne, k, device, date, outf, tiles_for(ne))
        empty_cache()


def precision_one(tokens: int, ne: int, k: int, device: str, date: str, outf, tiles) -> None:
    """Fraction of (token, head) rows whose ordered top-k indices equal a float64 top-k's."""
    import torch

    from kernels.torch import router as ktr

    x, w, b, _ = (to_torch(a) for a in make_inputs(200 + ne, tokens, ne, k))
    ref_idx, gap = [], []
    for h in range(NH):  # float64 scores head by head (bounded memory)
        s = x[:, h].double() @ w[h].double() + b[h].double()
        top = torch.topk(s, k + 1, dim=-1)
        ref_idx.append(top.indices[:, :k])
        # relative gap between the k-th and (k+1)-th biased score: rows closer than ~1e-6 are near ties
        gap.append((top.values[:, k - 1] - top.values[:, k]) / s.abs().amax(-1))
    ref_idx, gap = torch.stack(ref_idx, 1), torch.stack(gap, 1)
    cands, ms = {}, {}
    with torch.no_grad():
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        s32 = torch.einsum("nhd,hde->nhe", x.float(), w) + b
        cands["cublas_fp32"] = torch.topk(s32, k, dim=-1).indices
        torch.backends.cuda.matmul.allow_tf32 = prev
    for prec in ("ieee", "tf32", "tf32x3", "bf16x3", "bf16x2"):
        try:
            cands[prec] = ktr.router_fwd(x, w, b, k, prec, tiles)[1].long()
            ms[prec] = bench_torch(functools.partial(ktr.router_fwd, x, w, b, k, prec, tiles))
        except Exception as e:
            emit(dict(bench="router_precision", impl=prec, params=dict(ne=ne), error=str(e)[:200]), outf)
    near_tie = gap < 1e-6
    for name, idx in cands.items():
        ordered = (idx == ref_idx).all(-1)
        as_set = (torch.sort(idx, -1).values == torch.sort(ref_idx, -1).values).all(-1)
        rec = dict(bench="router_precision", impl=name, device=device, date=date,
                   params=dict(tokens=tokens, nh=NH, dh=DH, ne=ne, k=k),
                   rows=int(ordered.numel()), frac_ordered_equal=float(ordered.float().mean()),
                   frac_set_equal=float(as_set.float().mean()),
                   set_mismatch_not_near_tie=int((~as_set & ~near_tie).sum()), rows_near_tie=int(near_tie.sum()))
        if name in ms:
            rec["ms_fwd"] = ms[name]
        emit(rec, outf)


def bench_one(impl: str, sets, n: int, ne: int, k: int, tiles, device: str, date: str) -> dict:
    """One (impl, Ne) measurement: fwd and fwd+bwd time, peak memory."""
    import torch

    from kernels.torch import router as ktr

    fwd_flop = 2.0 * n * NH * DH * ne
    floor_bytes = n * NH * DH * 2 + n * NH * k * 8 + NH * DH * ne * 4  # x in, (vals, idx) out, W_r once
    params = dict(tokens=n, nh=NH, dh=DH, ne=ne, k=k)
    rec = dict(bench="router", impl=impl if impl != "ours" else "triton", device=device, date=date,
               params=dict(params, **({"tiles": list(tiles)} if impl != "reference" else {})))
    try:
        t0 = time.perf_counter()
        if impl in ("ours", "reference"):
            fwd, fb = jax_fns(impl, k, tiles)
            rec["ms_fwd"] = time_jax(fwd, sets)
            rec["ms"] = time_jax(fb, sets)
            rec["peak_gib"] = jax_peak_gib(fb, *sets[0])
            rec["peak_gib_fwd"] = jax_peak_gib(fwd, *sets[0])
        else:
            tsets = [[to_torch(a) for a in s] for s in sets]
            for s in tsets:
                s[0].requires_grad_()
                s[1].requires_grad_()
            st = {"i": 0}

            def run_fb():
                x, w, b, dv = tsets[st["i"] % len(tsets)]
                st["i"] += 1
                x.grad = w.grad = None
                vals, _ = ktr.route_topk_torch(x, w, b, k, tiles=tiles)
                vals.backward(dv)

            def run_f():
                x, w, b, _ = tsets[st["i"] % len(tsets)]
                st["i"] += 1
                with torch.no_grad():
                    ktr.router_fwd(x, w, b, k, "bf16x3", tiles)

            rec["ms_fwd"] = bench_torch(run_f)
            rec["ms"] = bench_torch(run_fb)
            del tsets[1]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                run_fb()
                torch.cuda.synchronize()
                rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec["ms_bwd"] = rec["ms"] - rec["ms_fwd"]
        rec["tflops"] = fwd_flop / rec["ms_fwd"] / 1e9
        rec["gbps"] = floor_bytes / rec["ms_fwd"] / 1e6
        if ne in AUTHORS_FB_MS:
            rec["authors_ms"] = AUTHORS_FB_MS[ne]
            rec["speedup_vs_authors"] = AUTHORS_FB_MS[ne] / rec["ms"]
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
    except Exception as e:  # recorded, not fatal
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=3)
    return rec


def nearest(best: dict, ne: int):
    if not best:
        return None
    return best[min(best, key=lambda n: abs(math.log(n / ne)))]


# -------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--ne", type=int, nargs="+", default=[128, 256, 384, 512, 1024, 2048])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--impls", nargs="+", default=["ours", "reference", "ours_torch"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-ne", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--fwd-tiles", nargs="+", default=None,
                    help="--sweep forward tiles: block_n,block_e,warps,stages,select[,row_tiles] (default FWD_TILES)")
    ap.add_argument("--fwd-only", action="store_true", help="--sweep: forward tiles only")
    ap.add_argument("--precision", action="store_true")
    ap.add_argument("--precision-ne", type=int, nargs="+", default=[2048])
    ap.add_argument("--meta", action="store_true", help="also time the JAX backward's sort + metadata per Ne")
    ap.add_argument("--tag", default=None, help="stored in every record (e.g. the code version)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-cpu", action="store_true", help="check the script on CPU (interpreter, tiny shapes)")
    args = ap.parse_args()
    global DRY, TAG
    DRY, TAG = args.dry_cpu, args.tag
    if DRY:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported

    import torch

    from mhl_jax.moe.plan import import_jax_triton

    try:
        import_jax_triton()  # also keeps TRITON_CACHE_DIR usable for torch.compile after it
    except ImportError:
        pass
    from kernels.triton.router import router_tiles
    from mhl_jax.moe.router import route_topk_reference

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    outf = open(args.out, "a") if args.out else None
    k, n = args.k, args.tokens
    if args.fwd_tiles:
        global FWD_TILES
        FWD_TILES = [tuple(int(v) for v in t.split(",")) for t in args.fwd_tiles]
    best = sweep(n, args.sweep_ne, k, device, date, outf, args.fwd_only) if args.sweep else {}

    def tiles_for(ne: int):
        t = nearest(best, ne)
        return router_tiles(ne, k, **(t._asdict() if t else {}))

    if args.precision:
        precision_check(n, args.precision_ne, k, device, date, outf, tiles_for)

    rows = []
    for ne in args.ne:
        sets = [make_inputs(s + ne, n, ne, k) for s in range(2)]
        for impl in args.impls:
            rec = bench_one(impl, sets, n, ne, k, tiles_for(ne), device, date)
            emit(rec, outf)
            rows.append(rec)
        if args.meta:
            time_meta(jax.jit(lambda x, w, b: route_topk_reference(x, w, b, k)[1])(*sets[0][:3]), ne, device, date,
                      outf)
        del sets
        empty_cache()

    print(f"\n{'Ne':>5} " + " ".join(f"{i:>26}" for i in args.impls) + f" {'authors':>8} {'x authors':>9}")
    for ne in args.ne:
        cells, ours = [], None
        for impl in args.impls:
            name = impl if impl != "ours" else "triton"
            r = [r for r in rows if r["impl"] == name and r["params"]["ne"] == ne]
            ok = r and "ms" in r[0]
            cells.append(f"{r[0]['ms_fwd']:6.3f}/{r[0]['ms']:7.3f} {r[0].get('peak_gib', 0):6.2f}G" if ok else "-")
            if ok and impl == "ours":
                ours = r[0]["ms"]
        a = AUTHORS_FB_MS.get(ne)
        sp = f"{a / ours:8.2f}x" if a and ours else "-"
        print(f"{ne:>5} " + " ".join(f"{c:>26}" for c in cells) + f" {a if a else '-':>8} {sp:>9}")
    print("(ms fwd / fwd+bwd, median; peak GiB of fwd+bwd; authors = their router fwd+bwd, H100)")


if __name__ == "__main__":
    main()
