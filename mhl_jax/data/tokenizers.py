"""Tokenizers: byte-level (always available), and byte-level BPEs through tiktoken: GPT-2's, or any rank file.

Each turns a document into token ids; `encode_documents` concatenates documents, each one preceded
by the end-of-text token (the modded-nanogpt / FineWeb convention), so EOT separates documents.

GPT-2's vocabulary needs a file: tiktoken downloads and caches it on first use, and a machine without network reads
it from a local rank file instead (`data.tokenizer_file`, prepare's `--tokenizer-file`): tiktoken's
`r50k_base.tiktoken`, one `base64(token) rank` line per token, ranks 0..50255, which holds GPT-2's merges.
`bpe` is the same kind of tokenizer from any such rank file (`data.tokenizer_file`, required), e.g. one that
`prepare --train-tokenizer` learned on the user's corpus (bpe_train.py): GPT-2's pre-split, the end-of-text id the
number of ranks. `gpt2` is `bpe` with GPT-2's file, checked to be that size.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from mhl_jax.data.errors import DataError

BYTE_EOT = 256  # end-of-text id of the byte tokenizer (ids 0..255 are the bytes themselves)
BYTE_VOCAB = 257  # byte tokenizer vocabulary: 256 bytes + EOT (tiny configs pad it to 320)


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int  # ids are in [0, vocab_size)
    eot: int  # end-of-text id, placed before every document

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no EOT): (n,) int64."""
        ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOT = 256."""

    name = "byte"
    vocab_size = BYTE_VOCAB
    eot = BYTE_EOT

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Inverse of `encode` (EOT and ids >= 256 are dropped; invalid UTF-8 is replaced)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A tiktoken encoding; special tokens in the text are encoded as ordinary text."""

    def __init__(self, encoding, name: str) -> None:
        self._enc = encoding
        self.name = name
        self.vocab_size = int(encoding.n_vocab)
        self.eot = int(encoding.eot_token)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self._enc.encode_ordinary_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


GPT2_RANKS = 50256  # BPE tokens of GPT-2 (r50k_base); its end-of-text token is the next id
BPE_FILE_HINT = ("name a .tiktoken rank file, e.g. the tokenizer.tiktoken that `python -m mhl_jax.data.prepare "
                 "--train-tokenizer VOCAB` writes beside its shards")
GPT2_FILE_HINT = ("copy tiktoken's r50k_base.tiktoken (GPT-2's vocabulary, 50256 lines) from a machine with network "
                  "and set data.tokenizer_file=PATH (prepare: --tokenizer-file PATH)")


def _tiktoken(name: str):
    try:
        import tiktoken
    except ImportError as e:
        raise DataError(f"tokenizer {name!r} needs the tiktoken package (pip install tiktoken)") from e
    return tiktoken


def read_ranks(path: str, hint: str = GPT2_FILE_HINT) -> dict[bytes, int]:
    """A .tiktoken rank file: {token bytes: rank}, ranks exactly 0..n-1, every single byte a token (BPE starts from
    bytes: a byte without a rank could not be encoded). `hint`: where to get a file, said when it cannot be read."""
    try:
        lines = Path(path).expanduser().read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"data.tokenizer_file={path!r} cannot be read ({e.strerror or e}); {hint}") from e
    ranks: dict[bytes, int] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise DataError(f"data.tokenizer_file={path!r} line {i}: {line[:60]!r} is not 'base64(token) rank' "
                            "(the .tiktoken format)") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"data.tokenizer_file={path!r}: its {len(ranks)} ranks are not 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(f"data.tokenizer_file={path!r}: byte {missing[0]} (and {len(missing) - 1} more) has no rank; "
                        "a BPE vocabulary holds every single byte")
    return ranks


