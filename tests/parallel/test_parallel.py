"""Head Parallel and Expert Parallel on 8 host CPU devices against the single-device model.

Every sharded configuration must give the single-device model's loss, gradients and loads (fp32
tolerance; loads exactly), and a whole sharded train step must match the single-device step.
"""

from __future__ import annotations

import functools

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
from mhl_jax.model.loss import head_loss, lm_head_loss
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel import traffic
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.expert_parallel import ExpertParallelMoE, make_plan, ragged_updates, received_groups
from mhl_jax.parallel.head_parallel import HeadParallelMoE
from mhl_jax.parallel.mesh import batch_spec, make_mesh, state_shardings
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.schedule import make_schedule
from mhl_jax.train.step import jit_train_step, loss_fn, make_train_step

B, T = 8, 16  # 128 tokens: 16 per device on 8 devices


def small_cfg(kind: str, hp: int = 1, ep: int = 1, data: int = -1) -> Config:
    ne = 8 if kind == "mh_latent_moe" else 16
    return load_config(None, [
        "model.vocab_size=64", "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.head_dim=32",
        f"model.context={T}", "model.compute_dtype=float32", "model.attention_impl=xla",
        f"ffn.kind={kind}", "ffn.stem_layers=0", "ffn.num_heads=8", "ffn.head_dim=8", "ffn.latent_dim=64",
        f"ffn.num_experts={ne}", "ffn.top_k=2", "ffn.expert_hidden=16", "ffn.kernels=reference",
        f"parallel.hp={hp}", f"parallel.ep={ep}", f"parallel.data={data}",
        f"train.global_batch={B}", "train.micro_batch=1", "ffn.balance_gamma=0.01"])


def init_state(cfg: Config, executor) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """Model with the executor; routers and biases randomised so that routing is far from ties and the
    bias changes the selection (it must be gathered / split correctly)."""
    graphdef, params, biases = nnx.split(build_model(cfg, seed=0, executor=executor), nnx.Param, RouterBias)
    rng = np.random.default_rng(1)

    def spread(path, x):
        name = getattr(path[-1], "key", None) if path else None
        if name == "w_router" or (path and getattr(path[-2], "key", None) == "w_router"):
            return jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        return x

    params = jax.tree_util.tree_map_with_path(spread, params)
    biases = jax.tree.map(lambda b: jnp.asarray(0.5 * rng.standard_normal(b.shape), b.dtype), biases)
    return graphdef, params, biases


def tokens(cfg: Config, seed: int, shape: tuple[int, ...] = (B, T + 1)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.model.vocab_size, shape, dtype=np.int32)


