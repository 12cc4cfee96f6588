"""XLA's autotuning results kept and shared, so that every process of a run, and every fresh run of one config on
one GPU model, compiles the same GPU kernels.

On GPUs XLA times candidate kernels (cuBLAS algorithms, its own GEMM fusions' tiles) while it compiles and keeps the
fastest. Timings are noisy, so two fresh processes can pick different kernels for the same step, and different kernels
round differently: the 2.2B MH-LatentMoE step's losses differed in the 6th digit from the second step between two
fresh processes on one H100, and were bitwise equal when the second process loaded the first one's autotuning
results. Turning autotuning off instead (`--xla_gpu_autotune_level=0`) made that step 11x slower.

`train.xla_autotune_file` ("auto": `<run_dir>/xla_autotune.txt`; "": off; else a path): the first process of a run
writes XLA's results there once its step and evaluation are compiled (through a temporary file and a rename, so a
killed run never leaves half a file); a later process of the run (a resume) loads them before it compiles, so it gets
the kernels the first one had and continues bitwise as if never stopped (and writes the file again, with whatever it
had to tune that the file lacked, e.g. an evaluation step the first process never reached). A run that resumes from
another run's checkpoint (`--resume <run>/checkpoints/<step>`) loads that run's file when its own has none. In a run
of several processes each keeps its own file (process i > 0: `xla_autotune.process<i>.txt`, beside process 0's), since
each tunes its own compile; a process without its own file (the run resumed with more processes) loads process 0's.
Only on GPUs: XLA's CPU compiler does not autotune.

With "auto" the results are also kept in a cache that every run shares (`shared_dir`: $MHL_CACHE_DIR/xla_autotune,
default ~/.cache/mhl_jax/xla_autotune), one file per `step_key`: the GPU model, the device and process counts, the
software versions, XLA_FLAGS and the config (less its logging and checkpoint sections, which do not shape the
compiled step). A fresh run with no file of its own loads the cache's file for its key, so two fresh runs of one
config on one GPU model compile the same kernels and give bitwise-equal losses (two runs started at the same moment
on an empty cache each tune, and may still differ). Loading results costs no step time: the kernels are the ones
tuning picked, only the timing is skipped.

A run of several processes on GPUs with the file on compiles without JAX's persistent compilation cache
(JAX_COMPILATION_CACHE_DIR; `guard_persistent_cache`). The file paths are compile options, so part of the
cache's key, and they differ between processes; only process 0 writes the cache. So process 1 never finds an entry,
while process 0 finds its own when a relaunch repeats its options; it then skips the compile that XLA's GEMM
autotuning, shared out among a run's processes, needs from every process, and process 1 waits for it for good (a
relaunch of two processes on H200s with the cache on never finished; without it each launch took ~30 s). With the
file off the processes' keys are equal on GPUs (JAX leaves the device
assignment out of them), and the cache is left on.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib
from jax.experimental.compilation_cache import compilation_cache

from mhl_jax.config import Config, ConfigError, config_to_dict

DEFAULT_NAME = "xla_autotune.txt"  # the text form (XLA picks the form from the extension)
_TEXT_SUFFIXES = (".txt", ".textproto", ".prototxt", ".pbtxt")


@dataclass(frozen=True)
class AutotuneFile:
    """Where a process keeps XLA's autotuning results. path None: off; load: the file read before compiling (None:
    tune afresh); shared: the cache file `commit` also writes (None: none)."""

    path: Path | None = None
    load: Path | None = None
    shared: Path | None = None

    @property
    def write(self) -> bool:
        """Whether this process writes `path` (through `tmp`): whenever it is on (each process its own file)."""
        return self.path is not None

    @property
    def tmp(self) -> Path | None:
        """XLA's dump target: beside `path`, with its extension (which sets the text or binary form)."""
        return None if self.path is None else self.path.with_name(f"{self.path.stem}.partial{self.path.suffix}")

    def compiler_options(self) -> dict:
        """XLA options for the jitted step and evaluation (empty when off)."""
        opts = {}
        if self.load is not None:
            opts["xla_gpu_load_autotune_results_from"] = str(self.load)
        if self.write:
            opts["xla_gpu_dump_autotune_results_to"] = str(self.tmp)
        return opts

    def discard(self) -> None:
        """Remove XLA's dump of a run that stops before committing it (a refused run leaves its directory as it was)."""
        if self.write and self.tmp.exists():
            self.tmp.unlink()

    def commit(self) -> bool:
        """After a compile: move XLA's dump into place (a rename: readers see the old or the new file whole). True
        when a dump was there."""
        if not self.write or not self.tmp.exists():
            return False
        self.tmp.replace(self.path)
        if self.shared is not None:
            _copy_into_cache(self.path, self.shared)
        return True


def _copy_into_cache(src: Path, dst: Path) -> None:
    """`src` as the cache's file `dst`, through a rename (a reader sees a whole file). XLA's dump holds what it loaded
    as well as what it tuned, so the newer file holds the older's entries. A cache that cannot be written (a read-only
    home) leaves the run as it is: the run's own file is in place."""
    part = dst.with_name(f"{dst.stem}.{os.getpid()}.partial{dst.suffix}")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(src.read_bytes())
        part.replace(dst)
    except OSError:
        try:
            part.unlink()
        except OSError:
            pass


