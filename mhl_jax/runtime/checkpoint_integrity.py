"""Verified checkpoints: checksums and finiteness of a checkpoint's arrays, from one pass over the state where it
lives, and what becomes of a checkpoint found damaged.

A save computes, per leaf, a 64-bit checksum of the leaf's bits and the count of its non-finite values, on the device
before the arrays leave it (one jitted pass that reads the state once); the checksums go into the checkpoint's meta
item, and a state holding a non-finite value is refused there, before anything is written. A restore recomputes both
on the restored arrays: a flipped bit, or bytes overwritten in an array file, no longer resumes silently.

The checksum is integer arithmetic on the leaf's bits viewed as uint32 words w_i (bf16, int8 and bool widened, 8-byte
types split in two; PRNG keys as their key data), all sums mod 2^32:
- s1 = sum of w_i: any change of one word changes it, so a single flipped bit is always caught;
- s2 = sum of fmix32(w_i xor (i x golden)), murmur3's finaliser keyed by the word's row-major position i: swapped or
  shifted words, and changes of several words that cancel in s1, change it but with probability 2^-32.
Integer sums are exact and associative, so the result does not depend on the order or the sharding the reduction
runs in: a checkpoint verifies on any mesh and in any process count. Numpy leaves (host values) are summed with numpy
the same way.

A checkpoint that cannot be read, fails its checksums or holds NaN/inf raises DamagedCheckpoint; the Checkpointer then
falls back to an older one and moves the damaged step directory aside (`move_aside`), or refuses it with
`damage_advice`.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from mhl_jax.runtime.checkpoint_tree import is_prng_key
from mhl_jax.runtime.errors import CheckpointError
from mhl_jax.runtime.memory import is_out_of_memory

ALGORITHM = "u32-sum+fmix32-v1"  # stored with the checksums: another algorithm's are not mistaken for damage
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive positions over the word


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's own files are at fault (unreadable, incomplete, corrupted, non-finite), not the run restoring it:
    an older intact checkpoint can stand in for it (checkpoint.on_damage=fallback)."""


def _fmix32(h, xp):
    """Murmur3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def _device_words(x: jax.Array) -> jax.Array:
    """The leaf's bits as uint32 words (a trailing dimension of 2 for 8-byte types), elementwise: no resharding."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size < 4:
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _device_sums(x: jax.Array) -> jax.Array:
    """[s1, s2, non-finite count] of one leaf as uint32, traced inside the pass."""
    w = _device_words(x)
    # the row-major position of each word mod 2^32, from per-axis iotas: no reshape of a sharded array
    position = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= w.shape[axis]
    s1 = jnp.sum(w, dtype=jnp.uint32)
    s2 = jnp.sum(_fmix32(w ^ (position * jnp.uint32(_GOLDEN)), jnp), dtype=jnp.uint32)
    bad = (jnp.sum(~jnp.isfinite(x), dtype=jnp.uint32) if jnp.issubdtype(x.dtype, jnp.floating)
           else jnp.uint32(0))
    return jnp.stack([s1, s2, bad])


@jax.jit
def _device_pass(leaves: list[jax.Array]) -> jax.Array:
    """uint32[len(leaves), 3]: every leaf read once (XLA fuses a leaf's three sums into one read of it)."""
    return jnp.stack([_device_sums(x) for x in leaves])


def _host_sums(x: np.ndarray) -> np.ndarray:
    """`_device_sums` of a numpy leaf, with numpy (no 8-byte type is narrowed on its way to a device)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        w = x.astype(np.uint32).reshape(-1)
    elif x.dtype.itemsize < 4:
        w = x.view(f"uint{8 * x.dtype.itemsize}").astype(np.uint32).reshape(-1)
    else:
        w = x.reshape(-1).view(np.uint32)
    position = np.arange(w.size, dtype=np.uint64).astype(np.uint32)  # mod 2^32
    s1 = np.sum(w, dtype=np.uint32)
    s2 = np.sum(_fmix32(w ^ (position * np.uint32(_GOLDEN)), np), dtype=np.uint32)
    bad = np.count_nonzero(~np.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else 0
    return np.array([s1, s2, bad], np.uint32)


def _devices_of(x: jax.Array) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in x.sharding.device_set))


def leaf_sums(leaves: list[Any]) -> np.ndarray:
    """uint32[len(leaves), 3]: per leaf (s1, s2, non-finite count), for jax arrays (of any sharding, typed PRNG keys
    as their key data) and numpy arrays alike. One jitted pass per set of devices the leaves live on (a train state:
    one), one small transfer back; what it reads is the state's size in bytes."""
    out = np.zeros((len(leaves), 3), np.uint32)
    leaves = list(leaves)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(leaves):
        if is_prng_key(x):
            x = leaves[i] = jax.random.key_data(x)
        if isinstance(x, jax.Array):
            groups.setdefault(_devices_of(x), []).append(i)
        else:
            out[i] = _host_sums(np.asarray(x))
    for members in groups.values():
        sums = _device_pass([leaves[i] for i in members])
        # a reduction's result is replicated over the pass's devices: each process reads its own copy
        out[members] = np.asarray(sums.addressable_data(0) if sums.is_fully_replicated else sums)
    return out


def _hex(s1: int, s2: int) -> str:
    return f"{int(s1):08x}{int(s2):08x}"


