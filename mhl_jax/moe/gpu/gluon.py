"""Gluon kernels (`triton.experimental.gluon`) through jax-triton.

jax-triton 0.3.1 compiles every kernel as Triton source: `ASTSource` -> TTIR -> `make_ttir` / `make_ttgir` ->
LLVM -> PTX. A Gluon kernel is written at the TTGIR level (explicit layouts, shared memory, mbarriers, warp
specialisation): its IR comes from `GluonASTSource.make_ir` (which also sets the module's target, warp count
and register limit), and the backend's `gluon_to_ttgir` replaces `make_ttir` + `make_ttgir`; from there on
the two paths are the same. `install` routes jax-triton's two compile steps accordingly for Gluon kernels
(Triton kernels take jax-triton's own path unchanged) and adds a kernel's `mhl_compile_options` (e.g. the
`maxnreg` a warp-specialised kernel needs) to the options it compiles with; a warp-specialised kernel is
launched with the warps of all its partitions (jax-triton would launch `num_warps`, those of the default
partition only: CUDA_ERROR_INVALID_VALUE). `compile_gluon` is the same compilation by itself (no GPU needed;
the CPU tests use it).

Global scratch (`redirect_global_scratch`): Triton appends two hidden pointer parameters to every kernel, global and
profile scratch, and a kernel that makes TMA descriptors on the device (`tma.make_tensor_descriptor`) writes them into
its program's slice of the global scratch. jaxlib's launcher passes null pointers for both (jaxlib/gpu/
triton_kernels.cc, `KernelCall::Launch`), so such a kernel must say `fn.mhl_global_scratch = bytes per program` and
take a buffer of programs x that many bytes as its last parameter (the custom call's last output): its PTX then
reads the scratch pointer from that parameter. A kernel that needs scratch without saying so does not compile here.
"""

from __future__ import annotations

import dataclasses
import re
from types import ModuleType

from mhl_jax.moe.plan import hopper_sms, import_jax_triton

__all__ = ["compile_gluon", "gluon_call", "hopper_sms", "install"]  # hopper_sms: the plan's, read here by the router


def is_gluon(fn) -> bool:
    return bool(getattr(fn, "is_gluon", lambda: False)())


def with_kernel_options(options, fn):
    """Backend options plus the kernel's own (`fn.mhl_compile_options`, e.g. {"maxnreg": 168})."""
    extra = getattr(fn, "mhl_compile_options", None) or {}
    return dataclasses.replace(options, **extra) if extra else options


