"""Benchmarks a user runs (`python -m bench.NAME`), their shared helper `bench.common`, and `bench.tools` for kernel
developers."""

import os

# Before any bench imports JAX: allocate device memory as it is used, so that the memory figures are each run's own and
# a torch baseline in the same process finds the memory JAX has not taken. `bench.common.user_env` takes it out again
# for the processes that must run as a user runs them.
PREALLOCATE_DEFAULTED = "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
