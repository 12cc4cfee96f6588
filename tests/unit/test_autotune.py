"""train.xla_autotune_file (mhl_jax/runtime/autotune.py): where XLA's autotuning results are read and written.

CPU: the resolution of the setting, the errors, and the rename that puts XLA's dump in place. What the file is for
(a resumed GPU process continuing bitwise) is tests/e2e/test_resume.py's GPU case.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mhl_jax.config import load_config
from mhl_jax.runtime.autotune import (
    DEFAULT_NAME,
    AutotuneFile,
    autotune_file,
    persistent_cache_off_reason,
    shared_dir,
    step_key,
)
from mhl_jax.train import step as step_mod

ROOT = Path(__file__).resolve().parents[2]

# the head of a file jaxlib 0.11.2 wrote on an H100
RESULTS = ('entries {\n  key {\n    target {\n      device: "699b92c0fb30cb16"\n      hlo_fingerprint: '
           '"059e5aad50ceb7b1c214d9634fb4c640"\n    }\n  }\n}\n')


def test_off_on_cpu_and_when_empty(tmp_path):
    assert autotune_file("auto", tmp_path, backend="cpu") == AutotuneFile()
    assert autotune_file("", tmp_path, backend="gpu") == AutotuneFile()
    assert AutotuneFile().compiler_options() == {}
    assert AutotuneFile().commit() is False


def test_auto_first_process_writes_through_a_partial_file(tmp_path):
    a = autotune_file("auto", tmp_path)
    assert a.path == (tmp_path / DEFAULT_NAME).resolve() and a.load is None and a.write
    assert a.tmp.suffix == ".txt" and a.tmp != a.path  # XLA picks the text form from the extension
    assert a.compiler_options() == {"xla_gpu_dump_autotune_results_to": str(a.tmp)}
    assert a.commit() is False and not a.path.exists()  # nothing dumped yet
    a.tmp.write_text(RESULTS)  # as XLA dumps at compile time
    assert a.commit() is True
    assert a.path.read_text() == RESULTS and not a.tmp.exists()
    assert a.commit() is False  # once moved, later calls do nothing


def test_auto_later_process_loads_and_rewrites(tmp_path):
    (tmp_path / DEFAULT_NAME).write_text(RESULTS)
    a = autotune_file("auto", tmp_path)
    assert a.load == a.path and a.write
    assert a.compiler_options() == {"xla_gpu_load_autotune_results_from": str(a.path),
                                    "xla_gpu_dump_autotune_results_to": str(a.tmp)}



def test_each_process_of_a_run_keeps_its_own_file(tmp_path):
    (tmp_path / DEFAULT_NAME).write_text(RESULTS)
    b = autotune_file("auto", tmp_path, process_index=1)  # no file of its own yet: process 0's is loaded
    assert b.path == (tmp_path / "xla_autotune.process1.txt").resolve() and b.write
    assert b.load == (tmp_path / DEFAULT_NAME).resolve()
    assert b.compiler_options()["xla_gpu_dump_autotune_results_to"] == str(b.tmp) and b.tmp.name.startswith(
        "xla_autotune.process1.")
    b.path.write_text(RESULTS)  # written by the first launch's process 1
    assert autotune_file("auto", tmp_path, process_index=1).load == b.path  # a resumed process 1: its own
    assert autotune_file("auto", tmp_path, process_index=0).load == (tmp_path / DEFAULT_NAME).resolve()
    other = tmp_path / "other"
    other.mkdir()
    c = autotune_file("auto", other, resume=str(tmp_path / "checkpoints" / "4"), process_index=1)
    assert c.load == b.path  # resuming another run's checkpoint: that run's process 1 file


def test_resume_from_another_run_loads_its_file(tmp_path):
    src, new = tmp_path / "src", tmp_path / "new"
    (src / "checkpoints" / "6").mkdir(parents=True)
    new.mkdir()
    (src / DEFAULT_NAME).write_text(RESULTS)
    for resume in (src / "checkpoints" / "6", src / "checkpoints"):
        a = autotune_file("auto", new, resume=str(resume))
        assert a.load == (src / DEFAULT_NAME).resolve() and a.path == (new / DEFAULT_NAME).resolve() and a.write
    # the run's own file wins over the source run's
    (new / DEFAULT_NAME).write_text(RESULTS)
    assert autotune_file("auto", new, resume=str(src / "checkpoints" / "6")).load == (new / DEFAULT_NAME).resolve()
    # an explicit path is not looked for elsewhere
    assert autotune_file(str(tmp_path / "mine.txt"), new, resume=str(src / "checkpoints")).load is None


def test_fresh_runs_of_one_config_share_the_cache(tmp_path):
    """A fresh run loads the shared cache's file for its key and, once compiled, writes its results there too; its
    own file (a resume) comes first; other keys and explicit paths do not touch the cache."""
    cache, first, second = tmp_path / "cache", tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    a = autotune_file("auto", first, key="k1", cache=cache)
    assert a.load is None and a.shared == cache / "k1.txt"
    a.tmp.write_text(RESULTS)  # XLA's dump at compile time
    assert a.commit() and (cache / "k1.txt").read_text() == RESULTS == a.path.read_text()
    assert not list(cache.glob("*partial*"))
    b = autotune_file("auto", second, key="k1", cache=cache)
    assert b.load == cache / "k1.txt" and b.path == (second / DEFAULT_NAME).resolve()
    assert autotune_file("auto", second, key="k2", cache=cache).load is None
    assert autotune_file("auto", second, key="k1", cache=cache, process_index=1).load is None  # its own entry
    (second / DEFAULT_NAME).write_text(RESULTS + "\n")
    assert autotune_file("auto", second, key="k1", cache=cache).load == (second / DEFAULT_NAME).resolve()
    assert autotune_file(str(tmp_path / "mine.txt"), second, key="k1", cache=cache).shared is None
    (cache / "k3.txt").write_text("not autotuning results\n")  # a damaged cache entry: tuned afresh, not refused
    (tmp_path / "third").mkdir()
    assert autotune_file("auto", tmp_path / "third", key="k3", cache=cache).load is None
    # a cache that cannot be written leaves the run's own file in place
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's directory would be")
    c = autotune_file("auto", first, key="k1", cache=blocked / "sub")
    c.tmp.write_text(RESULTS)
    assert c.commit() and c.path.read_text() == RESULTS


def test_step_key_follows_what_shapes_the_step(monkeypatch):
    base = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"))
    same = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"),
                       ["logging.run_dir=/elsewhere", "logging.log_every=3", "checkpoint.every=7"])
    assert step_key(base) == step_key(same)
    for change in ("train.micro_batch=8", "model.n_layers=2", "optimizer.lr=1e-3", "ffn.top_k=4"):
        assert step_key(load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [change])) != step_key(base), change
    key = step_key(base)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=2")
    assert step_key(base) != key
    monkeypatch.setenv("MHL_CACHE_DIR", "/some/cache")
    assert shared_dir() == Path("/some/cache/xla_autotune")


def test_explicit_path_and_binary_form(tmp_path):
    p = tmp_path / "tuned.pb"
    a = autotune_file(str(p), tmp_path / "elsewhere")
    assert a.path == p.resolve() and a.tmp.suffix == ".pb" and a.load is None
    p.write_bytes(b"\x0a\x00")  # binary: left to XLA to check
    assert autotune_file(str(p), tmp_path).load == p.resolve()
    empty = tmp_path / "empty.txt"  # no results at all: a valid (empty) text file
    empty.write_text("\n")
    assert autotune_file(str(empty), tmp_path).load == empty.resolve()


def test_step_compiles_with_the_options_added(monkeypatch):
    """jit_train_step hands jax.jit its own options plus the autotune ones (the all-reduce code motion pass stays
    off), and the default (no autotune options) is unchanged."""
    seen = []
    monkeypatch.setattr(step_mod.jax, "jit", lambda f, **kw: seen.append(kw["compiler_options"]) or f)
    opts = {"xla_gpu_load_autotune_results_from": "/x/a.txt"}
    step_mod.jit_train_step(None, None, 0.0, None, None, None, autotune_options=opts)
    step_mod.jit_train_step(None, None, 0.0, None, None, None)
    assert seen == [{**step_mod.TRAIN_STEP_COMPILER_OPTIONS, **opts}, step_mod.TRAIN_STEP_COMPILER_OPTIONS]


_PROBE = """
import sys, jax, jax.numpy as jnp
opts = dict(a.split("=", 1) for a in sys.argv[1:])
opts = {k: (v == "true" if v in ("true", "false") else v) for k, v in opts.items()}
f = jax.jit(lambda a, b: jax.nn.gelu(a @ b).sum(0), compiler_options=opts)
a = jnp.ones((512, 1024), jnp.bfloat16)
b = jnp.ones((1024, 768), jnp.bfloat16)
print("ok", float(f(a, b)[0]))
"""


@pytest.mark.gpu
def test_gpu_compiler_options_write_and_load_autotuning(tmp_path):
    """XLA takes the autotuning options per compile, as jit_train_step passes them: a fresh process writes the results
    of a GEMM it tuned; a second one, told to refuse any GEMM it has no loaded result for
    (xla_gpu_require_complete_aot_autotune_results), compiles with the file loaded and fails without it (the control:
    that option is honoured, so the load is what made the difference)."""
    tuned = autotune_file(str(tmp_path / "tuned.txt"), tmp_path)
    env = {**os.environ, "XLA_FLAGS": "", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def probe(opts):
        args = [f"{k}={'true' if v is True else v}" for k, v in opts.items()]
        return subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=env)

    r = probe(tuned.compiler_options())
    assert r.returncode == 0, r.stderr[-2000:]
    assert tuned.commit() and tuned.path.read_text().startswith("entries {")
    strict = {"xla_gpu_require_complete_aot_autotune_results": True}
    loaded = autotune_file(str(tmp_path / "tuned.txt"), tmp_path, process_index=1)  # process 1: loads process 0's
    r = probe({**loaded.compiler_options(), **strict})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    r = probe(strict)
    assert r.returncode != 0 and "autotun" in r.stderr.lower(), (r.returncode, r.stderr[-2000:])


def test_persistent_cache_off_only_for_several_gpu_processes_with_the_file():
    reason = persistent_cache_off_reason("auto", "gpu", 2, "/cache")
    assert reason is not None and "/cache" in reason and "2 processes" in reason and "'auto'" in reason
    assert persistent_cache_off_reason("/x/tuned.txt", "gpu", 4, "/cache") is not None
    for args in (("", "gpu", 2, "/cache"),  # the file off: the processes' keys are equal
                 ("auto", "cpu", 2, "/cache"),  # no autotuning
                 ("auto", "gpu", 1, "/cache"),  # one process: nothing shared
                 ("auto", "gpu", 2, None), ("auto", "gpu", 2, "")):  # no cache
        assert persistent_cache_off_reason(*args) is None, args


_GUARD = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp
from mhl_jax.runtime import autotune
cache = Path(sys.argv[1])
x = jnp.ones(8)
jax.jit(lambda x: jnp.sin(x) * 2).lower(x).compile()  # compiled with the cache on: entries written
before = len(list(cache.iterdir()))
autotune.persistent_cache_off_reason = lambda *a: "off"  # as on GPUs with several processes
reason = autotune.guard_persistent_cache("auto")
jax.jit(lambda x: jnp.cos(x) * 3).lower(x).compile()
print(json.dumps({"before": before, "after": len(list(cache.iterdir())), "reason": reason}))
"""


def test_guard_turns_the_cache_off_after_a_first_compile(tmp_path):
    """JAX decides once whether to use its persistent cache; the guard holds even after a compile used it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    r = subprocess.run([sys.executable, "-c", _GUARD, str(cache)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] >= 1 and out["after"] == out["before"] and out["reason"] == "off", out
