"""`python -m mhl_jax.data.prepare`: text (a named dataset, local files or a Hugging Face dataset) -> `.bin` shards.

Writes validation shards val_000000.bin, ... and training shards train_000000.bin, ... (--shard-tokens tokens
each, the last of each shorter) in the modded-nanogpt format. Validation is, by default, --val-fraction (0.5%) of
the tokens, in blocks of 2048 spread evenly over the input from its first block on (so a large input gives some from
every stretch of its files, and a few MB still a few blocks), at most --val-max-tokens (100M); --val-tokens N holds
out the first N tokens instead. Documents are EOT-separated (each one is preceded by EOT). The shards go to a
staging directory inside --out, moved into --out once the whole input is read (a failure leaves --out as it was;
--overwrite replaces its shards only then). Train with `data.source=bin data.path=OUT` (the directory: *train_*
files are trained on, *val_* validate).

    python -m mhl_jax.data.prepare fineweb10B    # the paper configs' data, where they read it (recipes.py)
    python -m mhl_jax.data.prepare --input 'books/*.txt' --tokenizer byte --out data/books
    python -m mhl_jax.data.prepare --hf-dataset HuggingFaceFW/fineweb-edu --hf-config sample-10BT \\
        --streaming --tokenizer gpt2 --out data/fineweb_edu10B
    python -m mhl_jax.data.prepare --input 'books/*.txt' --train-tokenizer 16384 --out data/books_bpe

--train-tokenizer VOCAB first learns a byte-level BPE of VOCAB ids on the --input documents (bpe_train.py), writes it
as OUT/tokenizer.tiktoken, then encodes with that file (train with data.tokenizer=bpe
data.tokenizer_file=OUT/tokenizer.tiktoken); --tokenizer bpe --tokenizer-file PATH encodes with an existing one (and
copies it into OUT). The tokenizer file is staged and installed with the shards.

Exit status: 0 done, 2 bad input (one line says why), 1 a failure while writing, 3 interrupted (--out as it was).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from mhl_jax.data.bin_shards import MAX_VOCAB, read_header
from mhl_jax.data.bpe_train import MIN_VOCAB, train_rank_file
from mhl_jax.data.errors import DataError
from mhl_jax.data.hf_source import iter_documents, iter_file_documents, local_files
from mhl_jax.data.recipes import RECIPES, check_hub
from mhl_jax.data.shard_writer import Holdout, ShardWriter
from mhl_jax.data.tokenizers import get_tokenizer, iter_encoded
from mhl_jax.runtime.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK

VAL_FRACTION = 0.005  # the default --val-fraction
VAL_MAX_TOKENS = 100_000_000  # the default --val-max-tokens: a 10B-token corpus's 0.5% is 50M
TOKENIZER_FILE = "tokenizer.tiktoken"  # a bpe tokenizer's rank file, beside the shards it encoded


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
    """What prepare writes in `out`: the shards, of any name prefix (so that a run with another prefix does not add to
    them), then the tokenizer file if there is one (it belongs to the shards: replaced, or removed, with them)."""
    shards = sorted({*out.glob("*train_*.bin"), *out.glob("*val_*.bin")})
    return shards + [f for f in [out / TOKENIZER_FILE] if f.is_file()]


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that is a file, or that holds shards without --overwrite (before any input is read)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file; expected a directory (made if absent)")
    old = _shards_in(out) if out.is_dir() else []
    if old and not overwrite:
        raise DataError(f"--out {str(out)!r} already holds shards ({old[0].name}, ...); choose an empty directory "
                        "or pass --overwrite")


def _install(staging: Path, out: Path) -> None:
    """Move the finished shards (and tokenizer file) from `staging` into `out`, replacing those there (set aside
    first, deleted once the new ones are in place; put back if the move stops part-way, Ctrl-C included)."""
    old = _shards_in(out)
    aside = Path(tempfile.mkdtemp(dir=out, prefix=".prepare-old-")) if old else None
    moved = []
    try:
        for f in old:
            f.rename(aside / f.name)
        for f in _shards_in(staging):
            f.rename(out / f.name)
            moved.append(out / f.name)
    except BaseException:
        for f in moved:
            f.unlink(missing_ok=True)
        if aside is not None:
            _restore_set_aside(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside)


def _restore_set_aside(aside: Path, out: Path) -> None:
    """Put the shards an interrupted `_install` set aside back into `out`, then remove `aside`."""
    for f in aside.iterdir():
        f.replace(out / f.name)
    shutil.rmtree(aside, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mhl_jax.data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("recipe", nargs="?", choices=sorted(RECIPES), metavar="NAME",
                   help=f"a named dataset, fetched and written where the configs read it: {', '.join(RECIPES)}")
    p.add_argument("--input", nargs="+", metavar="FILES_OR_GLOB",
                   help="local files, directories or globs (.txt/.md: one document per file; .json/.jsonl/"
                        ".csv/.parquet: one per row)")
    p.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset name")
    p.add_argument("--hf-config", default=None, help="dataset configuration name")
    p.add_argument("--split", default=None, help="dataset split (--hf-dataset; default: train)")
    p.add_argument("--streaming", action="store_true", help="stream the dataset instead of downloading it first")
    p.add_argument("--text-column", default=None,
                   help="column holding the text (json/csv/parquet, datasets; default: text)")
    p.add_argument("--tokenizer", choices=["byte", "gpt2", "bpe"], default=None)
    p.add_argument("--tokenizer-file", default="", metavar="PATH",
                   help="gpt2: a local r50k_base.tiktoken, read instead of tiktoken's download (no network "
                        f"needed); bpe: the .tiktoken rank file to encode with (required; copied into --out, as "
                        f"{TOKENIZER_FILE})")
    p.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB",
                   help=f"with --input: learn a byte-level BPE of VOCAB ids (256 bytes, merges, end-of-text) on the "
                        f"input, write it as --out/{TOKENIZER_FILE} and encode with it (instead of --tokenizer)")
    p.add_argument("--out", default=None, help="output directory (a NAME's default: where its configs read it)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="tokens per shard (default: %(default)s)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help=f"fraction of the tokens held out for validation, in blocks spread over the input (default: "
                        f"{VAL_FRACTION})")
    p.add_argument("--val-max-tokens", type=int, default=VAL_MAX_TOKENS,
                   help="at most this many validation tokens with --val-fraction (default: %(default)s)")
    p.add_argument("--val-tokens", type=int, default=None,
                   help="instead of --val-fraction: the first N tokens validate (the input needs more than N)")
    p.add_argument("--overwrite", action="store_true", help="replace the *train_*/*val_* shards already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if sum(x is not None for x in (args.recipe, args.input, args.hf_dataset)) != 1:
        p.error(f"give one source: a NAME ({', '.join(RECIPES)}), --input FILES or --hf-dataset NAME")
    if args.shard_tokens < 1:
        p.error(f"--shard-tokens={args.shard_tokens}: must be >= 1")
    if args.val_tokens is not None and args.val_fraction is not None:
        p.error("--val-tokens and --val-fraction: give one (the first N tokens, or a fraction spread over the input)")
    if args.val_tokens is not None and args.val_tokens < 1:
        p.error(f"--val-tokens={args.val_tokens}: must be >= 1")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction={args.val_fraction}: must be in (0, 1)")
    if args.val_max_tokens < 1:
        p.error(f"--val-max-tokens={args.val_max_tokens}: must be >= 1")
    _check_tokenizer_args(p, args)
    args.prefix = ""
    if args.recipe:
        r = RECIPES[args.recipe]
        fixed = [f"--{k.replace('_', '-')}" for k in ("hf_config", "split", "text_column", "tokenizer")
                 if getattr(args, k) is not None] + (["--streaming"] if args.streaming else [])
        if fixed:
            p.error(f"{r.name} sets {', '.join(fixed)} itself (source {r.source}, tokenizer {r.tokenizer})")
        args.hf_dataset, args.hf_config, args.split, args.text_column = r.source, r.hf_config, r.split, r.text_column
        args.tokenizer, args.streaming, args.prefix, args.out = r.tokenizer, True, r.prefix, args.out or r.out
    else:
        for name in ("tokenizer", "out"):
            if getattr(args, name) is None:
                p.error(f"--{name} is required with --input or --hf-dataset")
        args.hf_config = args.hf_config or ""
        args.split = args.split or "train"
        args.text_column = args.text_column or "text"
    return args


def _check_tokenizer_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--train-tokenizer (on --input, instead of --tokenizer) and --tokenizer bpe (with its --tokenizer-file)."""
    if args.train_tokenizer is not None:
        if args.input is None:
            p.error("--train-tokenizer learns from --input files; give --input FILES")
        if args.tokenizer is not None or args.tokenizer_file:
            p.error("--train-tokenizer and --tokenizer/--tokenizer-file: give one (learn a BPE, or encode with one)")
        if not MIN_VOCAB <= args.train_tokenizer <= MAX_VOCAB:
            p.error(f"--train-tokenizer={args.train_tokenizer}: must be in [{MIN_VOCAB}, {MAX_VOCAB}] (256 bytes, "
                    "at least one merge and end-of-text; .bin shards store uint16 ids)")
        args.tokenizer = "bpe"
    elif args.tokenizer == "bpe" and not args.tokenizer_file:
        p.error("--tokenizer bpe needs --tokenizer-file PATH (a .tiktoken rank file), or learn one with "
                "--train-tokenizer VOCAB")


