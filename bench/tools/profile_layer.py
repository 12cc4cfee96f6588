"""Per-kernel GPU times of one MH-LatentMoE layer forward+backward (`bench.layer`'s layer): where the layer's
milliseconds go, kernel by kernel.

    python -m bench.tools.profile_layer [--tokens 8192 81920] [--configs 384/4/256] [--tool jax|ncu] [--calls 5]
                                        [--hlo PREFIX] [--out FILE]

--tool jax (default): in-process, the JAX profiler (CUPTI activity records, no replay): the warmed step runs
`--calls` times inside one trace, read back with `jax.profiler.ProfileData` from GPU 0's stream lines: the first
call's kernels (and its "XLA Ops" line: which HLO op each is, to find in the `--hlo` dump), the busy time per call
over all. Kernels run as launched (launch gaps are not in the sum). Cheap: seconds per shape after compiling.

--tool ncu:
The parent runs itself under `ncu --profile-from-start off` (metric gpu__time_duration.sum, real clocks,
caches not flushed); the child compiles and warms the jitted fwd+bwd, then runs it once between
cuProfilerStart / cuProfilerStop. ncu serialises kernels, so the sum of kernel times is the layer without
launch gaps or overlap. One JSON line per shape (`bench: layer_profile`) with each kernel's ms, grouped
by kernel name, largest first, and a short table.
"""

from __future__ import annotations

import csv
import ctypes
import io
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp

from bench.common import JsonLines, parser, time_jax, today
from bench.layer import D, init_params, layer_fns
from bench.tools.trace import DERIVED_LINES, gpu0_lines, traced_calls, union_ms


def build(tokens: int, config: str):
    """The jitted layer fwd+bwd of `bench.layer` at one shape, compiled and warmed, and its inputs."""
    ne, k, de = (int(v) for v in config.split("/"))
    params = init_params(jax.random.key(0), ne, de)
    x = jax.random.normal(jax.random.key(1), (tokens, D), jnp.bfloat16)
    grad = layer_fns(k, "triton")[1]
    for _ in range(3):
        jax.block_until_ready(grad(params, x))
    return grad, params, x


def child(tokens: int, config: str) -> None:
    grad, params, x = build(tokens, config)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    jax.block_until_ready(grad(params, x))
    cuda.cuProfilerStop()


def trace_events(fn, args, calls: int):
    """`calls` back-to-back calls of the warmed fn(*args) inside one JAX profiler trace -> (kernel events, "XLA Ops"
    events, the line names) of GPU 0; events (start ns, duration ns, name), sorted by start."""
    def read(tmp):
        events, ops, names = [], [], []
        for name, evs in gpu0_lines(tmp)[1]:
            names.append(name)
            if name == "XLA Ops":
                ops += evs
            if not name.startswith(DERIVED_LINES):
                events += evs
        return sorted(events), sorted(ops), names

    return traced_calls(lambda: fn(*args), calls, read)[0]


