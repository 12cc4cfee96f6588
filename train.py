"""Train a model: `python train.py [--config configs/X.yaml] [--set key.sub=value ...] [--resume PATH]`.

With no arguments it trains the tiny Multi-Head LatentMoE on the built-in corpus (CPU, 2-3 minutes).
Several processes (hosts) in one run: start the same command once per process with `--coordinator HOST:PORT
--num-processes N --process-id I` (or MHL_COORDINATOR / MHL_NUM_PROCESSES / MHL_PROCESS_ID), or with
`--distributed-auto` under SLURM / Open MPI / Kubernetes.

SIGTERM, SIGINT or SIGUSR1 saves a checkpoint of the step in flight and exits; the same command resumes. Exit status:
0 done, 1 failed during the run, 2 bad input, 3 interrupted by a signal.

Afterwards: `python -m mhl_jax.infer evaluate|generate RUN_DIR` (a checkpoint's validation loss, text sampled from it)
and `python -m mhl_jax.compare RUN_DIR ...` (a table of runs and their loss curves).
"""

from __future__ import annotations

import argparse
import sys

import jax

from mhl_jax.config import ConfigError, config_to_dict, load_config
from mhl_jax.runtime.autotune import guard_persistent_cache
from mhl_jax.runtime.distributed import check_same_run, initialize, parse_launch, shutdown
from mhl_jax.runtime.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    INPUT_ERRORS,
    CheckpointSaveError,
    input_error_line,
)
from mhl_jax.runtime.memory import DeviceMemoryError
from mhl_jax.train.interrupt import Interrupted
from mhl_jax.train.loop import train

DEFAULT_CONFIG = "configs/tiny_mh_latent_moe.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set optimizer.lr=1e-3 (repeatable)")
    ap.add_argument("--resume", default=None, metavar="PATH",
                    help="checkpoint directory to resume from (default: the run directory's latest)")
    ap.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                    help="stop after this optimizer step (with a checkpoint, unless checkpoint.every=0), as a "
                         "preempted job would")
    ap.add_argument("--check", action="store_true",
                    help="compile the train step, print its memory per device against what the devices allow, and "
                         "exit (status 0 if it fits, 2 if not); no state is created, nothing is written")
    dist = ap.add_argument_group("several processes (one per host, or per GPU); every process runs the same command")
    dist.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="process 0's host and a free port, the same for every process (env MHL_COORDINATOR)")
    dist.add_argument("--num-processes", default=None, metavar="N", help="processes in the run (env MHL_NUM_PROCESSES)")
    dist.add_argument("--process-id", default=None, metavar="I", help="this process, 0 to N-1 (env MHL_PROCESS_ID)")
    dist.add_argument("--local-device-ids", default=None, metavar="IDS",
                      help="this process's GPUs, e.g. 0,1 (default: every GPU it sees)")
    dist.add_argument("--distributed-auto", action="store_true",
                      help="take the processes from the cluster (SLURM, Open MPI, Kubernetes) through jax.distributed")
    args = ap.parse_args(argv)
    if args.stop_after is not None and args.stop_after < 0:
        ap.error(f"--stop-after {args.stop_after}: must be a step number >= 0")

    try:
        launch = parse_launch(args.coordinator, args.num_processes, args.process_id, args.local_device_ids,
                              args.distributed_auto)
        cfg = load_config(args.config, args.overrides)
        initialize(launch)
        if (off := guard_persistent_cache(cfg.train.xla_autotune_file)) and jax.process_index() == 0:
            print(off, flush=True)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:  # every process of a run must run the same command
        check_same_run({**config_to_dict(cfg),
                        "command_line": {"resume": args.resume, "stop_after": args.stop_after, "check": args.check}})
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        shutdown(launch)
        return EXIT_BAD_INPUT
    try:
        train(cfg, resume=args.resume, stop_after=args.stop_after, check=args.check)
    except INPUT_ERRORS as e:  # bad input found once the run is set up: no traceback
        print(input_error_line(e), file=sys.stderr)
        code = EXIT_BAD_INPUT
    except (FloatingPointError, DeviceMemoryError, CheckpointSaveError) as e:
        # diverged, out of memory, or a checkpoint not saved: the last checkpoint is kept
        print(f"training stopped: {e}", file=sys.stderr)
        code = EXIT_FAILED
    except Interrupted as e:  # a preemption signal: saved, the same command resumes
        print(e, file=sys.stderr)
        code = EXIT_INTERRUPTED
    else:
        code = EXIT_OK
    shutdown(launch)  # these ends are reached by every process of a run alike
    return code


if __name__ == "__main__":
    sys.exit(main())
