"""Shared test setup: 8 host devices for the parallel tests; GPU or not decided here, once.

With a GPU the Triton kernels run compiled and `gpu`-marked tests run; without one the kernels run under the
Triton interpreter and `gpu`-marked tests are skipped. The interpreter must be chosen before any kernel module
is imported (`@triton.jit` reads TRITON_INTERPRET when it decorates), so it is set here, at collection start,
from whether JAX sees a GPU.
"""

import os

# Must be set before jax initialises its backends anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Many tests (and the train.py runs they start) compile the same train steps: JAX's persistent compilation cache,
# shared by the xdist workers and the subprocesses through the environment, compiles each once. Entries are keyed by
# the program and the compiler options, so a cached executable is the one a fresh compile would give. Only compiles
# of a second or more are kept (JAX's default): caching the thousands of small ones costs more than it saves. No size
# limit: with one, JAX scans the whole directory under a lock at every write.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))

# On the CPU, XLA's optimisation passes cost more than they save: the tests compile hundreds of small programs and run
# each a few times, and what they check (results against independent references, bitwise repeatability between runs
# compiled alike) does not depend on those passes. Without them the suite takes about a third less time. Set through
# the environment so that train.py subprocesses compile alike; a GPU keeps its optimised programs (below).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

HAS_GPU = jax.default_backend() == "gpu"
if HAS_GPU:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    jax.config.update("jax_disable_most_optimizations", False)
else:
    os.environ["TRITON_INTERPRET"] = "1"

from tests.models import emulate_kernels  # noqa: E402  (after the interpreter is chosen)


@pytest.fixture
def emulated(monkeypatch):
    """The Triton bindings through their `emulate` backend (tests.models.emulate_kernels)."""
    emulate_kernels(monkeypatch)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(
        reason="needs an NVIDIA GPU (on a GPU machine: python -m pytest -m gpu, or bench/gpu.sh tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
