"""The built-in corpus: CPython's `pydoc_data.topics` (~470 KB of English), byte-tokenized.

It ships with every CPython, so the default config trains with no download. Topics are joined in
sorted key order, each preceded by EOT; the last `val_fraction` of the tokens is held out.
"""

from __future__ import annotations

import functools
from pydoc_data.topics import topics

import numpy as np

from mhl_jax.data.errors import DataError
from mhl_jax.data.tokenizers import ByteTokenizer, encode_documents


@functools.lru_cache(maxsize=1)
def builtin_tokens() -> np.ndarray:
    """All built-in tokens: (n,) uint16, read-only."""
    tokens = encode_documents(ByteTokenizer(), (topics[k] for k in sorted(topics))).astype(np.uint16)
    tokens.flags.writeable = False
    return tokens


def split_tail(tokens: np.ndarray, val_fraction: float, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last round(n * val_fraction) tokens (at least 1) are validation."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction}: must be in (0, 1) to hold out a tail of {what}")
    n_val = max(1, int(round(len(tokens) * val_fraction)))
    return tokens[:-n_val], tokens[-n_val:]


def builtin_split(val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token arrays of the built-in corpus: (n_train,), (n_val,) uint16."""
    return split_tail(builtin_tokens(), val_fraction, "the built-in corpus")
