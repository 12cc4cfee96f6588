"""A kernel call on a batch split over a device mesh."""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def batch_sharded(fn, mesh: Mesh | None, *arrays: jax.Array, what: str = "kernel"):
    """fn(*arrays), arrays and outputs split along their first (batch) axis over every axis of `mesh`, the train and
    eval batches' layout (`mhl_jax.parallel.mesh.batch_spec`). For a kernel call, which is opaque to XLA's
    partitioner: it would gather the arrays to every device; under shard_map each device runs it on its own rows.
    mesh None or of one device: fn alone. `what` names the caller in the error for a batch the mesh does not split."""
    if mesh is None or mesh.size == 1:
        return fn(*arrays)
    if arrays[0].shape[0] % mesh.size:
        raise ValueError(f"{what}: a batch of {arrays[0].shape[0]} sequences does not split over the {mesh.size} "
                         f"devices of the mesh {dict(mesh.shape)}")
    spec = P(tuple(mesh.axis_names))
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec, check_vma=False)(*arrays)
