"""Which of the layer's kernels XLA records into command buffers (CUDA graphs) under the current XLA_FLAGS: the
compiled fwd+bwd's HLO, the custom calls (jax-triton kernels, cuBLAS) and fusions counted inside and outside
`command_buffer` computations. One JSON line per shape (bench/NOTES.md, Layer, Session 35).

    XLA_FLAGS=... python bench/cmdbuf_probe.py [--tokens 8192] [--configs 768/8/128] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.layer import D, expert_cfg, init_params, layer, resolve_router  # noqa: E402
from bench.timing import emit  # noqa: E402


def count_commands(hlo: str) -> dict:
    """Custom calls by target and fusions, split by whether their computation is a command buffer's."""
    out: dict = {"in_cmdbuf": {}, "outside": {}, "cmdbuf_computations": 0}
    comp = ""
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            comp = m.group(1)
            out["cmdbuf_computations"] += comp.startswith("command_buffer")
            continue
        where = "in_cmdbuf" if comp.startswith("command_buffer") else "outside"
        t = re.search(r'custom_call_target="([^"]+)"', line)
        key = t.group(1) if t else ("fusion" if " fusion(" in line else None)
        if key and not comp.startswith("fused_") and "wrapped_" not in comp:
            out[where][key] = out[where].get(key, 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--configs", nargs="+", default=["768/8/128"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    router = resolve_router("auto")
    outf = open(args.out, "a") if args.out else None
    for tokens in args.tokens:
        for c in args.configs:
            ne, k, de = (int(v) for v in c.split("/"))
            params = init_params(jax.random.key(0), ne, de)
            x = jax.random.normal(jax.random.key(1), (tokens, D), jnp.bfloat16)
            cfg = expert_cfg("default", tokens, ne, k, de)
            grad = jax.jit(jax.grad(lambda p, x, k=k, cfg=cfg: jnp.sum(layer(p, x, k, "triton", router, cfg).astype(
                jnp.float32) ** 2), argnums=(0, 1)))
            hlo = grad.lower(params, x).compile().as_text()
            emit(dict(bench="cmdbuf_probe", xla_flags=os.environ.get("XLA_FLAGS", ""),
                      params=dict(tokens=tokens, config=c), **count_commands(hlo)), outf)


if __name__ == "__main__":
    main()
