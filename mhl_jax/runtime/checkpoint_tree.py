"""A state pytree as the checkpoint stores it: a nested dict named by the pytree's paths.

Naming each leaf by its path (params/blocks/0/attn/wq, opt_state/1/0/mu/...) rather than by its position lets a
checkpoint be checked leaf by leaf against the run that restores it, and read in part (infer reads params and biases
only). Typed PRNG keys are stored as their key data and rewrapped on restore.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mhl_jax.runtime.errors import CheckpointError

PyTree = Any


def _key_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def is_prng_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def named_leaves(tree: PyTree) -> tuple[list[tuple[tuple[str, ...], Any]], Any]:
    """[(path names, leaf)] in flattening order, and the treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = [(tuple(_key_name(e) for e in path) or ("_",), leaf) for path, leaf in flat]
    if len({names for names, _ in named}) != len(named):
        raise CheckpointError("two leaves of the state have the same path names; use distinct dict keys")
    return named, treedef


def nest(named: list[tuple[tuple[str, ...], Any]]) -> dict:
    root: dict = {}
    for names, value in named:
        node = root
        for n in names[:-1]:
            node = node.setdefault(n, {})
        node[names[-1]] = value
    return root


def lookup(tree: dict, names: tuple[str, ...]) -> Any:
    for n in names:
        tree = tree[n]
    return tree


def storable(leaf: Any) -> Any:
    """The array actually written: key data for typed PRNG keys, numpy for host scalars."""
    if is_prng_key(leaf):
        return jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array):
        return leaf
    return np.asarray(leaf)


def abstract_leaf(leaf: Any) -> Any:
    """What Orbax restores a template leaf as: a sharded jax.Array or a numpy array."""
    if is_prng_key(leaf):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return np.zeros_like(np.asarray(leaf))


def describe(leaf: Any) -> list:
    """[shape, dtype name] of what is stored for a leaf (key data for PRNG keys)."""
    if is_prng_key(leaf):
        x = jax.eval_shape(jax.random.key_data, leaf)
    elif isinstance(leaf, jax.ShapeDtypeStruct):
        x = leaf
    else:
        x = storable(leaf)
    return [list(x.shape), str(np.dtype(x.dtype))]



def unflatten(restored: dict, named: list, treedef: Any, meta: dict, where: str) -> PyTree:
    """The template's structure filled with the restored values (typed PRNG keys rewrapped)."""
    leaves = []
    for names, leaf in named:
        value = lookup(restored, names)
        if is_prng_key(leaf):
            impl = meta["key_impls"].get("/".join(names))
            if impl is None:
                raise CheckpointError(f"checkpoint {where}: leaf {'/'.join(names)} was saved as raw key data, "
                                      "the template asks for a typed PRNG key")
            value = jax.random.wrap_key_data(value, impl=impl)
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _flat_dict(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat_dict(v, f"{prefix}{k}."))
    return out


def changed_leaves(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """[(dotted key, old value, new value)] over the leaves of two nested dicts that differ, sorted by key; a leaf
    missing on one side reads '<absent>'."""
    a, b = _flat_dict(old), _flat_dict(new)
    return [(k, a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]
