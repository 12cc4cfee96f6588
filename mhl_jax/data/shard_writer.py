"""Cutting one token stream into `.bin` shards: the validation part held out as the stream passes, the rest train.

`Holdout` decides, token position by token position, which part a token goes to, without knowing how long the
stream is: either the first N tokens (`Holdout.head`), or a fraction of it spread over the whole stream in blocks of
`VAL_BLOCK` tokens, up to a cap (`Holdout.spread`). `ShardWriter` writes each part as shards of a fixed token count:
`{prefix}val_000000.bin, ...` and `{prefix}train_000000.bin, ...` (the last of each shorter).
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np

from mhl_jax.data.bin_shards import write_shard
from mhl_jax.data.errors import DataError

# Tokens per held-out block of `Holdout.spread`: one sequence of the paper configs (2048), small enough that a corpus
# of a few MB holds several blocks at a 0.5% fraction, and large enough that the blocks' own sequences are contiguous
# text (a validation window crosses at most one cut between blocks).
VAL_BLOCK = 2048


class Holdout:
    """Which stretches of a token stream are validation; build with `head` or `spread`."""

    def __init__(self, head: int | None, fraction: Fraction | None, cap: int, describe: str) -> None:
        self.head = head
        self.fraction = fraction
        self.cap = cap
        self.describe = describe  # the options that chose it, for error messages

    @classmethod
    def first(cls, tokens: int) -> Holdout:
        """The first `tokens` tokens of the stream (prepare's --val-tokens)."""
        if tokens < 1:
            raise DataError(f"--val-tokens={tokens}: must be >= 1")
        return cls(tokens, None, tokens, f"--val-tokens={tokens}")

    @classmethod
    def spread(cls, fraction: float, cap: int) -> Holdout:
        """`fraction` of the blocks of VAL_BLOCK tokens, evenly spaced from the first block on (so every file of a
        large input gives some, and the smallest input one), until `cap` tokens are held out."""
        if not 0.0 < fraction < 1.0:
            raise DataError(f"--val-fraction={fraction}: must be in (0, 1)")
        if cap < 1:
            raise DataError(f"--val-max-tokens={cap}: must be >= 1")
        return cls(None, Fraction(fraction).limit_denominator(1_000_000), cap,
                   f"--val-fraction={fraction} (at least one block of {VAL_BLOCK} tokens)")

    def _val_block(self, i: int) -> bool:
        # block i is held out when it raises ceil(fraction x blocks so far): blocks 0, 1/f, 2/f, ... (exact rationals)
        p, q = self.fraction.numerator, self.fraction.denominator
        return -((-(i + 1) * p) // q) > -((-i * p) // q)

    def run(self, pos: int, held: int) -> tuple[bool, int]:
        """(whether the token at stream position `pos` is validation, how many tokens from `pos` on share that
        answer), given `held` validation tokens so far."""
        if self.head is not None:
            return (True, self.head - pos) if pos < self.head else (False, math.inf)
        left = VAL_BLOCK - pos % VAL_BLOCK
        if held < self.cap and self._val_block(pos // VAL_BLOCK):
            return True, min(left, self.cap - held)
        return False, left


class _Part:
    """One part (val or train) of the stream, cut into shards of `shard_tokens` as it fills."""

    def __init__(self, out: Path, name: str, shard_tokens: int) -> None:
        self.out, self.name, self.shard_tokens = out, name, shard_tokens
        self.written: list[Path] = []
        self.count = 0
        self._buf: np.ndarray | None = None  # allocated on first use: a part may stay empty
        self._fill = 0

    def add(self, tokens: np.ndarray) -> None:
        if self._buf is None:
            self._buf = np.empty(self.shard_tokens, np.uint16)
        self.count += len(tokens)
        while len(tokens):
            take = min(len(self._buf) - self._fill, len(tokens))
            self._buf[self._fill:self._fill + take] = tokens[:take]
            self._fill += take
            tokens = tokens[take:]
            if self._fill == len(self._buf):
                self.flush()

    def flush(self) -> None:
        if self._fill:
            path = self.out / f"{self.name}_{len(self.written):06d}.bin"
            write_shard(path, self._buf[:self._fill])
            self.written.append(path)
            self._fill = 0


class ShardWriter:
    """Cuts a token stream into validation and train shards in `out` as `holdout` decides."""

    def __init__(self, out: Path, shard_tokens: int, holdout: Holdout, prefix: str = "") -> None:
        if shard_tokens < 1:
            raise DataError(f"--shard-tokens={shard_tokens}: must be >= 1")
        self.holdout = holdout
        self.val = _Part(out, f"{prefix}val", shard_tokens)
        self.train = _Part(out, f"{prefix}train", shard_tokens)
        self.total = 0

    @property
    def written(self) -> list[Path]:
        """The shards written so far, validation first."""
        return self.val.written + self.train.written

    def add(self, tokens: np.ndarray) -> None:
        """Append (n,) ids < 65536."""
        while len(tokens):
            is_val, run = self.holdout.run(self.total, self.val.count)
            n = int(min(run, len(tokens)))
            (self.val if is_val else self.train).add(tokens[:n])
            tokens = tokens[n:]
            self.total += n

    def close(self) -> list[Path]:
        """Write the last partial shards; both parts must hold tokens. Returns every shard, validation first."""
        if self.total == 0:
            raise DataError("the input holds no text (no documents, or only empty ones)")
        if self.holdout.head is not None and self.total <= self.holdout.head:
            raise DataError(f"the input has {self.total} tokens, fewer than --val-tokens={self.holdout.head} plus "
                            "at least one training token")
        if self.train.count == 0:
            raise DataError(f"the input has {self.total} tokens, all held out for validation by "
                            f"{self.holdout.describe}: nothing is left to train on; give more text, or "
                            "--val-tokens N to hold out the first N tokens")
        self.val.flush()
        self.train.flush()
        return self.written
