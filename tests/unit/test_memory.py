"""The train state created in its shardings, and the train step's memory check (mhl_jax.runtime.state / memory)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.memory import eager_state
from mhl_jax.config import ConfigError, dump_config, load_config
from mhl_jax.parallel.mesh import make_mesh, state_shardings
from mhl_jax.runtime.autotune import AutotuneFile
from mhl_jax.runtime.memory import (
    GIB,
    DeviceMemoryError,
    StepMemory,
    check_fits,
    describe,
    device_limit,
    is_out_of_memory,
    out_of_memory_message,
    peak_in_use,
    step_memory,
)
from mhl_jax.runtime.state import init_state, state_creator
from mhl_jax.train import loop
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.state import shard_optimizer_saving
from tests.runs import ROOT, dir_snapshot, tiny

# The state of the tiny models at 2 layers (the dense stem and one MoE layer: every kind of leaf), with 32 experts:
# split 4 ways they are about half of the state, as in the 4-layer default.
STATE_SETS = ("model.n_layers=2", "ffn.num_experts=32", "train.global_batch=8", "train.micro_batch=2")


@pytest.mark.parametrize("config, axis", [("tiny_mh_latent_moe", "hp"), ("tiny_moe", "ep")])
def test_state_created_in_its_shardings_is_bitwise_the_eager_one(config, axis):
    cfg = load_config(str(ROOT / f"configs/{config}.yaml"), [f"parallel.{axis}=4", "parallel.devices=4", *STATE_SETS])
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg)
    graphdef, state, shardings = init_state(cfg, mesh, tx)
    ref_graphdef, ref = eager_state(cfg, mesh, tx)
    assert str(graphdef) == str(ref_graphdef)  # (their executors are two objects: == compares identity)
    leaves, ref_leaves = jax.tree.leaves(state), jax.tree.leaves(ref)
    assert len(leaves) == len(ref_leaves) > 50
    for a, b in zip(leaves, ref_leaves):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # every leaf is placed as state_shardings says, and the expert weights really are split: each device holds 1/4
    want = state_shardings(cfg, mesh, ref)
    for a, s in zip(leaves, jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))):
        assert a.sharding == s
    assert jax.tree.structure(shardings) == jax.tree.structure(want)
    experts = [a for p, a in jax.tree_util.tree_leaves_with_path(state["params"])
               if "experts" in jax.tree_util.keystr(p)]
    assert experts
    for a in experts:
        assert {sh.data.size for sh in a.addressable_shards} == {a.size // 4}


def test_state_creation_holds_only_each_devices_share():
    """The creating program's buffers per device (XLA's analysis): that device's shards and almost nothing else, not
    the whole model that the eager build put on the first device."""
    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), ["parallel.hp=4", "parallel.devices=4",
                                                                      *STATE_SETS])
    mesh = make_mesh(cfg)
    _, create, _ = state_creator(cfg, mesh, make_optimizer(cfg))
    state = create()
    whole = sum(a.nbytes for a in jax.tree.leaves(state))
    share = sum(sh.data.nbytes for a in jax.tree.leaves(state) for sh in a.addressable_shards
                if sh.device == mesh.devices.flat[0])
    assert share < 0.6 * whole  # the experts (split 4 ways) are about half of the model
    m = step_memory(create.lower().compile())
    assert 0 <= m.outputs - share < 4096  # (and the output tuple's table of pointers)
    assert m.outputs + m.temporaries < 0.9 * whole  # the eager build held `whole` there, then the share as well


def _memory(arguments=0.0, temporaries=0.0, outputs=0.0, aliased=0.0) -> StepMemory:
    return StepMemory(int(arguments * GIB), int(outputs * GIB), int(temporaries * GIB), int(aliased * GIB))


def test_check_fits_names_the_figures_and_what_to_change():
    cfg = load_config(str(ROOT / "configs/mh_latent_moe_hp_4.2b.yaml"))
    m = _memory(arguments=51.0, temporaries=20.0, outputs=51.0, aliased=51.0)
    check_fits(m, (int(80 * GIB), "H100"), cfg, 1)  # fits: nothing raised
    check_fits(m, None, cfg, 1)  # no limit known (CPU): nothing checked
    with pytest.raises(ConfigError) as e:
        check_fits(m, (int(60 * GIB), "NVIDIA H100 80GB HBM3"), cfg, 1)
    text = str(e.value)
    for part in ("71.00 GiB per device on 1 device(s)", "state and batch 51.00 GiB", "temporaries 20.00 GiB",
                 "60.00 GiB that JAX may allocate on each NVIDIA H100 80GB HBM3", "parallel.hp (now 1",
                 "train.micro_batch (now 4", "model.remat=block", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        assert part in text, (part, text)
    with pytest.raises(ConfigError) as e:  # the state alone does not fit: a smaller micro-batch cannot help
        check_fits(m, (int(40 * GIB), "H100"), cfg, 1)
    assert "micro_batch" not in str(e.value) and "remat" not in str(e.value) and "parallel.hp" in str(e.value)
    remat = load_config(str(ROOT / "configs/mh_latent_moe_hp_4.2b.yaml"), ["model.remat=block"])
    with pytest.raises(ConfigError) as e:  # on already: not suggested
        check_fits(m, (int(60 * GIB), "H100"), remat, 1)
    assert "remat" not in str(e.value) and "micro_batch" in str(e.value)
    moe = load_config(str(ROOT / "configs/moe_ep_2.2b.yaml"))
    with pytest.raises(ConfigError, match=r"parallel.ep \(now 1"):
        check_fits(m, (int(60 * GIB), "H100"), moe, 1)
    heads_all_split = load_config(str(ROOT / "configs/mh_latent_moe_hp_4.2b.yaml"), ["parallel.hp=8"])
    with pytest.raises(ConfigError, match=r"parallel.ep \(now 1"):  # hp at Nh = 8: ep splits each head's experts
        check_fits(m, (int(60 * GIB), "H100"), heads_all_split, 8)


def test_describe_and_out_of_memory_lines():
    m = _memory(arguments=26.0, temporaries=17.5, outputs=26.0, aliased=26.0)
    assert describe(m, None) == ("train step memory per device (XLA's estimate): 43.50 GiB = state and batch 26.00 "
                                 "+ activations and other temporaries 17.50")
    assert describe(m, (int(60 * GIB), "H100")).endswith(
        ", of 60.00 GiB that JAX may allocate on each H100 (its allocator's limit: XLA_PYTHON_CLIENT_MEM_FRACTION)")
    err = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.\nBFC ...")
    assert is_out_of_memory(err)
    assert not is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else"))
    assert not is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))  # not XLA's
    assert not is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: too many open streams"))
    line = out_of_memory_message(err, m, "training")
    assert line == ("out of memory on the device while training; the train step was estimated at 43.50 GiB per "
                    "device: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB. (a smaller "
                    "train.micro_batch or more devices, parallel.hp / parallel.ep, lower the step's memory; memory "
                    "other processes hold on the device counts too)")
    assert out_of_memory_message(err, None, "creating the state").startswith(
        "out of memory on the device while creating the state: RESOURCE_EXHAUSTED")


def test_check_fits_hints_only_what_can_help():
    cfg = load_config(str(ROOT / "configs/mh_latent_moe_hp_2.2b.yaml"), ["train.micro_batch=1"])
    with pytest.raises(ConfigError) as e:  # micro-batch 1 already: not suggested again
        check_fits(_memory(arguments=26.0, temporaries=40.0), (int(60 * GIB), "H100"), cfg, 1)
    assert "micro_batch" not in str(e.value) and "parallel.hp (now 1" in str(e.value)
    assert "shard_optimizer" not in str(e.value)  # nothing to save
    with pytest.raises(ConfigError, match=r"parallel.shard_optimizer=true \(8.23 GiB less per device: it splits"):
        check_fits(_memory(arguments=26.0, temporaries=40.0), (int(60 * GIB), "H100"), cfg, 2, int(8.23 * GIB))


@pytest.mark.parametrize("sets, devices, saving_gib", [
    (["parallel.hp=1"], 2, 8.23),  # data 2: every leaf's moments halved (16.45 -> 8.23 GiB)
    (["parallel.hp=2"], 2, 0.71),  # hp 2: only the non-expert leaves have copies
    (["parallel.hp=1"], 1, 0.0),  # one device: no copies
    (["parallel.hp=1", "parallel.shard_optimizer=true"], 2, 0.0)])  # on already
def test_shard_optimizer_saving_of_the_paper_state(sets, devices, saving_gib):
    """The saving the hint names, for the 2.2B MH-LatentMoE's abstract state (nothing allocated), against
    the counts of the state's arrays (moments 16.45 -> 8.23 GiB at data 2, 8.94 -> 8.23 at hp 2)."""
    cfg = load_config(str(ROOT / "configs/mh_latent_moe_hp_2.2b.yaml"),
                      [*sets, f"parallel.devices={devices}", "train.micro_batch=1"])
    mesh = make_mesh(cfg)
    abstract = state_creator(cfg, mesh, make_optimizer(cfg))[2]
    assert shard_optimizer_saving(cfg, mesh, abstract) / GIB == pytest.approx(saving_gib, abs=0.006)