def jax_trace(tokens: int, config: str, calls: int, hlo_out: str | None = None):
    """`calls` traced calls of the warmed step, back to back -> ([(kernel name, ms)] of the first call in start
    order, timing, the GPU plane's line names, [(XLA op, ms)] of the first call). timing: layer_ms =
    `time_jax` of the step (untraced); per call busy_ms (the union of kernel intervals) and span_ms
    (first start to last end over all calls); gaps_us (the first call's idle time between its kernels) and its
    largest gaps. hlo_out: also write the compiled step's HLO there."""
    grad, params, x = build(tokens, config)
    layer_ms = time_jax(grad, [(params, x)])
    events, ops, names = trace_events(grad, (params, x), calls)
    busy = union_ms([(s0, s0 + d) for s0, d, _ in events]) / calls
    span = (max(s0 + d for s0, d, _ in events) - events[0][0]) / 1e6 / calls if events else 0.0
    first = len(events) // calls
    gaps = sorted(((events[i + 1][0] - events[i][0] - events[i][1]) / 1e3, events[i][2], events[i + 1][2])
                  for i in range(first - 1))[::-1]
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(grad.lower(params, x).compile().as_text())
    timing = dict(layer_ms=layer_ms, busy_ms=busy, span_ms=span, gaps_us=sum(g for g, _, _ in gaps),
                  largest_gaps=[(round(g, 2), short(a), short(b)) for g, a, b in gaps[:12]])
    return ([(name, d / 1e6) for _, d, name in events[:first]], timing, names,
            [(name, round(d / 1e6, 4)) for _, d, name in ops[:len(ops) // calls]])


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


def profile_ncu(tokens: int, config: str, timeout: float) -> tuple[list[tuple[str, float]], dict]:
    """This module run under ncu on one shape (the child profiles one warmed step) -> (kernels, extra fields)."""
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--profile-from-start", "off", "--metrics", "gpu__time_duration.sum", "--csv", "--print-units", "base",
           "--clock-control", "none", "--cache-control", "none", sys.executable, "-m", "bench.tools.profile_layer",
           "--child", str(tokens), config]
    p = run_group(cmd, timeout)
    kernels = parse(p.stdout)
    return kernels, dict(tool="ncu", **({} if kernels else {"error": f"ncu rc={p.returncode}: "
                                                                     f"{(p.stderr or p.stdout)[-600:]}"}))


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 81920])
    ap.add_argument("--configs", nargs="+", default=["384/4/256"])
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds per shape under ncu (compiling under ncu is slow); past it, an error record")
    ap.add_argument("--tool", choices=("jax", "ncu"), default="jax")
    ap.add_argument("--calls", type=int, default=5, help="--tool jax: traced calls per shape (times are per call)")
    ap.add_argument("--hlo", default=None, help="--tool jax: write each step's compiled HLO to HLO-<shape>.txt")
    ap.add_argument("--child", nargs=2, default=None, metavar=("TOKENS", "CONFIG"),
                    help="(internal: the process ncu profiles)")
    args = ap.parse_args(argv)
    if args.child:
        child(int(args.child[0]), args.child[1])
        return
    with JsonLines(args.out) as emit:
        for tokens, config in ((t, c) for t in args.tokens for c in args.configs):
            if args.tool == "jax":
                hlo = f"{args.hlo}-{tokens}-{config.replace('/', '-')}.txt" if args.hlo else None
                kernels, timing, lines, ops = jax_trace(tokens, config, args.calls, hlo)
                extra = dict(tool="jax", calls=args.calls, **timing, lines=lines, xla_ops=ops)
            else:
                kernels, extra = profile_ncu(tokens, config, args.timeout)
            groups: dict[str, list[float]] = {}
            for name, ms in kernels:
                groups.setdefault(short(name), []).append(ms)
            ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
            rec = emit(dict(bench="layer_profile", device=jax.devices()[0].device_kind, date=today(),
                            params=dict(tokens=tokens, config=config), launches=len(kernels),
                            total_ms=sum(ms for _, ms in kernels),
                            kernels=[dict(name=n, count=len(v), ms=sum(v)) for n, v in ranked],
                            sequence=[(short(n), round(ms, 4)) for n, ms in kernels], **extra))
            print(f"\n{tokens} tokens {config}: {len(kernels)} launches, {rec['total_ms']:.3f} ms of kernels")
            for n, v in ranked[:25]:
                print(f"  {sum(v):8.3f} ms  x{len(v):<3} {n[:90]}")
            if "span_ms" in extra:
                print(f"  timed {extra['layer_ms']:.3f} ms; busy {extra['busy_ms']:.3f} ms, span "
                      f"{extra['span_ms']:.3f} ms per call; gaps in the first call {extra['gaps_us']:.0f} us, "
                      f"largest {extra['largest_gaps'][:4]}")


if __name__ == "__main__":
    main()
