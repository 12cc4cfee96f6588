"""The Grain input pipeline: training batches (endless, shuffled, prefetched, checkpointable) and the fixed
validation sequences, from any of the three sources of `DataConfig.source`.

Training order: windows (see windows.py) -> a shuffle seeded from `seed`, different (and deterministic) in every
epoch -> endless repeat ->
batches of `batch_size` -> threads read ahead `prefetch` batches (and `worker_count` processes,
when > 0). The iterator's position is its whole state: `get_state()` / `set_state()`, saved and
restored with Orbax through `grain.checkpoint.CheckpointSave/CheckpointRestore` (checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

import grain
import numpy as np
from absl import flags

from mhl_jax.config import DataConfig
from mhl_jax.data.bin_shards import open_shard, resolve_shards
from mhl_jax.data.builtin import builtin_split
from mhl_jax.data.errors import DataError
from mhl_jax.data.hf_source import hf_split
from mhl_jax.data.tokenizers import ByteTokenizer, check_vocab, get_tokenizer
from mhl_jax.data.windows import TokenWindows


def _bin_windows(spec: str, what: str, role: str, *, seq_len: int, vocab_size: int, verify: bool) -> TokenWindows:
    paths = resolve_shards(spec, what, role)
    counts = [len(open_shard(p, vocab_size if verify else None)) for p in paths]
    names = ", ".join(p.name for p in paths[:3]) + (f", ... ({len(paths)} shards)" if len(paths) > 3 else "")
    return TokenWindows(list(paths), counts, seq_len, f"{what}={spec!r} [{names}]")


def _array_windows(tokens: np.ndarray, name: str, *, seq_len: int, vocab_size: int) -> TokenWindows:
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(f"{name}: token id {int(tokens.max())} >= model.vocab_size={vocab_size}")
    return TokenWindows([np.asarray(tokens)], [len(tokens)], seq_len, name)


def source_windows(cfg: DataConfig, part: str, *, seq_len: int, vocab_size: int) -> TokenWindows:
    """All windows of the training (`part='train'`) or validation (`part='val'`) data of `cfg`."""
    if part not in ("train", "val"):
        raise DataError(f"part={part!r}: expected 'train' or 'val'")
    if seq_len < 1 or vocab_size < 1:
        raise DataError(f"seq_len={seq_len}, vocab_size={vocab_size}: must be positive")
    if cfg.source == "builtin":
        check_vocab(ByteTokenizer(), vocab_size)
        train, val = builtin_split(cfg.val_fraction)
        tokens = train if part == "train" else val
        return _array_windows(tokens, f"built-in corpus ({part})", seq_len=seq_len, vocab_size=vocab_size)
    if cfg.source == "bin":
        if cfg.tokenizer_file:  # a local vocabulary (cheap to read): the model must cover it, as generation samples it
            check_vocab(get_tokenizer(cfg.tokenizer, cfg.tokenizer_file), vocab_size)
        verify = cfg.verify_tokens
        if part == "train":
            return _bin_windows(cfg.path, "data.path", "train", seq_len=seq_len, vocab_size=vocab_size, verify=verify)
        if cfg.val_path:
            return _bin_windows(cfg.val_path, "data.val_path", "val", seq_len=seq_len, vocab_size=vocab_size,
                                verify=verify)
        if cfg.path and Path(cfg.path).expanduser().is_dir():  # prepare's layout: val_*.bin beside train_*.bin
            return _bin_windows(cfg.path, "data.path", "val", seq_len=seq_len, vocab_size=vocab_size, verify=verify)
        raise DataError(f"data.source='bin' with data.path={cfg.path!r} (not a directory) needs data.val_path "
                        "naming the validation shard(s)")
    if cfg.source == "hf":
        if not cfg.path:
            raise DataError("data.source='hf' needs data.path (local data files or a dataset name)")
        check_vocab(get_tokenizer(cfg.tokenizer, cfg.tokenizer_file), vocab_size)
        name = f"data.val_path={cfg.val_path!r}" if part == "val" and cfg.val_path else f"data.path={cfg.path!r}"
        return _array_windows(hf_split(cfg, part), f"{name} ({part})", seq_len=seq_len, vocab_size=vocab_size)
    raise DataError(f"data.source={cfg.source!r}: expected 'builtin', 'bin' or 'hf'")


def shuffle_seed(seed: int) -> int:
    """A 32-bit shuffle seed mixed from the run seed (Grain reseeds epoch e with seed + e, so nearby
    raw seeds would replay each other's epochs shifted by one)."""
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 0x6D686C]).generate_state(1)[0])


def _absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; a program that never ran absl.app (train.py, pytest)
    has not parsed them, so mark the defaults as parsed (a no-op under absl.app)."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_train_loader(cfg: DataConfig, *, seq_len: int, batch_size: int, seed: int,
                      vocab_size: int) -> grain.DatasetIterator:
    """An endless, checkpointable iterator of training batches.

    Each `next()` gives (batch_size, seq_len + 1) int32 token windows. Same arguments, same batches: the processes
    of a run of several build the same iterator of global batches, and each places its own rows of them
    (mhl_jax.runtime.distributed). Save/restore its position with `get_state()`/`set_state()` or through
    `Checkpointer` (which uses Grain's Orbax handler). Training data of fewer windows than one batch is refused
    (DataError): each batch would repeat the same sequences.
    """
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size}: must be >= 1")
    if cfg.prefetch < 0 or cfg.worker_count < 0 or cfg.read_threads < 1:
        raise DataError(f"data.prefetch={cfg.prefetch}, data.worker_count={cfg.worker_count}: must be >= 0; "
                        f"data.read_threads={cfg.read_threads}: must be >= 1")
    windows = source_windows(cfg, "train", seq_len=seq_len, vocab_size=vocab_size)
    if len(windows) < batch_size:  # every batch would hold the same sequences several times over
        raise DataError(f"{windows.name}: {windows.num_tokens} training tokens give {len(windows)} distinct sequences "
                        f"of {seq_len + 1} tokens, fewer than one batch of {batch_size} (train.global_batch); give "
                        f"more data, or lower train.global_batch or model.context")
    ds = grain.MapDataset.source(windows).shuffle(seed=shuffle_seed(seed))
    ds = ds.repeat(None).batch(batch_size, drop_remainder=True)
    read = grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch)
    it_ds = ds.to_iter_dataset(read)
    if cfg.worker_count > 0:
        _absl_flags_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    return iter(it_ds)


def load_val_sequences(cfg: DataConfig, *, seq_len: int, vocab_size: int) -> np.ndarray:
    """The fixed validation set: (cfg.val_sequences, seq_len + 1) int32, the same on every call.

    The sequences are evenly spaced over all validation windows (so they cover the held-out text).
    """
    if cfg.val_sequences < 0:
        raise DataError(f"data.val_sequences={cfg.val_sequences}: must be >= 0")
    if cfg.val_sequences == 0:
        return np.zeros((0, seq_len + 1), np.int32)
    windows = source_windows(cfg, "val", seq_len=seq_len, vocab_size=vocab_size)
    n = cfg.val_sequences
    if len(windows) < n:
        raise DataError(f"{windows.name}: {windows.num_tokens} validation tokens give {len(windows)} sequences of "
                        f"{seq_len + 1} tokens, fewer than data.val_sequences={n}")
    idx = (np.arange(n, dtype=np.int64) * len(windows)) // n
    return np.stack([windows[int(i)] for i in idx])
