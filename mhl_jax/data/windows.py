"""Training sequences as fixed windows over token streams, with random access for Grain.

A stream of n tokens gives (n - 1) // T windows of T + 1 tokens at stride T: window j is
tokens[j*T : j*T + T + 1] (inputs tokens[:-1], targets tokens[1:]), so every token but the first is
a target exactly once. Windows never cross from one stream (shard) into the next.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mhl_jax.data.bin_shards import open_shard
from mhl_jax.data.errors import DataError


def windows_in(num_tokens: int, seq_len: int) -> int:
    """How many windows of seq_len + 1 tokens at stride seq_len fit in num_tokens tokens."""
    return max(0, (num_tokens - 1) // seq_len)


class TokenWindows:
    """Random-access windows over token streams: `ws[i]` is (seq_len + 1,) int32.

    `streams` holds in-memory 1-D integer arrays or paths of validated `.bin` shards; shards are
    memory-mapped on first use in each process (so the object pickles cheaply into Grain workers).
    """

    def __init__(self, streams: list[np.ndarray | Path], counts: list[int], seq_len: int, name: str) -> None:
        if seq_len < 1:
            raise DataError(f"sequence length {seq_len}: must be >= 1")
        if len(streams) != len(counts):
            raise DataError(f"{name}: {len(streams)} streams but {len(counts)} token counts")
        self.seq_len = seq_len
        self.name = name
        self._streams = list(streams)
        self._open: list[np.ndarray | None] = [s if isinstance(s, np.ndarray) else None for s in streams]
        per_stream = np.array([windows_in(c, seq_len) for c in counts], dtype=np.int64)
        self._ends = np.cumsum(per_stream)  # window index where each stream's windows end
        self.num_tokens = int(sum(counts))
        if len(self) == 0:
            raise DataError(f"{name}: {self.num_tokens} tokens in {len(streams)} stream(s) hold no sequence of "
                            f"{seq_len + 1} tokens (model.context + 1); longest stream has "
                            f"{max(counts, default=0)} tokens")

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def _stream(self, k: int) -> np.ndarray:
        arr = self._open[k]
        if arr is None:
            arr = open_shard(self._streams[k])  # validated when the pipeline was built
            self._open[k] = arr
        return arr

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: window {index} out of range [0, {len(self)})")
        k = int(np.searchsorted(self._ends, index, side="right"))
        start = (index - (int(self._ends[k - 1]) if k else 0)) * self.seq_len
        return np.asarray(self._stream(k)[start:start + self.seq_len + 1], dtype=np.int32)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = [s if isinstance(s, np.ndarray) and not isinstance(s, np.memmap) else None
                          for s in self._streams]
        return state
