"""Data (issue 3): .bin shard format and prepare, the Grain pipeline, sources, and the errors.

Expected values come from an independent reading of the format (np.fromfile) and from slicing the
token stream directly, never from the pipeline under test.
"""

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from mhl_jax.config import DataConfig
from mhl_jax.data import BYTE_EOT, BYTE_VOCAB, DataError, load_val_sequences, make_train_loader
from mhl_jax.data.bin_shards import write_shard
from mhl_jax.data.builtin import builtin_tokens
from mhl_jax.data.prepare import main as prepare_main
from mhl_jax.data.tokenizers import ByteTokenizer, TiktokenTokenizer, encode_documents, get_tokenizer

MAGIC = 20240520


def read_shard(path):
    """An independent reader of the modded-nanogpt format: (header ints (3,), tokens uint16)."""
    raw = Path(path).read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    return header[:3], np.frombuffer(raw[1024:], dtype="<u2")


def doc_tokens(text):
    return [BYTE_EOT] + list(text.encode("utf-8"))


def windows_of(tokens, T):
    """All windows at stride T of a stream, as tuples (the reference the pipeline must match)."""
    n = (len(tokens) - 1) // T
    return [tuple(int(x) for x in tokens[j * T:j * T + T + 1]) for j in range(n)]


def bin_cfg(tmp, **kw):
    return DataConfig(**{"source": "bin", "path": str(tmp), "prefetch": 2, "read_threads": 2, **kw})


@pytest.fixture
def shards(tmp_path):
    """Two train shards (lengths 1000 and 733) and a val shard of distinct-ish tokens (< 300)."""
    rng = np.random.default_rng(0)
    d = tmp_path / "shards"
    d.mkdir()
    streams = [rng.integers(0, 300, n).astype(np.uint16) for n in (1000, 733)]
    for i, s in enumerate(streams):
        write_shard(d / f"train_{i:06d}.bin", s)
    val = rng.integers(0, 300, 500).astype(np.uint16)
    write_shard(d / "val_000000.bin", val)
    return d, streams, val


# ----------------------------------------------------------------------------- format and prepare


def test_prepare_round_trip_text_files(tmp_path):
    texts = {"a.txt": "Mixture of experts.\nSecond line é", "b.txt": "head parallel " * 50, "c.txt": "x"}
    for name, t in texts.items():
        (tmp_path / name).write_text(t, encoding="utf-8")
    out = tmp_path / "out"
    written = prepare_main(["--input", str(tmp_path / "*.txt"), "--tokenizer", "byte", "--out", str(out),
                            "--shard-tokens", "300", "--val-tokens", "100", "--no-progress"])
    expected = [t for name in sorted(texts) for t in doc_tokens(texts[name])]  # one document per file
    assert len(expected) == 738  # 35 + 701 + 2: val 100, then train 300, 300, 38
    order = ["val_000000.bin", "train_000000.bin", "train_000001.bin", "train_000002.bin"]
    assert sorted(p.name for p in out.iterdir()) == sorted(order)  # no temporary files left
    assert [p.name for p in written] == order
    got = []
    for name in order:
        header, tokens = read_shard(out / name)
        assert header[0] == MAGIC and header[1] == 1 and header[2] == len(tokens)
        got.append(tokens)
    assert [len(g) for g in got] == [100, 300, 300, 38]
    assert np.concatenate(got).tolist() == expected


