"""The device mesh from the config: ('data', 'hp') for MH-LatentMoE, ('data', 'hp', 'ep') for MH-LatentMoE with
parallel.ep > 1, ('data', 'ep') otherwise.

The batch is split over every device (all axes); non-expert parameters are replicated; expert weights, routers and
balancing biases are split over the model axes (by head over hp, by expert over ep: on data x hp x ep, each expert
weight lives on one device of its (hp, ep) cell).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mhl_jax.config import Config, ConfigError


def model_axis(cfg: Config) -> str:
    """Name of the axis that splits the expert weights first: 'hp' for mh_latent_moe, 'ep' otherwise."""
    return "hp" if cfg.ffn.kind == "mh_latent_moe" else "ep"


def mesh_axes(cfg: Config) -> tuple[str, ...]:
    """The mesh's axis names: 'data', then the model axes ('hp' and 'ep' for mh_latent_moe with parallel.ep > 1)."""
    if cfg.ffn.kind == "mh_latent_moe" and cfg.parallel.ep > 1:
        return ("data", "hp", "ep")
    return ("data", model_axis(cfg))


def more_devices_hint(need: int) -> str:
    """On the CPU, how to get `need` devices (JAX makes its host devices at start, as XLA_FLAGS says); else ''."""
    if jax.default_backend() != "cpu":
        return ""
    return f"; on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count={need} makes {need} of them"


def mesh_shape(cfg: Config, num_devices: int) -> tuple[int, ...]:
    """The sizes of `mesh_axes` (data first), validated against the device count and the head / expert counts."""
    par, f = cfg.parallel, cfg.ffn
    axes = mesh_axes(cfg)[1:]
    sizes = [par.hp if a == "hp" else par.ep for a in axes]
    for a, size in zip(axes, sizes):
        if size < 1 or num_devices < 1:
            raise ConfigError(f"parallel.{a}={size} on {num_devices} devices: both must be >= 1")
    inner = math.prod(sizes)
    named = " x ".join(f"parallel.{a}={size}" for a, size in zip(axes, sizes))
    label = named if len(axes) == 1 else f"{named} = {inner}"
    if inner > num_devices:
        raise ConfigError(f"{label} exceeds the {num_devices} devices of the mesh (parallel.devices={par.devices}, "
                          f"-1: all visible){more_devices_hint(inner * max(par.data, 1))}")
    if num_devices % inner:
        raise ConfigError(f"{label} does not divide the {num_devices} devices of the mesh")
    if "hp" in axes and f.num_heads % par.hp:
        raise ConfigError(f"ffn.num_heads={f.num_heads} is not divisible by parallel.hp={par.hp}")
    if "ep" in axes and f.kind != "mlp" and f.num_experts % par.ep:
        raise ConfigError(f"ffn.num_experts={f.num_experts} is not divisible by parallel.ep={par.ep}")
    data = num_devices // inner if par.data == -1 else par.data
    if data * inner != num_devices:
        more = more_devices_hint(data * inner) if data * inner > num_devices else ""
        raise ConfigError(f"parallel.data={par.data} x {named} = {data * inner} devices, but the mesh has "
                          f"{num_devices} (parallel.devices={par.devices}, -1: all visible; parallel.data=-1 fills "
                          f"them){more}")
    return (data, *sizes)


def check_batch(global_batch: int, num_devices: int) -> None:
    """The batch axis is split over every device: the sequence count must divide evenly."""
    if global_batch % num_devices:
        raise ConfigError(f"train.global_batch={global_batch} sequences cannot be split over {num_devices} "
                          f"devices (the batch is sharded over every device of the mesh)")


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    """The mesh of `mesh_axes` over `devices` (default: all).

    Raises ConfigError when the sizes do not fit the devices, the heads / experts or the batch."""
    if devices is None:
        devices = list(jax.devices())
        want = cfg.parallel.devices
        if want > len(devices):
            seen = f"{len(devices)} device" + ("s are" if len(devices) > 1 else " is")
            raise ConfigError(f"parallel.devices={want} but {seen} visible{more_devices_hint(want)}")
        if jax.process_count() > 1 and want not in (-1, len(devices)):
            raise ConfigError(f"parallel.devices={want} with {jax.process_count()} processes: a run of several "
                              f"processes uses all {len(devices)} of their devices (-1)")
        devices = devices if want == -1 else devices[:want]
    devices = list(devices)
    if jax.process_count() > 1:
        # process by process, so that the inner (hp / ep) axes stay inside a process (a host's NVLink) when they fit
        # there, and each process holds a contiguous range of the batch rows; on data x hp x ep the innermost, ep,
        # fills a host first (EP within a node, HP between nodes)
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    shape = mesh_shape(cfg, len(devices))
    check_batch(cfg.train.global_batch, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), mesh_axes(cfg))


def batch_spec(mesh: Mesh) -> P:
    """Spec of a (accum, micro_global, T + 1) batch: micro-batch rows split over every device."""
    return P(None, tuple(mesh.axis_names))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def expert_leaf_spec(cfg: Config, name: str, ndim: int) -> P | None:
    """PartitionSpec of an ExpertBank leaf (or its optimizer moments) by its attribute name.

    hp: every leaf is split by head (dim 0). ep: split by expert: w_router (H, dr, Ne) on dim 2,
    bias (H, Ne) on dim 1, w1/w2 (H, Ne, ., .) on dim 1. hp x ep: both, so each (head, expert) weight
    lives on the one device of its (hp, ep) cell. Other leaves: None (replicated).
    """
    axes = mesh_axes(cfg)[1:]
    by_head = {"w_router": 0, "bias": 0, "w1": 0, "w2": 0}
    by_expert = {"w_router": 2, "bias": 1, "w1": 1, "w2": 1}
    if name not in by_head:
        return None
    spec = [None] * ndim
    for axis in axes:
        spec[(by_head if axis == "hp" else by_expert)[name]] = axis
    return P(*spec)


def spread_over_copies(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`spec` with the mesh axes that hold copies of the leaf (size > 1, not in `spec`) added to its unsplit dims: all
    of them together on the largest dim they divide; else each alone (the largest axis first) on the largest unsplit
    dim it divides; an axis that divides none leaves the leaf copied over it."""
    used = {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None}
    free = [a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    by_size = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    together = int(np.prod([mesh.shape[a] for a in free]))
    if len(free) > 1:
        d = next((d for d in by_size if entries[d] is None and shape[d] % together == 0), None)
        if d is not None:
            entries[d] = tuple(free)
            return P(*entries)
    added = False
    for a in sorted(free, key=lambda a: -mesh.shape[a]):
        d = next((d for d in by_size if entries[d] is None and shape[d] % mesh.shape[a] == 0), None)
        if d is not None:
            entries[d], added = a, True
    return P(*entries) if added else spec


def state_shardings(cfg: Config, mesh: Mesh, state):
    """NamedShardings for a pytree whose expert leaves sit under a path '... experts/<name>'; with
    parallel.shard_optimizer, the leaves under 'opt_state' (AdamW's moments; not its scalar count) spread over their
    copies too (`spread_over_copies`)."""

    def one(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        keys = [k for k in keys if k != "value"]
        spec = None
        if len(keys) >= 2 and keys[-2] == "experts" and hasattr(leaf, "ndim"):
            spec = expert_leaf_spec(cfg, keys[-1], leaf.ndim)
        spec = spec or P()
        if cfg.parallel.shard_optimizer and keys and keys[0] == "opt_state" and getattr(leaf, "ndim", 0) > 0:
            spec = spread_over_copies(spec, leaf.shape, mesh)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, state)
