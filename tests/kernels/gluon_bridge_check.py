"""Run by tests/kernels/test_gluon_bridge.py in a process of its own (kernels compiled for sm_90 on the CPU, not
interpreted). `gluon_bridge.install` on a stand-in for jax-triton's `triton_lib` with the real Triton compiler behind it
(only jaxlib's kernel object is recorded instead of built): a Triton kernel goes through jax-triton's own
compile step untouched; the warp-specialised Gluon forward gets its IR from the Gluon builder, its
TTIR -> TTGIR stages replaced by `gluon_to_ttgir`, maxnreg 168, and is launched with all 12 warps of its
three partitions (jax-triton alone would launch the 4 it is called with: CUDA_ERROR_INVALID_VALUE on H100).
A Gluon kernel that makes a TMA descriptor on the device needs global scratch: without `mhl_global_scratch` it does
not compile; with it, its PTX reads the scratch pointer from its last own parameter (not the hidden one jaxlib passes
as null) and ptxas assembles it."""

import inspect
import os
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.pop("TRITON_INTERPRET", None)


def main() -> None:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import code_generator
    from triton.compiler.compiler import ASTSource, make_backend

    from kernels.gluon.experts_fwd import fwd_constexprs, gluon_expert_fwd_ws_kernel
    from kernels.triton.experts import expert_fwd_kernel
    from mhl_jax.moe.gpu import gluon as gluon_bridge

    calls = []

    def compile_ttir_inplace(ttir, backend, options, capability, platform):  # jax-triton's CUDA path, shortened
        md = {}
        ttgir = backend.make_ttgir(backend.make_ttir(ttir, md, options, capability), md, options, capability)
        ptx = backend.make_ptx(backend.make_llir(ttgir, md, options, capability), md, options, capability)
        calls.append((type(backend).__name__, options.maxnreg))
        return types.SimpleNamespace(name=md["name"], binary=ptx)

    call_lib = types.SimpleNamespace(get_compute_capability=lambda device: 90,
                                     TritonKernel=lambda name, num_warps, *rest: (name, num_warps))
    lib = types.SimpleNamespace(code_gen=code_generator, compile_ttir_inplace=compile_ttir_inplace,
                                triton_kernel_call_lib=call_lib)
    jt = types.SimpleNamespace(triton_lib=lib, __version__="stand-in")
    gluon_bridge.install(jt)
    gluon_bridge.install(jt)  # idempotent: one layer of wrapping
    assert lib._mhl_gluon_bridge and lib.compile_ttir_inplace.__name__ == "compile_ttir_inplace"

    backend = make_backend(GPUTarget("cuda", 90, 32))
    pointer_types = {"row_slot_ptr": "*i32", "block_group_ptr": "*i32", "group_block_start_ptr": "*i32",
                     "group_nblocks_ptr": "*i32"}

    def build(fn, consts, types_=None):  # what jax-triton's get_or_create_triton_kernel does, for one kernel
        params = list(inspect.signature(fn.fn).parameters)
        ptypes = types_ or pointer_types
        signature = {p: "constexpr" if p in consts else ptypes.get(p, "*bf16") for p in params}
        attrs = {} if types_ else {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in consts}
        options = backend.parse_options({"num_warps": 4, "num_stages": 3})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = lib.code_gen.ast_to_ttir(fn, ASTSource(fn, signature=signature, constexprs=consts, attrs=attrs),
                                          options=options, codegen_fns=backend.get_codegen_implementation(options),
                                          context=context, module_map=backend.get_module_map())
        result = lib.compile_ttir_inplace(module, backend, options, 90, "cuda")
        return lib.triton_kernel_call_lib.TritonKernel(result.name, 4, 1, 0, result.binary), result.binary

    kernel, ptx = build(expert_fwd_kernel, dict(K=4, DH=128, DE=256, PACK_BLOCK=128, BLOCK_M=128, BLOCK_E=32,
                                                FAST_TANH=True, PRECISION="tf32"))
    assert kernel == ("expert_fwd_kernel", 4) and calls[-1] == ("CUDABackend", None)
    kernel, ptx = build(gluon_expert_fwd_ws_kernel, fwd_constexprs(4, 128, 256, 64, 100, 128))
    assert kernel == ("gluon_expert_fwd_ws_kernel", 12) and calls[-1] == ("_GluonStages", 168)
    assert ".reqntid 384" in ptx and ".maxnreg 168" in ptx

    check_global_scratch(build)

    try:
        gluon_bridge.install(types.SimpleNamespace(triton_lib=types.SimpleNamespace(), __version__="old"))
        raise AssertionError("install accepted a jax-triton without the internals it replaces")
    except RuntimeError as e:
        assert "jax-triton old has no triton_lib.code_gen" in str(e), e
    print("ok")


def tma_store_kernel():
    """A kernel storing a (32, 32) fp32 tile through a device-made TMA descriptor; scratch_ptr: its global scratch."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

    @gluon.jit
    def tma_store_probe_kernel(x_ptr, out_ptr, scratch_ptr, N: gl.constexpr):
        lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, 32], gl.float32)
        desc = tma.make_tensor_descriptor(out_ptr, [N, 32], [32, 1], [32, 32], lay)
        smem = gl.allocate_shared_memory(gl.float32, [32, 32], lay)
        bl: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
        r = gl.arange(0, 32, layout=gl.SliceLayout(1, bl))
        c = gl.arange(0, 32, layout=gl.SliceLayout(0, bl))
        smem.store(gl.load(x_ptr + r[:, None] * 32 + c[None, :]))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [gl.program_id(0) * 32, 0], smem)
        tma.store_wait(0)

    return tma_store_probe_kernel


def check_global_scratch(build) -> None:
    from bench.tools.kernel_report import _ptxas_report
    from mhl_jax.moe.gpu import gluon as gluon_bridge

    fn = tma_store_kernel()
    consts = dict(N=1024)
    types_ = {"x_ptr": "*fp32", "out_ptr": "*fp32", "scratch_ptr": "*i8"}
    for declared, message in ((None, "tma_store_probe_kernel needs 128 bytes of global scratch per program"),
                              (64, "declares 64")):  # none declared, too little declared: no compile
        if declared:
            fn.mhl_global_scratch = declared
        try:
            build(fn, consts, types_)
            raise AssertionError(f"a kernel needing global scratch compiled with mhl_global_scratch={declared}")
        except ValueError as e:
            assert message in str(e), e
    fn.mhl_global_scratch = 128
    _, ptx = build(fn, consts, types_)
    name = "tma_store_probe_kernel"
    # its own parameters 0..2 (x, out, scratch), the hidden global / profile scratch 3 and 4
    assert re.findall(rf"{name}_param_(\d+)", ptx.split(")")[0]) == ["0", "1", "2", "3", "4"], ptx[:800]
    assert not re.search(rf"ld\.param\.\w+\s+%\w+,\s*\[{name}_param_3\]", ptx)
    assert re.search(rf"ld\.param\.\w+\s+%\w+,\s*\[{name}_param_2\]", ptx)
    assert "tensormap.cp_fenceproxy" in ptx
    assert _ptxas_report(fn, ptx, "", 0)["registers"] > 0  # ptxas assembles it for sm_90a (raises if not)
    # what the jax-triton path compiles, compile_gluon compiles the same way
    again = gluon_bridge.compile_gluon(fn, dict(types_, N="constexpr"), consts, {}, num_warps=4)
    assert again["ptx"] == ptx


if __name__ == "__main__":
    main()
