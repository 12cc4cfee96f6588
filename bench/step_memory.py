"""XLA's compiled memory of one train step, on CPU host devices: no GPU, nothing allocated (issue 7).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python bench/step_memory.py \\
        --config configs/moe_ep_2.2b.yaml --devices 4 [--kernels standin|reference] [--set key=value ...] \\
        [--top 12] [--out FILE]

Builds the step of `bench/train_scale.py` for `--devices` (the same config defaults: global batch 32,
micro-batch 4, all devices on the hp / ep axis) from abstract shapes, lowers and compiles it, and
prints XLA's memory analysis per device (arguments + outputs + temporaries - donated aliases, the
`mem_compiled_gib` of train_scale) and the largest buffers of the optimised HLO (outside fusions), so
a shape that would not fit a GPU is found before device time is spent on it.

--kernels reference: the pure-JAX ops (what runs on CPU). standin: the GPU path's ops as opaque
host callbacks with the outputs of the real ones and no temporaries: the grouped-GEMM expert launches
(`mhl_jax/moe/gpu/grouped.py`, experts wider than MAX_TRITON_EXPERT_WIDTH: MoE and LatentMoE at
d_model 1024; their routers are the reference there anyway) and, for Expert Parallel,
`lax.ragged_all_to_all` (XLA:CPU has none) with ep_impl ragged, as on a GPU. The fused kernels of
MH-LatentMoE have no stand-ins.

The figures are XLA:CPU's buffer assignment, not XLA:GPU's: CPU keeps more fp32 copies and attention
scores (no cuDNN), so they overstate the GPU's. Measured: moe_ep_2.2b on 1 device with stand-ins 65.1 GiB
here, 43.6 GiB compiled on an H100 (2026-11-23). Shapes are exact: a buffer listed here exists on the
GPU unless XLA:GPU fuses it away. `--set model.n_layers=3` (2 dense + 1 MoE layer) compiles in ~20 s on
2 cores; the 12-layer 2.2B step in ~30 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from bench.train_scale import DEFAULT_SETS, GIB, compiled_gib, run_config, state_init  # noqa: E402
from mhl_jax.config import Config  # noqa: E402
from mhl_jax.model.balancing import RouterBias  # noqa: E402
from mhl_jax.model.gpt import build_model  # noqa: E402
from mhl_jax.moe.plan import triton_expert_path  # noqa: E402
from mhl_jax.moe.router import MAX_TRITON_ROUTER_WIDTH  # noqa: E402
from mhl_jax.parallel.executors import make_executor  # noqa: E402
from mhl_jax.parallel.mesh import batch_spec, make_mesh, state_shardings  # noqa: E402
from mhl_jax.train.loop import accumulation_steps  # noqa: E402
from mhl_jax.train.optimizer import make_optimizer  # noqa: E402
from mhl_jax.train.schedule import make_schedule  # noqa: E402
from mhl_jax.train.step import jit_train_step  # noqa: E402

KERNELS = ("standin", "reference")
_ALIASES = ("bitcast", "get-tuple-element", "parameter", "tuple")  # no buffer of their own
_MULTI = ("custom-call", "fusion")  # ops whose tuple outputs are buffers (a while's tuple is its carry)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}


def _opaque(shapes: list, *operands):
    """Outputs of `shapes` from a host callback that reads `operands`: to XLA an opaque op, like a
    Triton custom call (never run here: the step is only compiled)."""
    return jax.pure_callback(lambda *_: tuple(np.zeros(s.shape, s.dtype) for s in shapes), tuple(shapes),
                             *operands)


def _rows_standin(st, a, gates, meta, w, *, a_mode, transpose_w, epi_gelu, hpre, out_dtype):
    """`experts_grouped._rows_triton`'s outputs: (P, N) and, with the gelu epilogue, a second (P, N)."""
    p, n = meta.row_slot.shape[0], (w.shape[1] if transpose_w else w.shape[2])
    shapes = [jax.ShapeDtypeStruct((p, n), out_dtype)] * (2 if epi_gelu else 1)
    out = _opaque(shapes, a, gates, meta.row_slot, meta.block_group, w, *([] if hpre is None else [hpre]))
    return tuple(out) if epi_gelu else out[0]


