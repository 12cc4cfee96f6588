# make train: set up .venv (if absent or stale) with what the CPU default needs, and train the built-in default.
# make test:  set up .venv with everything the tests need (the kernels' Triton interpreter, the PyTorch references,
#             datasets, the dev tools) and run the test suite.
PYTHON ?= python3
VENV := .venv
TRAIN_STAMP := $(VENV)/.installed-train
STAMP := $(VENV)/.installed

.PHONY: train test setup lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-cache-dir --upgrade pip

# the package and its required dependencies only: no torch or triton, which the CPU default never imports
$(TRAIN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/pip install -q --no-cache-dir -e .
	touch $(TRAIN_STAMP)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/pip install -q --no-cache-dir -e ".[kernels,data,dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(TRAIN_STAMP)
	$(VENV)/bin/python train.py

test: $(STAMP)
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile tests

lint: $(STAMP)
	$(VENV)/bin/ruff check mhl_jax kernels tests bench train.py

clean:
	rm -rf $(VENV) runs
