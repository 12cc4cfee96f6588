"""Shared test setup: 8 host devices for the parallel tests, the gpu marker skips without a GPU."""

import os

# Must be set before jax is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Without a GPU the Triton kernels run under the interpreter. Set it here, before any test module
# imports a kernel module: @triton.jit decorates at import, so the first importer decides (running
# tests/kernels/test_kernels_in_model.py before tests/kernels/test_router_kernel.py in one process failed otherwise).
if os.environ.get("MHL_TEST_GPU") != "1" and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        import jax

        return jax.default_backend() == "gpu"
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
