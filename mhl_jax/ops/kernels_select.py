"""Resolve the `ffn.kernels` switch (auto | triton | reference) to a concrete implementation."""

from __future__ import annotations

import os
import tempfile
from types import ModuleType

import jax


def import_jax_triton() -> ModuleType:
    """Import jax_triton and undo its side effect: its import sets TRITON_CACHE_DIR="" for the whole
    process (DESIGN §6), which later breaks torch.compile / FlexAttention ("Could not create or
    locate cache dir"). Puts back the previous value, else $MHL_TRITON_CACHE, else a fresh folder."""
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = before or os.environ.get("MHL_TRITON_CACHE") or tempfile.mkdtemp(
            prefix="triton-cache-")
    return jax_triton


def triton_available() -> bool:
    """True when JAX runs on a GPU and jax-triton imports."""
    if jax.default_backend() != "gpu":
        return False
    try:
        import_jax_triton()
    except Exception:  # jax-triton raises at import without a GPU jaxlib
        return False
    return True


def resolve_kernels(choice: str) -> str:
    """'auto' -> 'triton' on a GPU with jax-triton, else 'reference'. 'triton' without one is an error."""
    if choice == "reference":
        return "reference"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("ffn.kernels='triton' needs a GPU JAX backend and jax-triton; "
                               f"backend is {jax.default_backend()!r}. Use ffn.kernels=auto or reference.")
        return "triton"
    if choice == "auto":
        return "triton" if triton_available() else "reference"
    raise ValueError(f"ffn.kernels={choice!r}: expected auto, triton or reference")
