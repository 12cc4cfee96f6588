"""Head Parallel x Expert Parallel (data x hp x ep) on 8 host CPU devices against the single-device model.

Each mesh gives the single-device model's loss, gradients and loads (fp32 tolerance; loads exactly); the shardings
hold each (head, expert) weight on the one device of its (hp, ep) cell; the traffic figures are a hand count; and a
short training run on hp 2 x ep 2 resumes onto one device with the straight run's losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mhl_jax.config import Config, load_config
from mhl_jax.model.balancing import RouterBias
from mhl_jax.model.gpt import build_model
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel import traffic
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.expert_parallel import resolve_ep_impl
from mhl_jax.parallel.head_expert_parallel import HeadExpertParallelMoE
from mhl_jax.parallel.mesh import make_mesh, state_shardings
from mhl_jax.train.loop import train
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.step import loss_fn
from tests.runs import tiny

B, T = 8, 16  # 128 tokens: 16 per device on 8 devices
HEADS, EXPERTS = 8, 8


def small_cfg(hp: int = 1, ep: int = 1, data: int = -1) -> Config:
    """One MH-LatentMoE block, fp32, the reference kernels: 8 heads of width 8, 8 experts each, k = 2."""
    return load_config(None, [
        "model.vocab_size=64", "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.head_dim=32",
        f"model.context={T}", "model.compute_dtype=float32", "model.attention_impl=xla",
        "ffn.kind=mh_latent_moe", "ffn.stem_layers=0", f"ffn.num_heads={HEADS}", "ffn.head_dim=8",
        "ffn.latent_dim=64", f"ffn.num_experts={EXPERTS}", "ffn.top_k=2", "ffn.expert_hidden=16",
        "ffn.kernels=reference", f"parallel.hp={hp}", f"parallel.ep={ep}", f"parallel.data={data}",
        f"train.global_batch={B}", "train.micro_batch=1", "ffn.balance_gamma=0.01"])


def loss_grads_loads(cfg: Config, mesh):
    """(loss, grads, loads, the state as placed) of the model on `mesh` (None: one device, `LocalMoE`). Routers and
    biases random, so that the routing is far from ties and the bias changes the selection (the bias must reach the
    device that routes with it)."""
    executor = LocalMoE("reference") if mesh is None else make_executor(cfg, mesh)
    graphdef, params, biases = nnx.split(build_model(cfg, seed=0, executor=executor), nnx.Param, RouterBias)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        if "w_router" in jax.tree_util.keystr(path) else x, params)
    biases = jax.tree.map(lambda b: jnp.asarray(0.5 * rng.standard_normal(b.shape), b.dtype), biases)
    batch = np.random.default_rng(2).integers(0, cfg.model.vocab_size, (B, T + 1), dtype=np.int32)
    state = {"params": params, "biases": biases}
    if mesh is not None:
        state = jax.device_put(state, state_shardings(cfg, mesh, state))
        batch = jax.device_put(batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    fn = jax.jit(jax.value_and_grad(lambda p, b, t: loss_fn(graphdef, p, b, t), has_aux=True))
    (loss, loads), grads = fn(state["params"], state["biases"], batch)
    return loss, grads, loads, executor, state


def owners(leaf: jax.Array, mesh, head_dim: int, expert_dim: int) -> np.ndarray:
    """(data, Nh, Ne, hp, ep) counts: how many shards of `leaf` on the device at (data, hp, ep) hold each (head,
    expert) pair, from the shards' indices (independent of the spec that placed them)."""
    coords = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
    sizes = mesh.devices.shape
    held = np.zeros((sizes[0], leaf.shape[head_dim], leaf.shape[expert_dim], *sizes[1:]), np.int32)
    for shard in leaf.addressable_shards:
        d, h, e = coords[shard.device.id]
        held[d, shard.index[head_dim], shard.index[expert_dim], h, e] += 1
    return held


