#!/usr/bin/env bash
# Download the wheels the GPU image lacks (Python 3.12) into .whl/ (git-ignored): jax-triton for the
# kernels, grain and its missing dependencies for the training loop. On the GPU machine, carry `.whl`
# and start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."
for pkg in jax-triton==0.3.1 grain==0.2.18 array-record==0.8.6 cloudpickle==3.1.2 portpicker==1.6.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls -la .whl
