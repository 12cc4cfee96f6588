"""The kernel modules a CPU test runs under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).

`@triton.jit` reads TRITON_INTERPRET when it decorates, so a kernel module that another module of this process
imported first (compiled, for a GPU test's binding) is imported again here, and so are the launchers that hold its
kernels."""

from __future__ import annotations

import importlib
import os

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="interpreter test (CPU)")


def interpreted(kernel_module: str, *launchers: str):
    """The module named kernel_module, then each launcher module, as the interpreter runs them when INTERPRET (the
    kernel module reloaded if it holds a compiled kernel, the launchers reloaded to bind it); as imported otherwise."""
    mod = importlib.import_module(kernel_module)
    if INTERPRET and any(type(v).__name__ == "JITFunction" for v in vars(mod).values()):
        mod = importlib.reload(mod)
    return (mod, *(importlib.reload(importlib.import_module(m)) if INTERPRET else importlib.import_module(m)
                   for m in launchers))
