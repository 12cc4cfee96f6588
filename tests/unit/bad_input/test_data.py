"""Bad data: damaged or missing .bin shards, text sources and tokenizers, and prepare's inputs."""

from __future__ import annotations

import base64
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from mhl_jax.config import DataConfig
from mhl_jax.data import DataError, load_val_sequences, make_train_loader, prepare
from mhl_jax.data.bin_shards import resolve_shards, write_shard
from mhl_jax.data.pipeline import source_windows
from mhl_jax.data.tokenizers import get_tokenizer
from tests.unit.bad_input.catalogue import LOADER, Section, calls, check_refused, without

# ============================================================================= data: .bin shards

SHARDS = Section("shards")


def _bin(path, **kw) -> DataConfig:
    return DataConfig(**{"source": "bin", "path": str(path), "prefetch": 2, "read_threads": 2, **kw})


def _shard(tmp: Path, name: str = "train_000000.bin", n: int = 1000, top: int = 300) -> Path:
    path = tmp / name
    write_shard(path, np.random.default_rng(0).integers(0, top, n).astype(np.uint16))
    return path


def _damaged(mutate):
    """A shard of 1000 tokens with `mutate(bytearray)` applied, given to the train loader."""
    def provoke(tmp, mp):
        path = _shard(tmp, "damaged.bin")
        path.write_bytes(bytes(mutate(bytearray(path.read_bytes()))))
        return partial(make_train_loader, _bin(path), **LOADER)
    return provoke


def _header(i: int, value: int):
    def mutate(raw):
        raw[4 * i:4 * i + 4] = np.int32(value).tobytes()
        return raw
    return mutate


SHARDS.add("missing", DataError, "nope': no such file or directory",
           lambda tmp, mp: partial(make_train_loader, _bin(tmp / "nope"), **LOADER))
SHARDS.add("empty-spec", DataError, "data.path is empty: expected a directory, glob or file of .bin shards",
           calls(resolve_shards, ""))
SHARDS.add("no-train-shards", DataError, "the directory holds no train .bin shards (file names containing 'train')",
           lambda tmp, mp: partial(make_train_loader, _bin(tmp), **LOADER))
SHARDS.add("directory-named-bin", DataError, "the directory holds no train .bin shards", lambda tmp, mp: (
    (tmp / "s" / "train_x.bin").mkdir(parents=True), partial(make_train_loader, _bin(tmp / "s"), **LOADER))[1])
SHARDS.add("glob-matches-nothing", DataError, "fineweb_*.bin': the glob matches no shard files (python -m "
           "mhl_jax.data.prepare writes them",
           lambda tmp, mp: partial(make_train_loader, _bin(tmp / "fineweb_*.bin"), **LOADER))
SHARDS.add("wrong-magic", DataError, "damaged.bin': wrong magic number 12345, expected 20240520",
           _damaged(_header(0, 12345)))
SHARDS.add("wrong-version", DataError, "damaged.bin': unsupported version 7, expected 1", _damaged(_header(1, 7)))
SHARDS.add("negative-count", DataError, "damaged.bin': negative token count -5 in the header", _damaged(_header(2, -5)))
SHARDS.add("truncated-tokens", DataError, "damaged.bin' is truncated: the header promises 1000 tokens",
           _damaged(lambda raw: raw[:-10]))
SHARDS.add("truncated-header", DataError, "damaged.bin' is truncated: 100 bytes, shorter than the 1024-byte header",
           _damaged(lambda raw: raw[:100]))
SHARDS.add("bytes-after-tokens", DataError, "damaged.bin': 2 bytes after the 1000 tokens the header promises",
           _damaged(lambda raw: raw + b"\0\0"))


@SHARDS.refusal(DataError, "vocab.bin': token id 400 >= model.vocab_size=320 (first offending token at position 321)")
def token_past_vocab(tmp, mp):
    tokens = np.zeros(1000, np.uint16)
    tokens[321] = 400
    write_shard(tmp / "vocab.bin", tokens)
    return partial(make_train_loader, _bin(tmp / "vocab.bin"), **LOADER)


@SHARDS.refusal(DataError, "short.bin]: 16 tokens in 1 stream(s) hold no sequence of 17 tokens (model.context + 1)")
def shorter_than_a_sequence(tmp, mp):
    write_shard(tmp / "short.bin", np.arange(16, dtype=np.uint16))
    return partial(make_train_loader, _bin(tmp / "short.bin"), **LOADER)


