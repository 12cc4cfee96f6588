"""modded-nanogpt `.bin` token shards: the public FineWeb(-Edu) 10B GPT-2 format.

Layout of one shard: a header of 256 little-endian int32 (magic 20240520, version 1, token count,
then zeros), followed by `count` little-endian uint16 tokens. Shards are memory-mapped, never read
into memory whole; `open_shard` validates the header, the file size and (optionally) the largest id.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

from mhl_jax.data.errors import DataError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
PREPARE = "python -m mhl_jax.data.prepare writes them: docs/data.md"  # where shards come from, for the errors below
MAX_VOCAB = 1 << 16  # tokens are stored as uint16


def resolve_shards(spec: str, what: str = "data.path", role: str | None = None) -> list[Path]:
    """The sorted `.bin` files named by `spec`: a directory, a glob, or one file.

    In a directory, `role` ('train' or 'val') picks the files whose name contains it (prepare's
    train_000000.bin/val_000000.bin, modded-nanogpt's fineweb_train_*/fineweb_val_*); a directory without
    such names gives all its *.bin, except that data.path's validation part needs val-named files (the
    rest are its training shards). Raises DataError when the directory/glob/file does not exist or names
    no shard.
    """
    if not spec:
        raise DataError(f"{what} is empty: expected a directory, glob or file of .bin shards")
    p = Path(spec).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.glob("*.bin") if f.is_file())  # a directory named *.bin is no shard
        if role is not None:
            named = [f for f in files if role in f.name]
            if named:
                files = named
            elif role == "train":
                files = [f for f in files if "val" not in f.name]
            elif what == "data.path":  # the validation shards beside the training ones: named so
                files = []
        if not files:
            kind = f"{role} .bin shards (file names containing {role!r})" if role else ".bin shards"
            raise DataError(f"{what}={spec!r}: the directory holds no {kind} ({PREPARE})")
        return files
    if p.is_file():
        return [p]
    if glob.has_magic(spec):
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(spec)) if Path(f).is_file())
        if not files:
            raise DataError(f"{what}={spec!r}: the glob matches no shard files ({PREPARE})")
        return files
    raise DataError(f"{what}={spec!r}: no such file or directory ({PREPARE})")


def read_header(path: Path) -> int:
    """Check the header and the file size of one shard; return its token count."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"shard {str(path)!r} is truncated: {size} bytes, shorter than the "
                        f"{HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic != MAGIC:
        raise DataError(f"shard {str(path)!r}: wrong magic number {magic}, expected {MAGIC} "
                        "(not a modded-nanogpt .bin token shard)")
    if version != VERSION:
        raise DataError(f"shard {str(path)!r}: unsupported version {version}, expected {VERSION}")
    if count < 0:
        raise DataError(f"shard {str(path)!r}: negative token count {count} in the header")
    expected = HEADER_BYTES + 2 * count
    if size < expected:
        raise DataError(f"shard {str(path)!r} is truncated: the header promises {count} tokens "
                        f"({expected} bytes) but the file has {size} bytes")
    if size > expected:
        raise DataError(f"shard {str(path)!r}: {size - expected} bytes after the {count} tokens the "
                        "header promises (corrupt header or a partly overwritten file)")
    return count


def open_shard(path: Path, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map one validated shard: (count,) uint16, read-only.

    With `vocab_size`, also checks that every token id is < vocab_size (one vectorised pass).
    """
    count = read_header(path)
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))
    if vocab_size is not None and count:
        top = int(tokens.max())
        if top >= vocab_size:
            where = int(np.argmax(tokens >= vocab_size))
            raise DataError(f"shard {str(path)!r}: token id {top} >= model.vocab_size={vocab_size} "
                            f"(first offending token at position {where})")
    return tokens


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write `tokens` ((n,) integer ids < 65536) as one shard, atomically (temp file + rename)."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise DataError(f"write_shard {str(path)!r}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= MAX_VOCAB):
        raise DataError(f"write_shard {str(path)!r}: token ids must be in [0, {MAX_VOCAB}), got "
                        f"[{int(tokens.min())}, {int(tokens.max())}]")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, tokens.size
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
