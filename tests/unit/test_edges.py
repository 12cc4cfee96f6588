"""The data, config and newcomer edges: a train set smaller than a batch, an undecodable file, schedule defaults
that scale, configs found by name from any directory, the host-device hint, exit statuses, what the CPU default
installs and imports.

Expected values come from the inputs as the tests build them (byte offsets, windows, step counts), not from the code
under test.
"""

import builtins
import json
import re
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax import compare, infer
from mhl_jax.config import ConfigError, DataConfig, load_config
from mhl_jax.data import DataError, make_train_loader
from mhl_jax.data.bin_shards import write_shard
from mhl_jax.data.hf_source import iter_documents
from mhl_jax.data.prepare import main as prepare_main
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.moe.plan import plan_for_config
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh, mesh_shape
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.schedule import make_schedule
from mhl_jax.train.step import make_train_step

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- data


def test_train_set_smaller_than_one_batch_is_refused(tmp_path):
    """3 windows of 17 tokens and a batch of 16: refused, in one line; 16 windows: every batch holds each once."""
    T = 16
    rng = np.random.default_rng(0)
    (tmp_path / "small").mkdir()
    write_shard(tmp_path / "small" / "train_000000.bin", rng.integers(0, 300, 3 * T + 1).astype(np.uint16))
    cfg = DataConfig(source="bin", path=str(tmp_path / "small"), read_threads=1, prefetch=1)
    with pytest.raises(DataError, match=r"49 training tokens give 3 distinct sequences of 17 tokens, fewer than one "
                                        r"batch of 16 \(train.global_batch\)") as e:
        make_train_loader(cfg, seq_len=T, batch_size=16, seed=0, vocab_size=300)
    assert "\n" not in str(e.value)
    (tmp_path / "enough").mkdir()
    stream = rng.integers(0, 300, 16 * T + 1).astype(np.uint16)
    write_shard(tmp_path / "enough" / "train_000000.bin", stream)
    it = make_train_loader(DataConfig(source="bin", path=str(tmp_path / "enough"), read_threads=1, prefetch=1),
                           seq_len=T, batch_size=16, seed=0, vocab_size=300)
    windows = {tuple(stream[j * T:j * T + T + 1].tolist()) for j in range(16)}
    assert {tuple(r) for r in next(it).tolist()} == windows  # the one epoch's 16 windows, each once


