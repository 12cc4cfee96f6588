"""Figures the command-line tools write: matplotlib (an optional dependency) imported on demand, and a save that
fails in one line naming the file."""

from __future__ import annotations

from pathlib import Path

from mhl_jax.config import ConfigError


def pyplot(option: str):
    """matplotlib.pyplot on the file-only Agg backend; a ConfigError naming `option` when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError(f"{option} needs matplotlib (pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, option: str, dpi: int) -> None:
    """Write `fig` to `path` and close it; an unwritable path is a ConfigError naming `option` and the path."""
    plt = pyplot(option)
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise ConfigError(f"{option} {str(path)!r}: cannot write it ({e.strerror or e})") from e
    finally:
        plt.close(fig)
