"""The bad-input catalogue: every input the project refuses, one row each, with what its message must say.

The promise: bad input (a config, data files, shapes, mesh sizes, checkpoint directories, a command line) is refused
with ONE line that names the value and what was expected, and nothing is lost or left half-written. A row is an id,
the error, a fragment of the message, and `provoke(tmp, monkeypatch)`, which sets the case up under `tmp` and returns
the call that must be refused. Every row is checked alike (the two tests at the end): the call raises exactly the
row's error, whose message holds the fragment on one line, and everything under `tmp` is as the setup left it (a
refused run removes the directories it made; an output directory keeps its files, byte for byte). Command rows run a
command's `main(argv)` in this process: exit status 2 and one line on stderr (argparse's refusals: its usage lines,
then one `error:` line).

One section per kind of input, in the order a run meets them: config, config files, mesh, launch options, .bin
shards, text sources, prepare, checkpoints, a run's setup, a run's other files, generation, then the commands
(train.py, infer, compare, export, prepare). A new refusal is one more row in its section. Rows stay cheap: calls on
tiny files and small pytrees; the rows that run `train` are refused before its step is compiled.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import numpy as np
import pytest

import train as train_py
from mhl_jax import compare, export, infer
from mhl_jax.config import CheckpointConfig, ConfigError, DataConfig, dump_config, load_config
from mhl_jax.data import DataError, load_val_sequences, make_train_loader, prepare
from mhl_jax.data.bin_shards import resolve_shards, write_shard
from mhl_jax.data.pipeline import source_windows
from mhl_jax.data.tokenizers import get_tokenizer
from mhl_jax.generation import generate
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.autotune import DEFAULT_NAME, autotune_file
from mhl_jax.runtime.checkpoint import Checkpointer, CheckpointError, model_fingerprint
from mhl_jax.runtime.distributed import parse_launch
from mhl_jax.runtime.memory import GIB, StepMemory, check_fits
from mhl_jax.runtime.state import state_creator
from mhl_jax.train.loop import accumulation_steps, train
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.records import truncate_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_mh_latent_moe.yaml"  # 4 FFN heads, 16 experts, global and micro batch 16
TINY_MOE = ROOT / "configs" / "tiny_moe.yaml"
# the smallest run of a tiny config: one block, 32 tokens, one device, no progress bar
SMALL = ("model.n_layers=1", "model.context=32", "parallel.devices=1", "logging.progress_bar=false")
FP = {"model": {"d_model": 64, "n_layers": 2}, "ffn": {"kind": "mh_latent_moe", "num_experts": 16, "top_k": 2}}
CPU = jax.devices("cpu")  # 8 of them (tests/conftest.py), on a GPU machine too
ON_GPU = jax.default_backend() == "gpu"


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


# ============================================================================= config: load_config and its checks

CONFIG = Section("config")
for _id, _override, _fragment in [
    # the form of an override
    ("no-equals", "noequals", "override 'noequals': expected the form key.sub=value"),
    ("empty-key", "=1", "override '=1': bad key ''"),
    ("empty-key-part", "model..d_model=1", "bad key 'model..d_model'"),
    ("bad-yaml-value", "model.d_model=[1", "override 'model.d_model=[1': the value '[1' is not valid YAML"),
    # unknown keys
    ("unknown-key", "ffn.bogus=1", "unknown config key 'ffn.bogus'; known keys here: ["),
    ("unknown-section", "nosuch.lr=1", "unknown config key 'nosuch'"),
    ("misspelt-key", "optimizer.learning_rate=1", "unknown config key 'optimizer.learning_rate'"),
    # wrong types
    ("int-as-word", "ffn.top_k=two", "ffn.top_k='two': expected an integer"),
    ("int-as-float", "ffn.top_k=1.5", "ffn.top_k=1.5: expected an integer"),
    ("number-as-word", "optimizer.lr=fast", "optimizer.lr='fast': expected a number"),
    ("choice", "ffn.kind=dense", "ffn.kind='dense': expected one of ['mlp', 'moe', 'latent_moe', 'mh_latent_moe']"),
    ("bool", "logging.progress_bar=3", "logging.progress_bar=3: expected a bool (true/false)"),
    ("string-null", "data.path=null", "data.path=None: expected a string; for none give the empty one (--set "
     "data.path=)"),
    ("string-as-number", "name=3", "name=3: expected a string"),
    ("section-as-value", "model=3", "model: expected a mapping, got 3"),
    # values out of range
    ("width-zero", "model.d_model=0", "model.d_model=0: must be positive"),
    ("odd-head-dim", "model.head_dim=31", "model.head_dim=31: RoPE needs an even head dim"),
    ("init-std", "model.init_std=0", "model.init_std=0.0: must be in (0, 1]"),
    ("stem-layers", "ffn.stem_layers=5", "ffn.stem_layers=5: must be in [0, model.n_layers=4]"),
    ("stem-hidden", "ffn.stem_hidden=0", "ffn.stem_hidden=0: must be positive"),
    ("one-expert", "ffn.num_experts=1", "ffn.num_experts=1: need at least 2 experts"),
    ("top-k-one", "ffn.top_k=1", "ffn.top_k=1: k must be >= 2"),
    ("top-k-over-experts", "ffn.top_k=17", "ffn.top_k=17 > ffn.num_experts=16: k cannot exceed Ne"),
    ("expert-hidden", "ffn.expert_hidden=0", "ffn.expert_hidden=0: must be positive"),
    ("heads-zero", "ffn.num_heads=0", "ffn.num_heads=0, ffn.head_dim=32: must be positive"),
    ("heads-x-dim", "ffn.head_dim=16", "ffn.num_heads=4 x ffn.head_dim=16 = 64 does not match the projection width "
     "ffn.latent_dim=128"),
    ("hp-zero", "parallel.hp=0", "parallel.hp=0, parallel.ep=1: must be >= 1"),
    ("data-zero", "parallel.data=0", "parallel.data=0: must be -1 (auto) or >= 1"),
    ("devices-zero", "parallel.devices=0", "parallel.devices=0: must be -1 (all) or >= 1"),
    ("hp-not-dividing-heads", "parallel.hp=3", "ffn.num_heads=4 is not divisible by parallel.hp=3"),
    ("ep-with-mh-latent-moe", "parallel.ep=2", "parallel.ep=2 needs ffn.kind moe or latent_moe (got 'mh_latent_moe')"),
    ("batch-zero", "train.global_batch=0", "train.global_batch=0, train.micro_batch=16: must be positive"),
    ("micro-not-dividing", "train.micro_batch=5", "train.global_batch=16 is not a multiple of train.micro_batch=5"),
    ("total-steps", "schedule.total_steps=0", "schedule.total_steps=0: must be positive"),
    ("warmup-negative", "schedule.warmup_steps=-1", "schedule.warmup_steps=-1, decay_steps=60: must be >= 0"),
    ("warmup-past-total", "schedule.warmup_steps=290", "schedule.warmup_steps=290 + decay_steps=60 exceeds "
     "schedule.total_steps=300"),
    ("final-lr-ratio", "schedule.final_lr_ratio=2", "schedule.final_lr_ratio=2.0: must be in [0, 1]"),
    ("lr-zero", "optimizer.lr=0", "optimizer.lr=0.0: must be positive"),
    ("lr-nan", "optimizer.lr=.nan", "optimizer.lr=nan: must be a finite number"),
    ("grad-clip", "optimizer.grad_clip=0", "optimizer.grad_clip=0.0: must be positive or null"),
    ("val-sequences", "data.val_sequences=-1", "data.val_sequences=-1: must be >= 0"),
    ("eval-every", "data.eval_every=-5", "data.eval_every=-5: must be >= 0 (0: no validation)"),
    ("checkpoint-every", "checkpoint.every=-1", "checkpoint.every=-1: must be >= 0 (0: no checkpoints)"),
    ("checkpoint-keep", "checkpoint.keep=0", "checkpoint.keep=0: must be >= 1"),
    ("log-every", "logging.log_every=0", "logging.log_every=0: must be >= 1"),
    ("loads-every", "logging.loads_every=-1", "logging.loads_every=-1: must be >= 0 (0: never)"),
    ("profile-start", "logging.profile_start=400", "logging.profile_start=400: must be a step of the run, 1 to "
     "schedule.total_steps=300"),
    ("profile-steps", "logging.profile_steps=0", "logging.profile_steps=0: must be >= 1"),
    ("peak-tflops", "logging.peak_tflops=-1", "logging.peak_tflops=-1.0: must be positive"),
    ("builtin-with-path", "data.path=data/x", "data.path='data/x' / data.val_path='' with data.source='builtin', which "
     "reads the built-in corpus and no files: set data.source=bin (prepared .bin shards) or hf (text), or empty them "
     "(--set data.path= --set data.val_path=) to train on the built-in corpus"),
    ("tokenizer-file-with-byte", "data.tokenizer_file=r50k_base.tiktoken", "data.tokenizer_file='r50k_base.tiktoken' "
     "with data.tokenizer='byte', which reads no file: the file is GPT-2's vocabulary (set data.tokenizer=gpt2)"),
    ("builtin-with-gpt2", "data.tokenizer=gpt2", "data.tokenizer='gpt2' with data.source='builtin': the built-in "
     "corpus is byte-level"),
    # settings that would poison the state: not finite, or out of their range
    ("lr-inf", "optimizer.lr=.inf", "optimizer.lr=inf: must be a finite number"),
    ("lr-negative", "optimizer.lr=-1e-3", "optimizer.lr=-0.001: must be positive"),
    ("init-std-nan", "model.init_std=.nan", "model.init_std=nan: must be a finite number"),
    ("final-lr-ratio-nan", "schedule.final_lr_ratio=.nan", "schedule.final_lr_ratio=nan: must be a finite number"),
    ("peak-tflops-inf", "logging.peak_tflops=-.inf", "logging.peak_tflops=-inf: must be a finite number"),
    ("beta1-one", "optimizer.beta1=1", "optimizer.beta1=1.0: must be in [0, 1)"),
    ("beta2-negative", "optimizer.beta2=-0.5", "optimizer.beta2=-0.5: must be in [0, 1)"),
    ("eps-zero", "optimizer.eps=0", "optimizer.eps=0.0: must be positive"),
    ("weight-decay-negative", "optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1: must be >= 0"),
    ("grad-clip-zero", "optimizer.grad_clip=0", "optimizer.grad_clip=0.0: must be positive or null"),
    ("init-std-large", "model.init_std=3", "model.init_std=3.0: must be in (0, 1]"),
    ("norm-eps-zero", "model.norm_eps=0", "model.norm_eps=0.0: must be positive"),
    ("rope-base-below-one", "model.rope_base=0.5", "model.rope_base=0.5: must be > 1"),
    ("balance-gamma-negative", "ffn.balance_gamma=-1", "ffn.balance_gamma=-1.0: must be >= 0"),
    ("on-damage", "checkpoint.on_damage=ignore", "checkpoint.on_damage='ignore': expected one of ['fallback', "
     "'stop']"),
]:
    CONFIG.add(_id, ConfigError, _fragment, calls(load_config, str(TINY), [_override]))
for _id, _overrides, _fragment in [
    ("hp-with-moe", ["parallel.hp=2"], "parallel.hp=2 needs ffn.kind=mh_latent_moe (got 'moe'); use parallel.ep"),
    ("ep-not-dividing-experts", ["parallel.ep=3"], "ffn.num_experts=16 is not divisible by parallel.ep=3"),
    ("dense-hidden", ["ffn.kind=mlp", "ffn.hidden=0"], "ffn.hidden=0: must be positive"),
    ("latent-dim", ["ffn.kind=latent_moe", "ffn.latent_dim=0"], "ffn.latent_dim=0: must be positive"),
    ("decay-shape-without-decay", ["schedule.decay_steps=0", "schedule.decay=cosine"],
     "schedule.decay='cosine', final_lr_ratio=0.0 shape the decay, and schedule.decay_steps=0 has none"),
    ("bin-without-path", ["data.source=bin"], "data.source='bin' needs data.path"),
    ("routing-tokens-kind", ["ffn.routing_tokens=separate"], "ffn.routing_tokens='separate' with ffn.kind='moe': "
     "separate routing sub-tokens are a Multi-Head LatentMoE option (ffn.kind=mh_latent_moe)"),
]:
    CONFIG.add(_id, ConfigError, _fragment, calls(load_config, str(TINY_MOE), _overrides))


# ============================================================================= config files

CONFIG_FILES = Section("config-file")
CONFIG_FILES.add("missing", ConfigError, "nope.yaml' does not exist", lambda tmp, mp: partial(load_config,
                                                                                             str(tmp / "nope.yaml")))
CONFIG_FILES.add("a-directory", ConfigError, "is a directory; expected a YAML file such as configs/",
                 lambda tmp, mp: partial(load_config, str(tmp)))


def _config_file(text: str | bytes):
    def provoke(tmp, mp):
        path = tmp / "c.yaml"
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
        return partial(load_config, str(path))
    return provoke


CONFIG_FILES.add("section-not-a-mapping", ConfigError, "model: expected a mapping, got 3", _config_file("model: 3\n"))
CONFIG_FILES.add("top-level-list", ConfigError, "config: expected a mapping, got ['a']", _config_file("- a\n"))
CONFIG_FILES.add("unknown-key", ConfigError, "unknown config key 'model.widht'", _config_file("model:\n  widht: 3\n"))
CONFIG_FILES.add("wrong-type", ConfigError, "train.seed='zero': expected an integer",
                 _config_file("train:\n  seed: zero\n"))
CONFIG_FILES.add("not-yaml", ConfigError, "c.yaml' is not valid YAML at line 2, column 1: expected ',' or ']', but "
                 "got '<stream end>'", _config_file("model: [1, 2\n"))
CONFIG_FILES.add("not-utf8", ConfigError, "c.yaml' is not UTF-8 text (byte 0: invalid start byte)",
                 _config_file(b"\xff\xfe"))
CONFIG_FILES.add("unknown-name", ConfigError, "config 'tiny_mo': no such file here, and no config of that name in ",
                 calls(load_config, "tiny_mo"))




# ============================================================================= batch sizes and the device mesh

MESH = Section("mesh")
MESH.add("micro-batch-x-devices", ConfigError, "train.global_batch=16 is not a multiple of train.micro_batch=16 x 2 "
         "devices = 32; e.g. --set train.micro_batch=8", lambda tmp, mp: partial(accumulation_steps, small(tmp), 2))
MESH.add("no-micro-batch-fits", ConfigError, "train.global_batch=36 is not a multiple of train.micro_batch=4 x 5 "
         "devices = 20", lambda tmp, mp: partial(accumulation_steps, small(tmp, "train.global_batch=36",
                                                                          "train.micro_batch=4"), 5))
for _id, _config, _sets, _devices, _fragment in [
    ("hp-not-dividing-devices", TINY, ["parallel.hp=4", "train.micro_batch=2"], 6,
     "parallel.hp=4 does not divide the 6 devices of the mesh"),
    ("ep-past-devices", TINY_MOE, ["parallel.ep=8"], 4, "parallel.ep=8 exceeds the 4 devices of the mesh"),
    ("data-x-ep", TINY_MOE, ["parallel.ep=2", "parallel.data=4"], 4,
     "parallel.data=4 x parallel.ep=2 = 8 devices, but the mesh has 4"),
    ("batch-over-devices", TINY_MOE, ["parallel.ep=2", "train.global_batch=12", "train.micro_batch=4"], 8,
     "train.global_batch=12 sequences cannot be split over 8 devices"),
]:
    MESH.add(_id, ConfigError, _fragment, lambda tmp, mp, c=_config, s=_sets, n=_devices:
             partial(make_mesh, load_config(str(c), s), CPU[:n]))


@MESH.refusal(ConfigError, "ffn.num_heads=4 is not divisible by parallel.hp=8")
def heads_not_dividing_hp(tmp, mp):  # past load_config's own check: a config built in code
    cfg = small(tmp)
    return partial(make_mesh, dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, hp=8)), CPU)


@MESH.refusal(ConfigError, "ffn.num_experts=12 is not divisible by parallel.ep=8")
def experts_not_dividing_ep(tmp, mp):
    cfg = small(tmp, config=TINY_MOE)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=8),
                              ffn=dataclasses.replace(cfg.ffn, num_experts=12))
    return partial(make_mesh, cfg, CPU)




@MESH.refusal(ConfigError, "parallel.hp=0 on 8 devices: both must be >= 1")
def hp_zero(tmp, mp):
    cfg = small(tmp)
    return partial(make_mesh, dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, hp=0)), CPU)


MESH.add("more-devices-than-visible", ConfigError, "parallel.devices=99 but ",
         calls(make_mesh, load_config(str(TINY), ["parallel.devices=99"])))


@MESH.refusal(ConfigError, "parallel.devices=4 with 2 processes: a run of several processes uses all", cpu_only=True)
def devices_of_several_processes(tmp, mp):
    mp.setattr(jax, "process_count", lambda: 2)
    return partial(make_mesh, small(tmp, "parallel.devices=4"))


# ============================================================================= launch options (several processes)

LAUNCH = Section("launch")
for _id, _kw, _fragment in [
    ("no-process-id", dict(coordinator="h:1", num_processes=2), "missing: --process-id"),
    ("no-coordinator", dict(num_processes=2, process_id=0), "missing: --coordinator"),
    ("process-id-past-count", dict(coordinator="h:1", num_processes=2, process_id=2),
     "--num-processes=2 --process-id=2: need num_processes >= 1 and 0 <= process_id < num_processes"),
    ("no-processes", dict(coordinator="h:1", num_processes=0, process_id=0), "--num-processes=0 --process-id=0"),
    ("count-as-word", dict(coordinator="h:1", num_processes="two", process_id=0),
     "--num-processes='two': expected an integer"),
    ("coordinator-without-port", dict(coordinator="node0", num_processes=2, process_id=0),
     "--coordinator='node0': expected HOST:PORT"),
    ("coordinator-port-range", dict(coordinator="node0:99999", num_processes=2, process_id=0),
     "--coordinator='node0:99999': expected HOST:PORT"),
    ("device-ids-alone", dict(local_device_ids="0,1"), "--local-device-ids is for runs of several processes"),
    ("device-ids-repeated", dict(coordinator="h:1", num_processes=2, process_id=0, local_device_ids="0,0"),
     "--local-device-ids='0,0': expected distinct device numbers >= 0"),
    ("device-ids-one-process", dict(coordinator="h:1", num_processes=1, process_id=0, local_device_ids="0"),
     "choose them with CUDA_VISIBLE_DEVICES"),
    ("auto-and-explicit", dict(auto=True, num_processes=2), "--distributed-auto takes the coordinator"),
]:
    LAUNCH.add(_id, ConfigError, _fragment, calls(parse_launch, env={}, **_kw))
# Refused with real processes in tests/parallel/test_multiprocess.py: processes started with different commands, a
# run directory the processes do not share, a coordinator port in use, --distributed-auto without a cluster.


# ============================================================================= data: .bin shards

SHARDS = Section("shards")
LOADER = dict(seq_len=16, batch_size=4, seed=0, vocab_size=320)


def _bin(path, **kw) -> DataConfig:
    return DataConfig(**{"source": "bin", "path": str(path), "prefetch": 2, "read_threads": 2, **kw})


def _shard(tmp: Path, name: str = "train_000000.bin", n: int = 1000, top: int = 300) -> Path:
    path = tmp / name
    write_shard(path, np.random.default_rng(0).integers(0, top, n).astype(np.uint16))
    return path


def _damaged(mutate):
    """A shard of 1000 tokens with `mutate(bytearray)` applied, given to the train loader."""
    def provoke(tmp, mp):
        path = _shard(tmp, "damaged.bin")
        path.write_bytes(bytes(mutate(bytearray(path.read_bytes()))))
        return partial(make_train_loader, _bin(path), **LOADER)
    return provoke


def _header(i: int, value: int):
    def mutate(raw):
        raw[4 * i:4 * i + 4] = np.int32(value).tobytes()
        return raw
    return mutate


SHARDS.add("missing", DataError, "nope': no such file or directory",
           lambda tmp, mp: partial(make_train_loader, _bin(tmp / "nope"), **LOADER))
SHARDS.add("empty-spec", DataError, "data.path is empty: expected a directory, glob or file of .bin shards",
           calls(resolve_shards, ""))
SHARDS.add("no-train-shards", DataError, "the directory holds no train .bin shards (file names containing 'train')",
           lambda tmp, mp: partial(make_train_loader, _bin(tmp), **LOADER))
SHARDS.add("directory-named-bin", DataError, "the directory holds no train .bin shards", lambda tmp, mp: (
    (tmp / "s" / "train_x.bin").mkdir(parents=True), partial(make_train_loader, _bin(tmp / "s"), **LOADER))[1])
SHARDS.add("glob-matches-nothing", DataError, "fineweb_*.bin': the glob matches no shard files",
           lambda tmp, mp: partial(make_train_loader, _bin(tmp / "fineweb_*.bin"), **LOADER))
SHARDS.add("wrong-magic", DataError, "damaged.bin': wrong magic number 12345, expected 20240520",
           _damaged(_header(0, 12345)))
SHARDS.add("wrong-version", DataError, "damaged.bin': unsupported version 7, expected 1", _damaged(_header(1, 7)))
SHARDS.add("negative-count", DataError, "damaged.bin': negative token count -5 in the header", _damaged(_header(2, -5)))
SHARDS.add("truncated-tokens", DataError, "damaged.bin' is truncated: the header promises 1000 tokens",
           _damaged(lambda raw: raw[:-10]))
SHARDS.add("truncated-header", DataError, "damaged.bin' is truncated: 100 bytes, shorter than the 1024-byte header",
           _damaged(lambda raw: raw[:100]))
SHARDS.add("bytes-after-tokens", DataError, "damaged.bin': 2 bytes after the 1000 tokens the header promises",
           _damaged(lambda raw: raw + b"\0\0"))


@SHARDS.refusal(DataError, "vocab.bin': token id 400 >= model.vocab_size=320 (first offending token at position 321)")
def token_past_vocab(tmp, mp):
    tokens = np.zeros(1000, np.uint16)
    tokens[321] = 400
    write_shard(tmp / "vocab.bin", tokens)
    return partial(make_train_loader, _bin(tmp / "vocab.bin"), **LOADER)


@SHARDS.refusal(DataError, "short.bin]: 16 tokens in 1 stream(s) hold no sequence of 17 tokens (model.context + 1)")
def shorter_than_a_sequence(tmp, mp):
    write_shard(tmp / "short.bin", np.arange(16, dtype=np.uint16))
    return partial(make_train_loader, _bin(tmp / "short.bin"), **LOADER)


@SHARDS.refusal(DataError, "val_000000.bin]: 500 validation tokens give 31 sequences of 17 tokens, fewer than "
                           "data.val_sequences=100")
def validation_set_too_small(tmp, mp):
    _shard(tmp)
    _shard(tmp, "val_000000.bin", 500)
    return partial(load_val_sequences, _bin(tmp, val_sequences=100), seq_len=16, vocab_size=320)


@SHARDS.refusal(DataError, "data.source='bin' with data.path=")
def one_shard_without_val_path(tmp, mp):
    return partial(load_val_sequences, _bin(_shard(tmp), val_sequences=2), seq_len=16, vocab_size=320)


@SHARDS.refusal(DataError, "the directory holds no val .bin shards (file names containing 'val')")
def directory_without_val_shards(tmp, mp):
    _shard(tmp)
    return partial(load_val_sequences, _bin(tmp, val_sequences=2), seq_len=16, vocab_size=320)


SHARDS.add("write-2d", DataError, "tokens must be 1-D, got shape (2, 2)",
           lambda tmp, mp: partial(write_shard, tmp / "x.bin", np.zeros((2, 2))))
SHARDS.add("write-past-uint16", DataError, "token ids must be in [0, 65536), got [0, 70000]",
           lambda tmp, mp: partial(write_shard, tmp / "x.bin", np.array([0, 70000])))


def test_without_verify_tokens_the_shard_past_the_vocab_is_taken(tmp_path):
    """The control of shards/token-past-vocab: data.verify_tokens=false turns that check, and only it, off."""
    token_past_vocab(tmp_path, None)
    assert next(make_train_loader(_bin(tmp_path / "vocab.bin", verify_tokens=False), **LOADER)).shape == (4, 17)


# ============================================================================= data: text sources, tokenizers, pipeline

TEXT = Section("text")
TEXT_LOADER = dict(seq_len=32, batch_size=4, seed=0, vocab_size=320)


def _hf(tmp_name: str, content: str | None = None, **kw):
    """The train loader of data.source=hf over tmp/`tmp_name` (written with `content` when given)."""
    def provoke(tmp, mp):
        if content is not None:
            (tmp / tmp_name).write_text(content)
        return partial(make_train_loader, DataConfig(source="hf", path=str(tmp / tmp_name), read_threads=1, **kw),
                       **TEXT_LOADER)
    return provoke


ROWS = "".join(json.dumps({"content": "some words " * 30}) + "\n" for _ in range(40))
TEXT.add("glob-matches-nothing", DataError, "*.jsonl': the glob matches no files", _hf("*.jsonl"))
TEXT.add("path-typo", DataError, "data.path='corpus.txt': no such file or directory",
         calls(make_train_loader, DataConfig(source="hf", path="corpus.txt"), **TEXT_LOADER))
TEXT.add("directory-without-data-files", DataError, "the directory holds no data files (.csv, .json", _hf("."))
TEXT.add("unknown-format", DataError, "cannot tell the format of", _hf("notes.dat", "text"))
# then "cannot read the files as json" or "reading failed after 1 rows", as the datasets version reads it
TEXT.add("malformed-jsonl", DataError, "broken.jsonl': ",
         _hf("broken.jsonl", '{"text": "fine"}\n{"text": "unterminated\n'))
TEXT.add("no-text-column", DataError, "ok.jsonl' has no text column 'text' (data.text_column); columns: ['content']",
         _hf("ok.jsonl", ROWS))
TEXT.add("split-of-local-files", DataError, "data.hf_split='test' names a split of a Hugging Face dataset",
         _hf("ok.jsonl", ROWS, text_column="content", hf_split="test"))
TEXT.add("too-short", DataError, "tiny.txt' (train): 9 tokens in 1 stream(s) hold no sequence of 33 tokens",
         _hf("tiny.txt", "too short", val_fraction=0.1))


@TEXT.refusal(DataError, "data.val_path='validation' is not a local file, directory or glob")
def split_name_as_val_path(tmp, mp):
    (tmp / "ok.jsonl").write_text(ROWS)
    cfg = DataConfig(source="hf", path=str(tmp / "ok.jsonl"), val_path="validation", text_column="content",
                     val_sequences=2, read_threads=1)
    return partial(load_val_sequences, cfg, seq_len=32, vocab_size=320)


@TEXT.refusal(DataError, "data.path='org/corpus': no local file by that name, and loading it as a Hugging Face "
                         "dataset (config 'cfg', split 'train') failed: ConnectionError")
def dataset_name_offline(tmp, mp):
    import datasets  # optional: the hf source's reader

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    mp.setattr(datasets, "load_dataset", offline)
    return partial(make_train_loader, DataConfig(source="hf", path="org/corpus", hf_config="cfg"), **TEXT_LOADER)




@TEXT.refusal(DataError, "mixes formats ['json', 'text']; use files of one kind")
def mixed_formats(tmp, mp):
    (tmp / "a.txt").write_text("words")
    (tmp / "b.jsonl").write_text(ROWS)
    return partial(make_train_loader, DataConfig(source="hf", path=str(tmp)), **TEXT_LOADER)


@TEXT.refusal(DataError, "reading text through Hugging Face datasets needs the datasets package")
def datasets_missing(tmp, mp):
    without(mp, "datasets")
    (tmp / "ok.jsonl").write_text(ROWS)
    return partial(make_train_loader, DataConfig(source="hf", path=str(tmp / "ok.jsonl")), **TEXT_LOADER)


@TEXT.refusal(DataError, "tokenizer 'gpt2' needs the tiktoken package (pip install tiktoken)")
def tiktoken_missing(tmp, mp):
    without(mp, "tiktoken")
    return partial(get_tokenizer, "gpt2")


TEXT.add("tokenizer-unknown", DataError, "tokenizer 'sentencepiece': expected 'byte' or 'gpt2'",
         calls(get_tokenizer, "sentencepiece"))


@TEXT.refusal(DataError, "tokenizer 'gpt2': tiktoken could not load the GPT-2 encoding files")
def gpt2_files_offline(tmp, mp):
    import tiktoken  # optional: the gpt2 tokenizer's

    def offline(name):
        raise ConnectionError(f"cannot download {name}")

    mp.setattr(tiktoken, "get_encoding", offline)
    return partial(get_tokenizer, "gpt2")




def _rank_file(tmp, body: bytes) -> str:
    (tmp / "r50k_base.tiktoken").write_bytes(body)
    return str(tmp / "r50k_base.tiktoken")


BYTE_RANKS = b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256))
TEXT.add("tokenizer-file-missing", DataError, "data.tokenizer_file='nowhere.tiktoken' cannot be read (No such file or "
         "directory); copy tiktoken's r50k_base.tiktoken (GPT-2's vocabulary, 50256 lines) from a machine with "
         "network and set data.tokenizer_file=PATH", calls(get_tokenizer, "gpt2", "nowhere.tiktoken"))
TEXT.add("tokenizer-file-with-byte", DataError, "data.tokenizer_file='r50k_base.tiktoken' with tokenizer 'byte', "
         "which reads no file", calls(get_tokenizer, "byte", "r50k_base.tiktoken"))
for _id, _body, _msg in [
        ("tokenizer-file-line", b"YQ== 0\nnot-base64! 1\n", "line 2: b'not-base64! 1' is not 'base64(token) rank' "
         "(the .tiktoken format)"),
        ("tokenizer-file-ranks", BYTE_RANKS.replace(b" 7\n", b" 700\n"), "its 256 ranks are not 0..255, each once"),
        ("tokenizer-file-bytes", b"YQ== 0\n", "byte 0 (and 254 more) has no rank; a BPE vocabulary holds every "
         "single byte"),
        ("tokenizer-file-size", BYTE_RANKS, "holds 256 tokens, GPT-2's r50k_base.tiktoken 50256: it is another "
         "vocabulary")]:
    TEXT.add(_id, DataError, _msg, lambda tmp, mp, body=_body: partial(get_tokenizer, "gpt2", _rank_file(tmp, body)))
TEXT.add("vocab-below-tokenizer", DataError, "tokenizer 'byte' has 257 ids but model.vocab_size=200; "
         "model.vocab_size must be >= 257", calls(make_train_loader, DataConfig(), seq_len=64, batch_size=16, seed=0,
                                                 vocab_size=200))
TEXT.add("val-fraction", DataError, "data.val_fraction=1.5: must be in (0, 1) to hold out a tail of the built-in "
         "corpus", calls(load_val_sequences, DataConfig(val_fraction=1.5), seq_len=32, vocab_size=320))
TEXT.add("prefetch-negative", DataError, "data.prefetch=-1, data.worker_count=0: must be >= 0",
         calls(make_train_loader, DataConfig(prefetch=-1), **TEXT_LOADER))
TEXT.add("batch-zero", DataError, "batch_size=0: must be >= 1",
         calls(make_train_loader, DataConfig(), seq_len=32, batch_size=0, seed=0, vocab_size=320))
TEXT.add("hf-without-path", DataError, "data.source='hf' needs data.path (local data files or a dataset name)",
         calls(make_train_loader, DataConfig(source="hf"), **TEXT_LOADER))
TEXT.add("source-unknown", DataError, "data.source='s3': expected 'builtin', 'bin' or 'hf'",
         calls(make_train_loader, DataConfig(source="s3"), **TEXT_LOADER))
TEXT.add("val-sequences-negative", DataError, "data.val_sequences=-1: must be >= 0",
         calls(load_val_sequences, DataConfig(val_sequences=-1), seq_len=32, vocab_size=320))
TEXT.add("part", DataError, "part='test': expected 'train' or 'val'",
         calls(source_windows, DataConfig(), "test", seq_len=32, vocab_size=320))
TEXT.add("sequence-length", DataError, "seq_len=0, vocab_size=320: must be positive",
         calls(source_windows, DataConfig(), "train", seq_len=0, vocab_size=320))


# ============================================================================= data: python -m mhl_jax.data.prepare

PREPARE = Section("prepare")


def _prepare(*argv: str, text: str | None = "abcd", shards_there: bool = False):
    """prepare's main over tmp/in.txt holding `text` (none: no such file) into tmp/out (holding shards when
    `shards_there`), with `argv` after the defaults (the byte tokenizer, --val-tokens 100)."""
    def provoke(tmp, mp):
        if text is not None:
            (tmp / "in.txt").write_text(text)
        if shards_there:
            (tmp / "out").mkdir()
            _shard(tmp / "out", "train_000000.bin")
            _shard(tmp / "out", "val_000000.bin")
        args = ["--input", str(tmp / "in.txt"), "--tokenizer", "byte", "--out", str(tmp / "out"), "--val-tokens",
                "100", "--no-progress"]
        return partial(prepare.main, [*args, *(a.format(tmp=tmp) for a in argv)])
    return provoke


PREPARE.add("input-missing", DataError, "in.txt': no such file or directory", _prepare(text=None))
PREPARE.add("input-not-a-path", DataError, "--input 'no_such_input': no such file, directory or glob match",
            _prepare("--input", "no_such_input"))
PREPARE.add("fewer-than-val-tokens", DataError, "the input has 5 tokens, fewer than --val-tokens=100 plus at least "
            "one training token", _prepare())
PREPARE.add("out-holds-shards", DataError, "out' already holds shards (train_000000.bin, ...); choose an empty "
            "directory or pass --overwrite", _prepare("--val-tokens", "2", shards_there=True))
PREPARE.add("overwrite-keeps-shards-on-failure", DataError, "fewer than --val-tokens=100",
            _prepare("--overwrite", shards_there=True))
PREPARE.add("out-is-a-file", DataError, "in.txt' is a file; expected a directory (made if absent)",
            _prepare("--out", "{tmp}/in.txt"))
PREPARE.add("out-cannot-be-created", DataError, "in.txt/out' cannot be created", _prepare("--out", "{tmp}/in.txt/out"))


@PREPARE.refusal(DataError, "--input has no text column 'text' (--text-column); columns: ['body']")
def input_without_text_column(tmp, mp):
    (tmp / "in.jsonl").write_text(json.dumps({"body": "words " * 40}) + "\n")
    return partial(prepare.main, ["--input", str(tmp / "in.jsonl"), "--tokenizer", "byte", "--out", str(tmp / "out"),
                                  "--val-tokens", "10", "--no-progress"])


@PREPARE.refusal(DataError, "row 2 (counting from 0, over the files in name order) of column 'text' holds NoneType, "
                            "expected str")
def input_row_without_text(tmp, mp):
    (tmp / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("words " * 40, "more", None)))
    return partial(prepare.main, ["--input", str(tmp / "in.jsonl"), "--tokenizer", "byte", "--out", str(tmp / "out"),
                                  "--val-tokens", "10", "--no-progress"])


# ============================================================================= checkpoints: Checkpointer

CHECKPOINT = Section("checkpoint")


def tree(cols: int = 3, **extra) -> dict:
    """A small state: params/w (2, cols) float32, step, and `extra` leaves."""
    return {"params": {"w": np.ones((2, cols), np.float32)}, "step": np.int32(0), **extra}


def opened(directory: Path, action, fingerprint=None, read_only: bool = False, keep: int = 3):
    """The call that opens a Checkpointer on `directory` and does `action(ck)` with it."""
    def call():
        with Checkpointer(directory, CheckpointConfig(keep=keep, async_save=False), fingerprint or FP,
                          read_only=read_only) as ck:
            return action(ck)
    return call


def _saved(action, steps=(1,), damage=None, data_iter=None, **kw):
    """A row on tmp/ck holding `tree()` at `steps` (and the position of `data_iter()` when given), then
    `damage(tmp/ck/1)`: `action(ck, tmp)` with a Checkpointer opened there (`opened`'s `kw`) is refused."""
    def provoke(tmp, mp):
        save(tmp / "ck", tree(), steps, data_iter=data_iter and data_iter())
        if damage is not None:
            damage(tmp / "ck" / "1")
        return opened(tmp / "ck", lambda ck: action(ck, tmp), **kw)
    return provoke


def _builtin_loader():
    return make_train_loader(DataConfig(prefetch=0, read_threads=1), **LOADER)


def _data_files(*contents: str | None):
    """Damage: a step's iterator state replaced by files process_<i>-of-<len(contents)>.json holding `contents` (None:
    that one's file missing)."""
    def damage(step_dir: Path):
        for f in (step_dir / "data").iterdir():
            f.unlink()
        for i, text in enumerate(contents):
            if text is not None:
                (step_dir / "data" / f"process_{i}-of-{len(contents)}.json").write_text(text)
    return damage


def _overwrite(item: str, text: bytes = b"\0" * 7):
    """Damage: every file of a step's `item` (state, meta) overwritten with `text`."""
    def damage(step_dir: Path):
        for f in (step_dir / item).rglob("*"):
            if f.is_file():
                f.write_bytes(text)
    return damage


CHECKPOINT.add("keep-zero", CheckpointError, "checkpoint.keep=0: must be >= 1",
               lambda tmp, mp: opened(tmp / "ck", None, keep=0))
CHECKPOINT.add("fingerprint-not-json", CheckpointError, "the checkpoint fingerprint must be JSON-able",
               lambda tmp, mp: opened(tmp / "ck", None, fingerprint={"model": {1, 2}}))


@CHECKPOINT.refusal(CheckpointError, "ck' is a file; expected a directory (move the file away, or use another "
                                     "logging.run_dir)")
def directory_is_a_file(tmp, mp):
    (tmp / "ck").write_text("not a directory")
    return opened(tmp / "ck", None)


CHECKPOINT.add("read-only-missing", CheckpointError, "no checkpoint directory",
               lambda tmp, mp: opened(tmp / "ck", None, read_only=True))
CHECKPOINT.add("save-read-only", CheckpointError, "ck': opened read-only",
               _saved(lambda ck, tmp: ck.save(2, tree()), read_only=True))
CHECKPOINT.add("parts-not-read-only", CheckpointError, "restore_parts needs a Checkpointer opened with read_only=True",
               _saved(lambda ck, tmp: ck.restore_parts(tree())))
CHECKPOINT.add("save-older-step", CheckpointError, "cannot save step 1 into", _saved(
    lambda ck, tmp: ck.save(1, tree()), steps=(1, 2)))


@CHECKPOINT.refusal(CheckpointError, "no complete checkpoint in")
def no_checkpoint(tmp, mp):
    (tmp / "ck").mkdir()
    return opened(tmp / "ck", lambda ck: ck.restore(tree()))


@CHECKPOINT.refusal(CheckpointError, "latest': a step directory must be named by its step")
def step_directory_renamed(tmp, mp):
    save(tmp / "ck", tree())
    (tmp / "ck" / "1").rename(tmp / "latest")
    return opened(tmp / "ck", lambda ck: ck.restore(tree(), path=tmp / "latest"))


CHECKPOINT.add("no-such-step", CheckpointError, "no checkpoint of step 5 in", _saved(
    lambda ck, tmp: ck.restore(tree(), step=5), steps=(1, 2)))
CHECKPOINT.add("path-missing", CheckpointError, "missing' does not exist (or is not a directory)",
               _saved(lambda ck, tmp: ck.restore(tree(), path=tmp / "missing")))
CHECKPOINT.add("path-not-a-checkpoint", CheckpointError, "is not a checkpoint: expected a step directory holding "
               "state/ and meta/, or a directory of such step directories",
               _saved(lambda ck, tmp: ck.restore(tree(), path=tmp)))
CHECKPOINT.add("path-of-another-step", CheckpointError, "holds step 1, not the step 2 asked for",
               _saved(lambda ck, tmp: ck.restore(tree(), step=2, path=tmp / "ck" / "1")))
CHECKPOINT.add("path-without-the-step", CheckpointError, "no checkpoint of step 5 in",
               _saved(lambda ck, tmp: ck.restore(tree(), step=5, path=tmp / "ck")))
CHECKPOINT.add("another-model", CheckpointError, "was written by a different model config (ffn.num_experts: checkpoint "
               "16, this run 32; model.rope: checkpoint '<absent>', this run 10000.0)",
               _saved(lambda ck, tmp: ck.restore(tree()), fingerprint={
                   "model": {**FP["model"], "rope": 10000.0}, "ffn": {**FP["ffn"], "num_experts": 32}}))
CHECKPOINT.add("leaf-of-another-shape", CheckpointError, "leaf params/w is float32(2, 3), this run expects "
               "float32(2, 4)", _saved(lambda ck, tmp: ck.restore(tree(4))))
CHECKPOINT.add("leaf-missing", CheckpointError, "holds a different state layout: 1 leaves missing from it (extra), 0 "
               "not in this run ()", _saved(lambda ck, tmp: ck.restore(tree(extra=np.zeros(3)))))
CHECKPOINT.add("leaf-not-in-this-run", CheckpointError, "0 leaves missing from it (), 1 not in this run (step)",
               _saved(lambda ck, tmp: ck.restore({"params": tree()["params"]})))
CHECKPOINT.add("another-layout-version", CheckpointError, "layout version 2, expected 1", _saved(
    lambda ck, tmp: ck.restore(tree()), damage=lambda step: (step / "meta" / "metadata").write_text(
        (step / "meta" / "metadata").read_text().replace('"format": 1', '"format": 2'))))
CHECKPOINT.add("damaged-state", CheckpointError, "1: its state cannot be read (", _saved(
    lambda ck, tmp: ck.restore(tree()), damage=_overwrite("state")))
CHECKPOINT.add("damaged-meta", CheckpointError, "1: its meta cannot be read (", _saved(
    lambda ck, tmp: ck.restore(tree()), damage=_overwrite("meta", b"{not json")))
CHECKPOINT.add("no-data-state", CheckpointError, "holds no data-iterator state (data/), so the input pipeline cannot "
               "resume where it stopped", _saved(lambda ck, tmp: ck.restore(tree(), _builtin_loader())))
CHECKPOINT.add("data-state-file-missing", CheckpointError, "data/ holds no iterator state file", _saved(
    lambda ck, tmp: ck.restore(tree(), _builtin_loader()), damage=_data_files(), data_iter=_builtin_loader))
CHECKPOINT.add("data-state-of-missing-processes", CheckpointError, "not one per process of the run that wrote it",
               _saved(lambda ck, tmp: ck.restore(tree(), _builtin_loader()), damage=_data_files("{}", None),
                      data_iter=_builtin_loader))
CHECKPOINT.add("data-states-that-differ", CheckpointError, "was written by 2 processes whose input pipelines stood at "
               "different positions (process_0-of-2.json, process_1-of-2.json), so it cannot resume in a run of 1 "
               "process(es); resume it with 2 processes", _saved(lambda ck, tmp: ck.restore(tree(), _builtin_loader()),
                                                                 damage=_data_files("{}", "[]"),
                                                                 data_iter=_builtin_loader))
CHECKPOINT.add("data-state-not-json", CheckpointError, "process_0-of-2.json is not JSON (", _saved(
    lambda ck, tmp: ck.restore(tree(), _builtin_loader()), damage=_data_files("{x", "{x"), data_iter=_builtin_loader))


@CHECKPOINT.refusal(CheckpointError, "opt_state/mu is float32(2, 3), this run expects bfloat16(2, 3) (the optimizer's "
                                     "moments: set optimizer.moment_dtype=float32 as the run that wrote it had)")
def moments_of_another_dtype(tmp, mp):
    save(tmp / "ck", {"opt_state": {"mu": np.zeros((2, 3), np.float32)}})
    return opened(tmp / "ck", lambda ck: ck.restore({"opt_state": {"mu": np.zeros((2, 3), jax.numpy.bfloat16)}}))


@CHECKPOINT.refusal(CheckpointError, "leaf k was saved as raw key data, the template asks for a typed PRNG key")
def raw_key_data_for_a_typed_key(tmp, mp):
    save(tmp / "ck", {"k": np.asarray(jax.random.key_data(jax.random.key(0)))})
    return opened(tmp / "ck", lambda ck: ck.restore({"k": jax.random.key(1)}))

# Not reachable from outside: two leaves with the same path names (checkpoint_tree.named_leaves), which JAX's own
# flattening of dict keys already refuses.


# ============================================================================= a run: train() before its step compiles

RUN = Section("run")


def _quiet(*args, **kwargs) -> None:
    """train's log."""


def _train(*sets: str, resume: str | None = None, setup=None):
    """train() of `small(tmp, *sets)` (`resume`: formatted with tmp), after `setup(tmp)`."""
    def provoke(tmp, mp):
        if setup is not None:
            setup(tmp)
        return partial(train, small(tmp, *(s.format(tmp=tmp) for s in sets)),
                       resume=resume and resume.format(tmp=tmp), log=_quiet)
    return provoke


RUN.add("run-dir-is-a-file", ConfigError, "a_file' is a file; expected a directory (or a path to create)",
        _train("logging.run_dir={tmp}/a_file", setup=lambda tmp: (tmp / "a_file").write_text("x")))
RUN.add("run-dir-cannot-be-created", ConfigError, "a_file/run' cannot be created: ",
        _train("logging.run_dir={tmp}/a_file/run", setup=lambda tmp: (tmp / "a_file").write_text("x")))
RUN.add("validation-below-one-batch", ConfigError, "data.val_sequences=8 is fewer than one evaluation batch "
        "(train.micro_batch=16 x 1 devices = 16); raise it, or set data.eval_every=0",
        _train("data.val_sequences=8", "data.eval_every=1"))
RUN.add("batch-over-the-devices", ConfigError, "train.global_batch=16 is not a multiple of train.micro_batch=16 x 2 "
        "devices = 32; e.g. --set train.micro_batch=8", _train("parallel.devices=2"), cpu_only=True)
RUN.add("devices-not-visible", ConfigError, "parallel.devices=99 but ", _train("parallel.devices=99"))
RUN.add("cudnn-without-gpu", ConfigError, "model.attention_impl='cudnn' needs a GPU JAX backend",
        _train("model.attention_impl=cudnn"), cpu_only=True)
RUN.add("triton-without-gpu", ConfigError, "ffn.kernels='triton' needs a GPU JAX backend and jax-triton",
        _train("ffn.kernels=triton"), cpu_only=True)
RUN.add("shards-missing-fresh-dirs-removed", DataError, "no_shards': no such file or directory",
        _train("logging.run_dir={tmp}/new/run", "data.source=bin", "data.path={tmp}/no_shards"))
RUN.add("shards-missing-existing-dir-kept", DataError, "no_shards': no such file or directory",
        _train("data.source=bin", "data.path={tmp}/no_shards", setup=lambda tmp: (tmp / "run").mkdir()))
RUN.add("prefetch-negative", DataError, "data.prefetch=-1", _train("data.prefetch=-1"))
RUN.add("val-fraction", DataError, "data.val_fraction=0.0: must be in (0, 1)", _train("data.val_fraction=0"))
RUN.add("resume-missing", CheckpointError, "nowhere' does not exist (or is not a directory)",
        _train(resume="{tmp}/nowhere"))
RUN.add("resume-missing-into-an-existing-run-dir", CheckpointError, "nowhere' does not exist (or is not a directory)",
        _train(resume="{tmp}/nowhere", setup=lambda tmp: (tmp / "run").mkdir()))
RUN.add("resume-a-file", CheckpointError, "a_file' does not exist (or is not a directory)",
        _train(resume="{tmp}/a_file", setup=lambda tmp: (tmp / "a_file").write_text("x")))


@RUN.refusal(CheckpointError, "checkpoints' is a file; expected a directory")
def checkpoints_is_a_file(tmp, mp):
    (tmp / "run").mkdir()
    (tmp / "run" / "checkpoints").write_text("y")
    return partial(train, small(tmp), log=_quiet)


@RUN.refusal(ConfigError, "logging.tensorboard=true needs the tensorboardX package")
def tensorboard_missing(tmp, mp):
    without(mp, "tensorboardX")
    return partial(train, small(tmp, "logging.tensorboard=true"), log=_quiet)


@RUN.refusal(ConfigError, "holds the metrics of an earlier run")
def earlier_runs_records_under_another_config(tmp, mp):  # a launch killed before its first checkpoint
    (tmp / "run" / "checkpoints").mkdir(parents=True)
    (tmp / "run" / "config.yaml").write_text(dump_config(small(tmp, "optimizer.lr=1e-3")))
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return partial(train, small(tmp), log=_quiet)


@RUN.refusal(CheckpointError, "which already holds later checkpoints (steps [4]): this run's checkpoints and metrics "
                              "would collide with them")
def resume_older_than_the_latest(tmp, mp):
    save(tmp / "run" / "checkpoints", tree(), (2, 4))
    (tmp / "run" / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 5.0}}\n' for s in range(1, 5)))
    return partial(train, small(tmp), resume=str(tmp / "run" / "checkpoints" / "2"), log=_quiet)