@SHARDS.refusal(DataError, "val_000000.bin]: 500 validation tokens give 31 sequences of 17 tokens, fewer than "
                           "data.val_sequences=100")
def validation_set_too_small(tmp, mp):
    _shard(tmp)
    _shard(tmp, "val_000000.bin", 500)
    return partial(load_val_sequences, _bin(tmp, val_sequences=100), seq_len=16, vocab_size=320)


@SHARDS.refusal(DataError, "data.source='bin' with data.path=")
def one_shard_without_val_path(tmp, mp):
    return partial(load_val_sequences, _bin(_shard(tmp), val_sequences=2), seq_len=16, vocab_size=320)


@SHARDS.refusal(DataError, "the directory holds no val .bin shards (file names containing 'val')")
def directory_without_val_shards(tmp, mp):
    _shard(tmp)
    return partial(load_val_sequences, _bin(tmp, val_sequences=2), seq_len=16, vocab_size=320)


SHARDS.add("write-2d", DataError, "tokens must be 1-D, got shape (2, 2)",
           lambda tmp, mp: partial(write_shard, tmp / "x.bin", np.zeros((2, 2))))
SHARDS.add("write-past-uint16", DataError, "token ids must be in [0, 65536), got [0, 70000]",
           lambda tmp, mp: partial(write_shard, tmp / "x.bin", np.array([0, 70000])))


def test_without_verify_tokens_the_shard_past_the_vocab_is_taken(tmp_path):
    """The control of shards/token-past-vocab: data.verify_tokens=false turns that check, and only it, off."""
    token_past_vocab(tmp_path, None)
    assert next(make_train_loader(_bin(tmp_path / "vocab.bin", verify_tokens=False), **LOADER)).shape == (4, 17)


# ============================================================================= data: text sources, tokenizers, pipeline

TEXT = Section("text")
TEXT_LOADER = dict(seq_len=32, batch_size=4, seed=0, vocab_size=320)


def _hf(tmp_name: str, content: str | None = None, **kw):
    """The train loader of data.source=hf over tmp/`tmp_name` (written with `content` when given)."""
    def provoke(tmp, mp):
        if content is not None:
            (tmp / tmp_name).write_text(content)
        return partial(make_train_loader, DataConfig(source="hf", path=str(tmp / tmp_name), read_threads=1, **kw),
                       **TEXT_LOADER)
    return provoke


ROWS = "".join(json.dumps({"content": "some words " * 30}) + "\n" for _ in range(40))
TEXT.add("glob-matches-nothing", DataError, "*.jsonl': the glob matches no files", _hf("*.jsonl"))
TEXT.add("path-typo", DataError, "data.path='corpus.txt': no such file or directory",
         calls(make_train_loader, DataConfig(source="hf", path="corpus.txt"), **TEXT_LOADER))
TEXT.add("directory-without-data-files", DataError, "the directory holds no data files (.csv, .json", _hf("."))
TEXT.add("unknown-format", DataError, "cannot tell the format of", _hf("notes.dat", "text"))
# then "cannot read the files as json" or "reading failed after 1 rows", as the datasets version reads it
TEXT.add("malformed-jsonl", DataError, "broken.jsonl': ",
         _hf("broken.jsonl", '{"text": "fine"}\n{"text": "unterminated\n'))
TEXT.add("no-text-column", DataError, "ok.jsonl' has no text column 'text' (data.text_column); columns: ['content']",
         _hf("ok.jsonl", ROWS))
TEXT.add("split-of-local-files", DataError, "data.hf_split='test' names a split of a Hugging Face dataset",
         _hf("ok.jsonl", ROWS, text_column="content", hf_split="test"))
TEXT.add("too-short", DataError, "tiny.txt' (train): 9 tokens in 1 stream(s) hold no sequence of 33 tokens",
         _hf("tiny.txt", "too short", val_fraction=0.1))


@TEXT.refusal(DataError, "data.val_path='validation' is not a local file, directory or glob")
def split_name_as_val_path(tmp, mp):
    (tmp / "ok.jsonl").write_text(ROWS)
    cfg = DataConfig(source="hf", path=str(tmp / "ok.jsonl"), val_path="validation", text_column="content",
                     val_sequences=2, read_threads=1)
    return partial(load_val_sequences, cfg, seq_len=32, vocab_size=320)


@TEXT.refusal(DataError, "data.path='org/corpus': no local file by that name, and loading it as a Hugging Face "
                         "dataset (config 'cfg', split 'train') failed: ConnectionError")