def assert_one_device_per_cell(leaf: jax.Array, mesh, head_dim: int, expert_dim: int) -> None:
    """Every (head, expert) pair of `leaf` is on exactly one device of each data replica: the device of its cell
    (hp index = head // (Nh / hp), ep index = expert // (Ne / ep))."""
    _, hp, ep = mesh.devices.shape
    held = owners(leaf, mesh, head_dim, expert_dim)
    want = np.zeros_like(held)
    for h in range(HEADS):
        for e in range(EXPERTS):
            want[:, h, e, h // (HEADS // hp), e // (EXPERTS // ep)] = 1
    np.testing.assert_array_equal(held, want)


@pytest.fixture(scope="module")
def reference():
    return loss_grads_loads(small_cfg(), None)


# The three meshes of the issue: hp and ep each above and below the other, and data parallelism (the loads' psum over
# data, the data-replicated weights' gradient sum) with both
@pytest.mark.parametrize("data,hp,ep", [(1, 2, 4), (1, 4, 2), (2, 2, 2)])
def test_hp_x_ep_matches_single_device_and_splits_each_expert_once(data, hp, ep, reference):
    """Loss, every gradient and the loads equal the single-device model's; the expert leaves (and hence their
    gradients and moments, placed alike) sit each (head, expert) pair on one device of its (hp, ep) cell."""
    cfg = small_cfg(hp, ep, data)
    mesh = make_mesh(cfg, jax.devices()[:data * hp * ep])
    assert mesh.axis_names == ("data", "hp", "ep") and mesh.devices.shape == (data, hp, ep)
    loss, grads, loads, executor, state = loss_grads_loads(cfg, mesh)
    assert isinstance(executor, HeadExpertParallelMoE) and executor.ep_impl == "padded"
    rloss, rgrads, rloads, _, _ = reference
    np.testing.assert_allclose(float(loss), float(rloss), rtol=1e-5)
    assert set(loads) == set(rloads)
    for i in rloads:  # integer counts: the global ones, not one shard's
        np.testing.assert_array_equal(np.asarray(loads[i]), np.asarray(rloads[i]))
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert len(flat) == len(jax.tree.leaves(rgrads))
    for (path, g), r in zip(flat, jax.tree.leaves(rgrads)):
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(g), r, atol=2e-5 * max(np.abs(r).max(), 1e-6), rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))
    experts = state["params"]["blocks"][0]["ffn"]["experts"]
    for name, expert_dim in (("w_router", 2), ("w1", 1), ("w2", 1)):
        assert_one_device_per_cell(experts[name][...], mesh, 0, expert_dim)
    assert_one_device_per_cell(state["biases"]["blocks"][0]["ffn"]["experts"]["bias"][...], mesh, 0, 1)
    # the optimizer's moments take their parameter's sharding (state_shardings by path): AdamW's mu and nu of w1
    opt = jax.eval_shape(make_optimizer(cfg).init, state["params"])
    shardings = jax.tree_util.tree_flatten_with_path(state_shardings(cfg, mesh, {"opt_state": opt}))[0]
    moments = [s.spec for path, s in shardings if jax.tree_util.keystr(path).endswith("['experts']['w1'].value")]
    assert moments == [P("hp", "ep", None, None)] * 2


def test_traffic_per_link_kind_is_a_hand_count():
    """16 tokens per device, Nh 8 of width 8, Ne 8, k 2, fp32, hp 2 x ep 4: counted row by row."""
    tokens, itemsize = 16, 4
    # HP: each token sends its 4 heads that live on the other hp device, 8 floats each
    hp = tokens * 4 * 8 * itemsize
    # EP: the device then holds 2 x 16 tokens on 4 heads, 2 choices each: 256 slots; uniform routing sends the 3/4
    # of them whose expert is on another of the 4 ep devices; the worst case sends all 256 (each ep device has 2 of
    # a head's 8 experts, so both choices can land elsewhere); the counts: 4 heads x 8 experts int32 to 3 peers
    slots = 32 * 4 * 2
    want = {"comm/hp_a2a_bytes": hp, "comm/ep_a2a_bytes_uniform": slots * 3 // 4 * 8 * itemsize,
            "comm/ep_a2a_bytes_worst": slots * 8 * itemsize, "comm/ep_meta_bytes": 3 * 4 * 8 * 4}
    assert traffic.hp_ep_bytes(tokens, 8, 8, 2, 8, 2, 4, itemsize) == want
    assert traffic.hp_ep_bytes(tokens, 8, 8, 2, 8, 2, 4, itemsize, separate_routing=True)["comm/hp_a2a_bytes"] == 2 * hp
    cfg = small_cfg(hp=2, ep=4)
    assert traffic.comm_bytes_per_layer(cfg, make_mesh(cfg, jax.devices()), tokens) == want


def test_hp_x_ep_train_resumes_onto_one_device(tmp_path):
    """4 steps of the tiny model on hp 2 x ep 2 with a checkpoint at step 2, resumed from it on one device (every
    expert weight gathered from the 4 devices of its cell): steps 3 and 4 give the straight run's losses (fp32
    tolerance: the sums run in another order). The resumed run is tiny()'s own one-device program, which other
    tests compile too (JAX's persistent cache)."""
    common = ("schedule.total_steps=4", "data.val_sequences=0", "checkpoint.every=2", "checkpoint.keep=5",
              "checkpoint.async_save=false")
    straight = train(tiny(tmp_path, *common, "parallel.devices=4", "train.micro_batch=2", "parallel.hp=2",
                          "parallel.ep=2"))
    assert {"comm/hp_a2a_bytes", "comm/ep_a2a_bytes_uniform"} <= set(straight[0])
    resumed = train(tiny(tmp_path, *common, f"logging.run_dir={tmp_path / 'other'}"),
                    resume=str(tmp_path / "run" / "checkpoints" / "2"))
    assert [m["step"] for m in resumed] == [3, 4]
    np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in straight[2:]], rtol=1e-5)


def test_ep_groups_of_a_three_axis_mesh_decide_the_exchange(monkeypatch):
    """On GPUs the ragged EP exchange stays where every ep group is inside one process; hp groups may span processes
    (HP between hosts, EP within), while an ep group across processes takes the padded exchange."""
    @dataclass(frozen=True)
    class Dev:
        id: int
        process_index: int

    def mesh(process_of):  # (data 1, hp 2, ep 2) devices, process of each device id
        devices = np.empty((1, 2, 2), object)
        for i in range(4):
            devices.flat[i] = Dev(i, process_of(i))
        return SimpleNamespace(devices=devices)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_ep_impl("auto", mesh(lambda i: i // 2)) == "ragged"  # ep pairs (0, 1), (2, 3): one process each
    assert resolve_ep_impl("auto", mesh(lambda i: i % 2)) == "padded"
