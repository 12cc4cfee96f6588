"""Compile the expert kernels for Hopper (sm_90a) without a GPU and report what ptxas made of each tile:
registers, spill bytes, shared memory, and a count of the instructions that matter (HGMMA, FFMA, FMUL,
FADD, MUFU.TANH, local loads / stores). Costs no device time: the Triton wheel carries ptxas and
cuobjdump.

    python -m bench.tools.kernel_report [--tiles fwd,128,32,4,3 dx,64,32,4,3 dwt,64,64,4,3] [--dh 128] [--de 256]
    python -m bench.tools.kernel_report --tiles router,64,64,4,3,1 --ne 768 --k 8
        # the router forward: block_n, block_e, warps, stages, select[, row_tiles]
    python -m bench.tools.kernel_report --tiles fwd_ws --de 128   # the warp-specialised Gluon forward (fixed tile)
    python -m bench.tools.kernel_report --tiles dw_ws             # the warp-specialised Gluon weight gradients
    python -m bench.tools.kernel_report --tiles bwd_ws --de 128   # the warp-specialised fused backward (de 128)
    python -m bench.tools.kernel_report --tiles bwd_xw --de 128   # the same with the dX warp group (four warp groups)
    python -m bench.tools.kernel_report --tiles router_ws_cast --de 1536 --k 8   # the router forward with the caster

Pointers are marked 16-byte divisible as the launchers' arguments are (without that mark the gathered
row loads come out scalar and every tile spills). One JSON line per tile (`bench: kernel_report`).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

from bench.common import JsonLines

DEFAULT_TILES = ["fwd,128,32,4,3", "dx,64,32,4,3", "dwt,64,64,4,3"]
COUNTED = ("HGMMA", "FFMA", "FMUL", "FADD", "MUFU.TANH", "LDL", "STL", "BAR.SYNC", "SHFL.BFLY", "STS", "LDS")
POINTER_TYPES = {"gates_ptr": "*fp32", "dgate_ptr": "*fp32", "dw1_ptr": "*fp32", "dw2_ptr": "*fp32",
                 "acc1_ptr": "*fp32", "acc2_ptr": "*fp32", "part_ptr": "*fp32",
                 "row_slot_ptr": "*i32", "block_group_ptr": "*i32", "group_block_start_ptr": "*i32",
                 "group_nblocks_ptr": "*i32", "group_size_ptr": "*i32", "sched_ptr": "*i32"}  # every other: bf16


def report(kind: str, block_m: int, block_e: int, num_warps: int, num_stages: int, dh: int = 128, de: int = 256,
           k: int = 4, pack_block: int = 128) -> dict:
    """Compile kernel `kind` (fwd | dx | dwt, the model's launch options) and read ptxas' report."""
    import kernels.triton.experts as ke

    fn = {"fwd": ke.expert_fwd_kernel, "dx": ke.expert_dx_kernel, "dwt": ke.expert_dwt_kernel,
          "dw": ke.expert_dw_kernel}[kind]
    consts = dict(K=k, DH=dh, DE=de, PACK_BLOCK=pack_block, BLOCK_M=block_m, BLOCK_E=block_e, FAST_TANH=True,
                  PRECISION="tf32", FUSE_DX=kind == "dwt" and block_e == de, PACKED=False,
                  DGATES=kind == "dx" or (kind == "dwt" and block_e == de))  # as the binding launches them
    rec = _compile_report(fn, consts, num_warps, num_stages)
    return dict(bench="kernel_report", kernel=kind, tile=[block_m, block_e, num_warps, num_stages],
                params=dict(dh=dh, de=de, k=k, pack_block=pack_block), **rec)


def report_router(block_n: int, block_e: int, num_warps: int, num_stages: int, select: int, row_tiles: int = 1,
                  dh: int = 128, ne: int = 768, k: int = 8, heads: int = 8, tokens: int = 81920) -> dict:
    """Compile the router forward (bf16x3 weights, as the model launches it) and read ptxas' report."""
    import kernels.triton.router as kr

    kp = max(2, kr.next_pow2(k))
    consts = dict(N=tokens, H=heads, DH=dh, DHP=kr.next_pow2(dh), NE=ne, K=k, KP=kp, PARTS=3, PRECISION="ieee",
                  BLOCK_N=block_n, BLOCK_E=block_e, SELECT=select, UPCAST=False,
                  ROW_TILES=row_tiles)
    rec = _compile_report(kr.router_fwd_kernel, consts, num_warps, num_stages,
                          pointer_types={"b_ptr": "*fp32", "vals_ptr": "*fp32", "idx_ptr": "*i32"})
    return dict(bench="kernel_report", kernel="router", params=dict(dh=dh, ne=ne, k=k),
                tile=[block_n, block_e, num_warps, num_stages, select, row_tiles], **rec)


def _signature(fn, consts: dict, pointer_types: dict) -> tuple[dict, dict]:
    """Signature (pointers typed, the rest constexpr) and 16-byte divisibility marks, as the launchers pass them."""
    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in consts else pointer_types.get(p, "*bf16") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in consts}
    return signature, attrs


