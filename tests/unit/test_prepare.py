"""`python -m mhl_jax.data.prepare`: validation held out as a fraction spread over the input by default, and the
`fineweb10B` recipe (its shard names against the paper configs' paths; the hub unreachable).

The expected shards are cut from the token stream directly (documents' bytes, blocks of 2048), never by the writer.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from mhl_jax.config import load_config
from mhl_jax.data import BYTE_EOT, DataError
from mhl_jax.data import prepare as prepare_mod
from mhl_jax.data import recipes as recipes_mod
from mhl_jax.data.bin_shards import resolve_shards
from mhl_jax.data.prepare import cli, main

BLOCK = 2048


def read_tokens(path):
    """The tokens of a shard, read independently of mhl_jax: a 1024-byte header, then uint16."""
    return np.frombuffer(Path(path).read_bytes()[1024:], dtype="<u2")


def corpus(tmp_path, files: int, chars: int) -> list[int]:
    """`files` .txt files of `chars` ASCII characters each, and the byte-token stream prepare must read from them."""
    rng = np.random.default_rng(0)
    stream = []
    for i in range(files):
        text = "".join(rng.choice(list("abcdefgh \n"), chars))
        (tmp_path / f"part{i:02d}.txt").write_text(text)
        stream += [BYTE_EOT, *text.encode()]
    return stream


def test_default_validation_is_half_a_percent_spread_over_a_few_mb(tmp_path):
    """~1 MB in 5 files, default options: blocks 0, 200 and 400 of 2048 tokens (0.5%) validate, from the first,
    third and fifth file; the rest, in order, trains. --val-max-tokens cuts the held-out part exactly."""
    stream = np.array(corpus(tmp_path, 5, 200_000), np.uint16)
    out = tmp_path / "out"
    written = main(["--input", str(tmp_path / "*.txt"), "--tokenizer", "byte", "--out", str(out), "--no-progress"])
    assert [p.name for p in written] == ["val_000000.bin", "train_000000.bin"]
    held = [0, 200, 400]
    val = np.concatenate([stream[b * BLOCK:(b + 1) * BLOCK] for b in held])
    train = np.delete(stream, np.concatenate([np.arange(b * BLOCK, (b + 1) * BLOCK) for b in held]))
    np.testing.assert_array_equal(read_tokens(out / "val_000000.bin"), val)
    np.testing.assert_array_equal(read_tokens(out / "train_000000.bin"), train)
    main(["--input", str(tmp_path / "*.txt"), "--tokenizer", "byte", "--out", str(out), "--no-progress",
          "--overwrite", "--val-max-tokens", "3000", "--val-fraction", "0.01", "--shard-tokens", "400000"])
    held_cut = np.r_[0:BLOCK, 100 * BLOCK:100 * BLOCK + 952]  # blocks 0 and 100 at 1%, cut at 3000 tokens
    np.testing.assert_array_equal(read_tokens(out / "val_000000.bin"), stream[held_cut])
    assert sorted(p.name for p in out.iterdir()) == ["train_000000.bin", "train_000001.bin", "train_000002.bin",
                                                     "val_000000.bin"]
    got = np.concatenate([read_tokens(out / f"train_00000{i}.bin") for i in range(3)])
    np.testing.assert_array_equal(got, np.delete(stream, held_cut))


def test_an_input_of_one_block_is_refused_in_one_line(tmp_path):
    (tmp_path / "small.txt").write_text("x" * 1000)
    with pytest.raises(DataError, match=r"the input has 1001 tokens, all held out for validation by --val-fraction="
                                        r"0.005 \(at least one block of 2048 tokens\): nothing is left to train on"):
        main(["--input", str(tmp_path / "small.txt"), "--tokenizer", "byte", "--out", str(tmp_path / "o"),
              "--no-progress"])
    assert not (tmp_path / "o").exists()


@pytest.fixture
def local_fineweb(tmp_path, monkeypatch):
    """The fineweb10B recipe reading local files with the byte tokenizer, run from `tmp_path`: its names, not its
    download."""
    src = tmp_path / "src"
    src.mkdir()
    stream = corpus(src, 3, 5000)
    recipe = recipes_mod.RECIPES["fineweb10B"]
    monkeypatch.setitem(recipes_mod.RECIPES, "fineweb10B",
                        dataclasses.replace(recipe, source=str(src / "*.txt"), hf_config="", tokenizer="byte"))
    monkeypatch.chdir(tmp_path)
    return stream


def test_fineweb10B_writes_the_shards_the_paper_configs_read(local_fineweb, tmp_path):
    written = main(["fineweb10B", "--no-progress", "--val-fraction", "0.25", "--shard-tokens", "6000"])
    assert [p.as_posix() for p in written] == ["data/fineweb10B/fineweb_val_000000.bin",
                                               "data/fineweb10B/fineweb_train_000000.bin",
                                               "data/fineweb10B/fineweb_train_000001.bin"]
    data = load_config("mh_latent_moe_hp_2.2b").data  # the paths every paper config reads
    assert resolve_shards(data.path, "data.path", "train") == [Path(p) for p in written[1:]]
    assert resolve_shards(data.val_path, "data.val_path", "val") == [Path(written[0])]
    stream = np.array(local_fineweb, np.uint16)
    held = np.r_[0:BLOCK, 4 * BLOCK:5 * BLOCK]  # blocks 0 and 4 at 25%
    np.testing.assert_array_equal(read_tokens(written[0]), stream[held])
    with pytest.raises(SystemExit):  # argparse: the recipe fixes the tokenizer
        main(["fineweb10B", "--tokenizer", "gpt2"])


def test_fineweb10B_without_the_hub_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    assert cli(["fineweb10B", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("prepare: error: fineweb10B streams HuggingFaceFW/fineweb-edu (sample-10BT) from the "
                          "Hugging Face hub, which is not reachable from this machine (http://127.0.0.1:9: ")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli(["fineweb10B", "--no-progress"]) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_an_install_stopped_part_way_puts_the_old_shards_back(tmp_path, monkeypatch):
    """--overwrite replaces the shards of --out only whole: a move that stops part-way (here the second new shard's
    rename, as a Ctrl-C there would) leaves the old shards as they were, and so does a run killed in the middle (its
    set-aside shards go back when the next prepare starts)."""
    out, staging = tmp_path / "out", tmp_path / "out" / ".prepare-stage"
    staging.mkdir(parents=True)
    for name in ("train_000000.bin", "val_000000.bin"):
        (out / name).write_bytes(b"old " + name.encode())
        (staging / name).write_bytes(b"new " + name.encode())
    real, calls = Path.rename, []

    def rename(self, target):
        calls.append(self)
        if len(calls) == 4:  # 2 old shards set aside, then the second new one
            raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        prepare_mod._install(staging, out)
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in out.glob("*.bin")} == {
        "train_000000.bin": b"old train_000000.bin", "val_000000.bin": b"old val_000000.bin"}
    assert not list(out.glob(".prepare-old-*"))
    aside = out / ".prepare-old-x"  # as a kill after setting the shards aside leaves it
    aside.mkdir()
    (out / "train_000000.bin").rename(aside / "train_000000.bin")
    prepare_mod._restore_set_aside(aside, out)
    assert (out / "train_000000.bin").read_bytes() == b"old train_000000.bin" and not aside.exists()