class _FakeDevice:
    device_kind = "FakeGPU"

    def __init__(self, limit, peak):
        self.stats = {"bytes_limit": limit, "peak_bytes_in_use": peak}

    def memory_stats(self):
        return self.stats


def test_device_limit_is_the_smallest_and_peak_the_largest():
    devices = [_FakeDevice(80, 5), _FakeDevice(60, 9), _FakeDevice(70, 7)]
    assert device_limit(devices) == (60, "FakeGPU")
    assert peak_in_use(devices) == 9
    assert device_limit(jax.devices("cpu")) is None and peak_in_use(jax.devices("cpu")) is None


def test_out_of_memory_in_a_step_is_one_line_naming_the_estimate(tmp_path, monkeypatch):
    """XLA's out-of-memory error at step 2 (raised by a wrapped step: the CPU has no device limit to run into):
    DeviceMemoryError naming the phase and the step's estimate; any other runtime error passes through as it is."""
    real = loop.jit_train_step
    calls = []

    def failing_at_step_2(error):
        def make(*args, **kwargs):
            step_fn = real(*args, **kwargs)

            def wrapped(state, batch):
                calls.append(1)
                if len(calls) == 2:
                    raise error
                return step_fn(state, batch)
            wrapped.lower = step_fn.lower
            return wrapped
        return make

    cfg = tiny(tmp_path, "schedule.total_steps=3", "data.val_sequences=0")
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.\nmore")
    monkeypatch.setattr(loop, "jit_train_step", failing_at_step_2(oom))
    with pytest.raises(DeviceMemoryError) as e:
        loop.train(cfg)
    text = str(e.value)
    assert "\n" not in text and text.startswith("out of memory on the device while training; the train step was "
                                                 "estimated at 0.")
    assert "trying to allocate 2.00GiB." in text and e.value.__cause__ is oom
    calls.clear()
    other = jax.errors.JaxRuntimeError("INTERNAL: a kernel failed")
    monkeypatch.setattr(loop, "jit_train_step", failing_at_step_2(other))
    with pytest.raises(jax.errors.JaxRuntimeError) as e:
        loop.train(tiny(tmp_path, "schedule.total_steps=3", "data.val_sequences=0",
                        f"logging.run_dir={tmp_path / 'other'}"))
    assert e.value is other