def _wgrad_standin(st, a, d, gates, meta, *, a_mode, d_mode, num_groups, dw_dtype, acc=None):
    """`experts_grouped._wgrad_triton`'s output: (G, I, J) (with acc, the running sums it adds into: read too; the
    kernel's aliasing of acc to the output is not modelled)."""
    shape = jax.ShapeDtypeStruct((num_groups, a.shape[1], d.shape[1]), dw_dtype)
    return _opaque([shape], a, d, gates, meta.row_slot, meta.group_block_start, meta.group_nblocks,
                   *([] if acc is None else [acc]))[0]


def _ragged_standin(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                    **kw):
    """`lax.ragged_all_to_all`'s output (the shape of `output`)."""
    shape = jax.ShapeDtypeStruct(output.shape, output.dtype)
    return _opaque([shape], operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)[0]


def _group_blocks_standin(group_sizes, block, num_blocks=None):
    """`packing_triton.group_blocks_triton`'s outputs: (first block, block count, first row) (G,) int32 and, with
    num_blocks, each block's group (num_blocks,)."""
    shapes = [jax.ShapeDtypeStruct(group_sizes.shape, jnp.int32)] * 3
    if num_blocks is not None:
        shapes.append(jax.ShapeDtypeStruct((num_blocks,), jnp.int32))
    return tuple(_opaque(shapes, group_sizes))


@contextlib.contextmanager
def standin_ops():
    """Within: the grouped experts' Triton launches (and the packing metadata's), and lax.ragged_all_to_all are the
    stand-ins."""
    from mhl_jax.moe.gpu import grouped as eg
    from mhl_jax.moe.gpu import packing as pt

    saved = eg._rows_triton, eg._wgrad_triton, jax.lax.ragged_all_to_all, pt.group_blocks_triton
    eg._rows_triton, eg._wgrad_triton, jax.lax.ragged_all_to_all = _rows_standin, _wgrad_standin, _ragged_standin
    pt.group_blocks_triton = _group_blocks_standin
    try:
        yield
    finally:
        eg._rows_triton, eg._wgrad_triton, jax.lax.ragged_all_to_all, pt.group_blocks_triton = saved


def check_standin(cfg: Config) -> None:
    """The stand-ins cover the grouped experts with the reference router: experts and routers wide."""
    f, m = cfg.ffn, cfg.model
    width = f.head_dim if f.kind == "mh_latent_moe" else f.latent_dim if f.kind == "latent_moe" else m.d_model
    route = f.head_dim if f.kind == "mh_latent_moe" else m.d_model
    if f.kind == "mlp" or triton_expert_path(width) != "grouped" or route <= MAX_TRITON_ROUTER_WIDTH:
        raise SystemExit(f"--kernels standin: {cfg.name} ({f.kind}, expert width {width}, router width {route}) "
                         f"runs the fused Triton kernels or router on a GPU; stand-ins exist only for the "
                         f"grouped experts with the reference router (MoE / LatentMoE at d_model 1024)")


def largest_buffers(hlo: str, top: int) -> list[dict]:
    """The `top` largest array values defined outside fused / wrapped computations of an optimised HLO
    module (fusion outputs count once, at the fusion; the outputs of multi-output fusions and custom
    calls each; bitcasts, tuples, loop carries and parameters are left out):
    size, shape, op, name."""
    out, comp = [], ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            continue
        if comp.startswith(("%fused", "%wrapped")):
            continue
        m = re.match(r"\s*(?:ROOT )?(%?[\w.\-]+) = (\w+\[[\d,]*\]|\([^()]*\))(?:\{[^}]*\})?\s+([\w\-]+)\(", line)
        if not m or m.group(3) in _ALIASES or (m.group(2).startswith("(") and m.group(3) not in _MULTI):
            continue
        name, shapes, op = m.groups()
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shapes):
            if dtype in _BYTES:
                size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _BYTES[dtype]
                out.append({"gib": size / GIB, "shape": f"{dtype}[{dims}]", "op": op, "name": name})
    return sorted(out, key=lambda r: -r["gib"])[:top]


