"""A byte-level BPE learned on the user's corpus (`prepare --train-tokenizer`, bpe_train.py) and `data.tokenizer: bpe`.

The rank file is checked against Hugging Face `tokenizers` itself, the trainer, on text it did not learn from: its
ids, mapped to their bytes through GPT-2's byte alphabet (written out here) and to ranks through the file (parsed
here), are what tiktoken produces from the file. The corpora are a few tens of kB of sentences made up from a word
list, so each training takes well under a second.
"""

from __future__ import annotations

import base64
import builtins
from pathlib import Path

import numpy as np
import pytest

from mhl_jax.config import ConfigError, DataConfig, load_config
from mhl_jax.data import DataError
from mhl_jax.data import prepare as prepare_mod
from mhl_jax.data.bpe_train import merge_ranks, train_hf_bpe, train_rank_file, write_ranks
from mhl_jax.data.pipeline import source_windows
from mhl_jax.data.prepare import cli, main
from mhl_jax.data.tokenizers import get_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")

SYLLABLES = ["ka", "ro", "mi", "tel", "an", "shu", "ver", "o", "ing", "ß", "ü", "é", "語", "日本", "🙂", "'s", "42"]
UNICODE = "Ünïcødé: 日本語のテキスト, emoji 🙂👍🏽, combining e\u0301, RTL שלום, nbsp\u00a0x, \r\n\t  end  "


def sentences(seed: int, n: int) -> list[str]:
    """`n` documents (seeded) of made-up words of 1 to 4 SYLLABLES, common ones more often, with spaces, newlines and
    punctuation between them."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, int(rng.integers(1, 5)))) for _ in range(400)]
    p = 1 / np.arange(1, 401)
    seps = [" ", " ", " ", ", ", ".\n", "  ", "\t"]
    return ["".join(w + str(rng.choice(seps)) for w in rng.choice(words, int(rng.integers(20, 80)), p=p / p.sum()))
            for _ in range(n)]


def gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's printable stand-in of each byte (HF ByteLevel's token alphabet), inverted: {char: byte}."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):  # the other bytes: code points 256, 257, ... in byte order
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def parse_rank_file(path: Path) -> dict[bytes, int]:
    return {base64.b64decode(t): int(r) for t, r in (line.split() for line in path.read_bytes().splitlines())}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 600-id BPE learned on 300 documents: (HF tokenizer, rank file path)."""
    hf = train_hf_bpe(sentences(0, 300), 600)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.tiktoken"
    write_ranks(merge_ranks(hf), path)
    return hf, path


def test_rank_file_encodes_held_out_text_as_hf_tokenizers_does(trained):
    hf, path = trained
    ranks = parse_rank_file(path)
    assert len(ranks) == 599 and all(ranks[bytes([b])] == b for b in range(256))  # bytes first, then 343 merges
    assert sorted(ranks.values()) == list(range(599))
    tok = get_tokenizer("bpe", str(path))
    assert (tok.name, tok.vocab_size, tok.eot) == ("bpe", 600, 599)
    chars, vocab = gpt2_byte_chars(), {i: s for s, i in hf.get_vocab().items()}
    held_out = sentences(1, 20) + [UNICODE, "unseen words: zebra quokka Ωmega, runnings cafés"]
    n_bytes = n_ids = 0
    for text in held_out:
        want = [ranks[bytes(chars[c] for c in vocab[i])] for i in hf.encode(text).ids]
        assert tok.encode(text).tolist() == want, text
        n_bytes, n_ids = n_bytes + len(text.encode()), n_ids + len(want)
    assert n_ids < n_bytes / 2  # the merges were used: well under a token per byte


def test_decode_inverts_encode_on_unicode(trained):
    tok = get_tokenizer("bpe", str(trained[1]))
    for text in [UNICODE, "", " ", "\x00\x7f\xff", "🙂" * 7, "the cat sat on the mat.\n\n", "Ω≈ç√∫˜µ≤≥÷"]:
        assert tok.decode(tok.encode(text)) == text


def test_same_input_gives_the_same_file(tmp_path):
    docs = sentences(2, 200)
    assert train_rank_file(iter(docs), 500, tmp_path / "a") == train_rank_file(iter(docs), 500, tmp_path / "b") == 499
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    train_rank_file(iter(sentences(3, 200)), 500, tmp_path / "c")  # other text: other merges
    assert (tmp_path / "c").read_bytes() != (tmp_path / "a").read_bytes()


def read_tokens(path: Path) -> np.ndarray:
    """A shard's tokens, read independently of mhl_jax: a 1024-byte header, then uint16."""
    return np.frombuffer(path.read_bytes()[1024:], dtype="<u2")


def documents_of(tokens: np.ndarray, eot: int, tok) -> list[str]:
    """The documents of an EOT-separated stream (each one preceded by EOT), decoded."""
    assert tokens[0] == eot
    cuts = np.flatnonzero(tokens == eot).tolist() + [len(tokens)]
    return [tok.decode(tokens[a + 1:b].tolist()) for a, b in zip(cuts, cuts[1:])]