class _NoDumpOption(AutotuneFile):
    """An autotuning file without XLA's dump option, which the CPU's compiler ignores: with it (a path of this test's
    own) the step's compilation could not come from the persistent cache; the dump is written by the test instead."""

    def compiler_options(self) -> dict:
        return {}


def test_a_refused_run_removes_xla_autotuning_dump(tmp_path, monkeypatch):
    """On a GPU XLA dumps its autotuning results while it compiles the step (into the run directory): a refused run
    removes that dump, so the directory it created goes too."""
    cfg = tiny(tmp_path, "schedule.total_steps=2")
    tuned = _NoDumpOption(path=tmp_path / "run" / "xla_autotune.txt")
    monkeypatch.setattr(loop, "autotune_file", lambda *a, **k: tuned)

    def limit_after_dump(devices):  # called after the compile: where XLA has written its dump on a GPU
        tuned.tmp.write_text("entries {}\n")
        return 1000, "FakeGPU"

    monkeypatch.setattr(loop, "device_limit", limit_after_dump)
    with pytest.raises(ConfigError, match="FakeGPU"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists()


def test_step_memory_reads_xla_analysis():
    f = jax.jit(lambda x: (x @ x.T).sum(), donate_argnums=())
    m = step_memory(f.lower(jax.ShapeDtypeStruct((256, 512), jnp.float32)).compile())
    assert m is not None and m.arguments == 256 * 512 * 4 and m.total >= m.arguments


def test_train_refuses_a_step_over_the_device_limit_before_writing(tmp_path, monkeypatch, capsys):
    """A limit below the step's estimate (as a GPU reports one; the CPU reports none): refused with the figures named,
    before the run directory gets any file; above it, the run goes on and logs the estimate, and its summary line
    gives the devices' peak (where the platform reports one)."""
    cfg = tiny(tmp_path, "schedule.total_steps=2")
    seen = {}

    def fake_limit(devices):
        seen["devices"] = list(devices)
        return seen["limit"], "FakeGPU 1GB"

    monkeypatch.setattr(loop, "device_limit", fake_limit)
    seen["limit"] = int(0.01 * GIB)  # above the state (0.007 GiB), below the step (0.023)
    with pytest.raises(ConfigError) as e:
        loop.train(cfg)
    assert "more than the 0.01 GiB that JAX may allocate on each FakeGPU 1GB" in str(e.value)
    assert f"train.micro_batch (now {cfg.train.micro_batch};" in str(e.value)
    assert not (tmp_path / "run").exists()  # the directory this run created is gone again: nothing written
    assert seen["devices"] == jax.local_devices()
    seen["limit"] = 64 * GIB
    monkeypatch.setattr(loop, "peak_in_use", lambda devices: 3 * GIB)
    hist = loop.train(cfg)
    assert [m["step"] for m in hist] == [1, 2]
    out = capsys.readouterr().out
    lines = [s for s in out.splitlines() if s.startswith("train step memory per device")]
    assert len(lines) == 2 and "of 0.01 GiB that JAX may allocate on each FakeGPU 1GB (" in lines[0]
    assert "of 64.00 GiB that JAX may allocate on each FakeGPU 1GB (" in lines[1]
    assert "| peak device memory 3.00 GiB |" in out.splitlines()[-1]


@pytest.mark.gpu
def test_gpu_state_bitwise_the_eager_one_and_the_memory_line(tmp_path, capsys):
    """On one GPU: the jitted creation gives the eager build's values (the GPU's own sampler and scaling), the memory
    line names the device's real limit and the summary its measured peak."""
    cfg = tiny(tmp_path, "schedule.total_steps=2", "schedule.warmup_steps=1", "schedule.decay_steps=1")
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg)
    _, state, _ = init_state(cfg, mesh, tx)
    _, ref = eager_state(cfg, mesh, tx)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loop.train(cfg)
    out = capsys.readouterr().out
    limit = device_limit(jax.local_devices())
    assert limit is not None and limit[0] > 8 * GIB
    assert f"of {limit[0] / GIB:.2f} GiB that JAX may allocate on each {limit[1]}" in out
    assert "peak device memory" in out.splitlines()[-1]


