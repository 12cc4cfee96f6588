"""What the catalogue's sections share: the `Section` of rows, the two checks every row gets, and the setups
(a small config, a missing package, a saved checkpoint or run) that rows of several areas build on."""

from __future__ import annotations

import builtins
from functools import partial
from pathlib import Path

import jax
import numpy as np
import pytest

from mhl_jax.config import CheckpointConfig, dump_config, load_config
from mhl_jax.data import make_train_loader
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.runtime.state import state_creator
from mhl_jax.train.optimizer import make_optimizer

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny_mh_latent_moe.yaml"  # 4 FFN heads, 16 experts, global and micro batch 16
TINY_MOE = ROOT / "configs" / "tiny_moe.yaml"
# the smallest run of a tiny config: one block, 32 tokens, one device, no progress bar
SMALL = ("model.n_layers=1", "model.context=32", "parallel.devices=1", "logging.progress_bar=false")
FP = {"model": {"d_model": 64, "n_layers": 2}, "ffn": {"kind": "mh_latent_moe", "num_experts": 16, "top_k": 2}}
CPU = jax.devices("cpu")  # 8 of them (tests/conftest.py), on a GPU machine too
ON_GPU = jax.default_backend() == "gpu"
LOADER = dict(seq_len=16, batch_size=4, seed=0, vocab_size=320)  # the train loader's arguments over small shards


class Section(list):
    """The rows of one kind of refusal, as pytest params with ids '<section>/<row>'."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def add(self, row: str, error, fragment: str, provoke, cpu_only: bool = False) -> None:
        """`cpu_only`: a row for the CPU backend (a GPU setting refused there, or the 8 devices of conftest.py)."""
        marks = [pytest.mark.skipif(ON_GPU, reason="a row for the CPU backend")] if cpu_only else []
        self.append(pytest.param(provoke, error, fragment, id=f"{self.name}/{row}", marks=marks))

    def refusal(self, error, fragment: str, cpu_only: bool = False):
        """Decorator: the function is the row's `provoke`, its name (dashed) the row's id."""
        def add(provoke):
            self.add(provoke.__name__.replace("_", "-"), error, fragment, provoke, cpu_only)
            return provoke
        return add


def calls(f, *args, **kwargs):
    """The `provoke` of a row that needs nothing set up: `f(*args, **kwargs)` is refused."""
    return lambda tmp, mp: partial(f, *args, **kwargs)


def small(tmp: Path, *sets: str, config: Path = TINY):
    """The smallest run of `config` with `sets`, its run directory tmp/run."""
    return load_config(str(config), [*SMALL, f"logging.run_dir={tmp / 'run'}", *sets])


def without(mp: pytest.MonkeyPatch, package: str) -> None:
    """`import package` fails from now on, as where that optional package is not installed."""
    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == package:
            raise ImportError(f"no {package} here")
        return real(name, *args, **kwargs)

    mp.setattr(builtins, "__import__", refuse)


def snapshot(root: Path) -> dict:
    """Every path under `root`: a file's bytes, None for a directory."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def zeros(abstract):
    """A state of zeros with the leaves of `abstract` (a checkpoint of the right layout, without training)."""
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)


def save(directory: Path, state, steps=(1,), fingerprint=None, data_iter=None) -> Path:
    """Checkpoints of `state` at `steps` in `directory`, written before the call returns."""
    with Checkpointer(directory, CheckpointConfig(async_save=False), fingerprint or FP) as ck:
        for step in steps:
            ck.save(step, state, data_iter)
    return directory


def saved_run(tmp: Path, *sets: str, optimizer: bool = True, fingerprint_sets=(), data: bool = False) -> Path:
    """tmp/run as train.py leaves it at step 2 (config.yaml, checkpoints/2), the state zeros: `small(tmp, *sets)`'s
    state, its fingerprint that of `small(tmp, *fingerprint_sets)`; with the data iterator's state when `data`."""
    cfg = small(tmp, *sets)
    run = tmp / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    _, _, abstract = state_creator(cfg, make_mesh(cfg), make_optimizer(cfg) if optimizer else None)
    it = make_train_loader(cfg.data, seq_len=32, batch_size=16, seed=0, vocab_size=320) if data else None
    save(run / "checkpoints", zeros(abstract), (2,), model_fingerprint(small(tmp, *fingerprint_sets)), it)
    return run


def tree(cols: int = 3, **extra) -> dict:
    """A small state: params/w (2, cols) float32, step, and `extra` leaves."""
    return {"params": {"w": np.ones((2, cols), np.float32)}, "step": np.int32(0), **extra}


def overwrite(item: str, text: bytes = b"\0" * 7):
    """Damage: every file of a step's `item` (state, meta) overwritten with `text`."""
    def damage(step_dir: Path):
        for f in (step_dir / item).rglob("*"):
            if f.is_file():
                f.write_bytes(text)
    return damage


def check_refused(provoke, error, fragment, tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """A row's call raises exactly `error`, its message one line holding `fragment`; `tmp` is as the setup left it."""
    call = provoke(tmp, mp)
    before = snapshot(tmp)
    with pytest.raises(error) as refused:
        call()
    message = str(refused.value)
    assert type(refused.value) is error and fragment in message, message
    assert "\n" not in message, message
    assert snapshot(tmp) == before


def check_command_refused(provoke, error, fragment, tmp: Path, mp: pytest.MonkeyPatch, capsys) -> None:
    """A command row exits 2 with one line on stderr holding `fragment`; `tmp` is as the setup left it. `error`
    SystemExit: argparse's refusal (its usage lines, then one `error:` line); else the command's own."""
    call = provoke(tmp, mp)
    capsys.readouterr()
    before = snapshot(tmp)
    try:
        status, by_argparse = call(), False
    except SystemExit as e:
        status, by_argparse = e.code, True
    lines = capsys.readouterr().err.splitlines()
    assert (status, by_argparse) == (2, error is SystemExit), lines
    if by_argparse:
        assert lines[0].startswith("usage: ") and all(line.startswith(" ") for line in lines[1:-1]), lines
        assert ": error: " in lines[-1], lines
    else:
        assert len(lines) == 1, lines
    assert fragment in lines[-1], lines
    assert snapshot(tmp) == before
