"""A launch whose first steps have a gradient norm of exactly 0 (nothing trains) warns once; a gradient anywhere in
those steps, or later zeros, say nothing."""

from pathlib import Path

import pytest

from mhl_jax.config import load_config
from mhl_jax.train.progress import Progress
from mhl_jax.train.records import Records

ROOT = Path(__file__).resolve().parents[2]


def warnings(tmp_path, grad_norms: list[float], start: int = 0) -> list[str]:
    """The warnings of a Progress finishing steps start + 1 .. start + len(grad_norms) with those gradient norms."""
    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "checkpoint.every=0", "data.val_sequences=0", "logging.progress_bar=false", "logging.log_every=1000"])
    lines = []
    end = start + len(grad_norms)
    progress = Progress(cfg, tmp_path, True, lines.append, start, end, None, None, Records(), None, None,
                        (1.0, None, 1), {}, {})
    for n, g in enumerate(grad_norms, start + 1):
        progress.finish(n, {"loss": 5.7683, "lr": 3e-3, "grad_norm": g}, ahead=False, state=None)
    progress.close()
    return [line for line in lines if line.startswith("warning:")]


@pytest.mark.parametrize("grad_norms, start, want", [
    ([0.0] * 6, 0, ["warning: the gradient norm is exactly 0 at steps 1-3 (loss 5.7683): nothing is training; an init "
                    "or a learning rate far too large is the usual cause (model.init_std=0.02, optimizer.lr=0.003)"]),
    ([0.0, 0.0], 7, ["warning: the gradient norm is exactly 0 at steps 8-9 (loss 5.7683): nothing is training; an "
                     "init or a learning rate far too large is the usual cause (model.init_std=0.02, "
                     "optimizer.lr=0.003)"]),  # a launch of two steps, resumed at 7
    ([0.0, 1e-30, 0.0, 0.0, 0.0], 0, []),  # a gradient, however small, at step 2
    ([1.2, 0.0, 0.0, 0.0], 0, []),  # zeros later are not the launch's first steps
    ([0.5] * 4, 0, []),
])
def test_zero_gradient_at_the_start_warns_once(tmp_path, grad_norms, start, want):
    assert warnings(tmp_path, grad_norms, start) == want
