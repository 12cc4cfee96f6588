"""The Gluon bridge (`mhl_jax.moe.gpu.gluon`): Gluon kernels compiled and launched through jax-triton. Its PTX rewrite
of the global-scratch pointer and its routing of jax-triton's compile and launch run on a CPU (the Triton compiler
targets sm_90 without a GPU); a kernel with global scratch through JAX runs on a GPU (marker gpu).
"""

import os

import numpy as np
import pytest

pytest.importorskip("triton")


def test_redirect_global_scratch_rewrites_the_one_load():
    """`gluon_bridge.redirect_global_scratch` on a hand-written PTX entry (own parameters 0..2, hidden 3 and 4): the
    hidden global-scratch load reads parameter 2 instead; no scratch needed: unchanged; a kernel declaring too little,
    or whose PTX never loads the hidden pointer, gets an error naming it."""
    from mhl_jax.moe.gpu.gluon import redirect_global_scratch

    params = ",\n".join(f"\t.param .u64 .ptr .global .align 1 k_param_{i}" for i in range(5))
    body = "ld.param.b64 \t%rd1, [k_param_0];\n\tld.param.b64 \t%rd9, [k_param_3];\n\tld.param.b64 %rd7, [k_param_3];"
    ptx = f".visible .entry k(\n{params}\n)\n{{\n\t{body}\n}}"
    assert redirect_global_scratch(ptx, "k", 0, 0) == ptx
    out = redirect_global_scratch(ptx, "k", 128, 256)
    assert "[k_param_3]" not in out and out.count("[k_param_2]") == 2 and "[k_param_0]" in out
    assert out.replace("[k_param_2]", "[k_param_3]") == ptx  # nothing else touched
    with pytest.raises(ValueError, match="k needs 128 bytes of global scratch per program .* declares 64"):
        redirect_global_scratch(ptx, "k", 128, 64)
    with pytest.raises(ValueError, match="never loads"):
        redirect_global_scratch(ptx.replace("[k_param_3]", "[k_param_1]"), "k", 128, 128)


@pytest.mark.gpu
def test_gpu_gluon_kernel_with_global_scratch():
    """A Gluon kernel that makes its TMA descriptor on the device, through jax-triton with the bridge (its global
    scratch from its last parameter, an int8 output of programs x 128 bytes): each program stores the input tile at
    its rows by TMA; the output is the tile repeated, bitwise."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU JAX backend")
    from mhl_jax.moe.gpu.gluon import gluon_call
    from tests.kernels.gluon_bridge_check import tma_store_kernel

    fn = tma_store_kernel()
    fn.mhl_global_scratch = 128
    programs = 4
    x = jnp.arange(32 * 32, dtype=jnp.float32).reshape(32, 32) / 7
    out, _ = jax.jit(lambda x: gluon_call(
        x, kernel=fn, out_shape=[jax.ShapeDtypeStruct((programs * 32, 32), jnp.float32),
                                 jax.ShapeDtypeStruct((programs * 128,), jnp.int8)],
        programs=programs, N=programs * 32))(x)
    np.testing.assert_array_equal(np.asarray(out), np.tile(np.asarray(x), (programs, 1)))


def test_gluon_bridge_routes_jax_triton_compile_and_launch():
    """`gluon_bridge.install` on a stand-in for jax-triton's internals with the real Triton compiler behind it
    (tests/kernels/gluon_bridge_check.py, in a process of its own: kernels compiled, not interpreted)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, os.path.join(root, "tests", "kernels", "gluon_bridge_check.py")], env=env,
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.stdout[-2000:], p.stderr[-3000:])