def holdout_of(args: argparse.Namespace) -> Holdout:
    """The validation part `args` asks for: --val-tokens, else --val-fraction (default 0.5%) up to --val-max-tokens."""
    if args.val_tokens is not None:
        return Holdout.first(args.val_tokens)
    return Holdout.spread(VAL_FRACTION if args.val_fraction is None else args.val_fraction, args.val_max_tokens)


def _checked_tokenizer(name: str, tokenizer_file: str):
    tok = get_tokenizer(name, tokenizer_file)
    if tok.vocab_size > MAX_VOCAB:
        raise DataError(f"tokenizer {tok.name!r} has {tok.vocab_size} ids; .bin shards store uint16 ids "
                        f"(< {MAX_VOCAB})")
    return tok


def _train_tokenizer(args: argparse.Namespace, path: Path):
    """Learn the --train-tokenizer BPE on the input, write its rank file to `path`, and load it as training will."""
    if not args.no_progress:
        print(f"prepare: learning a byte-level BPE of {args.train_tokenizer} ids on the input", file=sys.stderr)
    start = time.perf_counter()
    ranks = train_rank_file(_documents(args), args.train_tokenizer, path)
    if not args.no_progress:
        print(f"prepare: {ranks} ranks learned in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return _checked_tokenizer("bpe", str(path))


def prepare(args: argparse.Namespace) -> list[Path]:
    """Tokenize and write the shards; returns their paths (val first)."""
    if args.recipe:
        check_hub(RECIPES[args.recipe])
    tok = None if args.train_tokenizer else _checked_tokenizer(args.tokenizer, args.tokenizer_file)
    holdout = holdout_of(args)
    docs = _documents(args)  # local files are found (or refused) here, before --out is touched
    out = Path(args.out)
    _check_out(out, args.overwrite)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {str(out)!r} cannot be created: {e}") from e
    # the shards are written into a staging directory and moved into --out only once the whole input is read: a
    # failure (bad input, a bad row halfway) leaves --out as it was, its old shards too
    for left in out.glob(".prepare-old-*"):  # a run killed while installing: its old shards go back first
        _restore_set_aside(left, out)
    for left in out.glob(".prepare-*"):  # a killed run's staging directory (one prepare per --out)
        shutil.rmtree(left, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".prepare-"))
    try:
        if tok is None:
            tok, docs = _train_tokenizer(args, staging / TOKENIZER_FILE), _documents(args)  # the input read again
        elif args.tokenizer == "bpe":
            shutil.copyfile(Path(args.tokenizer_file).expanduser(), staging / TOKENIZER_FILE)
        writer = ShardWriter(staging, args.shard_tokens, holdout, args.prefix)
        with tqdm(desc=f"prepare {out}", unit="tok", unit_scale=True, disable=args.no_progress,
                  file=sys.stderr) as bar:
            for ids in iter_encoded(tok, docs):
                writer.add(ids)
                bar.update(len(ids))
                bar.set_postfix(shards=len(writer.written), refresh=False)
        written = writer.close()
        _install(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a failed first run leaves no empty output directory behind
    return [out / f.name for f in written]


def main(argv: list[str] | None = None) -> list[Path]:
    """Parse `argv` (default: sys.argv[1:]) and prepare; raises DataError on bad input."""
    args = parse_args(argv)
    written = prepare(args)
    val = [p for p in written if "val_" in p.name]
    train = written[len(val):]
    n_val, n_train = (sum(read_header(p) for p in part) for part in (val, train))
    print(f"wrote {len(written)} shards to {args.out}: validation {n_val} tokens ({len(val)} shard(s), "
          f"{100 * n_val / (n_val + n_train):.2f}%), train {n_train} tokens ({len(train)} shard(s), "
          f"{train[0].name} .. {train[-1].name})")
    if args.tokenizer == "bpe":
        tok = get_tokenizer("bpe", str(Path(args.out) / TOKENIZER_FILE))
        print(f"its tokenizer: {Path(args.out) / TOKENIZER_FILE} ({tok.vocab_size} ids, end-of-text {tok.eot}): train "
              f"with data.tokenizer=bpe data.tokenizer_file={Path(args.out) / TOKENIZER_FILE} and model.vocab_size >= "
              f"{tok.vocab_size}")
    return written


def cli(argv: list[str] | None = None) -> int:
    """`main` as a command: one line on stderr and an exit status (mhl_jax.runtime.errors) instead of a traceback."""
    try:
        main(argv)
    except DataError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # writing failed: a full disk, permissions
        print(f"prepare: failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("prepare: interrupted; --out is as it was", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(cli())