def loss_grads(cfg: Config, devices: list | None, executor=None, repeat: int = 1, loss=loss_fn):
    """(loss, grads, loads, executor) of the model; devices None: the single-device model (LocalMoE,
    plain jit); else a mesh over `devices` with the config's executor (or the one given).
    repeat > 1 reruns the compiled function and checks the results are bitwise identical. loss: (graphdef, params,
    biases, tokens) -> (loss, loads), the train step's by default."""
    mesh = None if devices is None else make_mesh(cfg, devices)
    if executor is None:
        executor = LocalMoE("reference") if mesh is None else make_executor(cfg, mesh)
    graphdef, params, biases = init_state(cfg, executor)
    fn = jax.jit(jax.value_and_grad(lambda p, b, t: loss(graphdef, p, b, t), has_aux=True))
    batch = tokens(cfg, 2)
    if mesh is not None:
        state = jax.device_put({"params": params, "biases": biases}, state_shardings(cfg, mesh, {
            "params": params, "biases": biases}))
        params, biases = state["params"], state["biases"]
        batch = jax.device_put(batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    (loss, loads), grads = out = fn(params, biases, batch)
    for _ in range(repeat - 1):  # determinism: no atomics, fixed-order reductions
        for a, b in zip(jax.tree.leaves(fn(params, biases, batch)), jax.tree.leaves(out)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return loss, grads, loads, executor


_REFERENCE: dict[str, tuple] = {}


def reference(kind: str):
    if kind not in _REFERENCE:
        _REFERENCE[kind] = loss_grads(small_cfg(kind), None)
    return _REFERENCE[kind]


def assert_same(got, want):
    loss, grads, loads, _ = got
    rloss, rgrads, rloads, _ = want
    np.testing.assert_allclose(float(loss), float(rloss), rtol=1e-5)
    assert set(loads) == set(rloads)
    for i in rloads:  # integer counts: exactly the single-device ones (global, not per shard)
        np.testing.assert_array_equal(np.asarray(loads[i]), np.asarray(rloads[i]))
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    rflat = jax.tree_util.tree_leaves(rgrads)
    assert len(flat) == len(rflat)
    for (path, g), r in zip(flat, rflat):
        g, r = np.asarray(g), np.asarray(r)
        scale = max(np.abs(r).max(), 1e-6)
        np.testing.assert_allclose(g, r, atol=2e-5 * scale, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


# The distinct branches: hp 1 (data parallelism through the HP executor; the model projects its sub-tokens token-major,
# head_groups 1) and hp > 1 with data > 1 (the model's head-group-major sub-tokens, the all-to-alls over hp, the loads'
# psum over data); another hp size or data 1 (one device included) runs the same code, and hp 2 runs in tests/kernels.
@pytest.mark.parametrize("data,hp", [(8, 1), (2, 4)])
def test_head_parallel_matches_single_device(data, hp):
    """The HP model gives the single-device model's loss, gradients and loads, bitwise the same when rerun. Its LM
    head's loss goes in chunks of 2 tokens per device (8 chunks of two positions on each of the 8 devices) against the
    single-device model's one chunk of its 128 tokens: the chunks under sharding checked by the same compile (one
    device's chunks: tests/unit/test_params.py; the train step's own loss under HP:
    test_sharded_train_step_matches_single_device)."""
    want = reference("mh_latent_moe")  # one chunk

    def chunked_loss(graphdef, p, b, t):
        model = nnx.merge(graphdef, p, b)
        x, loads = model.hidden(t[:, :-1])
        w = model.head[...].astype(model.dtype)
        return lm_head_loss(x, w, t[:, 1:], model.batch_shards, chunk_tokens=2), loads

    cfg = small_cfg("mh_latent_moe", hp=hp, data=data)
    got = loss_grads(cfg, jax.devices()[:data * hp], repeat=2, loss=chunked_loss)
    assert isinstance(got[3], HeadParallelMoE) and got[3].hp == hp
    assert_same(got, want)


def test_head_loss_reduces_its_weight_gradient_once():
    """With the batch split over 4 devices, the LM head loss's chunk loop keeps one dW sum per device: the compiled
    gradient's loop bodies hold no all-reduce (summing over the whole batch inside the loop all-reduced every chunk's
    (d, V) term), and the result is the single-device one."""
    import re

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 64, 32), np.float32), rng.standard_normal((32, 256), np.float32)
    t = rng.integers(0, 256, (8, 64)).astype(np.int32)
    grad = jax.value_and_grad(lambda x, w, t, s: head_loss(x, w, t, 16, s), (0, 1))
    want = jax.jit(functools.partial(grad, s=1))(x, w, t)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(x, P("data")), put(w, P()), put(t, P("data")))
    fn = jax.jit(functools.partial(grad, s=4))
    hlo = fn.lower(*args).compile().as_text()
    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    assert bodies
    comps = {m.group(1): m.group(2) for m in re.finditer(r"\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S)}
    assert all("all-reduce(" not in comps[b] for b in bodies), "an all-reduce inside the chunk loop"
    assert "all-reduce(" in hlo  # the one after the loop
    for a, r in zip(jax.tree.leaves(fn(*args)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)


# ep > 1 with data > 1 (the padded exchange over ep, the loads' psum over data), for each FFN kind the EP executor runs:
# another ep size, ep 1 (data parallelism only) or data 1 (one device included) runs the same code without a branch of
# its own, and ep 2 runs in tests/kernels.
@pytest.mark.parametrize("kind,data,ep", [("moe", 2, 4), ("latent_moe", 2, 4)])
def test_expert_parallel_matches_single_device(kind, data, ep):
    """The EP model gives the single-device model's loss, gradients and loads, bitwise the same when rerun."""
    cfg = small_cfg(kind, ep=ep, data=data)
    got = loss_grads(cfg, jax.devices()[:data * ep], repeat=2)
    assert isinstance(got[3], ExpertParallelMoE) and got[3].ep == ep and got[3].ep_impl == "padded"
    assert_same(got, reference(kind))


def test_expert_parallel_worst_case_skew_is_dropless():
    """Biases that send every choice to the first device's experts: the static worst-case receive
    buffer must hold them all (no token dropped), so the layer still equals the local one."""
    from mhl_jax.moe.core import moe_heads

    rng = np.random.default_rng(3)
    n, ne, c, de, k = 64, 16, 8, 12, 4
    x = jnp.asarray(rng.standard_normal((n, 1, c)), jnp.float32)
    w_r = jnp.asarray(rng.standard_normal((1, c, ne)), jnp.float32)
    bias = jnp.zeros((1, ne), jnp.float32).at[0, :4].set(100.0)  # experts 0-3 live on device 0 of 4
    w1 = jnp.asarray(0.3 * rng.standard_normal((1, ne, c, de)), jnp.float32)
    w2 = jnp.asarray(0.3 * rng.standard_normal((1, ne, de, c)), jnp.float32)
    mesh = make_mesh(small_cfg("moe", ep=4, data=1), jax.devices()[:4])
    ex = ExpertParallelMoE(mesh, "reference", "padded")

    def f(run, x, w_r, w1, w2):
        y, load = run(x, x, w_r, bias, w1, w2, k)
        return jnp.sum(y * jnp.cos(x)), (y, load)

    (_, (y, load)), g = jax.jit(jax.value_and_grad(lambda *a: f(ex, *a), argnums=(0, 1, 2, 3), has_aux=True))(
        x, w_r, w1, w2)
    local = lambda *a: moe_heads(*a, "reference")  # noqa: E731
    (_, (ry, rload)), rg = jax.jit(jax.value_and_grad(lambda *a: f(local, *a), argnums=(0, 1, 2, 3),
                                                      has_aux=True))(x, w_r, w1, w2)
    assert int(load[0, :4].sum()) == n * k  # everything went to device 0
    np.testing.assert_array_equal(np.asarray(load), np.asarray(rload))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ry), atol=1e-5)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_head_parallel_token_major_layout():
    """The HP executor's token-major input layout (N, Nh, dh), which the model never sends with hp > 1 (it emits the
    head-group-major one there: checked against the single-device model by test_head_parallel_matches_single_device),
    equals the local MoE heads: outputs, gradients, loads. data 2 x hp 2: every all-to-all and psum of the executor;
    hp 4 on data 1 runs the same code."""
    from mhl_jax.moe.core import moe_heads

    rng = np.random.default_rng(5)
    n, d, heads, c, ne, de, k = 32, 16, 4, 8, 8, 12, 2
    arr = lambda *s, sd=1.0: jnp.asarray(sd * rng.standard_normal(s), jnp.float32)  # noqa: E731
    x, w_in, w_out = arr(n, d), arr(d, heads, c), arr(heads, c, d, sd=0.3)
    w_r, bias = arr(heads, c, ne), arr(heads, ne, sd=0.5)
    w1, w2 = arr(heads, ne, c, de, sd=0.3), arr(heads, ne, de, c, sd=0.3)
    ex = HeadParallelMoE(make_mesh(small_cfg("mh_latent_moe", hp=2, data=2), jax.devices()[:4]))

    def value_grads(run):
        def f(x, w_in, w_r, w1, w2, w_out):
            sub = jnp.einsum("nd,dhc->nhc", x, w_in)
            y, load = run(sub, sub, w_r, bias, w1, w2, k)
            out = jnp.einsum("nhc,hcd->nd", y, w_out)
            return jnp.sum(out * jnp.sin(x)), (out, load)

        (_, (out, load)), g = jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))(
            x, w_in, w_r, w1, w2, w_out)
        return [out, load, *g]

    want = value_grads(lambda *a: moe_heads(*a, "reference"))
    for got, ref in zip(value_grads(ex), want):
        ref = np.asarray(ref)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * max(np.abs(ref).max(), 1))