def dataset_name_offline(tmp, mp):
    import datasets  # optional: the hf source's reader

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    mp.setattr(datasets, "load_dataset", offline)
    return partial(make_train_loader, DataConfig(source="hf", path="org/corpus", hf_config="cfg"), **TEXT_LOADER)


@TEXT.refusal(DataError, "mixes formats ['json', 'text']; use files of one kind")
def mixed_formats(tmp, mp):
    (tmp / "a.txt").write_text("words")
    (tmp / "b.jsonl").write_text(ROWS)
    return partial(make_train_loader, DataConfig(source="hf", path=str(tmp)), **TEXT_LOADER)


@TEXT.refusal(DataError, "reading text through Hugging Face datasets needs the datasets package")
def datasets_missing(tmp, mp):
    without(mp, "datasets")
    (tmp / "ok.jsonl").write_text(ROWS)
    return partial(make_train_loader, DataConfig(source="hf", path=str(tmp / "ok.jsonl")), **TEXT_LOADER)


@TEXT.refusal(DataError, "tokenizer 'gpt2' needs the tiktoken package (pip install tiktoken)")
def tiktoken_missing(tmp, mp):
    without(mp, "tiktoken")
    return partial(get_tokenizer, "gpt2")


TEXT.add("tokenizer-unknown", DataError, "tokenizer 'sentencepiece': expected 'byte' or 'gpt2'",
         calls(get_tokenizer, "sentencepiece"))


@TEXT.refusal(DataError, "tokenizer 'gpt2': tiktoken could not load the GPT-2 encoding files")
def gpt2_files_offline(tmp, mp):
    import tiktoken  # optional: the gpt2 tokenizer's

    def offline(name):
        raise ConnectionError(f"cannot download {name}")

    mp.setattr(tiktoken, "get_encoding", offline)
    return partial(get_tokenizer, "gpt2")


def _rank_file(tmp, body: bytes) -> str:
    (tmp / "r50k_base.tiktoken").write_bytes(body)
    return str(tmp / "r50k_base.tiktoken")


BYTE_RANKS = b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256))
TEXT.add("tokenizer-file-missing", DataError, "data.tokenizer_file='nowhere.tiktoken' cannot be read (No such file or "
         "directory); copy tiktoken's r50k_base.tiktoken (GPT-2's vocabulary, 50256 lines) from a machine with "
         "network and set data.tokenizer_file=PATH", calls(get_tokenizer, "gpt2", "nowhere.tiktoken"))
TEXT.add("tokenizer-file-with-byte", DataError, "data.tokenizer_file='r50k_base.tiktoken' with tokenizer 'byte', "
         "which reads no file", calls(get_tokenizer, "byte", "r50k_base.tiktoken"))
for _id, _body, _msg in [
        ("tokenizer-file-line", b"YQ== 0\nnot-base64! 1\n", "line 2: b'not-base64! 1' is not 'base64(token) rank' "
         "(the .tiktoken format)"),
        ("tokenizer-file-ranks", BYTE_RANKS.replace(b" 7\n", b" 700\n"), "its 256 ranks are not 0..255, each once"),
        ("tokenizer-file-bytes", b"YQ== 0\n", "byte 0 (and 254 more) has no rank; a BPE vocabulary holds every "
         "single byte"),
        ("tokenizer-file-size", BYTE_RANKS, "holds 256 tokens, GPT-2's r50k_base.tiktoken 50256: it is another "
         "vocabulary")]:
    TEXT.add(_id, DataError, _msg, lambda tmp, mp, body=_body: partial(get_tokenizer, "gpt2", _rank_file(tmp, body)))
TEXT.add("vocab-below-tokenizer", DataError, "tokenizer 'byte' has 257 ids but model.vocab_size=200; "
         "model.vocab_size must be >= 257", calls(make_train_loader, DataConfig(), seq_len=64, batch_size=16, seed=0,
                                                 vocab_size=200))
TEXT.add("val-fraction", DataError, "data.val_fraction=1.5: must be in (0, 1) to hold out a tail of the built-in "
         "corpus", calls(load_val_sequences, DataConfig(val_fraction=1.5), seq_len=32, vocab_size=320))
TEXT.add("prefetch-negative", DataError, "data.prefetch=-1, data.worker_count=0: must be >= 0",
         calls(make_train_loader, DataConfig(prefetch=-1), **TEXT_LOADER))