RUN.add("checkpoint-of-another-model", CheckpointError, "was written by a different model config (model.d_model: "
        "checkpoint 64, this run 128)", _train(setup=lambda tmp: saved_run(tmp, fingerprint_sets=["model.d_model=64"])))
RUN.add("checkpoint-of-another-layout", CheckpointError, "leaves missing from it (opt_state/",
        _train(setup=lambda tmp: saved_run(tmp, optimizer=False, data=True)))
RUN.add("checkpoint-moments-in-bf16", CheckpointError, "set optimizer.moment_dtype=bfloat16 as the run that wrote it "
        "had", _train(setup=lambda tmp: saved_run(tmp, "optimizer.moment_dtype=bfloat16", data=True)))
RUN.add("checkpoint-without-data-state", CheckpointError, "holds no data-iterator state (data/)",
        _train(setup=lambda tmp: saved_run(tmp)))
RUN.add("checkpoint-damaged", CheckpointError, "checkpoints/2: its state/data cannot be read (", _train(
    setup=lambda tmp: _overwrite("state")(saved_run(tmp, data=True) / "checkpoints" / "2")))


# ============================================================================= a run's other files and its memory

RUN_FILES = Section("run-files")


@RUN_FILES.refusal(ConfigError, "metrics.jsonl: line 2 is not a metrics record (JSONDecodeError: ")
def metrics_line_malformed(tmp, mp):
    (tmp / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"st\n{"step": 2, "loss": 1.5}\n')
    return partial(truncate_metrics, tmp / "metrics.jsonl", 2)


RUN_FILES.add("autotune-file-is-a-directory", ConfigError, "' is a directory; expected 'auto', '' (off) or a file path",
              lambda tmp, mp: partial(autotune_file, str(tmp), tmp, backend="gpu"))
RUN_FILES.add("autotune-directory-missing", ConfigError, "no_such_dir does not exist; expected 'auto', '' (off) or a "
              "file path in an existing directory", lambda tmp, mp: partial(
                  autotune_file, str(tmp / "no_such_dir" / "tuned.txt"), tmp, backend="gpu"))


@RUN_FILES.refusal(ConfigError, "bad.txt is not a file of XLA autotuning results; delete it")
def autotune_not_results(tmp, mp):
    (tmp / "bad.txt").write_text("not autotune results\n")
    return partial(autotune_file, str(tmp / "bad.txt"), tmp, backend="gpu")


@RUN_FILES.refusal(ConfigError, "train.xla_autotune_file='auto': ")
def autotune_auto_not_results(tmp, mp):  # another file under the run directory's name for it
    (tmp / DEFAULT_NAME).write_text("{'some': 'json'}\n")
    return partial(autotune_file, "auto", tmp, backend="gpu")


RUN_FILES.add("step-over-device-memory", ConfigError, "the train step needs 2.00 GiB per device on 1 device(s) (XLA's "
              "estimate: state and batch 1.00 GiB, activations and other temporaries 1.00 GiB), more than the 1.50 GiB "
              "that JAX may allocate on each FakeGPU; try ", lambda tmp, mp: partial(
                  check_fits, StepMemory(GIB, 0, GIB, 0), (int(1.5 * GIB), "FakeGPU"), small(tmp), 1))


# ============================================================================= generation's arguments (mhl_jax.infer)

GENERATE = Section("generate")
for _id, _kw, _fragment in [
    ("temperature-negative", dict(temperature=-1.0), "temperature=-1.0: must be a number >= 0"),
    ("temperature-nan", dict(temperature=float("nan")), "temperature=nan: must be a number >= 0"),
    ("top-k-negative", dict(top_k=-1), "top_k=-1: must be >= 0 (0: no cut)"),
    ("top-p-zero", dict(top_p=0), "top_p=0: must be in (0, 1] (1: no cut)"),
    ("max-new-tokens-negative", dict(max_new_tokens=-1), "max_new_tokens=-1: must be >= 0"),
    ("empty-prompt", dict(prompts=[[1], []]), "every prompt needs at least one token"),
    ("stop-past-vocab", dict(vocab=257, stop=257), "stop=257: must be an id in [0, 257)"),
]:
    GENERATE.add(_id, ConfigError, _fragment, calls(generate, None, **{"prompts": [[1]], "max_new_tokens": 1,
                                                                              **_kw}))


# ============================================================================= commands: exit status 2, one line

TRAIN_CLI = Section("train.py")


def _command(main, *argv: str, setup=None):
    """`main(argv)` with `argv` formatted with tmp, ROOT and the tiny config (after `setup(tmp)`)."""
    def provoke(tmp, mp):
        if setup is not None:
            setup(tmp)
        return partial(main, [a.format(tmp=tmp, root=ROOT, tiny=TINY) for a in argv])
    return provoke


def _train_py(*argv: str, setup=None):
    """train.py's main with the smallest tiny config, its run directory tmp/run, and `argv`."""
    small_run = [x for s in (*SMALL, "logging.run_dir={tmp}/run") for x in ("--set", s)]
    return _command(train_py.main, "--config", "{tiny}", *small_run, *argv, setup=setup)


TRAIN_CLI.add("stop-after-negative", SystemExit, "--stop-after -1: must be a step number >= 0",
              _train_py("--stop-after", "-1"))
TRAIN_CLI.add("stop-after-word", SystemExit, "argument --stop-after: invalid int value: 'x'",
              _train_py("--stop-after", "x"))
TRAIN_CLI.add("config-missing", ConfigError, "config error: config file '", _command(
    train_py.main, "--config", "{tmp}/none.yaml"))
TRAIN_CLI.add("bad-value", ConfigError, "config error: ffn.top_k=99 > ffn.num_experts=16", _train_py(
    "--set", "ffn.top_k=99"))
TRAIN_CLI.add("unknown-key", ConfigError, "config error: unknown config key 'optimizer.learning_rate'", _train_py(
    "--set", "optimizer.learning_rate=1"))
TRAIN_CLI.add("launch", ConfigError, "config error: --num-processes=2 --process-id=5", _train_py(
    "--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "5"))
TRAIN_CLI.add("data-missing", DataError, "data error: data.path=", _train_py(
    "--set", "data.source=bin", "--set", "data.path={tmp}/no_shards"))
TRAIN_CLI.add("resume-missing", CheckpointError, "checkpoint error: checkpoint path '", _train_py(
    "--resume", "{tmp}/nowhere"))

INFER_CLI = Section("infer")


def _infer(*argv: str, run: bool = True):
    """infer's main with `argv` ({run}: tmp/run, a run at step 2 when `run`)."""
    def provoke(tmp, mp):
        if run:
            saved_run(tmp, optimizer=False)
        (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
        return partial(infer.main, [a.format(tmp=tmp, run=tmp / "run") for a in argv])
    return provoke


for _id, _error, _argv, _fragment in [
    ("no-command", SystemExit, [], "the following arguments are required: command"),
    ("run-missing", ConfigError, ["evaluate", "{tmp}/nowhere"], "config error: run directory '"),
    ("run-without-config", ConfigError, ["evaluate", "{tmp}"], "holds no config.yaml; expected a logging.run_dir"),
    ("no-such-step", CheckpointError, ["evaluate", "{run}", "--step", "40"], "checkpoint error: no checkpoint of step "
     "40 in"),
    ("another-model", CheckpointError, ["evaluate", "{run}", "--set", "model.d_model=64"],
     "was written by a different model config (model.d_model: checkpoint 128, this run 64)"),
    ("nothing-to-evaluate", ConfigError, ["evaluate", "{run}", "--set", "data.val_sequences=0"],
     "config error: data.val_sequences=0: nothing to evaluate; set it > 0"),
    ("checkpoint-not-a-checkpoint", CheckpointError, ["evaluate", "{run}", "--checkpoint", "{tmp}"],
     "is not a checkpoint: expected a step directory"),
    ("checkpoint-missing", CheckpointError, ["evaluate", "{run}", "--checkpoint", "{tmp}/a/b/2"],
     "b/2' does not exist (or is not a directory)"),
    ("checkpoint-of-another-step", CheckpointError, ["evaluate", "{run}", "--checkpoint", "{run}/checkpoints/2",
                                                     "--step", "60"], "holds step 2, not the step 60 asked for"),
    ("devices-not-visible", ConfigError, ["evaluate", "{run}", "--set", "parallel.devices=99"],
     "config error: parallel.devices=99 but "),
    ("gpt2-on-builtin", ConfigError, ["generate", "{run}", "--set", "data.tokenizer=gpt2"],
     "config error: data.tokenizer='gpt2' with data.source='builtin'"),
    ("prompt-not-utf8", DataError, ["generate", "{run}", "--prompt-file", "{tmp}/latin1.txt"],
     "latin1.txt' is not UTF-8 text"),
    ("prompt-file-missing", DataError, ["generate", "{run}", "--prompt-file", "{tmp}/none.txt"],
     "none.txt' cannot be read (No such file or directory)"),
    ("prompt-and-prompt-file", SystemExit, ["generate", "{run}", "--prompt", "a", "--prompt-file", "x"],
     "argument --prompt-file: not allowed with argument --prompt"),
    ("temperature-negative", SystemExit, ["generate", "{run}", "--temperature", "-1"],
     "--temperature -1.0: must be a number >= 0"),
    ("temperature-nan", SystemExit, ["generate", "{run}", "--temperature", "nan"], "--temperature nan: must be a"),
    ("max-new-tokens-negative", SystemExit, ["generate", "{run}", "--max-new-tokens", "-1"],
     "--max-new-tokens -1: must be >= 0"),
    ("top-k-negative", SystemExit, ["generate", "{run}", "--top-k", "-1"], "--top-k -1: must be >= 0 (0: no cut)"),
    ("top-p-past-one", SystemExit, ["generate", "{run}", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    ("no-samples", SystemExit, ["generate", "{run}", "--num-samples", "0"], "--num-samples 0: must be >= 1"),
]:
    INFER_CLI.add(_id, _error, _fragment, _infer(*_argv))
INFER_CLI.add("validation-below-devices", ConfigError, "config error: data.val_sequences=1 is fewer than the 2 "
              "devices of the mesh", _infer("evaluate", "{run}", "--set", "data.val_sequences=1", "--set",
                                            "parallel.devices=2"), cpu_only=True)
INFER_CLI.add("cudnn-without-gpu", ConfigError, "config error: model.attention_impl='cudnn' needs a GPU JAX backend",
              _infer("generate", "{run}", "--set", "model.attention_impl=cudnn", "--max-new-tokens", "1"),
              cpu_only=True)
INFER_CLI.add("triton-without-gpu", ConfigError, "config error: ffn.kernels='triton' needs a GPU",
              _infer("generate", "{run}", "--set", "ffn.kernels=triton"), cpu_only=True)



@INFER_CLI.refusal(ConfigError, "config error: mhl_jax.infer runs as one process; this is one of 2")
def infer_of_several_processes(tmp, mp):
    mp.setattr(jax, "process_count", lambda: 2)
    return partial(infer.main, ["evaluate", str(tmp)])


@INFER_CLI.refusal(CheckpointError, "holds no checkpoints/ directory (did the run save one? checkpoint.every)")
def run_without_checkpoints(tmp, mp):
    (tmp / "config.yaml").write_text(dump_config(small(tmp)))
    return partial(infer.main, ["evaluate", str(tmp)])


COMPARE_CLI = Section("compare")


def _compare(*argv: str, config: str | None = None, metrics: str | None = None, loads: str | None = None):
    """compare's main with `argv` ({run}: tmp/r, holding `config`, `metrics` and `loads` (loads.jsonl) when given:
    'tiny' writes the tiny config)."""
    def provoke(tmp, mp):
        run = tmp / "r"
        if config is not None or metrics is not None:
            run.mkdir()
        if config is not None:
            (run / "config.yaml").write_text(dump_config(small(tmp)) if config == "tiny" else config)
        if metrics is not None:
            (run / "metrics.jsonl").write_text(metrics)
        if loads is not None:
            (run / "loads.jsonl").write_text(loads)
        return partial(compare.main, [a.format(tmp=tmp, run=run) for a in argv])
    return provoke


RECORDS = '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n'
for _id, _error, _setup, _argv, _fragment in [
    ("smooth-zero", SystemExit, {}, ["{tmp}", "--smooth", "0"], "--smooth 0: must be >= 1"),
    ("run-missing", ConfigError, {}, ["{run}"], "error: run directory '"),
    ("no-config", ConfigError, dict(metrics=RECORDS), ["{run}"], "holds no config.yaml"),
    ("no-metrics", ConfigError, dict(config="tiny"), ["{run}"], "holds no metrics.jsonl (has the run taken a step "
     "yet?)"),
    ("empty-config", ConfigError, dict(config="\n", metrics=RECORDS), ["{run}"], "r': config.yaml is empty"),
    ("bad-config", ConfigError, dict(config="model:\n  foo: 1\n", metrics=RECORDS), ["{run}"],
     "r': config.yaml: unknown config key 'model.foo'"),
    ("line-not-json", ConfigError, dict(config="tiny", metrics='{"step": 1,\n' + RECORDS), ["{run}"],
     "metrics.jsonl: line 1 is not JSON"),
    ("line-not-a-record", ConfigError, dict(config="tiny", metrics="[1, 2]\n"), ["{run}"],
     "metrics.jsonl: line 1 is not a train.py metrics record (an integer step and a finite loss expected)"),
    ("step-as-string", ConfigError, dict(config="tiny", metrics='{"step": "1", "loss": 1.0}\n' + RECORDS), ["{run}"],
     "metrics.jsonl: line 1 is not a train.py metrics record"),
    ("loss-null", ConfigError, dict(config="tiny", metrics='{"step": 1, "loss": null}\n' + RECORDS), ["{run}"],
     "metrics.jsonl: line 1 is not a train.py metrics record"),
    ("no-records", ConfigError, dict(config="tiny", metrics=""), ["{run}"], "metrics.jsonl holds no records yet"),
    ("plot-unwritable", ConfigError, dict(config="tiny", metrics=RECORDS), ["{run}", "--plot", "{tmp}/no/curves.png"],
     "curves.png': cannot write it (No such file or directory)"),
    ("runs-and-plot-load", SystemExit, {}, ["{run}", "--plot-load", "{run}"], "give RUN_DIRs to compare, or "
     "--plot-load RUN_DIR"),
    ("neither-runs-nor-plot-load", SystemExit, {}, [], "give RUN_DIRs to compare, or --plot-load RUN_DIR"),
    ("plot-load-without-loads", ConfigError, dict(config="tiny", metrics=RECORDS), ["--plot-load", "{run}", "--out",
     "{tmp}/maps.png"], "r' holds no loads.jsonl (it records per-expert loads every logging.loads_every steps"),
    ("plot-load-line", ConfigError, dict(config="tiny", metrics=RECORDS, loads='{"step": 1, "loads": [1]}\n'),
     ["--plot-load", "{run}", "--out", "{tmp}/maps.png"], "loads.jsonl: line 1 is not a loads record"),
    ("plot-load-layers-change", ConfigError, dict(config="tiny", metrics=RECORDS, loads=(
        '{"step": 1, "loads": {"1": [[1, 2]]}}\n{"step": 2, "loads": {"1": [[1, 2, 3]]}}\n')),
     ["--plot-load", "{run}", "--out", "{tmp}/maps.png"], "loads.jsonl: step 1 records other layers or shapes than "
     "step 2"),
]:
    COMPARE_CLI.add(_id, _error, _fragment, _compare(*_argv, **_setup))



@COMPARE_CLI.refusal(ConfigError, "error: --plot needs matplotlib (pip install matplotlib)")
def plot_without_matplotlib(tmp, mp):
    without(mp, "matplotlib")
    return _compare("{run}", "--plot", "{tmp}/curves.png", config="tiny", metrics=RECORDS)(tmp, mp)


EXPORT_CLI = Section("export")


def _export(*argv: str):
    """export's main with `argv` ({run}: tmp/run, a run at step 2; {tmp}/taken: a directory holding a file)."""
    def provoke(tmp, mp):
        saved_run(tmp, optimizer=False)
        (tmp / "taken").mkdir()
        (tmp / "taken" / "mine.txt").write_text("kept")
        return partial(export.main, [a.format(tmp=tmp, run=tmp / "run") for a in argv])
    return provoke


for _id, _error, _argv, _fragment in [
    ("no-out", SystemExit, ["{run}"], "the following arguments are required: --out"),
    ("out-holds-files", ConfigError, ["{run}", "--out", "{tmp}/taken"], "config error: --out '"),
    ("out-is-a-file", ConfigError, ["{run}", "--out", "{tmp}/taken/mine.txt"], "mine.txt' exists and is not an empty "
     "directory: export writes a new directory (name another, or remove it)"),
    ("run-missing", ConfigError, ["{tmp}/nowhere", "--out", "{tmp}/new"], "config error: run directory '"),
    ("no-such-step", CheckpointError, ["{run}", "--out", "{tmp}/new", "--step", "40"], "checkpoint error: no "
     "checkpoint of step 40 in"),
]:
    EXPORT_CLI.add(_id, _error, _fragment, _export(*_argv))


PREPARE_CLI = Section("prepare")
for _id, _argv, _fragment in [
    ("no-source", ["--tokenizer", "byte", "--out", "o"],
     "give one source: a NAME (fineweb10B), --input FILES or --hf-dataset NAME"),
    ("two-sources", ["--input", "a", "--hf-dataset", "b", "--tokenizer", "byte", "--out", "o"],
     "give one source: a NAME (fineweb10B), --input FILES or --hf-dataset NAME"),
    ("no-tokenizer", ["--input", "a", "--out", "o"], "--tokenizer is required with --input or --hf-dataset"),
    ("unknown-tokenizer", ["--input", "a", "--tokenizer", "wordpiece", "--out", "o"], "argument --tokenizer: invalid "
     "choice: 'wordpiece'"),
    ("shard-tokens-zero", ["--input", "a", "--tokenizer", "byte", "--out", "o", "--shard-tokens", "0"],
     "--shard-tokens=0: must be >= 1"),
    ("val-tokens-zero", ["--input", "a", "--tokenizer", "byte", "--out", "o", "--val-tokens", "0"],
     "--val-tokens=0: must be >= 1"),
]:
    PREPARE_CLI.add(_id, SystemExit, _fragment, calls(prepare.main, _argv))


# ============================================================================= the checks every row gets

@pytest.mark.parametrize("provoke, error, fragment", [*CONFIG, *CONFIG_FILES, *MESH, *LAUNCH, *SHARDS, *TEXT, *PREPARE,
                                                      *CHECKPOINT, *RUN, *RUN_FILES, *GENERATE])
def test_refused_in_one_line_leaving_nothing_behind(provoke, error, fragment, tmp_path, monkeypatch):
    call = provoke(tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    with pytest.raises(error) as refused:
        call()
    message = str(refused.value)
    assert type(refused.value) is error and fragment in message, message
    assert "\n" not in message, message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("provoke, error, fragment", [*TRAIN_CLI, *INFER_CLI, *COMPARE_CLI, *EXPORT_CLI,
                                                      *PREPARE_CLI])
def test_command_exits_2_with_one_line(provoke, error, fragment, tmp_path, monkeypatch, capsys):
    """`error` SystemExit: argparse's refusal (its usage lines, then one `error:` line); else the command's own."""
    call = provoke(tmp_path, monkeypatch)
    capsys.readouterr()
    before = snapshot(tmp_path)
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
    assert snapshot(tmp_path) == before