def seal(stored: list[tuple[tuple[str, ...], Any]], step: int, kept: int | None) -> dict:
    """The meta entry {"checksums": {"algorithm", "leaves": {path: hex}}} of the leaves `stored` ([(path names, the
    array written)]). FloatingPointError naming the first non-finite leaf when any float leaf holds NaN or inf: such a
    state must not replace a good checkpoint (`kept`: the newest one there, named in the error)."""
    sums = leaf_sums([leaf for _, leaf in stored])
    # the parameters named first: what a reader checks (and an update that diverged made them non-finite first)
    bad = sorted([("/".join(names), int(n)) for (names, _), n in zip(stored, sums[:, 2]) if n],
                 key=lambda leaf: not leaf[0].startswith("params/"))
    if bad:
        left = f"the last checkpoint, step {kept}, is kept" if kept is not None else "there is no earlier one"
        raise FloatingPointError(f"the state of step {step} is not finite: leaf {bad[0][0]} holds {bad[0][1]} NaN/inf "
                                 f"values ({len(bad)} of {len(stored)} leaves hold some); its checkpoint is not "
                                 f"written ({left})")
    return {"checksums": {"algorithm": ALGORITHM,
                          "leaves": {"/".join(names): _hex(s1, s2) for (names, _), (s1, s2, _) in zip(stored, sums)}}}


def verify(meta: dict, restored: list[tuple[tuple[str, ...], Any]], where: str) -> bool:
    """Check the restored leaves ([(path names, array as read)]) against the checksums in `meta`, and that their float
    values are finite. DamagedCheckpoint naming the first leaf that fails; True when verified, False when `meta`
    holds no checksums (a checkpoint written before they existed: its finiteness is still checked)."""
    sums = leaf_sums([leaf for _, leaf in restored])
    entry = meta.get("checksums")
    if entry is not None:
        if entry.get("algorithm") != ALGORITHM:
            raise CheckpointError(f"checkpoint {where}: its checksums are of algorithm {entry.get('algorithm')!r}, "
                                  f"this version computes {ALGORITHM!r}; restore it with the version that wrote it")
        saved = entry["leaves"]
        for (names, _), (s1, s2, _) in zip(restored, sums):
            path = "/".join(names)
            if path not in saved:
                raise DamagedCheckpoint(f"checkpoint {where}: its meta item has no checksum of leaf {path}")
            if saved[path] != _hex(s1, s2):
                raise DamagedCheckpoint(f"checkpoint {where}: leaf {path} does not match its checksum (its array data "
                                        "changed after it was written)")
    for (names, _), n in zip(restored, sums[:, 2]):  # what a version without the save's check could write
        if n:
            raise DamagedCheckpoint(f"checkpoint {where}: leaf {'/'.join(names)} holds {int(n)} NaN/inf values (it "
                                    "was saved from a diverged state)")
    return entry is not None


def damage_advice(directory: Path, step: int, read_only: bool, explicit: bool) -> str:
    """What to do about damaged checkpoint `step` of `directory` when no older one stands in for it: `read_only` (a
    reader, which moves nothing, beside a run that may be rotating its checkpoints out), `explicit` (asked for by
    name)."""
    others = sorted(int(c.name) for c in directory.iterdir() if c.name.isdigit() and int(c.name) != step)
    if read_only and not (directory / str(step)).is_dir():  # a run writing there rotated it out (checkpoint.keep)
        return (f"it may have been removed by the run writing there while it was read; steps there now: {others}; "
                "pick one of them")
    if read_only:
        return f"steps there: {others}; pick another one"
    if explicit:
        return ("it was asked for by name (--resume / checkpoint.resume), so no other checkpoint stands in for it; "
                f"steps there: {others}")
    if others:
        return (f"other steps there: {others}; delete {directory / str(step)} to resume from the latest of them, or "
                "set checkpoint.on_damage=fallback to skip it")
    return f"no other steps there; delete {directory / str(step)} to start the run over"


def agree_intact(damage: DamagedCheckpoint | None, where: str) -> None:
    """Raise `damage` (this process found the checkpoint damaged), or, with several processes, a DamagedCheckpoint
    naming the processes that did: every process learns it before the verification, which they run together."""
    if jax.process_count() > 1:
        flags = np.asarray(multihost_utils.process_allgather(np.int32(damage is None))).reshape(-1)
        failed = [int(i) for i in np.flatnonzero(flags == 0)]
        if damage is None and failed:
            damage = DamagedCheckpoint(f"checkpoint {where}: process(es) {failed} could not read it")
    if damage is not None:
        raise damage


def move_aside(step_dir: Path) -> Path:
    """Rename a damaged step directory to `<step>.damaged` (`<step>.damaged.2`, ... when that name is taken): kept for
    a person to look at, and neither listed as a step nor cleaned up by Orbax, so saves of that step and later ones
    are accepted again. Process 0 renames (the directory is shared); every process waits for it."""
    target = step_dir.with_name(f"{step_dir.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = step_dir.with_name(f"{step_dir.name}.damaged.{n}")
    if jax.process_index() == 0:
        step_dir.rename(target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"moved aside {step_dir}")
    return target


def is_damage(e: BaseException) -> bool:
    """Whether a failed read says the checkpoint is damaged: not when the machine failed it (out of memory on the
    host or the devices, no permission, a file system that went away), which a fallback to an older checkpoint
    would only turn into lost training."""
    if isinstance(e, (MemoryError, PermissionError)) or is_out_of_memory(e):
        return False
    return not (isinstance(e, OSError) and e.errno in (errno.EACCES, errno.ESTALE, errno.EIO, errno.ENOSPC))