def test_undecodable_file_is_named_with_its_byte_offset_and_the_rows_before_it(tmp_path):
    """A latin-1 .txt file third among UTF-8 ones: the error names it, the byte (12, by construction) and the 2 rows
    (files) read before it; a .jsonl among others: the file and the 3 rows of the file before it."""
    (tmp_path / "a.txt").write_text("first document é", encoding="utf-8")
    (tmp_path / "b.txt").write_text("second document", encoding="utf-8")
    (tmp_path / "c.txt").write_bytes(b"plain ascii " + "café".encode("latin-1"))  # é is byte 12 + 3
    (tmp_path / "d.txt").write_text("after the bad one", encoding="utf-8")
    with pytest.raises(DataError, match=r"reading failed in '.*c\.txt' at byte 15 after 2 rows \(UnicodeDecodeError"):
        list(iter_documents(str(tmp_path / "*.txt")))
    with pytest.raises(DataError, match=r"--input: reading failed in '.*c\.txt' at byte 15 after 2 rows"):
        prepare_main(["--input", str(tmp_path / "*.txt"), "--tokenizer", "byte", "--out", str(tmp_path / "out"),
                      "--no-progress"])
    assert not (tmp_path / "out").exists()
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "1.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)))
    (tmp_path / "j" / "2.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"reading failed in '.*2\.jsonl' after 3 rows"):
        list(iter_documents(str(tmp_path / "j" / "*.jsonl")))


# ----------------------------------------------------------------------------- config


def test_schedule_scales_with_total_steps_unless_set():
    def sched(*sets, path=None):
        s = load_config(path, list(sets)).schedule
        return s.warmup_steps, s.decay_steps, s.total_steps

    assert sched() == (8000, 2000, 15000)  # the paper's
    assert sched("schedule.total_steps=150") == (80, 20, 150)  # 8/15 and 2/15
    assert sched("schedule.total_steps=7") == (3, 0, 7)
    assert sched("schedule.total_steps=150", "schedule.warmup_steps=140") == (140, 10, 150)  # what is left
    assert sched("schedule.total_steps=150", "schedule.decay_steps=100") == (50, 100, 150)
    assert sched(path="mh_latent_moe_hp_2.2b") == (8000, 2000, 15000)
    assert sched("schedule.total_steps=30", path="mh_latent_moe_hp_2.2b") == (16, 4, 30)
    # the tiny default keeps its explicit schedule (make train's losses), and explicit values that do not fit are
    # refused as before
    assert sched(path="tiny_mh_latent_moe") == (20, 60, 300)
    with pytest.raises(ConfigError, match=r"schedule.warmup_steps=20 \+ decay_steps=60 exceeds schedule.total_steps="
                                          r"50; lower them, or set them to null"):
        sched("schedule.total_steps=50", path="tiny_mh_latent_moe")
    assert sched("schedule.total_steps=50", "schedule.warmup_steps=null", "schedule.decay_steps=null",
                 path="tiny_mh_latent_moe") == (26, 6, 50)


def test_configs_found_by_name_from_any_directory(tmp_path, monkeypatch):
    want = load_config(str(ROOT / "configs" / "tiny_moe.yaml"))
    monkeypatch.chdir(tmp_path)
    for spec in ("tiny_moe", "tiny_moe.yaml", "configs/tiny_moe.yaml", "mlp_0.2b"):
        assert load_config(spec).name == spec.removeprefix("configs/").removesuffix(".yaml")
    assert load_config("tiny_moe") == want
    (tmp_path / "tiny_moe.yaml").write_text("name: mine\n")  # a file here wins over the repository's config
    assert load_config("tiny_moe.yaml").name == "mine"
    with pytest.raises(ConfigError) as e:
        load_config("tiny_mo")
    assert "\n" not in str(e.value)
    assert re.search(r"config 'tiny_mo': no such file here, and no config of that name in .*configs \(configs: "
                     r"latent_moe_ep_2.2b, .*tiny_moe\)", str(e.value))
    with pytest.raises(ConfigError, match="config file 'elsewhere/tiny_moe.yaml' does not exist"):
        load_config("elsewhere/tiny_moe.yaml")  # a path of another folder is never taken for a name


def test_a_mesh_larger_than_the_cpu_devices_says_how_to_get_host_devices():
    hint = "on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count={} makes {} of them"
    with pytest.raises(ConfigError, match=re.escape("parallel.hp=2 exceeds the 1 devices of the mesh") + ".*"
                       + re.escape(hint.format(2, 2))):
        mesh_shape(load_config("tiny_mh_latent_moe", ["parallel.hp=2"]), 1)
    with pytest.raises(ConfigError, match=re.escape(hint.format(4, 4))):
        mesh_shape(load_config("tiny_mh_latent_moe", ["parallel.hp=2", "parallel.data=2"]), 2)


# ----------------------------------------------------------------------------- commands and installs


def test_every_command_exits_2_on_bad_input(tmp_path, capsys):
    from mhl_jax.data.prepare import cli as prepare_cli

    missing = str(tmp_path / "missing")
    assert prepare_cli(["--input", missing + ".txt", "--tokenizer", "byte", "--out", missing]) == 2
    assert infer.main(["evaluate", missing]) == 2
    assert compare.main([missing]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(missing in line for line in lines), lines
    (tmp_path / "doc.txt").write_text("enough text to train on " * 200)
    assert prepare_cli(["--input", str(tmp_path / "doc.txt"), "--tokenizer", "byte", "--out", missing,
                        "--no-progress"]) == 0


def test_cpu_default_imports_no_gpu_package(monkeypatch):
    """The default config's path on CPU (config, mesh, kernel plan, model, the train step traced: forward, backward,
    optimizer) never imports torch, triton or the GPU bindings. Every import statement run is watched, those of
    modules other tests loaded already included; the layout test keeps these packages out of module tops."""
    real, tried = builtins.__import__, []
    gpu = ("torch", "triton", "jax_triton", "mhl_jax.moe.gpu", "kernels.triton", "kernels.gluon", "kernels.torch")

    def watch(name, globals=None, locals=None, fromlist=(), level=0):
        if name.startswith(gpu):
            tried.append(name)
            raise ImportError(f"{name}: a GPU package on the CPU default path")
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", watch)
    cfg = load_config("tiny_mh_latent_moe", ["model.n_layers=1", "ffn.stem_layers=0", "parallel.devices=1"])
    mesh = make_mesh(cfg)
    assert plan_for_config(cfg).experts == "reference"
    model = nnx.eval_shape(lambda: build_model(cfg, executor=make_executor(cfg, mesh), mesh=mesh))  # shapes only
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    tx = make_optimizer(cfg)
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "biases": biases, "step": jnp.int32(0)}
    step = make_train_step(graphdef, tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule))
    jax.make_jaxpr(step)(state, jnp.zeros((1, cfg.train.global_batch, cfg.model.context + 1), jnp.int32))
    assert not tried


def test_make_train_installs_no_gpu_package_and_make_test_all_the_tests_need():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu = {"torch", "triton", "jax-triton"}
    names = lambda reqs: {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower() for r in reqs}  # noqa: E731
    assert not names(project["dependencies"]) & gpu
    extras = project["optional-dependencies"]
    assert names(extras["kernels"]) == gpu
    assert {"tensorboard", "tensorboardx"} <= names(extras["tensorboard"])  # the writer and the viewer
    make = (ROOT / "Makefile").read_text()
    rules = {m.group(1): m.group(2) for m in re.finditer(r"^(\S+):[^\n]*\n((?:\t[^\n]*\n)+)", make, re.M)}
    deps = {m.group(1): m.group(2) for m in re.finditer(r"^(\w+): (\S+)$", make, re.M)}
    install_train = rules[deps["train"]]
    assert "pip install" in install_train and "-e ." in install_train and "[" not in install_train
    assert all(x in rules[deps["test"]] for x in ("kernels", "data", "dev"))
