"""The IO-aware router, forward and forward+backward: ours (the JAX binding, and the same kernels from torch) against
the plain JAX router (fp32 matmul + lax.top_k), one GPU.

    python -m bench.router [--tokens 81920] [--ne 128 256 384 512 1024 2048] [--k 4]
                           [--impls ours reference ours_torch] [--out FILE]

Shape: 81920 tokens (the paper's B=40 x T=2048) x 8 heads x dh 128, k = 4. Inputs: x (N, H, dh) bf16, w_r (H, dh, Ne)
fp32, bias (H, Ne) fp32, two input sets rotated; fwd+bwd = the value and gradients of sum(values * dv) with respect
to x and w_r. Peak memory: JAX, the compiled executable's arguments + outputs + temporaries; torch,
max_memory_allocated over one fwd+bwd, inputs included (the authors' convention). One JSON line per (impl, Ne) with
ms_fwd, ms, ms_bwd (JAX: batches of 3 calls, `time_jax`), ms_fwd_stream and ms_stream (JAX: batches of >= 20 ms
of calls, `time_jax`'s batch_ms), peak_gib, the forward's TFLOP/s and its bandwidth against the byte floor, and the
authors' fwd+bwd on one H100 where known; a table last.
"""

from __future__ import annotations

import time
import traceback

import jax
import jax.numpy as jnp

from bench.common import GIB, JsonLines, compiled_gib, error_text, parser, time_jax, today
from mhl_jax.moe.plan import import_jax_triton
from mhl_jax.moe.router import route_topk_reference

NH, DH = 8, 128
AUTHORS_FB_MS = {128: 8.0, 256: 9.8, 512: 12.7, 1024: 17.8, 2048: 27.4}  # their router's fwd+bwd, one H100


def make_inputs(seed: int, tokens: int, ne: int, k: int):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (tokens, NH, DH), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (NH, DH, ne), jnp.float32) * DH ** -0.5
    b = 0.1 * jax.random.normal(ks[2], (NH, ne), jnp.float32)
    dv = jax.random.normal(ks[3], (tokens, NH, k), jnp.float32)
    return x, w, b, dv