def _compile_report(fn, consts: dict, num_warps: int, num_stages: int, pointer_types: dict | None = None) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer_types = POINTER_TYPES if pointer_types is None else pointer_types
    signature, attrs = _signature(fn, consts, pointer_types)
    src = ASTSource(fn=fn, signature=signature, constexprs={p: v for p, v in consts.items() if p in signature},
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return _ptxas_report(fn, compiled.asm["ptx"], compiled.asm["ttgir"], int(compiled.metadata.shared))


def report_ws(kind: str = "fwd_ws", dh: int = 128, de: int = 256, k: int = 4, pack_block: int = 128) -> dict:
    """Compile a warp-specialised Gluon kernel (kernels/gluon/experts_fwd.py: `fwd_ws` the forward;
    kernels/gluon/experts_bwd.py: `dw_ws` the weight gradients; kernels/gluon/experts_bwd_fused.py: `bwd_ws` the fused
    backward, `bwd_xw` the same with the dX warp group; kernels/gluon/router.py: `router_ws` the router forward, Ne =
    de) as the JAX binding does (mhl_jax.moe.gpu.gluon) and read ptxas' report (registers: the kernel's launch limit,
    maxnreg)."""
    from kernels import tuning
    from kernels.gluon import experts_bwd, experts_bwd_fused, experts_fwd
    from mhl_jax.moe.gpu.gluon import compile_gluon

    if kind == "fwd_ws":
        fn = experts_fwd.gluon_expert_fwd_ws_kernel
        consts = experts_fwd.fwd_constexprs(k, dh, de, 8 * 384, 4096, pack_block)
        tile = [pack_block, tuning.GLUON_FWD_BLOCK_E, 12, de // tuning.GLUON_FWD_BLOCK_E]
    elif kind == "dw_ws":
        fn, consts = experts_bwd.gluon_expert_dw_ws_kernel, experts_bwd.dw_ws_constexprs(k, dh, de, pack_block)
        tile = [tuning.GLUON_DW_BLOCK_M, 128, 12, tuning.GLUON_DW_STAGES]
    elif kind == "bwd_ws":  # the fused backward (de 128)
        fn = experts_bwd_fused.gluon_expert_bwd_ws_kernel
        consts = experts_bwd_fused.bwd_ws_constexprs(k, dh, de, pack_block)
        tile = [tuning.GLUON_DW_BLOCK_M, 128, 12, tuning.GLUON_BWD_STAGES]
    elif kind == "bwd_xw":  # the fused backward with the dX warp group
        fn = experts_bwd_fused.gluon_expert_bwd_xw_kernel
        consts = experts_bwd_fused.bwd_xw_constexprs(k, dh, de, pack_block)
        tile = [tuning.GLUON_DW_BLOCK_M, 128, 16, tuning.GLUON_XW_STAGES]
    elif kind in ("router_ws", "router_ws_cast"):  # the router forward at 81920 tokens x 8 heads, Ne = de, bf16x3
        import kernels.gluon.router as gr  # _cast: with the caster warp group (two consumers; the layer's expert
        # weights at de 128: 8 x Ne x 128 x 128 elements each)

        cast = kind == "router_ws_cast"
        consts = gr.ws_router_constexprs(81920, 8, dh, de, k, cast_n=8 * de * dh * 128 if cast else 0)
        fn = gr.ws_router_kernel(consts["NC"], cast)
        tile = [64 * consts["NC"], 64, 4 * (consts["NC"] + 1 + cast), consts["NST"]]
        pointer = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*fp32", "vals_ptr": "*fp32", "idx_ptr": "*i32",
                   "c1_ptr": "*fp32", "c2_ptr": "*fp32"}
    else:
        raise ValueError(f"kernel_report: warp-specialised kernel {kind!r}; expected fwd_ws, dw_ws, bwd_ws, "
                         "bwd_xw, router_ws or router_ws_cast")
    signature, attrs = _signature(fn, consts, pointer if kind.startswith("router_ws") else POINTER_TYPES)
    c = compile_gluon(fn, signature, consts, attrs, num_warps=4)
    rec = _ptxas_report(fn, c["ptx"], c["ttgir"], int(c["shared"]))
    rec["setmaxnreg"] = [int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", c["ptx"])]
    rec["warp_specialized"] = "ttg.warp_specialize" in c["ttgir"]
    rec["launch_warps"] = c["launch_warps"]  # all partitions' (the PTX requires exactly that many threads)
    rec["reqntid"] = [int(v) for v in re.findall(r"\.reqntid (\d+)", c["ptx"])]
    return dict(bench="kernel_report", kernel=kind, tile=tile, params=dict(dh=dh, de=de, k=k, pack_block=pack_block),
                **rec)


def ptxas_sass(ptx_text: str) -> tuple[str, str]:
    """PTX assembled for sm_90a by the Triton wheel's ptxas (no GPU): (ptxas -v's report, cuobjdump's SASS)."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(ptx_text)
        info = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    return info, sass


def _ptxas_report(fn, ptx_text: str, ttgir: str, shared: int) -> dict:
    info, sass = ptxas_sass(ptx_text)
    dump = os.environ.get("KERNEL_REPORT_DUMP")  # a directory: the TTGIR and SASS are written there
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ttgir", ttgir), ("sass", sass)):
            with open(os.path.join(dump, f"{fn.fn.__name__}.{ext}"), "w") as f:
                f.write(text)

    def num(pattern: str) -> int:
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    return dict(registers=num(r"Used (\d+) registers"), spill_store_bytes=num(r"(\d+) bytes spill stores"),
                spill_load_bytes=num(r"(\d+) bytes spill loads"), shared_bytes=shared,
                # ptxas' C7512 / C7515 "Potential Performance Loss: wgmma.mma_async instructions are serialized due to
                # ...": every wgmma of the kernel then waits for the one before (no MMA pipelining at all)
                wgmma_serialized="wgmma.mma_async instructions are serialized" in info,
                sass_instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
                sass_counts={op: len(re.findall(r"\b" + re.escape(op) + r"\b", sass)) for op in COUNTED},
                sass_partitions=sass_partitions(sass))


SETMAXNREG = re.compile(r"USETMAXREG\.(\w+)\.CTAPOOL(?: UP0,)? (0x[0-9a-f]+)")


def partition_name(sass: str) -> str | None:
    """The partition a register reconfiguration (USETMAXREG) starts, named by its kind and count ("try_alloc 208",
    "dealloc 32"); None for any other instruction."""
    m = SETMAXNREG.search(sass)
    return f"{m.group(1).lower()} {int(m.group(2), 16)}" if m else None


def sass_partitions(sass: str) -> list[dict]:
    """The SASS cut at its register reconfigurations (USETMAXREG, named as `partition_name` names them:
    a warp-specialised kernel's partitions, "setup" before the first): instructions and spill loads / stores
    (LDL / STL) in each, in address order."""
    parts = [dict(name="setup", instructions=0, spill_instructions=0)]
    for line in sass.splitlines():
        if not re.match(r"^\s+/\*[0-9a-f]{4,}\*/", line):
            continue
        name = partition_name(line)
        if name:
            parts.append(dict(name=name, instructions=0, spill_instructions=0))
        parts[-1]["instructions"] += 1
        parts[-1]["spill_instructions"] += bool(re.search(r"\b(LDL|STL)\b", line))
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", nargs="+", default=DEFAULT_TILES,
                    help="kind,block_m,block_e,warps,stages; router,block_n,block_e,warps,stages,select[,row_tiles]; "
                         "fwd_ws, dw_ws, bwd_ws, bwd_xw, router_ws, router_ws_cast")
    ap.add_argument("--dh", type=int, default=128)
    ap.add_argument("--de", type=int, default=256)
    ap.add_argument("--pack-block", type=int, default=128)
    ap.add_argument("--ne", type=int, default=768, help="router kind only")
    ap.add_argument("--k", type=int, default=None, help="top-k (default 4 for the experts, 8 for the router)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    emit = JsonLines(args.out)
    rows = []
    for spec in args.tiles:
        kind, *nums = spec.split(",")
        if kind in ("fwd_ws", "dw_ws", "bwd_ws", "bwd_xw", "router_ws", "router_ws_cast"):
            rec = report_ws(kind, dh=args.dh, de=args.de, k=args.k or (8 if kind.startswith("router_ws") else 4),
                            pack_block=args.pack_block)
        elif kind == "router":
            rec = report_router(*(int(v) for v in nums), dh=args.dh, ne=args.ne, k=args.k or 8)
        else:
            rec = report(kind, *(int(v) for v in nums), dh=args.dh, de=args.de, k=args.k or 4,
                         pack_block=args.pack_block)
        emit(rec)
        rows.append(rec)
    print(f"\n{'kernel':>6} {'tile':>16} {'regs':>5} {'spill B':>8} {'smem KB':>8}  sass")
    for r in rows:
        print(f"{r['kernel']:>6} {str(r['tile']):>16} {r['registers']:>5} {r['spill_store_bytes']:>8} "
              f"{r['shared_bytes'] / 1024:8.1f}  {r['sass_instructions']} {r['sass_counts']}")


if __name__ == "__main__":
    main()
