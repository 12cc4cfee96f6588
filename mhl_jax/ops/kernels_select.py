"""Resolve the `ffn.kernels` switch (auto | triton | reference) to a concrete implementation."""

from __future__ import annotations

import jax


def triton_available() -> bool:
    """True when JAX runs on a GPU and jax-triton imports."""
    if jax.default_backend() != "gpu":
        return False
    try:
        import jax_triton  # noqa: F401
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