def gluon_ir(fn, src, target, options, codegen_fns, module_map, context):
    """TTGIR-level module of Gluon kernel `fn` for the signature / constants / attributes of `src` (an ASTSource
    as jax-triton builds it)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    gsrc = GluonASTSource(fn, signature=src.signature, constexprs=src.constants, attrs=src.attrs)
    return gsrc.make_ir(target, options, codegen_fns, module_map, context)


class _GluonStages:
    """A CUDA backend whose TTIR -> TTGIR stages are the Gluon ones (jax-triton calls make_ttir, make_ttgir).
    Keeps the warp count the LLVM stage reports: a warp-specialised kernel runs its worker partitions in warps
    beyond `num_warps`, and must be launched with all of them."""

    def __init__(self, backend, scratch_per_program: int = 0):
        self._backend = backend
        self._scratch = scratch_per_program
        self.num_warps = None

    def make_ptx(self, src, metadata, options, capability):
        ptx = self._backend.make_ptx(src, metadata, options, capability)
        return redirect_global_scratch(ptx, metadata["name"], metadata.get("global_scratch_size", 0), self._scratch)

    def make_llir(self, mod, metadata, options, capability):
        llir = self._backend.make_llir(mod, metadata, options, capability)
        self.num_warps = metadata.get("num_warps")
        return llir

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def make_ttir(self, mod, metadata, options, capability):
        return mod

    def make_ttgir(self, mod, metadata, options, capability):
        return self._backend.gluon_to_ttgir(mod, metadata, options, capability)


def redirect_global_scratch(ptx: str, name: str, needed: int, per_program: int) -> str:
    """The PTX of kernel `name` reading its global-scratch pointer from its last own parameter instead of the hidden
    one jaxlib passes as null (module docstring). needed: the compiled kernel's scratch bytes per program (Triton's
    metadata); per_program: what the kernel's `mhl_global_scratch` says its buffer holds per program (0: none). No
    scratch needed: the PTX unchanged. Raises ValueError naming the kernel where the buffer is missing or small."""
    if needed == 0:
        return ptx
    if needed > per_program:
        raise ValueError(f"Gluon kernel {name} needs {needed} bytes of global scratch per program (device-made TMA "
                         f"descriptors) and declares {per_program} (mhl_global_scratch); jaxlib launches Triton "
                         "kernels with a null global scratch, so the kernel must take a buffer of programs x that "
                         "many bytes as its last parameter and set mhl_global_scratch to its bytes per program")
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\(([^)]*)\)", ptx)
    params = sorted({int(i) for i in re.findall(rf"\b{re.escape(name)}_param_(\d+)\b", entry.group(1))}) if entry \
        else []
    if len(params) < 3 or params != list(range(len(params))):
        raise ValueError(f"Gluon kernel {name}: expected its own parameters and the two hidden scratch pointers in "
                         f"the PTX entry, found parameters {params}")
    hidden, own = f"[{name}_param_{len(params) - 2}]", f"[{name}_param_{len(params) - 3}]"
    ptx, loads = re.subn(rf"(ld\.param\.\w+\s+%\w+,\s*){re.escape(hidden)}", lambda m: m.group(1) + own, ptx)
    if not loads:
        raise ValueError(f"Gluon kernel {name} needs global scratch but its PTX never loads {hidden}")
    return ptx


HOOKS = ("code_gen", "compile_ttir_inplace", "triton_kernel_call_lib")  # jax_triton.triton_lib names it replaces


def install(jt: ModuleType) -> None:
    """Let `jt.triton_call` (jax_triton, imported) run Gluon kernels. Idempotent. Raises RuntimeError (naming
    the jax-triton version) if its internals are not the ones this bridge was written against (0.3.1)."""
    lib = jt.triton_lib
    if getattr(lib, "_mhl_gluon_bridge", False):
        return
    missing = [name for name in HOOKS if not hasattr(lib, name)]
    if missing:
        raise RuntimeError(f"mhl_jax.moe.gpu.gluon: jax-triton {getattr(jt, '__version__', '?')} has no "
                           f"triton_lib.{', '.join(missing)}; the Gluon bridge was written for jax-triton 0.3.1")
    from triton.backends.compiler import GPUTarget

    code_gen, compile_ttir, call_lib = lib.code_gen, lib.compile_ttir_inplace, lib.triton_kernel_call_lib
    gluon_modules: dict[int, object] = {}  # id(module) -> options with the kernel's own, until compiled
    launch_warps: dict[str, int] = {}  # kernel name -> warps to launch with (all partitions')

    class CodeGen:
        """jax-triton's `code_gen` with `ast_to_ttir` routing Gluon kernels to their own IR builder."""

        def __getattr__(self, name):
            return getattr(code_gen, name)

        @staticmethod
        def ast_to_ttir(fn, src, *, options, codegen_fns, context, module_map):
            if not is_gluon(fn):
                return code_gen.ast_to_ttir(fn, src, options=options, codegen_fns=codegen_fns, context=context,
                                            module_map=module_map)
            options = with_kernel_options(options, fn)
            target = GPUTarget("cuda", lib.triton_kernel_call_lib.get_compute_capability(0), 32)
            module = gluon_ir(fn, src, target, options, codegen_fns, module_map, context)
            gluon_modules[id(module)] = options, getattr(fn, "mhl_global_scratch", 0)
            return module

    def compile_ttir_inplace(ttir, backend, options, compute_capability, platform):
        gluon = gluon_modules.pop(id(ttir), None)
        if gluon is None:
            return compile_ttir(ttir, backend, options, compute_capability, platform)
        gluon_options, scratch = gluon
        stages = _GluonStages(backend, scratch)
        result = compile_ttir(ttir, stages, gluon_options, compute_capability, platform)
        if stages.num_warps:
            launch_warps[result.name] = stages.num_warps
        return result

    class KernelCallLib:
        """jax-triton's `triton_kernel_call_lib` launching Gluon kernels with every partition's warps."""

        def __getattr__(self, name):
            return getattr(call_lib, name)

        @staticmethod
        def TritonKernel(name, num_warps, *args):  # noqa: N802 (jaxlib's name)
            return call_lib.TritonKernel(name, launch_warps.get(name, num_warps), *args)

    lib.code_gen = CodeGen()
    lib.compile_ttir_inplace = compile_ttir_inplace
    lib.triton_kernel_call_lib = KernelCallLib()
    lib._mhl_gluon_bridge = True


def compile_gluon(fn, signature: dict, constexprs: dict, attrs: dict, num_warps: int, capability: int = 90) -> dict:
    """Compile Gluon kernel `fn` for sm_`capability` as `install` does under jax-triton (no GPU needed): its
    ptx, ttgir, shared memory bytes, name, and the warps `install` launches it with."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    options = with_kernel_options(backend.parse_options({"num_warps": num_warps}), fn)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    module = gluon_ir(fn, src, target, options, backend.get_codegen_implementation(options),
                      backend.get_module_map(), context)
    stages = _GluonStages(backend, getattr(fn, "mhl_global_scratch", 0))
    metadata: dict = {}
    ttgir = stages.make_ttgir(stages.make_ttir(module, metadata, options, capability), metadata, options, capability)
    ttgir_text = str(ttgir)
    llir = stages.make_llir(ttgir, metadata, options, capability)
    ptx = stages.make_ptx(llir, metadata, options, capability)
    return dict(ptx=ptx, ttgir=ttgir_text, shared=metadata.get("shared"), name=metadata.get("name"),
                launch_warps=stages.num_warps)


def gluon_call(*args, kernel, out_shape, programs: int, **constexprs):
    """A persistent warp-specialised Gluon kernel (kernels/gluon/) through jax-triton with this bridge installed:
    `programs` programs, four warps per partition."""
    jt = import_jax_triton()
    install(jt)
    return jt.triton_call(*args, kernel=kernel, out_shape=out_shape, grid=(programs,), num_warps=4, num_stages=1,
                          **constexprs)
