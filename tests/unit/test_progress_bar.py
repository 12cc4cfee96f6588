"""The tqdm bar is drawn on a terminal only: redrawn with carriage returns, it would be noise in a log file or a
pipe (`make train 2>&1 | tee log`), where the step lines say everything it says."""

import io
import sys
from pathlib import Path

import pytest

from mhl_jax.config import load_config
from mhl_jax.train.progress import Progress
from mhl_jax.train.records import Records

ROOT = Path(__file__).resolve().parents[2]


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty, setting, drawn", [(True, True, True), (False, True, False), (True, False, False)])
def test_bar_on_a_terminal_only(tmp_path, monkeypatch, tty, setting, drawn):
    err = _Stderr(tty)
    monkeypatch.setattr(sys, "stderr", err)
    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "checkpoint.every=0", "data.val_sequences=0", f"logging.progress_bar={str(setting).lower()}",
        "logging.log_every=1000"])
    progress = Progress(cfg, tmp_path, True, lambda line: None, 0, 3, None, None, Records(), None, None,
                        (1.0, None, 1), {}, {})
    for n in (1, 2, 3):
        progress.finish(n, {"loss": 5.0, "lr": 3e-3, "grad_norm": 1.0}, ahead=False, state=None)
    progress.close()
    assert ("3/3" in err.getvalue()) == drawn, err.getvalue()
