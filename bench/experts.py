"""Expert FFN forward and forward+backward: ours (Triton, IO-aware) against grouped-GEMM baselines
that materialise the (rows x de) hidden activations, and the FlexAttention oracle.

    python bench/experts.py [--tokens 2048 81920] [--de 128 256 512] [--ne 64 256 1024 1536]
                            [--impls ours ours_grouped ours_torch grouped_mm ragged_mgpu flex] [--out FILE]
                            [--variants v2 new ...] [--dwt-tile 64,128,8,2] [--sweep]

Shapes: Nh=8 heads, dh=128, k=4 (paper section 4.2: B=4 x T=512 = 2048 tokens), plus 81920 tokens.
Inputs: x (N, Nh, dh) bf16, uniform random routing (k distinct experts per sub-token), softmax gates
(fp32), bf16 weights (all implementations get and return the same dtypes). Each implementation
includes its own packing (sort by (head, expert)) and the gate-weighted combine.

impls: ours = JAX + jax-triton (mhl_jax/moe/gpu/experts.py), once per --variants name
(`experts_triton.VARIANTS`; each later variant's output and gradients are compared with the first's:
`rel_vs_first`); ours_torch = the same kernels from
torch; ours_grouped = our grouped-GEMM Triton kernels in JAX (mhl_jax/moe/gpu/grouped.py, hidden
activations written to HBM); grouped_mm = torch._grouped_mm (cuBLAS/CUTLASS grouped GEMM) with autograd; ragged_mgpu =
JAX Pallas Mosaic-GPU ragged_dot (+ transposed_ragged_dot for dW) in a custom_vjp; flex = the
oracle (kernels/torch/flex_oracle.py, torch.compile'd FlexAttention).
Output: one JSON line per (impl, shape) per DESIGN §8, a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.timing import emit, time_jax  # noqa: E402

NH, DH, K = 8, 128, 4


def flops_fwd(tokens: int, nh: int, k: int, dh: int, de: int) -> float:
    return tokens * nh * k * 4.0 * dh * de


# ------------------------------------------------------------------------------------------- inputs

def make_inputs(seed: int, tokens: int, ne: int, de: int, nh: int = NH, dh: int = DH, k: int = K):
    ks = jax.random.split(jax.random.key(seed), 7)
    x = jax.random.normal(ks[0], (tokens, nh, dh), jnp.bfloat16)
    base = jax.random.randint(ks[1], (tokens, nh, 1), 0, ne)
    step = jax.random.randint(ks[2], (tokens, nh, 1), 1, max(ne // k, 2))
    idx = ((base + jnp.arange(k) * step) % ne).astype(jnp.int32)  # k distinct experts, uniform marginal
    gates = jax.nn.softmax(jax.random.normal(ks[3], (tokens, nh, k)), axis=-1)
    w1 = (jax.random.normal(ks[4], (nh, ne, dh, de)) * dh ** -0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[5], (nh, ne, de, dh)) * de ** -0.5).astype(jnp.bfloat16)
    wy = jax.random.normal(ks[6], (tokens, nh, dh), jnp.bfloat16)
    return x, idx, gates, w1, w2, wy


# -------------------------------------------------------------------------------------- JAX timing



def jax_fns(ffn):
    """ffn(x, idx, gates, w1, w2) -> y. Returns jitted forward and forward+backward (all four grads)."""
    fwd = jax.jit(lambda x, idx, g, w1, w2, wy: ffn(x, idx, g, w1, w2))

    def loss(x, g, w1, w2, idx, wy):
        return jnp.sum(ffn(x, idx, g, w1, w2).astype(jnp.float32) * wy.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return fwd, lambda x, idx, g, w1, w2, wy: grad(x, g, w1, w2, idx, wy)


def ours_jax(variant: str = "v2", dwt_tile=None):
    from mhl_jax.moe.gpu.experts import expert_ffn_triton, variant_config

    def ffn(x, idx, g, w1, w2):
        cfg = variant_config(variant, idx.size, w1.shape[0] * w1.shape[1], x.shape[2], w1.shape[3], dwt_tile)
        return expert_ffn_triton(x, idx, g, w1, w2, cfg=cfg)[0]

    return jax_fns(ffn)


def ours_grouped_jax():
    """Our grouped-GEMM Triton kernels (mhl_jax/moe/gpu/grouped.py: hidden activations in HBM), the
    path `ffn.kernels=triton` takes for experts wider than 128."""
    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    return jax_fns(lambda x, idx, g, w1, w2: expert_ffn_grouped(x, idx, g, w1, w2)[0])


def rel_diffs(a, b) -> list[float]:
    """Relative L2 differences of matching leaves (fp64 on the host)."""
    import numpy as np

    out = []
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        out.append(float(np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-30)))
    return out


def parse_tile(text: str | None):
    from kernels.triton.experts import Tile

    return Tile(*(int(v) for v in text.split(","))) if text else None


def _gelu_grad(h):
    c, a = 0.7978845608028654, 0.044715
    t = jnp.tanh(c * (h + a * h ** 3))
    return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * a * h * h)


def ragged_mgpu():
    """Grouped-GEMM expert FFN on JAX's Mosaic-GPU ragged_dot: rows sorted by (head, expert), no
    padding, hidden (M, de) materialised (saved for the backward), dW by transposed_ragged_dot."""
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot

    cfg = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
    tcfg = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=2, grid_block_n=1)

    @jax.custom_vjp
    def grouped_ffn(xs, w1, w2, gs):
        return _fwd(xs, w1, w2, gs)[0]

    def _fwd(xs, w1, w2, gs):
        h = ragged_dot(xs, w1, group_sizes=gs, **cfg)
        a = jax.nn.gelu(h.astype(jnp.float32)).astype(xs.dtype)
        o = ragged_dot(a, w2, group_sizes=gs, **cfg)
        return o, (xs, h, a, w1, w2, gs)

    def _bwd(res, do):
        xs, h, a, w1, w2, gs = res
        da = ragged_dot(do, w2, group_sizes=gs, transpose_rhs=True, **cfg)
        dh = (da.astype(jnp.float32) * _gelu_grad(h.astype(jnp.float32))).astype(xs.dtype)
        dxs = ragged_dot(dh, w1, group_sizes=gs, transpose_rhs=True, **cfg)
        dw1 = transposed_ragged_dot(xs, dh, group_sizes=gs, **tcfg)
        dw2 = transposed_ragged_dot(a, do, group_sizes=gs, **tcfg)
        return dxs, dw1, dw2, None

    grouped_ffn.defvjp(_fwd, _bwd)

    def ffn(x, idx, gates, w1, w2):
        n, nh, dh = x.shape
        _, ne, _, de = w1.shape
        m = n * nh * idx.shape[2]
        group = (jnp.arange(nh, dtype=jnp.int32)[None, :, None] * ne + idx).reshape(m)
        order = jnp.argsort(group, stable=True)
        gs = jnp.bincount(group, length=nh * ne).astype(jnp.int32)
        xs = jnp.take(x.reshape(n * nh, dh), order // idx.shape[2], axis=0)
        o = grouped_ffn(xs, w1.reshape(nh * ne, dh, de), w2.reshape(nh * ne, de, dh), gs)
        per_slot = jnp.zeros_like(o).at[order].set(o, unique_indices=True).reshape(n, nh, -1, dh)
        return jnp.einsum("nhkd,nhk->nhd", per_slot.astype(jnp.float32), gates).astype(x.dtype)

    return jax_fns(ffn)


# ------------------------------------------------------------------------------------ torch timing

def torch_fns(impl: str):
    import torch
    import torch.nn.functional as F

    from kernels.torch.experts import pack_torch, triton_expert_ffn

    if impl == "ours_torch":
        ffn = triton_expert_ffn
    elif impl == "flex":
        from kernels.torch.flex_oracle import flex_expert_ffn

        ffn = flex_expert_ffn
    elif impl == "grouped_mm":
        def ffn(x, idx, gates, w1, w2):
            n, nh, dh = x.shape
            _, ne, _, de = w1.shape
            k = idx.shape[2]
            pk = pack_torch(idx, ne, 16)  # groups padded to 16 rows (alignment of the grouped GEMM)
            slot = pk.row_slot.long()
            rows = x.reshape(n * nh, dh)[slot.clamp(min=0) // k] * (slot >= 0)[:, None].to(x.dtype)
            ends = ((pk.group_block_start + pk.group_nblocks) * 16).to(torch.int32)
            w1g, w2g = w1.reshape(nh * ne, dh, de), w2.reshape(nh * ne, de, dh)
            outs, g_count = [], nh * ne
            # torch._grouped_mm refused 1024 groups per call on the H100 image: chunk by 512 (host sync per chunk)
            bounds = [0] + ends[511:g_count - 1:512].tolist() + [int(ends[-1])]
            for c, g0 in enumerate(range(0, g_count, 512)):
                g1 = min(g0 + 512, g_count)
                r0, r1 = bounds[c], bounds[c + 1]
                offs = ends[g0:g1] - r0
                h = torch._grouped_mm(rows[r0:r1], w1g[g0:g1], offs=offs)
                a = F.gelu(h.float(), approximate="tanh").to(x.dtype)
                outs.append(torch._grouped_mm(a, w2g[g0:g1], offs=offs))
            o = torch.cat(outs + [rows.new_zeros(rows.shape[0] - bounds[-1], dh)])
            per_slot = o[pk.slot_row.long()].view(n, nh, k, dh).float()
            return torch.einsum("nhkd,nhk->nhd", per_slot, gates).to(x.dtype)
    else:
        raise ValueError(impl)
    return ffn


def time_torch(ffn, sets, backward: bool) -> float:
    import torch
    from triton.testing import do_bench

    state = {"i": 0}

    def run():
        x, idx, g, w1, w2, wy = sets[state["i"] % len(sets)]
        state["i"] += 1
        if backward:
            for t in (x, g, w1, w2):
                t.grad = None
            y = ffn(x, idx, g, w1, w2)
            y.backward(wy)
        else:
            with torch.no_grad():
                ffn(x, idx, g, w1, w2)

    return float(do_bench(run, warmup=50, rep=300, return_mode="median"))


def to_torch(arrs):
    import torch  # noqa: F401

    out = []
    for i, a in enumerate(arrs):
        t = torch.from_dlpack(a).clone()
        if i in (0, 2, 3, 4):
            t.requires_grad_()
        out.append(t)
    x, idx, g, w1, w2, wy = out
    return x, idx.long(), g, w1, w2, wy


# ------------------------------------------------------------------------------------------- sweep

SWEEP_TILES = {
    "fwd": [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)],
    "dx": [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)],
    "dw": [(64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 2),
           (64, 64, 4, 3)],
    # transposed dW kernel (dw_form "t"); "_packed": packed X / dO rows (the packing copy not timed)
    "dwt": [(64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3), (128, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3),
            (64, 64, 8, 2)],
    "dwt_packed": [(64, 128, 8, 2), (32, 128, 8, 3)],
    "dw_packed": [(128, 64, 8, 2)],
}
QUICK_KINDS = ("dw", "dwt", "dwt_packed", "dw_packed")  # --sweep-kinds default: the backward only
QUICK_DW = [(128, 64, 8, 2)]  # with QUICK_KINDS, the rows-form dW only at its measured default


def sweep(tokens: int, ne: int, de: int, pack_block: int, device: str, date: str, outf,
          kinds=tuple(SWEEP_TILES)) -> None:
    """Time each kernel alone (torch launcher) over SWEEP_TILES[kinds]; prints one JSON line per tile.

    dW kinds are timed as the whole backward with the dX kernel at a fixed tile (dx_tile): the dX
    launch is the same in every dW line, so differences between lines are the dW kernels'. Each
    line also checks the dW1 / dW2 it produced against the first dW line's (rel_vs_first)."""
    import torch
    from triton.testing import do_bench

    from kernels.torch.experts import experts_bwd, experts_fwd, pack_bwd_rows, pack_torch
    from kernels.triton.experts import ExpertsConfig, Tile

    x, idx, g, w1, w2, wy = (torch.from_dlpack(a).clone() for a in make_inputs(0, tokens, ne, de))
    pk = pack_torch(idx.long(), ne, pack_block)
    xs, dys, gf = x.reshape(-1, DH), wy.reshape(-1, DH), g.reshape(-1).float()
    w1g, w2g = w1.reshape(-1, DH, de), w2.reshape(-1, de, DH)
    first = None
    dx_tile = Tile(min(128, pack_block), 32, 4, 3)
    for kind in kinds:
        tiles = QUICK_DW if kind == "dw" and tuple(kinds) == QUICK_KINDS else SWEEP_TILES[kind]
        for t in tiles:
            tile = Tile(*t)
            if tile.block_m > pack_block or tile.block_e > de:
                continue
            big = Tile(pack_block, 64, 4, 2)  # unused kernels' tiles
            rec = dict(bench="experts_sweep", kernel=kind, device=device, date=date,
                       params=dict(tokens=tokens, ne=ne, de=de, pack_block=pack_block, tile=list(t),
                                   fused_dx=kind.startswith("dw") and tile.block_e == de))
            try:
                if kind == "fwd":
                    cfg = ExpertsConfig(pack_block, tile, big, big)
                    fn = lambda cfg=cfg: experts_fwd(xs, pk.row_slot, pk.block_group, w1g, w2g, K, cfg)  # noqa: E731
                elif kind == "dx":  # dx kernel + a cheap dw launch cannot be separated: time dx via dw fused off
                    cfg = ExpertsConfig(pack_block, big, tile, Tile(min(64, pack_block), min(64, de // 2), 4, 2))
                    fn = lambda cfg=cfg: experts_bwd(xs, dys, gf, pk, w1g, w2g, K, cfg)  # noqa: E731
                else:
                    form = "t" if kind.startswith("dwt") else "rows"
                    cfg = ExpertsConfig(pack_block, big, dx_tile, tile, dw_form=form,
                                        packed_bwd=kind.endswith("_packed"))
                    fn = lambda cfg=cfg: experts_bwd(xs, dys, gf, pk, w1g, w2g, K, cfg)  # noqa: E731
                    dws = fn()[1:3]
                    if first is None:
                        first = dws
                    rec["rel_vs_first"] = [float((a.double() - b.double()).norm() / b.double().norm())
                                           for a, b in zip(dws, first)]
                    if cfg.packed_bwd:  # the packing copy the binding adds (XLA gather there; torch here)
                        rec["ms_pack_rows"] = float(do_bench(lambda: pack_bwd_rows(xs, dys, gf, pk.row_slot, K),
                                                             warmup=10, rep=50, return_mode="median"))
                rec["ms"] = float(do_bench(fn, warmup=25, rep=150, return_mode="median"))
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            emit(rec, outf)


PROGRESS = "progress:"  # stderr lines of an isolated child, read back when it times out


def progress(t0: float, what: str) -> None:
    print(f"{PROGRESS} {what} at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def run_isolated(impl: str, tokens: int, de: int, ne: int, timeout: float) -> dict:
    """Run one (impl, shape) in a child process (own session, killed as a group on timeout): a Mosaic-GPU
    compiler crash or hang is recorded, not fatal."""
    import signal
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--tokens", str(tokens), "--de", str(de), "--ne", str(ne),
           "--impls", impl, "--inproc"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()  # what the child had written: its progress lines say where it stopped
        done = [ln[len(PROGRESS):].strip() for ln in (err or "").splitlines() if ln.startswith(PROGRESS)]
        return dict(error=f"child timed out ({timeout:.0f} s); reached: {'; '.join(done) or 'nothing'}")
    for line in out.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    tail = [ln for ln in err.strip().splitlines() if ln.strip()][-3:]
    return dict(error=f"child exited {p.returncode}: {' | '.join(tail)[:400]}")


# -------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 81920])
    ap.add_argument("--de", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--ne", type=int, nargs="+", default=[64, 256, 1024, 1536])
    ap.add_argument("--impls", nargs="+", default=["ours", "ours_torch", "grouped_mm", "ragged_mgpu", "flex"])
    ap.add_argument("--flex-max-compiles", type=int, default=8, help="skip flex after this many shapes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--inproc", action="store_true", help="run ragged_mgpu in this process")
    ap.add_argument("--sweep", action="store_true", help="time each kernel over SWEEP_TILES and exit")
    ap.add_argument("--pack-block", type=int, default=128)
    ap.add_argument("--sweep-kinds", nargs="+", default=None, help=f"subset of {list(SWEEP_TILES)}")
    ap.add_argument("--variants", nargs="+", default=["v2"], help="configs of impl ours (experts_triton.VARIANTS)")
    ap.add_argument("--dwt-tile", default=None, help="block_m,block_e,warps,stages of the transposed dW kernel")
    ap.add_argument("--child-timeout", type=float, default=90.0)
    args = ap.parse_args()

    import torch

    from mhl_jax.moe.plan import import_jax_triton

    try:
        import_jax_triton()  # also keeps TRITON_CACHE_DIR usable for torch.compile after it
    except ImportError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else jax.devices()[0].device_kind
    date = datetime.date.today().isoformat()
    rows, flex_done = [], 0
    outf = open(args.out, "a") if args.out else None
    if args.sweep:
        for tokens in args.tokens:
            for de in args.de:
                for ne in args.ne:
                    sweep(tokens, ne, de, args.pack_block, device, date, outf,
                          tuple(args.sweep_kinds or SWEEP_TILES))
        return
    for tokens in args.tokens:
        for de in args.de:
            for ne in args.ne:
                n_sets = 2 if tokens * NH * DH * 2 + 2 * NH * ne * DH * de * 2 < 200e6 else 1
                sets = [make_inputs(s, tokens, ne, de) for s in range(n_sets)]
                f = flops_fwd(tokens, NH, K, DH, de)
                params = dict(tokens=tokens, nh=NH, dh=DH, k=K, ne=ne, de=de)
                first_grads = None
                runs = [(i, v) for i in args.impls for v in (args.variants if i == "ours" else [None])]
                for impl, variant in runs:
                    if impl == "flex" and flex_done >= args.flex_max_compiles:
                        continue
                    rec = dict(bench="experts", impl=impl, device=device, date=date, params=params)
                    if variant:
                        rec["variant"] = variant
                    try:
                        t0 = time.perf_counter()
                        if impl == "ragged_mgpu" and not args.inproc:
                            rec.update({k: v for k, v in run_isolated(impl, tokens, de, ne, args.child_timeout).items()
                                        if k not in rec})
                            if "error" in rec:
                                raise RuntimeError(rec.pop("error"))
                        elif impl in ("ours", "ours_grouped", "ragged_mgpu"):
                            fwd, fb = (ours_jax(variant, parse_tile(args.dwt_tile)) if impl == "ours" else
                                       ours_grouped_jax() if impl == "ours_grouped" else ragged_mgpu())
                            if impl == "ragged_mgpu":  # compile and first-call times, for a timed-out child
                                jax.block_until_ready(fwd(*sets[0]))
                                progress(t0, "forward compiled and run once")
                                t1 = time.perf_counter()
                                jax.block_until_ready(fwd(*sets[0]))
                                progress(t0, f"forward warm call {1e3 * (time.perf_counter() - t1):.1f} ms")
                                jax.block_until_ready(fb(*sets[0]))
                                progress(t0, "fwd+bwd compiled and run once")
                            if impl != "ragged_mgpu":  # same function as the first variant? (bf16: ~1e-3 expected)
                                got = (fwd(*sets[0]), fb(*sets[0]))
                                if first_grads is None:
                                    first_grads = got
                                else:
                                    rec["rel_vs_first"] = rel_diffs(got, first_grads)
                                del got
                            rec["ms_fwd"] = time_jax(fwd, sets)
                            rec["ms"] = time_jax(fb, sets)
                        else:
                            ffn = torch_fns(impl)
                            tsets = [to_torch(s) for s in sets]
                            rec["ms_fwd"] = time_torch(ffn, tsets, False)
                            rec["ms"] = time_torch(ffn, tsets, True)
                            del tsets
                            flex_done += impl == "flex"
                        rec["ms_bwd"] = rec["ms"] - rec["ms_fwd"]
                        rec["tflops"] = 3 * f / rec["ms"] / 1e9
                        rec["tflops_fwd"] = f / rec["ms_fwd"] / 1e9
                        rec["wall_s"] = round(time.perf_counter() - t0, 1)
                    except Exception as e:  # a baseline that cannot run this shape is recorded, not fatal
                        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        traceback.print_exc(limit=2)
                    emit(rec, outf)
                    rows.append(rec)
                del sets
    names = [i if i != "ours" else f"ours:{v}" for i in args.impls for v in (args.variants if i == "ours" else [0])]
    print(f"\n{'tokens':>6} {'de':>4} {'ne':>5} " + " ".join(f"{i:>18}" for i in names))
    keys = sorted({(r["params"]["tokens"], r["params"]["de"], r["params"]["ne"]) for r in rows})
    for key in keys:
        cells = []
        for name in names:
            r = [r for r in rows if (r["impl"] if "variant" not in r else f"ours:{r['variant']}") == name and
                 (r["params"]["tokens"], r["params"]["de"], r["params"]["ne"]) == key]
            cells.append(f"{r[0]['ms_fwd']:7.3f}/{r[0]['ms']:8.3f}" if r and "ms" in r[0] else f"{'-':>16}")
        print(f"{key[0]:>6} {key[1]:>4} {key[2]:>5} " + " ".join(f"{c:>18}" for c in cells))
    print("(ms fwd / fwd+bwd, median)")


if __name__ == "__main__":
    main()