@pytest.mark.gpu
def test_gpu_running_out_of_memory_is_one_line(tmp_path, monkeypatch):
    """A step that passed the check but finds too little memory (the test's arrays take what is left once the state
    is created and the step compiled): DeviceMemoryError with one line that names the estimate, not XLA's allocator
    dump; no metrics are written."""
    cfg = tiny(tmp_path, "schedule.total_steps=2", "schedule.warmup_steps=1", "schedule.decay_steps=1")
    hogs = []

    def fill_after(compiled):
        m = step_memory(compiled)
        stats = jax.local_devices()[0].memory_stats()
        left, size = stats["bytes_limit"] - stats["bytes_in_use"], GIB
        while size >= 2**20:  # the free memory taken in chunks of 1 GiB, then of halves, down to 1 MiB
            if left >= size + 2**20:
                try:
                    hogs.append(jnp.ones((size // 4,), jnp.float32).block_until_ready())
                    left -= size
                    continue
                except jax.errors.JaxRuntimeError:
                    pass
            size //= 2
        return m

    monkeypatch.setattr(loop, "step_memory", fill_after)
    try:
        with pytest.raises(DeviceMemoryError) as e:
            loop.train(cfg)
    finally:
        hogs.clear()
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("out of memory on the device while training; the train step was estimated at 0.0")
    assert "micro_batch" in text
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_check_compiles_reports_and_writes_nothing(tmp_path):
    """train.py --check: the memory line and the verdict, status 0, no run directory left behind; on one device no
    parallel.shard_optimizer hint (nothing to split), on two the hint with its saving. The CLI runs in a process of
    its own once, on the config the other tests here train (its step compiled already: JAX's persistent cache, whose
    key holds the XLA flags, which it inherits); the 2-device verdict is the same `train(check=True)` in this
    process."""
    run = tmp_path / "a" / "run"
    config = tmp_path / "tiny.yaml"
    config.write_text(dump_config(tiny(tmp_path)))
    r = subprocess.run([sys.executable, "train.py", "--check", "--config", str(config), "--set",
                        f"logging.run_dir={run}"], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "train step memory per device (XLA's estimate)" in r.stdout
    assert "check done: the train step compiles (no device limit to check it against here); nothing was written" \
        in r.stdout
    assert not (tmp_path / "a").exists()
    assert "shard_optimizer" not in r.stdout  # one device: nothing to split
    lines = []
    assert loop.train(tiny(tmp_path, "parallel.devices=2", "train.micro_batch=4", f"logging.run_dir={run}"),
                      check=True, log=lines.append) == []
    line = next((x for x in lines if "shard_optimizer" in x), "")
    assert line.startswith("parallel.shard_optimizer=true would hold ") and " MiB less per device (AdamW's" in line, \
        lines
    assert lines[-1].startswith("check done: ") and not (tmp_path / "a").exists()


def test_check_of_a_run_with_checkpoints_changes_nothing(tmp_path, monkeypatch, capsys):
    """--check in a run directory that holds a checkpoint: says where the run would resume, reads no state and leaves
    every file as it was; over a (fake) device limit it is refused like the run itself."""
    cfg = tiny(tmp_path, "schedule.total_steps=4", "checkpoint.every=2", "data.val_sequences=0")
    loop.train(cfg, stop_after=2)
    before = dir_snapshot(tmp_path / "run")
    monkeypatch.setattr(loop.Checkpointer, "restore", lambda *a, **k: pytest.fail("--check restored the state"))
    monkeypatch.setattr(loop, "state_creator", _no_create(loop.state_creator))
    capsys.readouterr()
    assert loop.train(cfg, check=True) == []
    out = capsys.readouterr().out
    assert "check done: the train step compiles" in out and "the run would resume from step 2" in out
    monkeypatch.setattr(loop, "device_limit", lambda devices: (1000, "FakeGPU"))
    with pytest.raises(ConfigError, match="more than the 0.00 GiB that JAX may allocate on each FakeGPU"):
        loop.train(cfg, check=True)
    assert dir_snapshot(tmp_path / "run") == before


def _no_create(real):
    """state_creator whose `create` fails the test if called."""
    def wrapped(*args, **kwargs):
        graphdef, _, abstract = real(*args, **kwargs)
        return graphdef, lambda: pytest.fail("--check created the state"), abstract
    return wrapped
