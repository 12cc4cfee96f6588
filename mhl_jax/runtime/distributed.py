"""Several JAX processes in one run (one per host, or one per GPU of a host): `jax.distributed` set up from
train.py's options, and the helpers the loop uses so that every process runs the same steps.

A run of P processes is one program on one mesh: every process builds the same model, reads the same global batch
(B x (T + 1) int32 tokens per step, e.g. 2 MiB at B 256, T 2048: cheap beside a step) and hands the devices its
own rows of it, so a run's losses do not depend on how its devices are split into processes. Process 0 alone writes
the run directory's files (config.yaml, metrics.jsonl, the progress line); Orbax writes each process's shards of a
checkpoint, so `logging.run_dir` must be on a filesystem every process sees (one host: any directory).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils as mh
from orbax.checkpoint import multihost as ocp_multihost

from mhl_jax.config import ConfigError
from mhl_jax.runtime.checkpoint_tree import changed_leaves

ENV = {"coordinator": "MHL_COORDINATOR", "num_processes": "MHL_NUM_PROCESSES", "process_id": "MHL_PROCESS_ID"}
# gather_flags' calls so far: every process makes the same calls, so the n-th names the same exchange on all of them
_FLAG_ROUNDS = itertools.count()


@dataclass(frozen=True)
class Launch:
    """How this process joins the run: `num_processes` 1 means a single process (nothing to set up)."""

    coordinator: str | None = None  # "host:port" of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0
    local_device_ids: tuple[int, ...] | None = None  # this process's GPUs (None: all it sees)
    auto: bool = False  # cluster auto-detection (SLURM, Open MPI, Kubernetes) by jax.distributed


def _int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r}: expected an integer") from None


def parse_launch(coordinator: str | None = None, num_processes=None, process_id=None, local_device_ids=None,
                 auto: bool = False, env: dict | None = None) -> Launch:
    """The Launch from train.py's options, each defaulting to its MHL_* environment variable (ENV). Raises
    ConfigError naming the value for a half-given or inconsistent set."""
    env = os.environ if env is None else env
    coordinator = coordinator if coordinator is not None else env.get(ENV["coordinator"])
    num_processes = num_processes if num_processes is not None else env.get(ENV["num_processes"])
    process_id = process_id if process_id is not None else env.get(ENV["process_id"])
    ids = None
    if local_device_ids not in (None, ""):
        ids = tuple(_int("--local-device-ids", i) for i in str(local_device_ids).split(","))
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ConfigError(f"--local-device-ids={local_device_ids!r}: expected distinct device numbers >= 0, "
                              "e.g. 0,1")
    if auto:
        if coordinator is not None or num_processes is not None or process_id is not None:
            raise ConfigError("--distributed-auto takes the coordinator, process count and id from the cluster "
                              f"(SLURM, Open MPI, Kubernetes); got also coordinator={coordinator!r}, num_processes="
                              f"{num_processes!r}, process_id={process_id!r} (options or {', '.join(ENV.values())})")
        return Launch(local_device_ids=ids, auto=True)
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if all(v is None for v in given.values()):
        if ids is not None:
            raise ConfigError("--local-device-ids is for runs of several processes; give --coordinator, "
                              "--num-processes and --process-id too (or use CUDA_VISIBLE_DEVICES)")
        return Launch()
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ConfigError(f"a run of several processes needs --coordinator, --num-processes and --process-id (or "
                          f"{', '.join(ENV.values())}); missing: {', '.join(missing)}")
    n, i = _int("--num-processes", num_processes), _int("--process-id", process_id)
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"--num-processes={n} --process-id={i}: need num_processes >= 1 and 0 <= process_id < "
                          "num_processes")
    if n == 1 and ids is not None:
        raise ConfigError(f"--local-device-ids={local_device_ids!r} with --num-processes=1: a single process uses "
                          "every GPU it sees; choose them with CUDA_VISIBLE_DEVICES")
    host, _, port = str(coordinator).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator={coordinator!r}: expected HOST:PORT of process 0's host, e.g. "
                          "node0:12355 or localhost:12355")
    return Launch(coordinator=str(coordinator), num_processes=n, process_id=i, local_device_ids=ids)


def initialize(launch: Launch, timeout_s: int = 300) -> None:
    """Join the run (before anything else touches JAX's devices). A single-process launch does nothing. On CPU the
    processes' collectives go through gloo."""
    if launch.num_processes == 1 and not launch.auto:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    # JAX's preemption service (unused here) catches SIGTERM, so a scheduler's or kill's SIGTERM would leave the
    # process running: without it SIGTERM is train()'s to handle (or ends the process) as in a single-process run
    try:
        jax.config.update("jax_enable_preemption_service", False)
    except AttributeError:  # a JAX without that service
        pass
    # Ctrl-C likewise ends the process at once outside train() (which stops every process at one step, with a
    # checkpoint): as Python's KeyboardInterrupt it could wait in a blocked call, and JAX's exit then waits up to
    # 300 s at its shutdown barrier for the others, which wait for this process
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if not launch.auto and launch.process_id == 0:
        _check_port_free(launch.coordinator)
    ids = list(launch.local_device_ids) if launch.local_device_ids is not None else None
    who = ("this process (cluster auto-detection)" if launch.auto else
           f"process {launch.process_id} of {launch.num_processes}")
    print(f"{who}: joining the run at {launch.coordinator or 'the cluster coordinator'}, waiting up to {timeout_s} s "
          "for the others (if one never comes, JAX then aborts this process)", file=sys.stderr, flush=True)
    try:
        if launch.auto:
            jax.distributed.initialize(local_device_ids=ids, initialization_timeout=timeout_s)
        else:
            jax.distributed.initialize(launch.coordinator, num_processes=launch.num_processes,
                                       process_id=launch.process_id, local_device_ids=ids,
                                       initialization_timeout=timeout_s)
    except Exception as e:  # an error JAX raises (a timeout instead aborts the process: README)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        if launch.auto:
            raise ConfigError(f"--distributed-auto found no cluster to join ({type(e).__name__}: {first}); it "
                              "takes the processes from SLURM, Open MPI or Kubernetes; elsewhere give --coordinator, "
                              "--num-processes and --process-id instead") from e
        raise ConfigError(f"{who} could not join the run at {launch.coordinator} ({type(e).__name__}: {first})") \
            from e


def _check_port_free(coordinator: str) -> None:
    """Process 0 hosts the coordination service on the coordinator's port: a port already taken made it crash with
    a segmentation fault, so it is refused first, naming the port."""
    port = int(coordinator.rpartition(":")[2])
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's connections do not count
        try:
            s.bind(("", port))
        except OSError as e:
            raise ConfigError(f"--coordinator={coordinator!r}: port {port} is already in use on process 0's host "
                              f"({e.strerror}); choose a free port (the same one for every process)") from e


def shutdown(launch: Launch) -> None:
    """Leave the run together: every process waits for the others before the coordination service (process 0's)
    goes away, so no process logs a lost connection at exit. A no-op for a single process."""
    if launch.num_processes > 1 or launch.auto:
        jax.distributed.shutdown()


def _failed(ok: bool) -> list[int]:
    """The processes whose `ok` is False (an all-gather of one flag per process; every process gets the list)."""
    return [int(i) for i in np.flatnonzero(np.asarray(mh.process_allgather(np.int32(ok))).reshape(-1) == 0)]


def check_same_run(run: dict) -> None:
    """Every process must run the same command (config, overrides, resume and stop options): `run` (a nested dict of
    them) is compared with process 0's, and on any difference every process raises ConfigError (a process that
    differs names the keys) instead of running mismatched steps. A no-op with one process."""
    if jax.process_count() == 1:
        return
    text = json.dumps(run, sort_keys=True, default=str)
    mine = np.frombuffer(text.encode(), np.uint8)
    n = int(mh.broadcast_one_to_all(np.int32(mine.size)))
    buf = np.zeros(max(n, 1), np.uint8)
    if is_lead():
        buf[:n] = mine
    lead = bytes(np.asarray(mh.broadcast_one_to_all(buf))[:n]).decode()
    others = _failed(lead == text)
    if not others:
        return
    if lead != text:
        keys = "; ".join(f"{k}: process 0 {a!r}, this process {b!r}"
                         for k, a, b in changed_leaves(json.loads(lead), json.loads(text)))
        raise ConfigError(f"process {jax.process_index()} was started with another run than process 0 ({keys}); "
                          "start every process with the same command")
    raise ConfigError(f"process(es) {others} were started with another run than process 0 (their errors name the "
                      "keys); start every process with the same command")


def check_shared_directory(path) -> None:
    """With several processes, `path` (the run directory) must be one directory that every process sees: process 0
    writes a probe file there and every process looks for it. ConfigError naming the processes that miss it (each
    host's own disk, or a relative path from different working directories). A no-op with one process."""
    if jax.process_count() == 1:
        return
    token = int(mh.broadcast_one_to_all(np.int32(np.random.SeedSequence().entropy % 2**31 if is_lead() else 0)))
    probe = path / f".process-probe-{token}"
    failed = None
    if is_lead():
        try:
            probe.write_text(str(token))
        except OSError as e:  # the others still meet below, and all stop
            failed = e
    sync("probe written")
    missing = _failed(probe.is_file() and probe.read_text() == str(token))
    sync("probe read")
    if is_lead():
        probe.unlink(missing_ok=True)
    if failed is not None:
        raise ConfigError(f"logging.run_dir={str(path)!r}: process 0 cannot write there ({failed})") from failed
    if 0 in missing:
        raise ConfigError(f"logging.run_dir={str(path)!r}: process 0 could not write there (its error says why)")
    if missing:
        raise ConfigError(f"logging.run_dir={str(path)!r}: process(es) {missing} do not see process 0's files there "
                          "(a directory on each host's own disk, or a relative path from different working "
                          "directories); a run of several processes needs one directory that every process sees (a "
                          "shared filesystem): its checkpoints are written by all of them")


def failed_processes(ok: bool) -> list[int]:
    """The processes whose `ok` is False, known to every process (one all-gather; none with one process)."""
    if jax.process_count() == 1:
        return [] if ok else [jax.process_index()]
    return _failed(ok)


def gather_flags(flags: int, timeout_s: int = 3600) -> list[int]:
    """Every process's `flags` (a small int), in process order, exchanged through JAX's coordination service: host to
    host, no device work, so unlike an all-gather it does not wait for the steps still running on the devices (about
    1.7 ms for 2 processes on one host). Every process must make the same calls in the same order. With one process:
    [flags], at no cost."""
    if jax.process_count() == 1:
        return [int(flags)]
    client = ocp_multihost.get_jax_distributed_client()
    me, n = jax.process_index(), next(_FLAG_ROUNDS)
    key = f"mhl_jax/flags/{n}"
    client.key_value_set(f"{key}/{me}", str(int(flags)))
    client.wait_at_barrier(key, timeout_in_ms=timeout_s * 1000)
    got = dict(client.key_value_dir_get(f"{key}/"))
    if n:  # every process read the previous round's keys before it came to this round's barrier
        client.key_value_delete(f"mhl_jax/flags/{n - 1}/{me}")
    return [int(got[f"{key}/{i}"]) for i in range(jax.process_count())]


def agree(ok: bool, what: str) -> None:
    """After a step that may fail on some processes only (process 0's writes): every process learns whether all
    succeeded; a process that succeeded while another failed raises ConfigError (the failed one raises its own error
    after this), so no process is left waiting in the next collective. A no-op with one process."""
    if jax.process_count() == 1:
        return
    failed = _failed(ok)
    if ok and failed:
        raise ConfigError(f"stopping: process(es) {failed} failed {what} (their own errors say why)")


def xla_options(backend: str) -> dict:
    """XLA options for the run's compiles with several processes on GPUs: XLA's ragged all-to-all (Expert Parallel's
    dispatch and combine) runs as its own kernel of peer stores between the devices of one process, and between
    processes refuses to run unless its NCCL send / recv form is allowed (measured on 2 H200s, one process per GPU:
    `RaggedAllToAll fallback to NCCL is not allowed`)."""
    if backend == "gpu" and jax.process_count() > 1:
        return {"xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback": True}
    return {}


def is_lead() -> bool:
    """Whether this process writes the run's files and prints (process 0)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Every process waits here until all have arrived (a no-op with one process)."""
    if jax.process_count() > 1:
        mh.sync_global_devices(name)


def global_array(x: np.ndarray, sharding) -> jax.Array:
    """The global array `x` (the same on every process) placed with `sharding`: each process transfers only the
    slices its own devices hold."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