def rank_tokenizer(ranks: dict[bytes, int], name: str) -> TiktokenTokenizer:
    """The byte-level BPE of `ranks` (read_ranks) over GPT-2's pre-split; its end-of-text id is len(ranks)."""
    tiktoken = _tiktoken(name)
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-split pattern (words, numbers, spaces)

    enc = tiktoken.Encoding(name, pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    return TiktokenTokenizer(enc, name)


def bpe_tokenizer(tokenizer_file: str) -> TiktokenTokenizer:
    """The byte-level BPE of a .tiktoken rank file (n ranks: n + 1 ids, EOT n)."""
    if not tokenizer_file:
        raise DataError(f"tokenizer 'bpe' needs its rank file: data.tokenizer_file=PATH (prepare: --tokenizer-file "
                        f"PATH); {BPE_FILE_HINT}")
    return rank_tokenizer(read_ranks(tokenizer_file, BPE_FILE_HINT), "bpe")


def gpt2_tokenizer(tokenizer_file: str = "") -> TiktokenTokenizer:
    """GPT-2's BPE (50257 ids, EOT 50256), from `tokenizer_file` (a local r50k_base.tiktoken) or else from tiktoken,
    which downloads its files on first use and caches them (TIKTOKEN_CACHE_DIR, else <tmp>/data-gym-cache)."""
    tiktoken = _tiktoken("gpt2")
    if tokenizer_file:
        ranks = read_ranks(tokenizer_file)
        if len(ranks) != GPT2_RANKS:
            raise DataError(f"data.tokenizer_file={tokenizer_file!r} holds {len(ranks)} tokens, GPT-2's "
                            f"r50k_base.tiktoken {GPT2_RANKS}: it is another vocabulary (data.tokenizer=bpe reads "
                            "any rank file)")
        return rank_tokenizer(ranks, "gpt2")
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # requests/urllib errors when offline, OSError for unreadable caches
        raise DataError(
            "tokenizer 'gpt2': tiktoken could not load the GPT-2 encoding files (vocab.bpe, encoder.json): they are "
            "downloaded on first use and cached (TIKTOKEN_CACHE_DIR), and this machine has no network or no cached "
            f"copy. Either {GPT2_FILE_HINT}, or use tokenizer 'byte'. "
            f"Underlying error: {type(e).__name__}: {e}") from e
    return TiktokenTokenizer(enc, "gpt2")


def get_tokenizer(name: str, tokenizer_file: str = "") -> Tokenizer:
    """'byte', 'gpt2' (from `tokenizer_file` if given) or 'bpe' (from `tokenizer_file`, required); anything else is a
    DataError."""
    if name == "byte":
        if tokenizer_file:
            raise DataError(f"data.tokenizer_file={tokenizer_file!r} with tokenizer 'byte', which reads no file: "
                            "set data.tokenizer=gpt2 or bpe, or leave data.tokenizer_file empty")
        return ByteTokenizer()
    if name == "gpt2":
        return gpt2_tokenizer(tokenizer_file)
    if name == "bpe":
        return bpe_tokenizer(tokenizer_file)
    raise DataError(f"tokenizer {name!r}: expected 'byte' or 'gpt2', or 'bpe' with a rank file")


def iter_encoded(tokenizer: Tokenizer, docs: Iterable[str], batch: int = 256) -> Iterator[np.ndarray]:
    """[EOT] + tokens(doc) for each document, in order: each (n_i + 1,) uint32."""
    eot = np.array([tokenizer.eot], dtype=np.uint32)
    pending: list[str] = []
    for doc in docs:
        pending.append(doc)
        if len(pending) >= batch:
            for ids in tokenizer.encode_batch(pending):
                yield np.concatenate([eot, ids.astype(np.uint32)])
            pending = []
    for ids in tokenizer.encode_batch(pending) if pending else []:
        yield np.concatenate([eot, ids.astype(np.uint32)])


def encode_documents(tokenizer: Tokenizer, docs: Iterable[str], batch: int = 256) -> np.ndarray:
    """Concatenate [EOT] + tokens(doc) for every document: (n,) uint32 (n may be 0)."""
    parts = list(iter_encoded(tokenizer, docs, batch))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint32)


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """The model's embedding must cover every id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but model.vocab_size="
                        f"{vocab_size}; model.vocab_size must be >= {tokenizer.vocab_size}")
