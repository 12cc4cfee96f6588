"""Where the tests' runs of several processes go (the CPU's host devices or 2 GPUs), and the check they share: two
processes of one run train as one process of all the devices. On the CPU the one-process runs go in the test process
(`here`)."""

import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from mhl_jax.config import load_config
from mhl_jax.train.loop import train
from tests.runs import ROOT, common, final_params, losses


def gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except Exception:
        return 0


class Machine:
    """Where a run's processes go: the CPU (4 host devices, 2 per process, gloo) or 2 GPUs (1 per process)."""

    def __init__(self, gpu: bool, compilation_cache=None):
        self.gpu = gpu
        self.devices = 2 if gpu else 4
        self.compilation_cache = compilation_cache  # JAX's persistent compilation cache for every run, if given

    def args(self, run_dir, *extra, moe: bool = False):
        """The tiny MH-LatentMoE over all devices with hp (moe: the tiny MoE with ep), 4 steps."""
        model = ["--config", "configs/tiny_moe.yaml", "--set", f"parallel.ep={self.devices}"] if moe else \
            ["--set", f"parallel.hp={self.devices}"]
        return [*common(run_dir), "--set", "schedule.total_steps=4", "--set", "train.micro_batch=1", *model, *extra]

    def env(self, devices: int) -> dict:
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        if self.gpu:
            env["XLA_FLAGS"] = ""
            env.pop("JAX_PLATFORMS", None)
            env.pop("TRITON_INTERPRET", None)
        else:
            env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        if self.gpu:  # GPUs: only with a cache of the test's own (test_gpu_relaunch_with_the_compilation_cache)
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
        if self.compilation_cache is not None:
            env.update(JAX_COMPILATION_CACHE_DIR=str(self.compilation_cache),
                       JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        return env

    def one_process(self, args):
        r = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                           env=self.env(self.devices), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]

    def run_two(self, args_of, cwd_of=lambda i: ROOT) -> list[tuple[int, str, str]]:
        """Both processes of a run (half the devices each), process i with `args_of(i)` in `cwd_of(i)`:
        [(exit status, stdout, stderr)]."""
        port = free_port()
        per = self.devices // 2
        procs = []
        for i in range(2):
            own = ["--local-device-ids", ",".join(str(i * per + j) for j in range(per))] if self.gpu else []
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args_of(i), "--coordinator",
                                           f"localhost:{port}", "--num-processes", "2", "--process-id", str(i), *own],
                                          cwd=cwd_of(i), env=self.env(per), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        try:
            outs = [p.communicate(timeout=600) for p in procs]
            return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
        finally:
            for p in procs:
                p.kill()

    def two_processes(self, args) -> list[str]:
        """Both processes of a run that must succeed; their stdout."""
        runs = self.run_two(lambda i: args)
        for code, _, err in runs:
            assert code == 0, err[-3000:]
        return [out for _, out, _ in runs]


def here(args) -> list[dict]:
    """`python train.py ARGS` of one process, run in this test process instead: the same config (train.py's --config
    and --set) through the same `train`, without a process start and with this process's compiles reused. ARGS must
    set parallel.devices (this process has 8 host devices). Where the process boundary is what a test checks, the
    runs go through `Machine`."""
    config, sets, stop_after, resume = "configs/tiny_mh_latent_moe.yaml", [], None, None
    for flag, value in zip(args[::2], args[1::2]):
        if flag == "--config":
            config = value
        elif flag == "--set":
            sets.append(value)
        elif flag == "--stop-after":
            stop_after = int(value)
        elif flag == "--resume":
            resume = value
        else:
            raise ValueError(f"here: {flag} is not an option of a one-process run")
    cfg = load_config(str(ROOT / config), sets)
    assert cfg.parallel.devices != -1, "here: set parallel.devices (this process's 8 host devices are not the run's)"
    return train(cfg, resume=resume, stop_after=stop_after)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def assert_close_runs(a, b, rel):
    assert [s for s, *_ in a] == [s for s, *_ in b]
    for (_, la, va), (_, lb, vb) in zip(a, b):
        assert la == pytest.approx(lb, rel=rel) and (va is None) == (vb is None)
        assert va is None or va == pytest.approx(vb, rel=rel)


def two_processes_train_as_one(tmp_path, machine: Machine, rel: float, *extra: str):
    """Two processes of one run against one process of all devices: the losses, and the parameters and optimizer
    state after 4 steps, straight through, resumed by two processes and by one. Every run compiles with the GEMM
    kernels that the one-process run tuned (train.xla_autotune_file, a no-op on the CPU): left to tune its own, each
    process may pick other kernels, and AdamW turns their rounding in near-zero gradients into whole updates (a 2-GPU
    run's parameters differed by 3% at 5 of 16384 elements)."""
    two, moved, one = tmp_path / "two", tmp_path / "moved", tmp_path / "one"
    tuned = ["--set", f"train.xla_autotune_file={tmp_path / 'tuned.txt'}", *extra]
    machine.one_process(machine.args(one, *tuned))  # all devices in one process, straight through (tunes, writes)
    assert not machine.gpu or (tmp_path / "tuned.txt").is_file()
    outs = machine.two_processes(machine.args(two, "--stop-after", "2", *tuned))  # checkpoint at step 2
    assert "step 2/4" in outs[0] and "step " not in outs[1]  # process 0 alone prints
    shutil.copytree(two, moved)
    machine.two_processes(machine.args(two, *tuned))  # resumes step 2 with two processes
    machine.one_process(machine.args(moved, *tuned))  # the two processes' checkpoint of step 2, resumed by one process

    assert_trained_as_one(one, two, moved, rel)


def assert_trained_as_one(one, two, moved, rel: float):
    """Runs `two` (two processes, resumed by two at step 2) and `moved` (their checkpoint of step 2 resumed by one
    process) against `one` (one process, straight through 4 steps): the losses, and the parameters and optimizer
    state of step 4."""
    ref = losses(one)
    assert len(ref) == 4 and ref[-1][2] is not None
    assert_close_runs(losses(two), ref, rel)  # one record per step: process 1 writes none
    assert_close_runs(losses(moved), ref, rel)
    assert (two / "checkpoints" / "2" / "data" / "process_1-of-2.json").is_file()
    for other in (two, moved):
        (sa, la), (sb, lb) = final_params(other), final_params(one)
        assert sa == sb == 4 and len(la) == len(lb)
        for x, y in zip(la, lb):
            np.testing.assert_allclose(x, y, rtol=10 * rel, atol=1e-6)

