"""Per-kernel GPU times of one MH-LatentMoE layer forward+backward (bench/layer.py's layer), read with
Nsight Compute: where the layer's milliseconds go, kernel by kernel.

    python bench/profile_layer.py [--tokens 8192 81920] [--configs 384/4/256] [--variants default gluon_bwd]
                                  [--out FILE]

The parent runs itself under `ncu --profile-from-start off` (metric gpu__time_duration.sum, real clocks,
caches not flushed); the child compiles and warms the jitted fwd+bwd, then runs it once between
cuProfilerStart / cuProfilerStop. ncu serialises kernels, so the sum of kernel times is the layer without
launch gaps or overlap. One JSON line per shape (`bench: layer_profile`) with each kernel's ms, grouped
by kernel name, largest first, and a short table.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import io
import os
import re
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.timing import emit  # noqa: E402


def child(tokens: int, config: str, variant: str) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    from bench.layer import D, expert_cfg, init_params, layer

    ne, k, de = (int(v) for v in config.split("/"))
    params = init_params(jax.random.key(0), ne, de)
    x = jax.random.normal(jax.random.key(1), (tokens, D), jnp.bfloat16)
    cfg = expert_cfg(None if variant == "default" else variant, tokens, ne, k, de)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(layer(p, x, k, "triton", "triton", cfg).astype(jnp.float32) ** 2),
                            argnums=(0, 1)))
    for _ in range(3):
        jax.block_until_ready(grad(params, x))
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    jax.block_until_ready(grad(params, x))
    cuda.cuProfilerStop()


def short(name: str) -> str:
    """Kernel name without template arguments / parameters, XLA fusion numbers folded."""
    name = re.sub(r"\(.*", "", name).strip()
    name = re.sub(r"<.*", "", name)
    return re.sub(r"(_\d+)+$", "", name)


MS_PER_UNIT = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
               "second": 1e3}  # ncu's time units


def csv_rows(text: str) -> list[dict]:
    """ncu --csv output (banner lines dropped) -> one dict per metric row."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def metric_value(row: dict) -> float:
    return float(row["Metric Value"].replace(",", "") or 0)


def parse(text: str) -> list[tuple[str, float]]:
    """ncu --csv output -> [(kernel name, ms)] in launch order."""
    return [(row["Kernel Name"], metric_value(row) * MS_PER_UNIT[row["Metric Unit"]]) for row in csv_rows(text)
            if row.get("Metric Name") == "gpu__time_duration.sum"]


def run_group(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run cmd in a process group of its own; past `timeout` s kill the whole group (ncu and the profiled child) and
    return what it printed with returncode -1."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(cmd, -1, out, f"timed out after {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 81920])
    ap.add_argument("--configs", nargs="+", default=["384/4/256"])
    from mhl_jax.ops.experts_triton import VARIANTS

    ap.add_argument("--variants", nargs="+", default=["default"], choices=VARIANTS,
                    help="expert configs (mhl_jax.ops.experts_triton.VARIANTS; default = the binding's default)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds per (tokens, config, variant) under ncu (compiling under ncu is slow: two "
                         "81920-token configs ran past 400 s on 2026-11-25); past it, an error record")
    ap.add_argument("--child", nargs=3, default=None, metavar=("TOKENS", "CONFIG", "VARIANT"))
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.child[2])
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    date = datetime.date.today().isoformat()
    outf = open(args.out, "a") if args.out else None
    for tokens, config, variant in ((t, c, v) for t in args.tokens for c in args.configs for v in args.variants):
        cmd = [ncu, "--profile-from-start", "off", "--metrics", "gpu__time_duration.sum", "--csv",
               "--print-units", "base", "--clock-control", "none", "--cache-control", "none",
               sys.executable, os.path.abspath(__file__), "--child", str(tokens), config,
               variant]
        p = run_group(cmd, args.timeout)
        kernels = parse(p.stdout)
        groups: dict[str, list[float]] = {}
        for name, ms in kernels:
            groups.setdefault(short(name), []).append(ms)
        ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
        rec = dict(bench="layer_profile", device=os.environ.get("GPU_NAME", ""), date=date,
                   params=dict(tokens=tokens, config=config, variant=variant), launches=len(kernels),
                   total_ms=sum(ms for _, ms in kernels),
                   kernels=[dict(name=n, count=len(v), ms=sum(v)) for n, v in ranked],
                   sequence=[(short(n), round(ms, 4)) for n, ms in kernels])
        if not kernels:
            rec["error"] = f"ncu rc={p.returncode}: {(p.stderr or p.stdout)[-600:]}"
        emit(rec, outf)
        print(f"\n{tokens} tokens {config} {variant}: {len(kernels)} launches, {rec['total_ms']:.3f} ms of kernels")
        for n, v in ranked[:25]:
            print(f"  {sum(v):8.3f} ms  x{len(v):<3} {n[:90]}")


if __name__ == "__main__":
    main()
