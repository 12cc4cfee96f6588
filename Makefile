# make train: set up .venv (if absent or stale) and train the built-in default on CPU.
# make test:  set up the same way and run the test suite.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test setup lint clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-cache-dir --upgrade pip
	$(VENV)/bin/pip install -q --no-cache-dir -e ".[kernels,data,dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python train.py

test: $(STAMP)
	XLA_PYTHON_CLIENT_PREALLOCATE=false $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile tests

lint: $(STAMP)
	$(VENV)/bin/ruff check mhl_jax kernels tests bench train.py

clean:
	rm -rf $(VENV) runs