def test_received_groups_against_numpy():
    rng = np.random.default_rng(4)
    peers, groups, cap = 3, 5, 12
    counts = rng.integers(0, 3, (peers, groups)).astype(np.int32)
    for starts in (np.concatenate([[0], np.cumsum(counts.sum(1))[:-1]]), np.arange(peers) * cap):
        want = np.full(peers * cap, -1)
        for q in range(peers):
            row = starts[q]
            for g in range(groups):
                want[row:row + counts[q, g]] = g
                row += counts[q, g]
        got = received_groups(jnp.asarray(counts), jnp.asarray(starts, jnp.int32), peers * cap)
        np.testing.assert_array_equal(np.asarray(got), want)


def emulate_ragged_all_to_all(operands, outputs, updates):
    """numpy model of lax.ragged_all_to_all's documented semantics over P devices: sender s writes
    operand_s[in_off : in_off + size] to outputs[j][out_off : out_off + size] for each update of peer j.
    Also checks each receiver's recv_sizes against what its senders send."""
    peers = len(operands)
    outputs = [o.copy() for o in outputs]
    parts = len(updates[0][0]) // peers
    for s, (in_off, send, out_off, _) in enumerate(updates):
        for i in range(peers * parts):
            j = i // parts
            outputs[j][out_off[i]:out_off[i] + send[i]] = operands[s][in_off[i]:in_off[i] + send[i]]
            assert updates[j][3][s * parts + i % parts] == send[i]  # the receiver expects this many rows
    return outputs


