"""Expert FFN forward and forward+backward: ours (Triton, IO-aware) against grouped-GEMM baselines that write the
(rows x de) hidden activations to memory, and the FlexAttention oracle.

    python -m bench.experts [--tokens 2048 81920] [--de 128 256 512] [--ne 64 256 1024 1536]
                            [--impls ours ours_torch ours_grouped grouped_mm ragged_mgpu flex] [--out FILE]

Shapes: Nh=8 heads, dh=128, k=4 (the paper's B=4 x T=512 = 2048 tokens), and 81920 tokens. Inputs: x (N, Nh, dh)
bf16, uniform random routing (k distinct experts per sub-token), softmax gates (fp32), bf16 weights; every
implementation gets and returns the same dtypes and includes its own packing (sort by (head, expert)) and the
gate-weighted combine.

impls: ours = the JAX binding (`mhl_jax.moe.gpu.experts`); ours_torch = the same kernels launched from torch;
ours_grouped = our grouped-GEMM Triton kernels in JAX (`mhl_jax.moe.gpu.grouped`, hidden activations in memory: the
path of experts wider than the fused kernels); grouped_mm = torch._grouped_mm (cuBLAS / CUTLASS grouped GEMM) with
autograd; ragged_mgpu = JAX Pallas Mosaic-GPU ragged_dot (+ transposed_ragged_dot for dW) in a custom_vjp, run in a
child process so that a compiler crash or hang is recorded, not fatal; flex = the oracle
(`kernels.torch.flex_oracle`, torch.compile'd FlexAttention).
One JSON line per (impl, shape), a table last (ms fwd / fwd+bwd).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from bench.common import JsonLines, error_text, parser, time_jax, today
from mhl_jax.moe.plan import import_jax_triton

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


def ours_jax():
    from mhl_jax.moe.gpu.experts import expert_ffn_triton

    return jax_fns(lambda x, idx, g, w1, w2: expert_ffn_triton(x, idx, g, w1, w2)[0])


def ours_grouped_jax():
    """Our grouped-GEMM Triton kernels (mhl_jax/moe/gpu/grouped.py: hidden activations in HBM), the
    path `ffn.kernels=triton` takes for experts wider than 128."""
    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    return jax_fns(lambda x, idx, g, w1, w2: expert_ffn_grouped(x, idx, g, w1, w2)[0])


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
    import torch

    out = []
    for i, a in enumerate(arrs):
        t = torch.from_dlpack(a).clone()
        if i in (0, 2, 3, 4):
            t.requires_grad_()
        out.append(t)
    x, idx, g, w1, w2, wy = out
    return x, idx.long(), g, w1, w2, wy


PROGRESS = "progress:"  # stderr lines of an isolated child, read back when it times out


def progress(t0: float, what: str) -> None:
    print(f"{PROGRESS} {what} at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def run_isolated(impl: str, tokens: int, de: int, ne: int, timeout: float) -> dict:
    """One (impl, shape) in a child process (its own session, killed as a group on timeout)."""
    cmd = [sys.executable, "-m", "bench.experts", "--tokens", str(tokens), "--de", str(de), "--ne", str(ne),
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


def time_jax_impl(impl: str, sets, t0: float) -> tuple[float, float]:
    """(ms fwd, ms fwd+bwd) of a JAX implementation; ragged_mgpu reports its progress for a parent that may time out."""
    fwd, fb = {"ours": ours_jax, "ours_grouped": ours_grouped_jax, "ragged_mgpu": ragged_mgpu}[impl]()
    if impl == "ragged_mgpu":
        jax.block_until_ready(fwd(*sets[0]))
        progress(t0, "forward compiled and run once")
        jax.block_until_ready(fb(*sets[0]))
        progress(t0, "fwd+bwd compiled and run once")
    return time_jax(fwd, sets), time_jax(fb, sets)


def measure(impl: str, tokens: int, de: int, ne: int, args) -> dict:
    """One (impl, shape) record: ms_fwd, ms, ms_bwd, tflops (3 x the forward's expert FLOPs), or the error."""
    params = dict(tokens=tokens, nh=NH, dh=DH, k=K, ne=ne, de=de)
    rec = dict(bench="experts", impl=impl, device=args.device, date=today(), params=params)
    t0 = time.perf_counter()
    try:
        if impl == "ragged_mgpu" and not args.inproc:
            got = run_isolated(impl, tokens, de, ne, args.child_timeout)
            if "error" in got:
                raise RuntimeError(got["error"])
            rec.update({k: v for k, v in got.items() if k not in rec})
            return rec
        # two input sets when they fit easily (rotating them keeps a cache from flattering the figure)
        n_sets = 2 if tokens * NH * DH * 2 + 2 * NH * ne * DH * de * 2 < 200e6 else 1
        sets = [make_inputs(s, tokens, ne, de) for s in range(n_sets)]
        if impl in ("ours", "ours_grouped", "ragged_mgpu"):
            rec["ms_fwd"], rec["ms"] = time_jax_impl(impl, sets, t0)
        else:
            ffn = torch_fns(impl)
            tsets = [to_torch(s) for s in sets]
            rec["ms_fwd"], rec["ms"] = time_torch(ffn, tsets, False), time_torch(ffn, tsets, True)
        f = flops_fwd(tokens, NH, K, DH, de)
        rec.update(ms_bwd=rec["ms"] - rec["ms_fwd"], tflops=3 * f / rec["ms"] / 1e9,
                   tflops_fwd=f / rec["ms_fwd"] / 1e9, wall_s=round(time.perf_counter() - t0, 1))
    except Exception as e:  # a baseline that cannot run this shape is recorded, not fatal
        rec["error"] = error_text(e)
        traceback.print_exc(limit=2)
    return rec


def table(rows: list[dict], impls: list[str]) -> str:
    lines = [f"{'tokens':>6} {'de':>4} {'ne':>5} " + " ".join(f"{i:>18}" for i in impls)]
    for key in sorted({(r["params"]["tokens"], r["params"]["de"], r["params"]["ne"]) for r in rows}):
        cells = []
        for impl in impls:
            r = [r for r in rows if r["impl"] == impl and (r["params"]["tokens"], r["params"]["de"],
                                                            r["params"]["ne"]) == key]
            cells.append(f"{r[0]['ms_fwd']:7.3f}/{r[0]['ms']:8.3f}" if r and "ms" in r[0] else "-")
        lines.append(f"{key[0]:>6} {key[1]:>4} {key[2]:>5} " + " ".join(f"{c:>18}" for c in cells))
    return "\n".join(lines + ["(ms fwd / fwd+bwd, median)"])


# -------------------------------------------------------------------------------------------- main

def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 81920])
    ap.add_argument("--de", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--ne", type=int, nargs="+", default=[64, 256, 1024, 1536])
    ap.add_argument("--impls", nargs="+", default=["ours", "ours_torch", "grouped_mm", "ragged_mgpu", "flex"],
                    choices=["ours", "ours_torch", "ours_grouped", "grouped_mm", "ragged_mgpu", "flex"])
    ap.add_argument("--flex-max-compiles", type=int, default=8, help="skip flex after this many shapes")
    ap.add_argument("--inproc", action="store_true", help="run ragged_mgpu in this process")
    ap.add_argument("--child-timeout", type=float, default=90.0)
    args = ap.parse_args(argv)
    args.device = jax.devices()[0].device_kind
    try:  # jax-triton first, then torch.compile: its import would leave torch without a Triton cache folder
        import_jax_triton()
    except ImportError:
        pass
    rows, flex_done = [], 0
    with JsonLines(args.out) as emit:
        for tokens in args.tokens:
            for de in args.de:
                for ne in args.ne:
                    for impl in args.impls:
                        if impl == "flex" and flex_done >= args.flex_max_compiles:
                            continue  # each FlexAttention shape is a torch.compile of its own
                        flex_done += impl == "flex"
                        rows.append(emit(measure(impl, tokens, de, ne, args)))
    print(table(rows, args.impls))


if __name__ == "__main__":
    main()