def shared_dir() -> Path:
    """The cache of autotuning results every run on this machine (or shared home) reads and writes."""
    root = os.environ.get("MHL_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                    "mhl_jax")
    return Path(root).expanduser() / "xla_autotune"


def step_key(cfg: Config) -> str:
    """What decides the compiled step and the kernels XLA may pick for it: the config less its logging and checkpoint
    sections, the GPU model, the device and process counts, the JAX and jaxlib versions and XLA_FLAGS."""
    shaping = {k: v for k, v in config_to_dict(cfg).items() if k not in ("logging", "checkpoint")}
    devices = jax.devices()
    what = {"config": shaping, "device_kind": devices[0].device_kind, "devices": len(devices),
            "processes": jax.process_count(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _looks_like_results(path: Path) -> bool:
    """A text file of XLA's AutotuneResults (jaxlib 0.11.2 writes only its repeated `entries { ... }`; older XLA
    also `version` / `results`) starts with one of those fields, or is empty (no results). A binary file is left to
    XLA to check."""
    if path.suffix not in _TEXT_SUFFIXES:
        return True
    head = path.read_bytes()[:256].lstrip()
    return not head or head.startswith((b"entries", b"version", b"results"))


def _own(path: Path, process_index: int) -> Path:
    """Process `process_index`'s file of a run whose process 0 keeps `path`."""
    return path if process_index == 0 else path.with_name(f"{path.stem}.process{process_index}{path.suffix}")


def persistent_cache_off_reason(setting: str, backend: str, process_count: int, cache_dir: str | None) -> str | None:
    """Why this run must compile without JAX's persistent compilation cache (module docstring), or None: a run of
    several processes on GPUs with the autotuning file on and a cache directory set."""
    if backend != "gpu" or setting == "" or process_count < 2 or not cache_dir:
        return None
    return (f"JAX's persistent compilation cache ({cache_dir}) is off in this run of {process_count} processes: with "
            f"train.xla_autotune_file={setting!r} each process compiles with options of its own, so the others could "
            "never use process 0's entries, and a relaunch where process 0 alone found its step there would wait "
            "forever in XLA's shared autotuning (README: several processes)")


def guard_persistent_cache(setting: str) -> str | None:
    """Turn JAX's persistent compilation cache off for this process when `persistent_cache_off_reason` says so (after
    jax.distributed is initialized; it holds even if something was compiled before); returns the reason."""
    cache_dir = getattr(jax.config, "jax_compilation_cache_dir", None) or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    reason = persistent_cache_off_reason(setting, jax.default_backend(), jax.process_count(), cache_dir)
    if reason is not None:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX decides whether to use it once, at the first compile
    return reason


def autotune_file(setting: str, run_dir: Path, resume: str | None = None, backend: str = "gpu",
                  process_index: int = 0, key: str | None = None, cache: Path | None = None) -> AutotuneFile:
    """Resolve `train.xla_autotune_file` for this process (module docstring). `key`: the run's `step_key`, for the
    shared cache (None: no cache) in `cache` (default `shared_dir()`). Raises ConfigError naming the value when the
    file's directory is missing or the file to load is not XLA autotuning results."""
    if backend != "gpu" or setting == "":
        return AutotuneFile()
    if setting == "auto":
        path = (run_dir / DEFAULT_NAME).resolve()
    else:
        path = Path(setting).expanduser().resolve()
        if path.is_dir():
            raise ConfigError(f"train.xla_autotune_file={setting!r} is a directory; expected 'auto', '' (off) or a "
                              "file path (e.g. <dir>/xla_autotune.txt)")
        if not path.parent.is_dir():
            raise ConfigError(f"train.xla_autotune_file={setting!r}: directory {path.parent} does not exist; "
                              "expected 'auto', '' (off) or a file path in an existing directory")
    candidates = [_own(path, process_index), path]  # this process's own file, else process 0's
    if setting == "auto" and resume:
        r = Path(resume).expanduser().resolve()
        # <run>/checkpoints/<step> or <run>/checkpoints
        candidates += [_own(d / DEFAULT_NAME, i) for d in (r.parent.parent, r.parent) for i in (process_index, 0)]
    shared = None
    if setting == "auto" and key is not None:
        shared = _own((cache or shared_dir()) / f"{key}.txt", process_index)
        candidates.append(shared)
    load = next((c for c in candidates if c.is_file()), None)
    if load is not None and load == shared and not _looks_like_results(load):
        load = None  # the cache's file is not the user's setting: tune afresh, and the commit writes it anew
    if load is not None and not _looks_like_results(load):
        raise ConfigError(f"train.xla_autotune_file={setting!r}: {load} is not a file of XLA autotuning results; "
                          "delete it (XLA then tunes afresh and writes a new one) or set train.xla_autotune_file=''")
    return AutotuneFile(path=_own(path, process_index), load=load, shared=shared)
