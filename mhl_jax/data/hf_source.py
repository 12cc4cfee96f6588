"""Hugging Face `datasets` text: local files or a dataset name, one text column, tokenized.

`data.path` is either local files (a file, a directory, or a glob of .txt/.md, .json/.jsonl,
.csv or .parquet files, optionally compressed) read file by file with datasets' builders ("text" files are one
document each), or a dataset name (with `data.hf_config` and `data.hf_split`). Validation comes
from `data.val_path` (local files, or else the name of another split of the same dataset) or, when
that is empty, from the held-out tail of the training tokens. The whole split is tokenized in
memory when the pipeline is built: for large corpora, run `python -m mhl_jax.data.prepare` once
and train on the `.bin` shards instead.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mhl_jax.data.builtin import split_tail
from mhl_jax.data.errors import DataError
from mhl_jax.data.tokenizers import encode_documents, get_tokenizer

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".csv": "csv",
            ".parquet": "parquet"}
COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".zip"}


def _builder_of(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION:
        suffixes = suffixes[:-1]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def local_files(spec: str, what: str) -> list[Path] | None:
    """The local data files `spec` names (a file, a directory's data files, a glob), sorted; None
    when `spec` is no local path, has no glob characters, no data-file suffix and does not start with
    '/', '.' or '~' (then it is a dataset name)."""
    p = Path(spec).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _builder_of(f))
        if not files:
            raise DataError(f"{what}={spec!r}: the directory holds no data files ({', '.join(sorted(BUILDERS))})")
    elif glob.has_magic(spec):
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(spec), recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"{what}={spec!r}: the glob matches no files")
    elif _builder_of(p) or spec.startswith(("/", ".", "~")):
        raise DataError(f"{what}={spec!r}: no such file or directory")
    else:
        return None
    return files


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise DataError("reading text through Hugging Face datasets needs the datasets package "
                        "(pip install datasets)") from e
    return datasets


def _format_of(files: list[Path], what: str) -> str:
    """The one `datasets` builder that reads all of `files`; a DataError for a name of no known format or a mix."""
    builders = {_builder_of(f) for f in files}
    if None in builders:
        bad = next(f for f in files if _builder_of(f) is None)
        raise DataError(f"{what}: cannot tell the format of {str(bad)!r} from its name; expected one of "
                        f"{sorted(BUILDERS)}")
    if len(builders) > 1:
        raise DataError(f"{what} mixes formats {sorted(builders)}; use files of one kind")
    return builders.pop()


def _open_files(files: list[Path], builder: str, what: str):
    """Local data files of one format as one streaming `datasets` split ("text" files: one document each)."""
    datasets = _import_datasets()
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]}, split="train",
                                     streaming=True, **kwargs)
    except Exception as e:
        raise DataError(f"{what}: cannot read the files as {builder} ({_root_cause(e)})") from e


def _innermost(e: BaseException) -> BaseException:
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def _root_cause(e: BaseException) -> str:
    """The innermost cause of a `datasets` error, as "Type: first line" (its own message is often generic)."""
    e = _innermost(e)
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}"


def _load(spec: str, *, hf_config: str, split: str, streaming: bool, what: str):
    """A `datasets` Dataset (IterableDataset when streaming) of a Hugging Face dataset name."""
    datasets = _import_datasets()
    try:
        return datasets.load_dataset(spec, hf_config or None, split=split, streaming=streaming)
    except Exception as e:
        raise DataError(f"{what}={spec!r}: no local file by that name, and loading it as a Hugging Face dataset "
                        f"(config {hf_config or None!r}, split {split!r}) failed: {type(e).__name__}: {e}") from e


class _ReadFailed(Exception):
    """A file could not be read after `row` rows (`_texts`); the caller names the file."""

    def __init__(self, row: int, error: BaseException) -> None:
        super().__init__(row, error)
        self.row, self.error = row, error


def _texts(ds, text_column: str, what: str, batch: int = 1024, files: list[Path] | None = None) -> Iterator[str]:
    """The strings of `text_column`, row by row (`batch` at a time); a bad row raises DataError naming `what` (the
    config key, or prepare's option, that named the data) and the row, and its file when `files` are one document
    each (row i is files[i]); a file that cannot be read raises _ReadFailed."""
    flag = "--text-column" if what.startswith("--") else "data.text_column"
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise DataError(f"{what} has no text column {text_column!r} ({flag}); columns: {columns}")
    row = 0
    try:
        for chunk in ds.iter(batch_size=batch):
            if text_column not in chunk:
                raise DataError(f"{what} has no text column {text_column!r} ({flag}); columns: {sorted(chunk)}")
            for text in chunk[text_column]:
                if not isinstance(text, str):
                    of = f", {str(files[row])!r}" if files else ""
                    raise DataError(f"{what}: row {row} (counting from 0, over the files in name order{of}) of column "
                                    f"{text_column!r} holds {type(text).__name__}, expected str")
                row += 1
                yield text
    except DataError:
        raise
    except Exception as e:  # a malformed or undecodable file met while reading (streaming)
        raise _ReadFailed(row, e) from e


def _rows_until_unreadable(files: list[Path], builder: str, text_column: str, what: str) -> tuple[int, int]:
    """(index of the first of `files` that cannot be read on its own, the rows of the files before it); (-1, rows)
    when each can. Reads every file before it again: only for an error message."""
    rows = 0
    for i, path in enumerate(files):
        try:
            rows += sum(1 for _ in _texts(_open_files([path], builder, what), text_column, what))
        except (_ReadFailed, DataError):
            return i, rows
    return -1, rows


def _file_texts(files: list[Path], text_column: str, what: str) -> Iterator[str]:
    """The documents of local data files, in order; a file that cannot be read is named, with the byte where decoding
    failed (a .txt file) and the rows read before it."""
    builder = _format_of(files, what)
    # a .txt file is one document (a .zip may hold several): row i is files[i], and one row per batch costs nothing
    one_each = builder == "text" and not any(f.suffix.lower() == ".zip" for f in files)
    try:
        yield from _texts(_open_files(files, builder, what), text_column, what, 1 if one_each else 1024,
                          files if one_each else None)
    except _ReadFailed as failed:
        cause = _innermost(failed.error)
        bad, rows = ((failed.row, failed.row) if one_each else
                     _rows_until_unreadable(files, builder, text_column, what))
        # a .txt file is decoded whole, so the error's position is the byte offset in the (decompressed) file
        at = f" at byte {cause.start}" if one_each and isinstance(cause, UnicodeDecodeError) else ""
        name = f" in {str(files[bad])!r}{at}" if bad >= 0 else ""
        raise DataError(f"{what}: reading failed{name} after {rows} rows ({_root_cause(failed.error)})"
                        ) from failed.error


def iter_documents(spec: str, *, hf_config: str = "", split: str = "train", text_column: str = "text",
                   streaming: bool = False, what: str = "data.path") -> Iterator[str]:
    """The text of every row of `spec`'s `text_column` (local files or a dataset name), in order. Local files are
    always streamed (`streaming` applies to a dataset name)."""
    files = local_files(spec, what)
    if files is not None:
        yield from _file_texts(files, text_column, f"{what}={spec!r}")
        return
    ds = _load(spec, hf_config=hf_config, split=split, streaming=streaming, what=what)
    try:
        yield from _texts(ds, text_column, f"{what}={spec!r}")
    except _ReadFailed as failed:
        raise DataError(f"{what}={spec!r}: reading failed after {failed.row} rows "
                        f"({_root_cause(failed.error)})") from failed.error


def iter_file_documents(files: list[Path], *, text_column: str = "text", what: str = "--input") -> Iterator[str]:
    """The documents of local data files (one per .txt file, one per row of json/csv/parquet)."""
    yield from _file_texts(files, text_column, what)


@functools.lru_cache(maxsize=4)
def hf_tokens(spec: str, hf_config: str, split: str, text_column: str, tokenizer: str, what: str,
              tokenizer_file: str = "") -> np.ndarray:
    """All documents of one split, EOT-separated and tokenized: (n,) uint32, read-only (cached)."""
    tok = get_tokenizer(tokenizer, tokenizer_file)
    docs = iter_documents(spec, hf_config=hf_config, split=split, text_column=text_column, what=what)
    tokens = encode_documents(tok, docs)
    tokens.flags.writeable = False
    return tokens


def hf_split(cfg, part: str) -> np.ndarray:
    """Tokens of the training part (`part='train'`) or the validation part (`'val'`) per DataConfig."""
    val_local = bool(cfg.val_path) and local_files(cfg.val_path, "data.val_path") is not None
    if local_files(cfg.path, "data.path") is not None:  # local files have one split: split names do not apply
        if cfg.hf_split != "train":
            raise DataError(f"data.hf_split={cfg.hf_split!r} names a split of a Hugging Face dataset, but data.path="
                            f"{cfg.path!r} is local files, which have one; leave data.hf_split as 'train'")
        if cfg.val_path and not val_local:
            raise DataError(f"data.val_path={cfg.val_path!r} is not a local file, directory or glob (a split name "
                            f"applies to a dataset name only), and data.path={cfg.path!r} is local files: name the "
                            "validation files, or leave data.val_path empty to hold out data.val_fraction")
    train = hf_tokens(cfg.path, cfg.hf_config, cfg.hf_split, cfg.text_column, cfg.tokenizer, "data.path",
                       cfg.tokenizer_file)
    if not cfg.val_path:
        return split_tail(train, cfg.val_fraction, f"data.path={cfg.path!r}")[0 if part == "train" else 1]
    if part == "train":
        return train
    if val_local:
        return hf_tokens(cfg.val_path, cfg.hf_config, "train", cfg.text_column, cfg.tokenizer, "data.val_path",
                         cfg.tokenizer_file)
    return hf_tokens(cfg.path, cfg.hf_config, cfg.val_path, cfg.text_column, cfg.tokenizer, "data.val_path",
                     cfg.tokenizer_file)
