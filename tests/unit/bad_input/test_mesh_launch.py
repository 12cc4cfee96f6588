"""Bad device layouts: batch sizes and parallel sizes the mesh cannot hold, and launch options."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import pytest

from mhl_jax.config import ConfigError, load_config
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.distributed import parse_launch
from mhl_jax.train.loop import accumulation_steps
from tests.unit.bad_input.catalogue import CPU, TINY, TINY_MOE, Section, calls, check_refused, small

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
    # data x hp x ep (mh_latent_moe with parallel.ep > 1)
    ("hp-x-ep-not-dividing-devices", TINY, ["parallel.hp=2", "parallel.ep=2"], 6,
     "parallel.hp=2 x parallel.ep=2 = 4 does not divide the 6 devices of the mesh"),
    ("hp-x-ep-past-devices", TINY, ["parallel.hp=4", "parallel.ep=4"], 8,
     "parallel.hp=4 x parallel.ep=4 = 16 exceeds the 8 devices of the mesh"),
    ("data-x-hp-x-ep", TINY, ["parallel.hp=2", "parallel.ep=2", "parallel.data=4"], 8,
     "parallel.data=4 x parallel.hp=2 x parallel.ep=2 = 16 devices, but the mesh has 8"),
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


@MESH.refusal(ConfigError, "ffn.num_experts=10 is not divisible by parallel.ep=4")
def experts_not_dividing_ep_of_hp_x_ep(tmp, mp):  # past load_config's own check (the config rows below)
    cfg = small(tmp)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, hp=2, ep=4),
                              ffn=dataclasses.replace(cfg.ffn, num_experts=10))
    return partial(make_mesh, cfg, CPU)


for _id, _config, _sets, _fragment in [
    ("hp-x-ep-experts", TINY, ["parallel.hp=2", "parallel.ep=3"], "ffn.num_experts=16 is not divisible by "
     "parallel.ep=3"),
    ("hp-x-ep-heads", TINY, ["parallel.hp=3", "parallel.ep=2"], "ffn.num_heads=4 is not divisible by parallel.hp=3"),
    ("hp-x-ep-with-moe", TINY_MOE, ["parallel.hp=2", "parallel.ep=2"], "parallel.hp=2 needs ffn.kind=mh_latent_moe "
     "(got 'moe'); use parallel.ep"),
    ("ep-with-mlp", TINY_MOE, ["ffn.kind=mlp", "parallel.ep=2"], "parallel.ep=2 needs ffn.kind moe, latent_moe or "
     "mh_latent_moe (got 'mlp')"),
]:
    MESH.add(_id, ConfigError, _fragment, calls(load_config, str(_config), _sets))


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


# ============================================================================= every row, checked alike (catalogue.py)

@pytest.mark.parametrize("provoke, error, fragment", [*MESH, *LAUNCH])
def test_refused_in_one_line_leaving_nothing_behind(provoke, error, fragment, tmp_path, monkeypatch):
    check_refused(provoke, error, fragment, tmp_path, monkeypatch)