@pytest.mark.parametrize("parts", [1, 3])
def test_ragged_plan_moves_every_row_to_its_place(parts):
    """The GPU path (ragged_all_to_all is not on CPU), through a numpy model of the collective: dispatch
    puts sender q's rows for p at p's recv_offsets[q], in order; combine brings every row back."""
    rng = np.random.default_rng(6)
    peers = 3
    counts = rng.integers(0, 6, (peers, peers)).astype(np.int32)
    counts[1, 2] = 0  # an empty chunk
    plans = [make_plan(jnp.asarray(counts), jnp.int32(me)) for me in range(peers)]
    sends = [np.arange(counts[q].sum()) + 100 * q for q in range(peers)]  # row ids, sorted by destination
    rows = peers * counts.sum()
    recv = emulate_ragged_all_to_all(sends, [np.full(rows, -1)] * peers,
                                     [[np.asarray(a) for a in ragged_updates(pl, "send", parts)] for pl in plans])
    for p in range(peers):
        want = np.concatenate([sends[q][counts[q, :p].sum():counts[q, :p + 1].sum()] for q in range(peers)])
        np.testing.assert_array_equal(recv[p][:len(want)], want)
        assert (recv[p][len(want):] == -1).all()
    back = emulate_ragged_all_to_all(recv, [np.full(len(x), -1) for x in sends],
                                     [[np.asarray(a) for a in ragged_updates(pl, "return", parts)] for pl in plans])
    for q in range(peers):
        np.testing.assert_array_equal(back[q], sends[q])


