"""`python -m mhl_jax.data.prepare`: text (local files or a Hugging Face dataset) -> `.bin` shards.

Writes val_000000.bin (the first --val-tokens tokens) and train_000000.bin, train_000001.bin, ...
(--shard-tokens tokens each, the last one shorter) in the modded-nanogpt format, into a staging
directory inside --out, moved into --out once the whole input is read (a failure leaves --out as it
was; --overwrite replaces its shards only then). Documents are EOT-separated (each one is preceded by EOT). Train with
`data.source=bin data.path=OUT` (the directory: train_* are trained on, val_* validate).

    python -m mhl_jax.data.prepare --input 'books/*.txt' --tokenizer byte --out data/books \\
        --shard-tokens 100000000 --val-tokens 1000000
    python -m mhl_jax.data.prepare --hf-dataset HuggingFaceFW/fineweb-edu --hf-config sample-10BT \\
        --streaming --tokenizer gpt2 --out data/fineweb_edu10B
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mhl_jax.data.bin_shards import MAX_VOCAB, write_shard
from mhl_jax.data.errors import DataError
from mhl_jax.data.hf_source import iter_documents, iter_file_documents, local_files
from mhl_jax.data.tokenizers import get_tokenizer, iter_encoded


class ShardWriter:
    """Cuts a token stream into val_000000.bin (first `val_tokens`) then train_%06d.bin shards."""

    def __init__(self, out: Path, shard_tokens: int, val_tokens: int) -> None:
        self.out = out
        self.shard_tokens = shard_tokens
        self.val_tokens = val_tokens
        self.written: list[Path] = []
        self.total = 0
        self._train_index = 0
        self._buf = np.empty(val_tokens, np.uint16)  # the val shard fills first
        self._fill = 0
        self._in_val = True

    def add(self, tokens: np.ndarray) -> None:
        """Append (n,) ids < 65536."""
        self.total += len(tokens)
        while len(tokens):
            take = min(len(self._buf) - self._fill, len(tokens))
            self._buf[self._fill:self._fill + take] = tokens[:take]
            self._fill += take
            tokens = tokens[take:]
            if self._fill == len(self._buf):
                self._flush()

    def _flush(self) -> None:
        if self._in_val:
            path = self.out / "val_000000.bin"
        else:
            path = self.out / f"train_{self._train_index:06d}.bin"
            self._train_index += 1
        write_shard(path, self._buf[:self._fill])
        self.written.append(path)
        if self._in_val:
            self._in_val = False
            self._buf = np.empty(self.shard_tokens, np.uint16)
        self._fill = 0

    def close(self) -> None:
        """Write the last partial train shard; the input must have filled val and one train token."""
        if self._in_val:
            raise DataError(f"the input has {self.total} tokens, fewer than --val-tokens={self.val_tokens} "
                            "plus at least one training token")
        if self._fill:
            self._flush()
        if self._train_index == 0:
            raise DataError(f"the input has {self.total} tokens, all taken by --val-tokens={self.val_tokens}; "
                            "nothing is left to train on")


def _input_files(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        found = local_files(pattern, "--input")
        if found is None:
            raise DataError(f"--input {pattern!r}: no such file, directory or glob match")
        files.extend(found)
    return sorted(dict.fromkeys(files))  # unique, deterministic order


def _documents(args: argparse.Namespace) -> Iterator[str]:
    if args.input:
        return iter_file_documents(_input_files(args.input), text_column=args.text_column)
    return iter_documents(args.hf_dataset, hf_config=args.hf_config, split=args.split,
                          text_column=args.text_column, streaming=args.streaming, what="--hf-dataset")


def _shards_in(out: Path) -> list[Path]:
    return sorted(out.glob("train_*.bin")) + sorted(out.glob("val_*.bin"))


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is a file, or that holds shards without --overwrite (before any input is read)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file; expected a directory (made if absent)")
    old = _shards_in(out) if out.is_dir() else []
    if old and not overwrite:
        raise DataError(f"--out {str(out)!r} already holds shards ({old[0].name}, ...); choose an empty directory "
                        "or pass --overwrite")


def _install(staging: Path, out: Path) -> None:
    """Move the finished shards from `staging` into `out`, replacing the shards there (set aside first, deleted
    once the new ones are in place)."""
    old = _shards_in(out)
    if old:
        aside = Path(tempfile.mkdtemp(dir=out, prefix=".prepare-old-"))
        for f in old:
            f.rename(aside / f.name)
    for f in _shards_in(staging):
        f.rename(out / f.name)
    if old:
        shutil.rmtree(aside)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mhl_jax.data.prepare", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILES_OR_GLOB",
                     help="local files, directories or globs (.txt/.md: one document per file; .json/.jsonl/"
                          ".csv/.parquet: one per row)")
    src.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset name")
    p.add_argument("--hf-config", default="", help="dataset configuration name")
    p.add_argument("--split", default="train", help="dataset split (--hf-dataset)")
    p.add_argument("--streaming", action="store_true", help="stream the dataset instead of downloading it first")
    p.add_argument("--text-column", default="text", help="column holding the text (json/csv/parquet, datasets)")
    p.add_argument("--tokenizer", choices=["byte", "gpt2"], required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="tokens per train shard (default: %(default)s)")
    p.add_argument("--val-tokens", type=int, default=100_000_000,
                   help="tokens in the validation shard, written first (default: %(default)s; the input needs more "
                   "tokens than this)")
    p.add_argument("--overwrite", action="store_true", help="replace train_*/val_* shards already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.shard_tokens < 1:
        p.error(f"--shard-tokens={args.shard_tokens}: must be >= 1")
    if args.val_tokens < 1:
        p.error(f"--val-tokens={args.val_tokens}: must be >= 1")
    return args


def prepare(args: argparse.Namespace) -> list[Path]:
    """Tokenize and write the shards; returns their paths (val first)."""
    tok = get_tokenizer(args.tokenizer)
    if tok.vocab_size > MAX_VOCAB:
        raise DataError(f"tokenizer {tok.name!r} has {tok.vocab_size} ids; .bin shards store uint16 ids "
                        f"(< {MAX_VOCAB})")
    out = Path(args.out)
    _check_out(out, args.overwrite)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {str(out)!r} cannot be created: {e}") from e
    # the shards are written into a staging directory and moved into --out only once the whole input is read: a
    # failure (bad input, a bad row halfway) leaves --out as it was, its old shards too
    for left in out.glob(".prepare-*"):  # a killed run's staging or set-aside shards (one prepare per --out)
        shutil.rmtree(left, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".prepare-"))
    try:
        writer = ShardWriter(staging, args.shard_tokens, args.val_tokens)
        with tqdm(desc=f"prepare {out}", unit="tok", unit_scale=True, disable=args.no_progress,
                  file=sys.stderr) as bar:
            for ids in iter_encoded(tok, _documents(args)):
                writer.add(ids)
                bar.update(len(ids))
                bar.set_postfix(shards=len(writer.written), refresh=False)
        writer.close()
        _install(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a failed first run leaves no empty output directory behind
    return [out / f.name for f in writer.written]


def main(argv: list[str] | None = None) -> list[Path]:
    """Parse `argv` (default: sys.argv[1:]) and prepare; raises DataError on bad input."""
    args = parse_args(argv)
    written = prepare(args)
    print(f"wrote {len(written)} shards to {args.out}: {written[0].name} and "
          f"{len(written) - 1} train shard(s) ({written[1].name} .. {written[-1].name})")
    return written


if __name__ == "__main__":
    try:
        main()
    except DataError as e:
        sys.exit(f"prepare: error: {e}")
