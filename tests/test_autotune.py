"""train.xla_autotune_file (mhl_jax/train/autotune.py): where XLA's autotuning results are read and written.

CPU: the resolution of the setting, the errors, and the rename that puts XLA's dump in place. What the file is for
(a resumed GPU process continuing bitwise) is tests/test_resume.py's GPU case.
"""

import os

import pytest

from mhl_jax.config import ConfigError
from mhl_jax.train.autotune import DEFAULT_NAME, AutotuneFile, autotune_file

# the head of a file jaxlib 0.11.2 wrote on an H100 (bench/results/autotune-h100-2026-11-27.log's run a)
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


def test_several_processes_dump_through_names_of_each_launch(tmp_path):
    """A run of several processes: every launch's dump name (a compile option, so part of JAX's persistent cache key)
    is new, so that no process of a relaunch takes its step from the cache while another compiles (module docstring);
    one process keeps its fixed name. A commit removes killed launches' dumps of the same file, not other files'."""
    one = [autotune_file("auto", tmp_path) for _ in range(2)]
    assert one[0].compiler_options() == one[1].compiler_options() and one[0].tmp.name == "xla_autotune.partial.txt"
    for i in (0, 1):
        a, b = (autotune_file("auto", tmp_path, process_index=i, process_count=2) for _ in range(2))
        assert a.path == b.path and a.tmp != b.tmp and a.tmp.parent == a.path.parent and a.tmp.suffix == ".txt"
        assert a.tmp.name.startswith(f"{a.path.stem}.partial-")
        assert a.compiler_options()["xla_gpu_dump_autotune_results_to"] != \
            b.compiler_options()["xla_gpu_dump_autotune_results_to"]
    a, killed = (autotune_file("auto", tmp_path, process_index=0, process_count=2) for _ in range(2))
    other = autotune_file("auto", tmp_path, process_index=1, process_count=2)
    killed.tmp.write_text(RESULTS)  # a launch killed between XLA's dump and the rename
    other.tmp.write_text(RESULTS)  # process 1's, in flight
    a.tmp.write_text(RESULTS)
    assert a.commit() is True and a.path.read_text() == RESULTS
    assert not killed.tmp.exists() and other.tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.path.name, other.tmp.name])


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


def test_explicit_path_and_binary_form(tmp_path):
    p = tmp_path / "tuned.pb"
    a = autotune_file(str(p), tmp_path / "elsewhere")
    assert a.path == p.resolve() and a.tmp.suffix == ".pb" and a.load is None
    p.write_bytes(b"\x0a\x00")  # binary: left to XLA to check
    assert autotune_file(str(p), tmp_path).load == p.resolve()
    empty = tmp_path / "empty.txt"  # no results at all: a valid (empty) text file
    empty.write_text("\n")
    assert autotune_file(str(empty), tmp_path).load == empty.resolve()


def test_errors_name_the_value(tmp_path):
    missing = tmp_path / "no_such_dir" / "tuned.txt"
    with pytest.raises(ConfigError, match=r"train.xla_autotune_file=.*no_such_dir.*does not exist"):
        autotune_file(str(missing), tmp_path)
    with pytest.raises(ConfigError, match=r"train.xla_autotune_file=.* is a directory"):
        autotune_file(str(tmp_path), tmp_path)
    bad = tmp_path / "bad.txt"
    bad.write_text("not autotune results\n")
    with pytest.raises(ConfigError, match=r"train.xla_autotune_file=.*bad.txt is not a file of XLA autotuning"):
        autotune_file(str(bad), tmp_path)
    (tmp_path / DEFAULT_NAME).write_text("{'some': 'json'}\n")  # another file under that name: refused, not passed
    with pytest.raises(ConfigError, match="delete it"):  # to XLA, and left as it was
        autotune_file("auto", tmp_path)
    assert (tmp_path / DEFAULT_NAME).read_text() == "{'some': 'json'}\n"


def test_step_compiles_with_the_options_added(monkeypatch):
    """jit_train_step hands jax.jit its own options plus the autotune ones (the all-reduce code motion pass stays
    off), and the default (no autotune options) is unchanged."""
    from mhl_jax.train import step as step_mod

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
    import subprocess
    import sys

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
