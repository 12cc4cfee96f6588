"""A fix for Triton 3.6's CPU interpreter, applied only under TRITON_INTERPRET=1."""

from __future__ import annotations

import os


def fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with int(array),
    which numpy >= 2.4 rejects: a loop bound loaded from memory (`range(0, n)`) then fails. Make
    __index__ take the single element. Idempotent; no effect outside TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    if getattr(interpreter, "_mhl_index_fixed", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._mhl_index_fixed = True
