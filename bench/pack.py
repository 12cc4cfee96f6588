"""The Triton packing (`mhl_jax.moe.gpu.packing.pack_triton`) alone at the layer's shapes, chunk sizes side by
side in one process: time per call and each launch's device time (JAX profiler trace).

    python bench/pack.py [--tokens 81920] [--configs 384/4 768/8 1536/8] [--chunks 1024 2048 4096]
                         [--sort-warps 8] [--offsets-eb 256 32] [--out FILE]

idx (N, 8, k): each row's k experts drawn without replacement (uniform scores, lax.top_k), the packing block of the
layer's default expert config. One JSON line per (shape, chunk, scatter warps): `ms` (bench.timing.time_jax),
`kernels_ms` (launch name -> ms per call, from a trace of 5 calls) and whether the outputs equal the default's
(kernels.triton.packing.PACK_CHUNK, PACK_SORT_WARPS).
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

NH = 8


def kernel_times(fn, args, calls: int = 5) -> dict:
    """Launch name -> device ms per call over `calls` traced calls (bench.profile_layer.trace_events)."""
    from bench.profile_layer import short, trace_events

    times: dict[str, float] = {}
    for _, d, name in trace_events(fn, args, calls)[0]:
        times[short(name)] = times.get(short(name), 0.0) + d / 1e6 / calls
    return {k: round(v, 4) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[81920])
    ap.add_argument("--configs", nargs="+", default=["384/4", "768/8", "1536/8"], help="Ne/k")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--sort-warps", type=int, nargs="+", default=[], help="kernels.triton.packing.PACK_SORT_WARPS values")
    ap.add_argument("--offsets-eb", type=int, nargs="+", default=[], help="kernels.triton.packing.PACK_OFFSETS_EB values")
    ap.add_argument("--de", type=int, default=128, help="expert width for the default config's packing block")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import kernels.triton.packing as kp
    from kernels.triton.packing import PACK_CHUNK
    from mhl_jax.moe.gpu.experts import resolve_config
    from mhl_jax.moe.gpu.packing import pack_triton

    outf = open(args.out, "a") if args.out else None
    date, device = datetime.date.today().isoformat(), jax.devices()[0].device_kind
    for tokens in args.tokens:
        for config in args.configs:
            ne, k = (int(v) for v in config.split("/"))
            block = resolve_config(tokens * NH * k, NH * ne, 128, args.de, None).pack_block
            scores = jax.random.uniform(jax.random.key(0), (tokens, NH, ne))
            idx = jax.block_until_ready(jax.lax.top_k(scores, k)[1].astype(jnp.int32))
            del scores
            ref = None
            warps, eb0 = kp.PACK_SORT_WARPS, kp.PACK_OFFSETS_EB
            runs = [(c, w, eb) for c in [PACK_CHUNK] + [c for c in args.chunks if c != PACK_CHUNK]
                    for w in [warps] + [w for w in args.sort_warps if w != warps]
                    for eb in [eb0] + [v for v in args.offsets_eb if v != eb0]]
            for chunk, sort_warps, eb in runs:
                kp.PACK_SORT_WARPS, kp.PACK_OFFSETS_EB = sort_warps, eb  # read when traced (the first call below)
                fn = jax.jit(lambda i, c=chunk, e=ne, b=block: tuple(pack_triton(i, e, b, c)))
                try:
                    out = jax.block_until_ready(fn(idx))
                finally:
                    kp.PACK_SORT_WARPS, kp.PACK_OFFSETS_EB = warps, eb0
                ref = out if ref is None else ref
                same = all(bool(jnp.array_equal(a, b)) for a, b in zip(out, ref))
                rec = dict(bench="pack", impl="triton", device=device, date=date,
                           params=dict(tokens=tokens, heads=NH, ne=ne, k=k, block=block, chunk=chunk,
                                       sort_warps=sort_warps, offsets_eb=eb),
                           ms=time_jax(fn, [(idx,)]), kernels_ms=kernel_times(fn, (idx,)), same_as_default=same)
                emit(rec, outf)


if __name__ == "__main__":
    main()