def test_prepare_learns_writes_and_encodes_with_the_file(tmp_path):
    """--train-tokenizer: shards + tokenizer.tiktoken in --out, the file the one train_rank_file writes from the same
    documents, the shards those documents in order; --tokenizer bpe --tokenizer-file encodes a second run alike."""
    docs = sentences(4, 40)
    (tmp_path / "in").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "in" / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
    out = tmp_path / "out"
    written = main(["--input", str(tmp_path / "in"), "--train-tokenizer", "400", "--out", str(out), "--val-tokens",
                    "50", "--no-progress"])
    assert [p.name for p in written] == ["val_000000.bin", "train_000000.bin"]
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.tiktoken", "train_000000.bin", "val_000000.bin"]
    train_rank_file(iter(docs), 400, tmp_path / "direct.tiktoken")
    assert (out / "tokenizer.tiktoken").read_bytes() == (tmp_path / "direct.tiktoken").read_bytes()
    tok = get_tokenizer("bpe", str(out / "tokenizer.tiktoken"))
    stream = np.concatenate([read_tokens(out / "val_000000.bin"), read_tokens(out / "train_000000.bin")])
    assert documents_of(stream, 399, tok) == docs and len(stream) < sum(len(d) for d in docs) / 2

    again = tmp_path / "again"
    main(["--input", str(tmp_path / "in"), "--tokenizer", "bpe", "--tokenizer-file", str(out / "tokenizer.tiktoken"),
          "--out", str(again), "--val-tokens", "50", "--no-progress"])
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in out.iterdir()}


def test_a_failure_after_learning_leaves_out_as_it_was(tmp_path, monkeypatch):
    """The tokenizer file is staged with the shards: a run that fails while encoding (--overwrite) leaves --out's old
    shards and old tokenizer file, byte for byte, and nothing else."""
    (tmp_path / "a.txt").write_text(" ".join(sentences(5, 30)), encoding="utf-8")
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "a.txt"), "--train-tokenizer", "300", "--out", str(out), "--val-tokens", "10",
            "--no-progress"]
    main(args)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def failing(tok, docs):
        yield np.array([tok.eot], np.uint32)
        raise DataError("a bad row halfway")

    monkeypatch.setattr(prepare_mod, "iter_encoded", failing)
    with pytest.raises(DataError, match="a bad row halfway"):
        main([*args[:3], "500", *args[4:], "--overwrite"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("tokenizer_file, fragment", [
    ("", "tokenizer 'bpe' needs its rank file: data.tokenizer_file=PATH (prepare: --tokenizer-file PATH)"),
    ("nowhere.tiktoken", "data.tokenizer_file='nowhere.tiktoken' cannot be read (No such file or directory); name a "
     ".tiktoken rank file, e.g. the tokenizer.tiktoken that `python -m mhl_jax.data.prepare --train-tokenizer VOCAB`"),
    ("{tmp}/bad.tiktoken", "bad.tiktoken' line 1: b'not a rank line' is not 'base64(token) rank'"),
])
def test_bpe_tokenizer_refusals(tmp_path, tokenizer_file, fragment):
    (tmp_path / "bad.tiktoken").write_bytes(b"not a rank line\n")
    with pytest.raises(DataError) as e:
        get_tokenizer("bpe", tokenizer_file.format(tmp=tmp_path))
    assert fragment in one_line(e)


def test_config_refusals(trained):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.source=hf", "data.path=x.txt", "data.tokenizer=bpe"])
    assert "data.tokenizer='bpe' needs data.tokenizer_file=PATH, its .tiktoken rank file" in one_line(e)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.source=hf", "data.path=x.txt", f"data.tokenizer_file={trained[1]}"])
    assert "with data.tokenizer='byte', which reads no file" in one_line(e)
    load_config(None, ["data.source=bin", "data.path=x", "data.tokenizer=bpe", f"data.tokenizer_file={trained[1]}"])
    # the model's embedding must cover the file's 600 ids: refused before any shard is opened
    cfg = DataConfig(source="bin", path="no_shards_here", tokenizer="bpe", tokenizer_file=str(trained[1]))
    with pytest.raises(DataError) as e:
        source_windows(cfg, "train", seq_len=32, vocab_size=599)
    assert one_line(e) == "tokenizer 'bpe' has 600 ids but model.vocab_size=599; model.vocab_size must be >= 600"


@pytest.mark.parametrize("argv, fragment", [
    (["--tokenizer", "bpe"], "--tokenizer bpe needs --tokenizer-file PATH (a .tiktoken rank file), or learn one"),
    (["--train-tokenizer", "257"], "--train-tokenizer=257: must be in [258, 65536]"),
    (["--train-tokenizer", "70000"], "--train-tokenizer=70000: must be in [258, 65536]"),
    (["--train-tokenizer", "300", "--tokenizer", "byte"], "--train-tokenizer and --tokenizer/--tokenizer-file: give "
     "one"),
])
def test_prepare_refusals(tmp_path, capsys, argv, fragment):
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(SystemExit) as e:
        cli(["--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # argparse: usage lines, then one error line
    assert fragment in err and not (tmp_path / "out").exists()


def test_prepare_refusals_of_the_source(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cli(["--hf-dataset", "some/dataset", "--train-tokenizer", "300", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--train-tokenizer learns from --input files" in capsys.readouterr().err.strip().splitlines()[-1]
    real = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("no tokenizers here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    (tmp_path / "a.txt").write_text("some text")
    assert cli(["--input", str(tmp_path / "a.txt"), "--train-tokenizer", "300", "--out", str(tmp_path / "out"),
                "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "prepare: error: --train-tokenizer needs the Hugging Face tokenizers package (pip install tokenizers, or pip "
        "install -e '.[data]')"]
    assert not (tmp_path / "out").exists()