TEXT.add("batch-zero", DataError, "batch_size=0: must be >= 1",
         calls(make_train_loader, DataConfig(), seq_len=32, batch_size=0, seed=0, vocab_size=320))
TEXT.add("hf-without-path", DataError, "data.source='hf' needs data.path (local data files or a dataset name)",
         calls(make_train_loader, DataConfig(source="hf"), **TEXT_LOADER))
TEXT.add("source-unknown", DataError, "data.source='s3': expected 'builtin', 'bin' or 'hf'",
         calls(make_train_loader, DataConfig(source="s3"), **TEXT_LOADER))
TEXT.add("val-sequences-negative", DataError, "data.val_sequences=-1: must be >= 0",
         calls(load_val_sequences, DataConfig(val_sequences=-1), seq_len=32, vocab_size=320))
TEXT.add("part", DataError, "part='test': expected 'train' or 'val'",
         calls(source_windows, DataConfig(), "test", seq_len=32, vocab_size=320))
TEXT.add("sequence-length", DataError, "seq_len=0, vocab_size=320: must be positive",
         calls(source_windows, DataConfig(), "train", seq_len=0, vocab_size=320))


# ============================================================================= data: python -m mhl_jax.data.prepare

PREPARE = Section("prepare")


def _prepare(*argv: str, text: str | None = "abcd", shards_there: bool = False):
    """prepare's main over tmp/in.txt holding `text` (none: no such file) into tmp/out (holding shards when
    `shards_there`), with `argv` after the defaults (the byte tokenizer, --val-tokens 100)."""
    def provoke(tmp, mp):
        if text is not None:
            (tmp / "in.txt").write_text(text)
        if shards_there:
            (tmp / "out").mkdir()
            _shard(tmp / "out", "train_000000.bin")
            _shard(tmp / "out", "val_000000.bin")
        args = ["--input", str(tmp / "in.txt"), "--tokenizer", "byte", "--out", str(tmp / "out"), "--val-tokens",
                "100", "--no-progress"]
        return partial(prepare.main, [*args, *(a.format(tmp=tmp) for a in argv)])
    return provoke


PREPARE.add("input-missing", DataError, "in.txt': no such file or directory", _prepare(text=None))
PREPARE.add("input-not-a-path", DataError, "--input 'no_such_input': no such file, directory or glob match",
            _prepare("--input", "no_such_input"))
PREPARE.add("fewer-than-val-tokens", DataError, "the input has 5 tokens, fewer than --val-tokens=100 plus at least "
            "one training token", _prepare())
PREPARE.add("out-holds-shards", DataError, "out' already holds shards (train_000000.bin, ...); choose an empty "
            "directory or pass --overwrite", _prepare("--val-tokens", "2", shards_there=True))
PREPARE.add("overwrite-keeps-shards-on-failure", DataError, "fewer than --val-tokens=100",
            _prepare("--overwrite", shards_there=True))
PREPARE.add("out-is-a-file", DataError, "in.txt' is a file; expected a directory (made if absent)",
            _prepare("--out", "{tmp}/in.txt"))
PREPARE.add("out-cannot-be-created", DataError, "in.txt/out' cannot be created", _prepare("--out", "{tmp}/in.txt/out"))


@PREPARE.refusal(DataError, "--input has no text column 'text' (--text-column); columns: ['body']")
def input_without_text_column(tmp, mp):
    (tmp / "in.jsonl").write_text(json.dumps({"body": "words " * 40}) + "\n")
    return partial(prepare.main, ["--input", str(tmp / "in.jsonl"), "--tokenizer", "byte", "--out", str(tmp / "out"),
                                  "--val-tokens", "10", "--no-progress"])


@PREPARE.refusal(DataError, "row 2 (counting from 0, over the files in name order) of column 'text' holds NoneType, "
                            "expected str")
def input_row_without_text(tmp, mp):
    (tmp / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("words " * 40, "more", None)))
    return partial(prepare.main, ["--input", str(tmp / "in.jsonl"), "--tokenizer", "byte", "--out", str(tmp / "out"),
                                  "--val-tokens", "10", "--no-progress"])


# ============================================================================= every row, checked alike (catalogue.py)

@pytest.mark.parametrize("provoke, error, fragment", [*SHARDS, *TEXT, *PREPARE])
def test_refused_in_one_line_leaving_nothing_behind(provoke, error, fragment, tmp_path, monkeypatch):
    check_refused(provoke, error, fragment, tmp_path, monkeypatch)
