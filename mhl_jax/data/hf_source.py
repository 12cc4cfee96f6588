"""Hugging Face `datasets` text: local files or a dataset name, one text column, tokenized.

`data.path` is either local files (a file, a directory, or a glob of .txt/.md, .json/.jsonl,
.csv or .parquet files, optionally compressed) read with datasets' builders ("text" files are one
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


def _load_files(files: list[Path], *, split: str, streaming: bool, what: str):
    """A `datasets` split made of local data files of one format ("text" files: one document each)."""
    datasets = _import_datasets()
    builders = {_builder_of(f) for f in files}
    if None in builders:
        bad = next(f for f in files if _builder_of(f) is None)
        raise DataError(f"{what}: cannot tell the format of {str(bad)!r} from its name; expected one of "
                        f"{sorted(BUILDERS)}")
    if len(builders) > 1:
        raise DataError(f"{what} mixes formats {sorted(builders)}; use files of one kind")
    builder = builders.pop()
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files={split: [str(f) for f in files]}, split=split,
                                     streaming=streaming, **kwargs)
    except Exception as e:
        raise DataError(f"{what}: cannot read the files as {builder} ({_root_cause(e)})") from e


def _root_cause(e: BaseException) -> str:
    """The innermost cause of a `datasets` error, as "Type: first line" (its own message is often generic)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}"


def _load(spec: str, *, hf_config: str, split: str, streaming: bool, what: str):
    """A `datasets` Dataset (IterableDataset when streaming) for local files or a dataset name."""
    files = local_files(spec, what)
    if files is not None:
        return _load_files(files, split=split, streaming=streaming, what=f"{what}={spec!r}")
    datasets = _import_datasets()
    try:
        return datasets.load_dataset(spec, hf_config or None, split=split, streaming=streaming)
    except Exception as e:
        raise DataError(f"{what}={spec!r}: no local file by that name, and loading it as a Hugging Face dataset "
                        f"(config {hf_config or None!r}, split {split!r}) failed: {type(e).__name__}: {e}") from e


def _texts(ds, text_column: str, what: str) -> Iterator[str]:
    """The strings of `text_column`, row by row; bad rows and unreadable files raise DataError naming `what` (the
    config key, or prepare's option, that named the data) and the row."""
    flag = "--text-column" if what.startswith("--") else "data.text_column"
    columns = ds.column_names
    if columns is not None and text_column not in columns:
        raise DataError(f"{what} has no text column {text_column!r} ({flag}); columns: {columns}")
    row = 0
    try:
        for batch in ds.iter(batch_size=1024):
            if text_column not in batch:
                raise DataError(f"{what} has no text column {text_column!r} ({flag}); columns: {sorted(batch)}")
            for text in batch[text_column]:
                if not isinstance(text, str):
                    raise DataError(f"{what}: row {row} (counting from 0, over the files in name order) of column "
                                    f"{text_column!r} holds {type(text).__name__}, expected str")
                row += 1
                yield text
    except DataError:
        raise
    except Exception as e:  # a malformed or undecodable file met while reading (streaming)
        raise DataError(f"{what}: reading failed after {row} rows ({_root_cause(e)})") from e


def iter_documents(spec: str, *, hf_config: str = "", split: str = "train", text_column: str = "text",
                   streaming: bool = False, what: str = "data.path") -> Iterator[str]:
    """The text of every row of `spec`'s `text_column` (local files or a dataset name), in order."""
    ds = _load(spec, hf_config=hf_config, split=split, streaming=streaming, what=what)
    yield from _texts(ds, text_column, f"{what}={spec!r}")


def iter_file_documents(files: list[Path], *, text_column: str = "text", what: str = "--input") -> Iterator[str]:
    """The documents of local data files (one per .txt file, one per row of json/csv/parquet)."""
    ds = _load_files(files, split="train", streaming=True, what=what)
    yield from _texts(ds, text_column, what)


@functools.lru_cache(maxsize=4)
def hf_tokens(spec: str, hf_config: str, split: str, text_column: str, tokenizer: str, what: str) -> np.ndarray:
    """All documents of one split, EOT-separated and tokenized: (n,) uint32, read-only (cached)."""
    tok = get_tokenizer(tokenizer)
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
    train = hf_tokens(cfg.path, cfg.hf_config, cfg.hf_split, cfg.text_column, cfg.tokenizer, "data.path")
    if not cfg.val_path:
        return split_tail(train, cfg.val_fraction, f"data.path={cfg.path!r}")[0 if part == "train" else 1]
    if part == "train":
        return train
    if val_local:
        return hf_tokens(cfg.val_path, cfg.hf_config, "train", cfg.text_column, cfg.tokenizer, "data.val_path")
    return hf_tokens(cfg.path, cfg.hf_config, cfg.val_path, cfg.text_column, cfg.tokenizer, "data.val_path")