def test_sharded_train_step_matches_single_device():
    """A whole train step (2 accumulation micro-batches, AdamW, bias update) on a 2 x 4 data x hp mesh
    equals the single-device step; expert leaves and their Adam moments stay split over hp. One layer: the sharding
    and the step are per leaf."""
    cfg = small_cfg("mh_latent_moe", hp=4, data=2)
    batch = tokens(cfg, 5, (2, B, T + 1))
    results = []
    for devices in (jax.devices()[:1], jax.devices()):
        mesh = make_mesh(cfg, devices) if len(devices) > 1 else None
        executor = make_executor(cfg, mesh) if mesh is not None else LocalMoE("reference")
        graphdef, params, biases = init_state(cfg, executor)
        tx = make_optimizer(cfg)
        state = {"params": params, "opt_state": tx.init(params), "biases": biases, "step": jnp.int32(0)}
        step = make_train_step(graphdef, tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule))
        if mesh is None:
            new, metrics = jax.jit(step)(state, batch)
        else:
            sh = state_shardings(cfg, mesh, state)
            bsh = NamedSharding(mesh, batch_spec(mesh))
            step = jit_train_step(graphdef, tx, cfg.balance_gamma, make_schedule(cfg.optimizer, cfg.schedule), sh,
                                  bsh)
            new, metrics = step(jax.device_put(state, sh), jax.device_put(batch, bsh))
            w1 = new["params"]["blocks"][0]["ffn"]["experts"]["w1"]
            assert w1.sharding.spec == P("hp", None, None, None)
            assert w1.addressable_shards[0].data.shape[0] == cfg.ffn.num_heads // 4
            mu = jax.tree.leaves(new["opt_state"], is_leaf=lambda x: hasattr(x, "sharding"))
            assert any(getattr(m, "sharding", None) is not None and m.sharding.spec == P("hp", None, None, None)
                       for m in mu)
        results.append((jax.device_get(new), jax.device_get(metrics)))
    (one, m1), (many, m8) = results
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
    for key in m1:
        if key.startswith("load_"):
            assert m8[key] == m1[key], key
    for a, b in zip(jax.tree.leaves(many["biases"]), jax.tree.leaves(one["biases"])):
        np.testing.assert_array_equal(a, b)  # identical global loads -> identical bias updates
    for a, b in zip(jax.tree.leaves(many["params"]), jax.tree.leaves(one["params"])):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)


def test_traffic_bytes():
    # HP: (P - 1) / P of the tokens' Nh * dh elements, any k, any routing
    assert traffic.hp_bytes(81920, 8, 128, 2, 2) == 81920 * 1024 * 2 // 2
    assert traffic.hp_bytes(100, 8, 16, 8, 4) == 100 * 7 * 16 * 4
    assert traffic.hp_bytes(100, 8, 16, 1, 4) == 0
    with pytest.raises(ValueError, match="Nh=6 is not divisible by hp=4"):
        traffic.hp_bytes(10, 6, 8, 4, 2)
    # EP from counts: rows to other devices only
    assert traffic.ep_bytes_from_counts(np.array([5, 7, 1]), 1, 16, 2) == 6 * 16 * 2
    assert traffic.ep_bytes_uniform(1000, 1, 4, 4, 64, 2) == 1000 * 4 * 3 * 64 * 2 // 4
    assert traffic.ep_bytes_worst(1000, 1, 4, 2, 16, 64, 2) == 1000 * 4 * 64 * 2
    assert traffic.ep_bytes_worst(1000, 1, 8, 2, 8, 64, 2) == 1000 * 4 * 64 * 2  # only 4 remote experts
    loads = traffic.ep_bytes_from_loads(np.array([[3, 1, 0, 0]]), 2, 10, 2, 8, 2)
    assert loads == {"send_max": 10 * 2 * 8 * 2 * 1.0, "recv_max": 10 * 2 * 8 * 2 * 1.0}
    # the loop hook
    mesh = make_mesh(small_cfg("mh_latent_moe", hp=4, data=2), jax.devices())
    assert traffic.comm_bytes_per_layer(small_cfg("mh_latent_moe", hp=4), mesh, 16 * T) == {
        "comm/a2a_bytes": float(16 * T * 6 * 8 * 4)}
    mesh = make_mesh(small_cfg("moe", ep=8), jax.devices())
    got = traffic.comm_bytes_per_layer(small_cfg("moe", ep=8), mesh, 16)
    assert got == {"comm/a2a_bytes_uniform": 16 * 2 * 7 * 64 * 4 / 8, "comm/a2a_bytes_worst": 16 * 2 * 64 * 4.0,
                   "comm/meta_bytes": 7 * 16 * 4.0}