def test_prepare_jsonl_text_column_and_refusals(tmp_path):
    rows = [{"body": f"document number {i}", "id": i} for i in range(40)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["--input", str(src), "--text-column", "body", "--tokenizer", "byte", "--out", str(out),
            "--shard-tokens", "10000", "--val-tokens", "50", "--no-progress"]
    prepare_main(args)
    expected = [t for r in rows for t in doc_tokens(r["body"])]
    got = np.concatenate([read_shard(out / "val_000000.bin")[1], read_shard(out / "train_000000.bin")[1]])
    assert got.tolist() == expected
    with pytest.raises(DataError, match="already holds shards"):
        prepare_main(args)
    prepare_main([*args, "--overwrite"])
    with pytest.raises(DataError, match="no text column 'text'"):
        prepare_main([*args[:2], "--tokenizer", "byte", "--out", str(tmp_path / "o2"), "--no-progress"])
    with pytest.raises(DataError, match="fewer than --val-tokens=100000"):
        prepare_main([*args[:4], "--tokenizer", "byte", "--out", str(tmp_path / "o3"), "--val-tokens", "100000",
                      "--no-progress"])
    with pytest.raises(DataError, match="no such file"):
        prepare_main(["--input", str(tmp_path / "missing.txt"), "--tokenizer", "byte", "--out", str(tmp_path / "o4")])
    # failed runs leave no empty output directory behind (o2 / o3 / o4 did not exist before)
    assert not any((tmp_path / o).exists() for o in ("o2", "o3", "o4"))



def test_prepare_leaves_out_as_it_was_when_it_fails(tmp_path):
    """--out is a file: refused. A bad row halfway (after shards were cut) or input too short for --val-tokens,
    with --overwrite: the error names the row, --out keeps its old shards, byte for byte, and no staging files."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(60)))
    out = tmp_path / "out"
    base = ["--tokenizer", "byte", "--out", str(out), "--shard-tokens", "2000", "--val-tokens", "500", "--no-progress"]
    prepare_main(["--input", str(good), *base])
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert len(before) >= 3
    bad = tmp_path / "bad.jsonl"  # 600 good rows (several shards' worth), then a null text
    bad.write_text("".join(json.dumps({"text": f"row {i} " * 10}) + "\n" for i in range(600))
                   + json.dumps({"text": None}) + "\n")
    with pytest.raises(DataError, match=r"row 600 \(counting from 0.*of column 'text' holds NoneType"):
        prepare_main(["--input", str(bad), *base, "--overwrite"])
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(DataError, match=r"fewer than --val-tokens=500"):
        prepare_main(["--input", str(tmp_path / "short.txt"), *base, "--overwrite"])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    (out / ".prepare-1").mkdir()  # a killed run's staging directory (same pid in a container): replaced
    (out / ".prepare-1" / "train_000000.bin").write_bytes(b"partial")
    prepare_main(["--input", str(good), *base, "--overwrite"])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(DataError, match=r"--out .*a_file' is a file; expected a directory"):
        prepare_main(["--input", str(good), "--tokenizer", "byte", "--out", str(a_file)])
    assert a_file.read_text() == "x"


def test_a_val_path_directory_without_val_names_gives_all_its_shards(shards, tmp_path):
    d, streams, val = shards
    vdir = tmp_path / "valdir"
    vdir.mkdir()
    write_shard(vdir / "shard_000.bin", val)
    v = load_val_sequences(bin_cfg(d, val_path=str(vdir), val_sequences=3), seq_len=16, vocab_size=300)
    assert all(tuple(r) in set(windows_of(val.tolist(), 16)) for r in v.tolist())
    train_only = tmp_path / "trainonly"
    train_only.mkdir()
    write_shard(train_only / "train_000000.bin", streams[0])
    with pytest.raises(DataError, match=r"holds no val .bin shards \(file names containing 'val'\)"):
        load_val_sequences(bin_cfg(train_only, val_sequences=3), seq_len=16, vocab_size=300)


# ----------------------------------------------------------------------------- the pipeline


def test_batches_are_windows_shuffled_per_epoch_and_deterministic(shards):
    d, streams, _ = shards
    T, B = 16, 8
    all_windows = windows_of(streams[0], T) + windows_of(streams[1], T)  # never across shards
    n = len(all_windows)
    assert n == 62 + 45

    def take(seed, k):
        it = make_train_loader(bin_cfg(d), seq_len=T, batch_size=B, seed=seed, vocab_size=320)
        out = [next(it) for _ in range(k)]
        assert all(b.shape == (B, T + 1) and b.dtype == np.int32 for b in out)
        return [tuple(int(x) for x in row) for b in out for row in b]

    k = -(-3 * n // B)  # batches covering three epochs (batches run across epoch ends)
    rows = take(0, k)
    assert rows == take(0, k)
    no_prefetch = make_train_loader(bin_cfg(d, prefetch=0), seq_len=T, batch_size=B, seed=0, vocab_size=320)
    assert [tuple(r) for _ in range(k) for r in next(no_prefetch).tolist()] == rows  # prefetch changes no order
    other = take(1, k)
    assert other != rows
    for e in range(3):
        epoch = rows[e * n:(e + 1) * n]
        assert sorted(epoch) == sorted(all_windows)  # each epoch: every window exactly once
    assert rows[:n] != rows[n:2 * n]  # and a different order every epoch
    assert rows[:n] != all_windows  # shuffled at all


@pytest.mark.parametrize("workers", [0, 1])
def test_iterator_state_restores_the_same_batches(shards, workers):
    d, _, _ = shards
    cfg = bin_cfg(d, worker_count=workers)
    kw = dict(seq_len=16, batch_size=8, seed=5, vocab_size=320)
    it = make_train_loader(cfg, **kw)
    for _ in range(17):  # past the first epoch (107 windows / 8)
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(6)]
    fresh = make_train_loader(cfg, **kw)
    fresh.set_state(json.loads(json.dumps(state)))  # as written to and read from a checkpoint
    got = [next(fresh) for _ in range(6)]
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    for i in (it, fresh):
        i.close()


def test_val_sequences_fixed_and_spread(shards):
    d, _, val = shards
    cfg = bin_cfg(d, val_sequences=5)
    v = load_val_sequences(cfg, seq_len=16, vocab_size=320)
    ref = windows_of(val, 16)  # 31 windows; evenly spaced picks 0, 6, 12, 18, 24
    assert v.shape == (5, 17) and v.dtype == np.int32
    assert [tuple(r) for r in v.tolist()] == [ref[i] for i in (0, 6, 12, 18, 24)]
    assert np.array_equal(v, load_val_sequences(cfg, seq_len=16, vocab_size=320))
    explicit = load_val_sequences(dataclasses.replace(cfg, path=str(d / "train_*.bin"),
                                                      val_path=str(d / "val_000000.bin")), seq_len=16, vocab_size=320)
    assert np.array_equal(v, explicit)


# ----------------------------------------------------------------------------- sources and tokenizers


def test_builtin_corpus_and_fixed_validation():
    from pydoc_data.topics import topics

    expected = [t for k in sorted(topics) for t in doc_tokens(topics[k])]
    tokens = builtin_tokens()
    assert tokens.tolist() == expected
    n_val = round(len(expected) * 0.05)
    cfg = DataConfig(val_sequences=20)
    v = load_val_sequences(cfg, seq_len=64, vocab_size=320)
    tail = windows_of(expected[-n_val:], 64)
    idx = (np.arange(20) * len(tail)) // 20
    assert [tuple(r) for r in v.tolist()] == [tail[i] for i in idx]
    assert np.array_equal(v, load_val_sequences(cfg, seq_len=64, vocab_size=320))
    # training batches come from the head only: every row is a window of the first len - n_val tokens
    head = set(windows_of(expected[:-n_val], 64))
    it = make_train_loader(cfg, seq_len=64, batch_size=16, seed=0, vocab_size=320)
    rows = [tuple(r) for _ in range(3) for r in next(it).tolist()]
    assert all(r in head for r in rows)
    with pytest.raises(DataError, match="has 257 ids but model.vocab_size=200"):
        make_train_loader(cfg, seq_len=64, batch_size=16, seed=0, vocab_size=200)


def test_hf_source_local_text_and_json(tmp_path):
    docs = [f"paragraph {i}: " + "routing experts " * (i % 7 + 1) for i in range(60)]
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i:03d}.txt").write_text(doc)
    cfg = DataConfig(source="hf", path=str(tmp_path / "doc*.txt"), val_sequences=4, val_fraction=0.2,
                     read_threads=1)
    expected = [t for doc in docs for t in doc_tokens(doc)]  # one document per .txt file
    n_val = round(len(expected) * 0.2)
    v = load_val_sequences(cfg, seq_len=32, vocab_size=320)
    tail = windows_of(expected[-n_val:], 32)
    assert [tuple(r) for r in v.tolist()] == [tail[i] for i in (np.arange(4) * len(tail)) // 4]
    head = set(windows_of(expected[:-n_val], 32))
    it = make_train_loader(cfg, seq_len=32, batch_size=4, seed=0, vocab_size=320)
    assert all(tuple(r) in head for _ in range(5) for r in next(it).tolist())
    # json lines with another text column, validation from a separate local file
    val_docs = ["held out text " * 5, "more held out text " * 5]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in val_docs))
    cfg = DataConfig(source="hf", path=str(tmp_path / "train.jsonl"), val_path=str(tmp_path / "val.jsonl"),
                     text_column="content", val_sequences=2, read_threads=1)
    v = load_val_sequences(cfg, seq_len=32, vocab_size=320)
    ref = windows_of([t for d in val_docs for t in doc_tokens(d)], 32)
    assert [tuple(r) for r in v.tolist()] == [ref[i] for i in (np.arange(2) * len(ref)) // 2]
    every = set(windows_of(expected, 32))
    it = make_train_loader(cfg, seq_len=32, batch_size=4, seed=0, vocab_size=320)
    assert all(tuple(r) in every for r in next(it).tolist())
    with pytest.raises(DataError, match="no text column 'text'"):
        make_train_loader(dataclasses.replace(cfg, text_column="text"), seq_len=32, batch_size=4, seed=0,
                          vocab_size=320)


def test_tokenizers(monkeypatch):
    tok = get_tokenizer("byte")
    assert (tok.vocab_size, tok.eot) == (BYTE_VOCAB, BYTE_EOT) == (257, 256)
    assert tok.encode("hé").tolist() == [104, 195, 169] and tok.decode(tok.encode("hé")) == "hé"
    assert encode_documents(ByteTokenizer(), ["ab", "", "c"]).tolist() == [256, 97, 98, 256, 256, 99]
    with pytest.raises(DataError, match="tokenizer 'sentencepiece'"):
        get_tokenizer("sentencepiece")
    # GPT-2 without its cached files (no network): a clear error, never a silent fallback
    import tiktoken

    def offline(name):
        raise ConnectionError(f"cannot download {name}")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match="could not load the GPT-2 encoding.*TIKTOKEN_CACHE_DIR"):
        get_tokenizer("gpt2")
    # the tiktoken wrapper itself, on a small byte-level BPE with one merge and an EOT special token
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"ab"] = 256
    enc = tiktoken.Encoding("tiny", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 257})
    wrapped = TiktokenTokenizer(enc, "tiny")
    assert (wrapped.vocab_size, wrapped.eot) == (258, 257)
    expected = [257, 256, 99, 257] + list(b"<|endoftext|>")  # special tokens in text stay text
    assert encode_documents(wrapped, ["abc", "<|endoftext|>"]).tolist() == expected


def _bpe_reference(ranks: dict[bytes, int], piece: bytes) -> list[int]:
    """Byte-pair encoding of one pre-split piece, written out: start from single bytes and merge, again and again,
    the adjacent pair whose joined bytes have the lowest rank (the leftmost on a tie), until no joined pair has one."""
    parts = [bytes([b]) for b in piece]
    while True:
        joined = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not joined:
            return [ranks[p] for p in parts]
        _, i = min(joined)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_gpt2_from_a_local_rank_file(tmp_path):
    """data.tokenizer_file: GPT-2 from a .tiktoken rank file, no download. A made-up vocabulary of GPT-2's size (the
    256 bytes, then letter pairs and triples in a shuffled order, so merges compete by rank): ids as the BPE written
    out above gives them, piece by piece over GPT-2's split into words with their leading space; EOT is 50256. (Files
    that are not such a vocabulary: the bad-input catalogue.)"""
    rng = np.random.default_rng(0)
    letters = [bytes([c]) for c in b" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pairs = [a + b for a in letters for b in letters]
    triples = [a + b + c for a in letters for b in letters for c in letters[1:]]
    # every pair is a token, so every triple can be reached by merges (as in a vocabulary BPE learned; tiktoken
    # takes a whole piece that is a token at once)
    merged = [pairs[i] for i in rng.permutation(len(pairs))] + [triples[i] for i in rng.permutation(len(triples))]
    merged = merged[:50256 - 256]
    ranks = {bytes([i]): i for i in range(256)} | {t: 256 + i for i, t in enumerate(merged)}
    path = tmp_path / "r50k_base.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))

    tok = get_tokenizer("gpt2", str(path))
    assert (tok.name, tok.vocab_size, tok.eot) == ("gpt2", 50257, 50256)
    text = "Merges compete by rank in the words of this sentence"
    pieces = [text.split(" ")[0]] + [" " + w for w in text.split(" ")[1:]]
    want = [i for p in pieces for i in _bpe_reference(ranks, p.encode())]
    assert tok.encode(text).tolist() == want and len(want) < len(text)  # merges happened
    assert tok.decode(want) == text
    assert encode_documents(tok, [text]).tolist() == [50256, *want]
