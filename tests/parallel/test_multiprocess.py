"""Runs of several JAX processes (mhl_jax.runtime.distributed): train.py's launch options, and two processes against
one with the same devices: the same losses and parameters, exact resume, a checkpoint resumed by another process
count, one set of records. On the CPU: two processes of two host devices each (gloo collectives) against one of
four; on a machine with 2 GPUs (marker gpu): a process per GPU (NCCL) against one process of both."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

from mhl_jax.config import ConfigError, load_config
from mhl_jax.parallel import expert_parallel as ep
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.checkpoint import CheckpointError
from mhl_jax.runtime.checkpoint_data import shared_data_state
from mhl_jax.runtime.distributed import ENV, Launch, parse_launch
from mhl_jax.train.records import truncate_metrics
from tests.parallel.machine import (
    Machine,
    assert_close_runs,
    assert_trained_as_one,
    free_port,
    gpus,
    here,
    two_processes_train_as_one,
)
from tests.runs import final_params, losses

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- launch options


def test_launch_options_and_environment():
    assert parse_launch(env={}) == Launch()
    got = parse_launch("node0:12355", "4", "3", "0,1", env={})
    assert got == Launch("node0:12355", 4, 3, (0, 1))
    env = {ENV["coordinator"]: "localhost:9000", ENV["num_processes"]: "2", ENV["process_id"]: "1"}
    assert parse_launch(env=env) == Launch("localhost:9000", 2, 1)
    assert parse_launch(process_id=0, env=env).process_id == 0  # an option wins over its variable
    assert parse_launch(auto=True, env={}) == Launch(auto=True)


def test_mesh_lists_devices_process_by_process(monkeypatch):
    """With several processes the mesh takes the devices by (process, id) whatever their order, so the hp axis stays
    inside a process and each process holds a contiguous range of the batch rows."""
    @dataclass(frozen=True)
    class Dev:
        id: int
        process_index: int

    devs = [Dev(i, p) for i, p in ((4, 1), (0, 0), (5, 1), (1, 0), (6, 1), (2, 0), (7, 1), (3, 0))]
    cfg = load_config("configs/tiny_mh_latent_moe.yaml", ["parallel.hp=4", "train.micro_batch=2"])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr("mhl_jax.parallel.mesh.Mesh", lambda arr, names: (arr, names))
    arr, names = make_mesh(cfg, devs)
    assert names == ("data", "hp") and [[d.id for d in row] for row in arr] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.setattr(jax, "devices", lambda: devs)
    with pytest.raises(ConfigError, match="parallel.devices=4 with 2 processes"):
        make_mesh(load_config("configs/tiny_mh_latent_moe.yaml", ["parallel.hp=4", "parallel.devices=4"]))


def test_expert_parallel_across_processes_takes_the_padded_exchange(monkeypatch):
    @dataclass(frozen=True)
    class Dev:
        id: int
        process_index: int

    class FakeMesh:
        def __init__(self, rows):
            self.devices = np.asarray([[Dev(i, p) for i, p in row] for row in rows], dtype=object)

    within = FakeMesh([[(0, 0), (1, 0)], [(2, 1), (3, 1)]])  # ep groups inside a process (data spans them)
    across = FakeMesh([[(0, 0), (1, 1)]])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert [ep.resolve_ep_impl("auto", m) for m in (None, within, across)] == ["ragged", "ragged", "padded"]
    assert ep.resolve_ep_impl("ragged", across) == "ragged"  # as asked (XLA's NCCL fallback: xla_options)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert ep.resolve_ep_impl("auto", within) == "padded"


def test_a_metrics_line_cut_short_is_dropped_on_resume(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    truncate_metrics(f, 2)
    assert f.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    f.write_text('{"step": 1, "loss": 2.0}\n{"st\n{"step": 2, "loss": 1.5}\n')
    with pytest.raises(ConfigError, match="line 2 is not a metrics record"):
        truncate_metrics(f, 2)


def test_data_state_of_another_process_count(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    with pytest.raises(CheckpointError, match="holds no iterator state file"):
        shared_data_state(d, "ck/2")
    for i in range(2):
        (d / f"process_{i}-of-2.json").write_text(json.dumps({"next_index": 3}))
    assert shared_data_state(d, "ck/2") == {"next_index": 3}  # this test process is 1 of 1
    (d / "process_1-of-2.json").unlink()
    with pytest.raises(CheckpointError, match="not one per process"):  # a file missing
        shared_data_state(d, "ck/2")
    (d / "process_1-of-2.json").write_text(json.dumps({"next_index": 5}))
    with pytest.raises(CheckpointError, match="different positions .*resume it with 2 processes"):
        shared_data_state(d, "ck/2")
    (d / "process_0-of-1.json").write_text(json.dumps({"next_index": 7}))
    assert shared_data_state(d, "ck/2") is None  # its own file: Grain's handler restores it


# ----------------------------------------------------------------------------- two processes against one


CPU = Machine(gpu=False)
# The CPU runs of this file: one MoE layer (no dense stem), as what the processes must agree on (the collectives, the
# checkpoint's shards, the records) does not depend on the depth; parallel.devices=4 (as the two processes' 2 + 2) lets
# the one-process runs go in this test process (`here`, 8 host devices) with the two processes' config. The runs that
# reach the train step with the same model and schedule share its compile (JAX's persistent cache).
SMALL = ("--set", "model.n_layers=1", "--set", "ffn.stem_layers=0", "--set", "parallel.devices=4")


def test_two_processes_train_as_one(tmp_path):
    """Two processes of 2 CPU devices each (gloo collectives; hp 4, so the heads' all-to-all crosses the processes)
    against one process of the 4: `assert_trained_as_one`, straight through, resumed by two processes and by one.
    The two processes start with AdamW's moments split over both processes' devices (parallel.shard_optimizer: the
    split state created, stepped and saved across processes) and resume step 2 with them copied: the one scenario
    covers both layouts across processes and the switch between them. The one process resumes their split checkpoint
    of step 2 with the moments copied, as the reference's; the switch the other way: test_shard_optimizer.py."""
    two, moved, one = tmp_path / "two", tmp_path / "moved", tmp_path / "one"
    here(CPU.args(one, *SMALL))  # all devices in one process, moments copied, straight through
    split = ("--set", "parallel.shard_optimizer=true")
    outs = CPU.two_processes(CPU.args(two, *SMALL, *split, "--stop-after", "2"))  # checkpoint at step 2
    assert "step 2/4" in outs[0] and "step " not in outs[1]  # process 0 alone prints
    shutil.copytree(two, moved)
    outs = CPU.two_processes(CPU.args(two, *SMALL))  # resumes step 2, the moments copied
    assert "resuming with changed settings" in outs[0] and "shard_optimizer" in outs[0], outs[0][-2000:]
    here(CPU.args(moved, *SMALL))  # the two processes' checkpoint of step 2, resumed by one process
    assert_trained_as_one(one, two, moved, rel=1e-5)


def _expert_parallel_as_one(tmp_path, machine: Machine, rel: float):
    """The tiny MoE with its experts split over both processes' devices (ep): the dispatch and the combine cross
    processes."""
    two, one = tmp_path / "two", tmp_path / "one"
    machine.two_processes(machine.args(two, moe=True))
    machine.one_process(machine.args(one, moe=True))
    ref = losses(one)
    assert len(ref) == 4
    assert_close_runs(losses(two), ref, rel)


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_gpu_two_processes_train_as_one(tmp_path):
    """With JAX's persistent compilation cache set: train.py turns it off in the runs of two processes
    (mhl_jax/runtime/autotune.py, `guard_persistent_cache`); with it on, this test's relaunch hung."""
    two_processes_train_as_one(tmp_path, Machine(gpu=True, compilation_cache=tmp_path / "jax_cache"), rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_gpu_two_processes_expert_parallel_as_one(tmp_path):
    _expert_parallel_as_one(tmp_path, Machine(gpu=True), rel=1e-4)


def test_processes_started_with_different_commands_are_refused(tmp_path):
    """Process 1 with another learning rate: both stop before anything is written, process 1 naming the key."""
    machine = Machine(gpu=False)
    runs = machine.run_two(lambda i: [*machine.args(tmp_path / "run"), *(["--set", "optimizer.lr=1e-3"] if i else [])])
    codes, errs = [c for c, _, _ in runs], [e for _, _, e in runs]
    assert codes == [2, 2], errs
    assert "config error: process(es) [1] were started with another run than process 0" in errs[0], errs[0][-2000:]
    assert ("config error: process 1 was started with another run than process 0 (optimizer.lr: process 0 0.003, "
            "this process 0.001)") in errs[1], errs[1][-2000:]
    assert not (tmp_path / "run").exists()


def test_a_run_directory_the_processes_do_not_share_is_refused(tmp_path):
    """A relative logging.run_dir from two working directories (as on two hosts' own disks): both processes stop with
    status 2, naming the process that does not see process 0's files, and leave no directory behind."""
    machine = Machine(gpu=False)
    args = [str(ROOT / "configs/tiny_mh_latent_moe.yaml") if a == "configs/tiny_mh_latent_moe.yaml" else a
            for a in machine.args("runs/x")]
    cwds = [tmp_path / "host0", tmp_path / "host1"]
    for cwd in cwds:
        cwd.mkdir()
    runs = machine.run_two(lambda i: args, cwd_of=lambda i: cwds[i])
    codes, errs = [c for c, _, _ in runs], [e for _, _, e in runs]
    assert codes == [2, 2], errs
    for err in errs:
        want = "config error: logging.run_dir='runs/x': process(es) [1] do not see process 0's files"
        assert want in err, err[-2000:]
    assert [sorted(c.iterdir()) for c in cwds] == [[], []]


def test_a_write_failing_on_process_0_stops_every_process(tmp_path):
    """config.yaml a directory: process 0's write fails; both processes stop with status 2 (the other is not left
    waiting in the first step). The write comes once the train step is compiled and the state made: the model is
    nothing to it, so the one-layer dense model, the quickest to compile."""
    run = tmp_path / "run"
    (run / "config.yaml").mkdir(parents=True)
    mlp = ("--config", "configs/tiny_mlp.yaml", "--set", "parallel.hp=1", "--set", "model.n_layers=1")
    runs = CPU.run_two(lambda i: CPU.args(run, *mlp))
    codes, errs = [c for c, _, _ in runs], [e for _, _, e in runs]
    assert codes == [2, 2], errs
    assert "config error: logging.run_dir=" in errs[0] and "cannot write the run's files" in errs[0], errs[0][-2000:]
    assert "config error: stopping: process(es) [0] failed to write the run directory's files" in errs[1], \
        errs[1][-2000:]


def test_coordinator_port_in_use_is_refused_at_once(tmp_path):
    machine = Machine(gpu=False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "train.py", *machine.args(tmp_path / "run"), "--coordinator",
                            f"localhost:{port}", "--num-processes", "2", "--process-id", "0"], cwd=ROOT,
                           env=machine.env(2), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"port {port} is already in use on process 0's host" in r.stderr, r.stderr[-2000:]


def test_a_signal_to_one_process_stops_every_process_at_one_step(tmp_path):
    """Ctrl-C (SIGINT) on process 1 alone, mid-run: the processes agree to stop before the same step (the flags they
    exchange each step), both save that step's checkpoint although checkpoint.every does not fall on it, and both
    exit with status 3; process 0 says where. The run is the tiny MoE with its experts split over both processes'
    devices (ep 4: the dispatch and the combine cross the processes; the model is nothing to the interrupt): its
    records up to that step (the losses, the evaluation of step 2) and the checkpoint saved at the signal are those of
    one process of the 4 devices stopped at that step."""
    log = [tmp_path / f"p{i}.txt" for i in range(2)]
    port = free_port()
    run, one = tmp_path / "run", tmp_path / "one"
    extra = (*SMALL, "--set", "schedule.total_steps=400", "--set", "checkpoint.every=1000", "--set",
             "data.eval_every=2", "--set", "logging.log_every=1")
    procs = [subprocess.Popen([sys.executable, "train.py", *CPU.args(run, *extra, moe=True), "--coordinator",
                               f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)], cwd=ROOT,
                              env=CPU.env(2), stdout=open(log[i], "w"), stderr=subprocess.STDOUT) for i in range(2)]
    try:
        deadline = time.time() + 300
        while "step 3/400" not in log[0].read_text():
            assert time.time() < deadline and procs[0].poll() is None, log[0].read_text()[-2000:]
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGINT)
        assert [p.wait(timeout=60) for p in procs] == [3, 3], [f.read_text()[-2000:] for f in log]
    finally:
        for p in procs:
            p.kill()
    out = log[0].read_text()
    stopped = [line for line in out.splitlines() if line.startswith("interrupted at step ")]
    assert len(stopped) == 1 and stopped[0].endswith(": checkpoint saved; run the same command to resume"), out[-2000:]
    step = int(stopped[0].split()[3].rstrip(":"))
    assert 3 <= step < 400 and f"step {step}/400" in out and f"step {step + 1}/400" not in out, out[-2000:]
    assert [p.name for p in (run / "checkpoints").iterdir()] == [str(step)]
    assert sorted(p.name for p in (run / "checkpoints" / str(step) / "data").glob("process_*")) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    assert "Traceback" not in out + log[1].read_text()

    here(CPU.args(one, *extra, "--stop-after", str(step), moe=True))
    ref = losses(one)
    assert len(ref) == step and ref[1][2] is not None
    assert_close_runs(losses(run), ref, rel=1e-5)
    (sa, la), (sb, lb) = final_params(run), final_params(one)
    assert sa == sb == step and len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_distributed_auto_without_a_cluster_says_so(tmp_path):
    env = {k: v for k, v in Machine(gpu=False).env(2).items() if not k.startswith(("SLURM_", "OMPI_", "KUBERNETES_"))}
    r = subprocess.run([sys.executable, "train.py", *Machine(gpu=False).args(tmp_path / "run"), "--distributed-auto"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "config error: --distributed-auto found no cluster to join" in r.stderr, \
        r.stderr[-2000:]
    assert not (tmp_path / "run").exists()
