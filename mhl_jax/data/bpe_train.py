"""Training a byte-level BPE on a corpus and writing it as a tiktoken rank file (`prepare --train-tokenizer`).

Hugging Face `tokenizers` learns the merges (fast, in Rust) over GPT-2's pre-split (its ByteLevel pre-tokenizer:
words with their leading space, numbers, punctuation, whitespace), starting from all 256 bytes. The result is written
in the `.tiktoken` format `tokenizers.read_ranks` reads, `base64(token bytes) rank` per line: ranks 0..255 are the
bytes (rank b is byte b), then each merged token in the order it was learned. Encoding then goes through tiktoken,
the code path training and generation use; the end-of-text id is the number of ranks.

tiktoken merges, in a piece, the adjacent pair whose joined bytes have the lowest rank; HF's BPE the pair whose
merge was learned first. With ranks in merge order the two give the same ids, as they do for GPT-2's own vocabulary
(tests/unit/test_bpe.py compares them on held-out text); they could differ only where a token's bytes can also be
joined from a pair that training never merged. The rank file is the tokenizer: training, evaluation and generation
all encode through it, never through HF's model. Another `tokenizers` version may learn other merges from the same
text, so a run's tokenizer.tiktoken, not the version, is what to keep.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from pathlib import Path

from mhl_jax.data.errors import DataError

MIN_VOCAB = 258  # 256 bytes, one merge and the end-of-text id: a BPE with no merge is the byte tokenizer


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 bytes (what HF's ByteLevel writes tokens in): {char: byte}. Printable
    bytes stand for themselves; the others are mapped, in order, to the code points from 256 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


def _hf_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise DataError("--train-tokenizer needs the Hugging Face tokenizers package (pip install tokenizers, or "
                        "pip install -e '.[data]')") from e
    return tokenizers


def train_hf_bpe(docs: Iterable[str], vocab_size: int):
    """A Hugging Face byte-level BPE trained on `docs` to at most `vocab_size` - 1 tokens (bytes + merges; the
    end-of-text id is the last of `vocab_size`): a `tokenizers.Tokenizer`. Fewer when the corpus runs out of pairs."""
    if vocab_size < MIN_VOCAB:
        raise DataError(f"--train-tokenizer={vocab_size}: a byte-level BPE needs >= {MIN_VOCAB} ids (256 bytes, "
                        "merges, end-of-text)")
    hf = _hf_tokenizers()
    tok = hf.Tokenizer(hf.models.BPE())
    # GPT-2's split (its regex), no space added before a text, bytes as their printable stand-ins
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
                                     special_tokens=[], show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return tok


def merge_ranks(hf_tokenizer) -> dict[bytes, int]:
    """The rank table of a trained HF byte-level BPE: {token bytes: rank}, bytes first (rank b = byte b), then the
    merged tokens in merge order (a token two merges produce keeps its first rank)."""
    alphabet = _byte_alphabet()
    model = json.loads(hf_tokenizer.to_str())["model"]  # its JSON form: the merges' one stable API across versions
    ranks = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(alphabet[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """`ranks` as a .tiktoken file, in rank order (written to a temporary name, then renamed: never half a file)."""
    body = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)


def train_rank_file(docs: Iterable[str], vocab_size: int, path: Path) -> int:
    """Train a byte-level BPE of at most `vocab_size` ids on `docs` and write its rank file to `path`; returns the
    number of ranks (the tokenizer's end-of-text id; its vocabulary is one more)."""
    ranks = merge_ranks(train_hf_bpe(docs, vocab_size))
    write_ranks(ranks, path)
    return len(ranks)