def step_memory(cfg: Config, devices: list, kernels: str = "standin", top: int = 12) -> dict:
    """Compile `cfg`'s train step over `devices` from abstract shapes; XLA's memory analysis (GiB per
    device) and the largest buffers."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: expected one of {KERNELS}")
    mesh = make_mesh(cfg, devices)
    executor = make_executor(cfg, mesh)  # ffn.kernels auto: the reference ops on CPU
    ctx = contextlib.nullcontext()
    if kernels == "standin":
        check_standin(cfg)
        executor.impl = "triton"  # what ffn.kernels=auto resolves to on a GPU
        if hasattr(executor, "ep_impl"):
            executor.ep_impl = "ragged"
        ctx = standin_ops()
    graphdef, p_abs, b_abs = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed=0, executor=executor, mesh=mesh)),
                                       nnx.Param, RouterBias)
    tx = make_optimizer(cfg)
    state = jax.eval_shape(state_init(tx), p_abs, b_abs)
    sh = state_shardings(cfg, mesh, state)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sh)
    bsh = NamedSharding(mesh, batch_spec(mesh))
    accum = accumulation_steps(cfg, mesh.size)
    batch = jax.ShapeDtypeStruct((accum, cfg.train.micro_batch * mesh.size, cfg.model.context + 1), jnp.int32,
                                 sharding=bsh)
    step = jit_train_step(graphdef, tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule), sh, bsh,
                          donate=True)
    t0 = time.perf_counter()
    with ctx:
        compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    parts = {k: getattr(ma, f"{k}_size_in_bytes") / GIB for k in ("argument", "output", "temp", "alias")}
    return {"bench": "step_memory", "config": cfg.name, "devices": mesh.size, "mesh": dict(mesh.shape),
            "executor": repr(executor), "kernels": kernels, "accum": accum, "micro_batch": cfg.train.micro_batch,
            "n_layers": cfg.model.n_layers, "compile_s": compile_s,
            **{f"{k}_gib": v for k, v in parts.items()},
            "mem_compiled_gib": compiled_gib(ma),
            "largest": largest_buffers(compiled.as_text(), top)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/moe_ep_2.2b.yaml")
    ap.add_argument("--devices", type=int, nargs="+", default=[4], help="device counts (one compile each)")
    ap.add_argument("--kernels", choices=KERNELS, default="standin")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="config override, applied after the defaults " + " ".join(DEFAULT_SETS))
    ap.add_argument("--top", type=int, default=12, help="largest buffers to list")
    ap.add_argument("--out", default="", help="JSON lines file to append to")
    args = ap.parse_args()
    for n in args.devices:
        if n > len(jax.devices()):
            raise SystemExit(f"--devices {n}: only {len(jax.devices())} visible "
                             f"(XLA_FLAGS=--xla_force_host_platform_device_count={n})")
        cfg = run_config(args.config, [*DEFAULT_SETS, *args.overrides], n)
        rec = step_memory(cfg, jax.devices()[:n], args.kernels, args.top)
        print(f"# {rec['config']} x{n} {rec['executor']} ({args.kernels}), {rec['n_layers']} layers, accum "
              f"{rec['accum']}: compiled {rec['mem_compiled_gib']:.2f} GiB per device (arguments "
              f"{rec['argument_gib']:.2f}, temporaries {rec['temp_gib']:.2f}), compile {rec['compile_s']:.1f} s")
        for b in rec["largest"]:
            print(f"  {b['gib']:8.3f} GiB  {b['shape']:30s} {b['op']:20s} {b['name']}")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