def jax_fns(impl: str, k: int):
    """(forward, value and gradients) of the JAX router `impl` ("ours": the Triton / Gluon binding), jitted."""
    if impl == "ours":
        from mhl_jax.moe.gpu.router import route_topk_triton  # imports triton

        route = lambda x, w, b: route_topk_triton(x, w, b, k)  # noqa: E731
    else:
        route = lambda x, w, b: route_topk_reference(x, w, b, k)  # noqa: E731

    def loss(x, w, b, dv):
        return jnp.vdot(route(x, w, b)[0], dv)

    return jax.jit(lambda x, w, b, dv: route(x, w, b)), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def time_torch(sets, k: int) -> dict:
    """ms_fwd, ms and peak_gib of our kernels launched from torch (do_bench: CUDA events, median)."""
    import torch
    from triton.testing import do_bench

    from kernels.torch import router as ktr

    tsets = [[torch.from_dlpack(a).clone() for a in s] for s in sets]
    for s in tsets:
        s[0].requires_grad_()
        s[1].requires_grad_()
    count = {"i": 0}

    def next_set():
        count["i"] += 1
        return tsets[count["i"] % len(tsets)]

    def run_fb():
        x, w, b, dv = next_set()
        x.grad = w.grad = None
        ktr.route_topk_torch(x, w, b, k)[0].backward(dv)

    def run_f():
        x, w, b, _ = next_set()
        with torch.no_grad():
            ktr.router_fwd(x, w, b, k)

    out = {"ms_fwd": float(do_bench(run_f, warmup=10, rep=60, return_mode="median")),
           "ms": float(do_bench(run_fb, warmup=10, rep=60, return_mode="median"))}
    del tsets[1:]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run_fb()
    torch.cuda.synchronize()
    out["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def measure(impl: str, sets, ne: int, k: int, device: str) -> dict:
    """One (impl, Ne) record (see the module's docstring)."""
    n = sets[0][0].shape[0]
    rec = dict(bench="router", impl="triton" if impl == "ours" else impl, device=device, date=today(),
               params=dict(tokens=n, nh=NH, dh=DH, ne=ne, k=k))
    try:
        t0 = time.perf_counter()
        if impl == "ours_torch":
            rec.update(time_torch(sets, k))
        else:
            fwd, fb = jax_fns(impl, k)
            rec["ms_fwd"], rec["ms"] = time_jax(fwd, sets, reps=15), time_jax(fb, sets, reps=15)
            rec["ms_fwd_stream"], rec["ms_stream"] = (time_jax(f, sets, reps=10, batch_ms=20.0) for f in (fwd, fb))
            rec["peak_gib"], rec["peak_gib_fwd"] = compiled_gib(fb, *sets[0]), compiled_gib(fwd, *sets[0])
        floor_bytes = n * NH * DH * 2 + n * NH * k * 8 + NH * DH * ne * 4  # x in, (values, indices) out, W_r once
        rec.update(ms_bwd=rec["ms"] - rec["ms_fwd"], tflops=2.0 * n * NH * DH * ne / rec["ms_fwd"] / 1e9,
                   gbps=floor_bytes / rec["ms_fwd"] / 1e6, wall_s=round(time.perf_counter() - t0, 1))
        if ne in AUTHORS_FB_MS:
            rec["authors_h100_ms"] = AUTHORS_FB_MS[ne]  # another GPU's figure: same-GPU comparisons time theirs too
            rec["speedup_vs_authors_h100"] = AUTHORS_FB_MS[ne] / rec["ms"]
    except Exception as e:  # recorded, not fatal
        rec["error"] = error_text(e)
        traceback.print_exc(limit=3)
    return rec


def table(rows: list[dict], impls: list[str], nes: list[int]) -> str:
    names = ["triton" if i == "ours" else i for i in impls]
    lines = [f"{'Ne':>5} " + " ".join(f"{i:>26}" for i in names) + f" {'H100 auth':>9} {'x H100 au':>9}"]
    for ne in nes:
        cells = []
        for name in names:
            r = [r for r in rows if r["impl"] == name and r["params"]["ne"] == ne and "ms" in r]
            cells.append(f"{r[0]['ms_fwd']:6.3f}/{r[0]['ms']:7.3f} {r[0].get('peak_gib') or 0:6.2f}G" if r else "-")
        ours = [r for r in rows if r["impl"] == "triton" and r["params"]["ne"] == ne and "ms" in r]
        a = AUTHORS_FB_MS.get(ne)
        sp = f"{a / ours[0]['ms']:8.2f}x" if a and ours else "-"
        lines.append(f"{ne:>5} " + " ".join(f"{c:>26}" for c in cells) + f" {a or '-':>9} {sp:>9}")
    return "\n".join(lines + ["(ms fwd / fwd+bwd, median; peak GiB of fwd+bwd; authors: their router fwd+bwd, H100)"])


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--ne", type=int, nargs="+", default=[128, 256, 384, 512, 1024, 2048])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--impls", nargs="+", default=["ours", "reference", "ours_torch"],
                    choices=["ours", "reference", "ours_torch"])
    args = ap.parse_args(argv)
    try:  # jax-triton before torch: its import would leave torch without a Triton cache folder
        import_jax_triton()
    except ImportError:
        pass
    device = jax.devices()[0].device_kind
    rows = []
    with JsonLines(args.out) as emit:
        for ne in args.ne:
            sets = [make_inputs(s + ne, args.tokens, ne, args.k) for s in range(2)]
            for impl in args.impls:
                rows.append(emit(measure(impl, sets, ne, args.k, device)))
            del sets
    print(table(rows, args.impls, args.ne))


if __name__ == "__main__":
    main()
