"""The chunked exchange (`parallel.hp_chunks`) on 8 host CPU devices against the unchunked executor and one device.

Each executor is called on global arrays as the model calls it. With C chunks, every token's output must be bitwise
the unchunked executor's (routing is per sub-token, every expert row depends on its own input only), the loads
exactly the single-device ones, and the loss's gradients the single-device ones to fp32 rounding (the weight
gradients sum C chunks'). Per-token comparisons catch chunks put back in the wrong place, which sums would not.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bench import a2a, train_scale
from mhl_jax.config import load_config
from mhl_jax.moe.context import ExpertContext
from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel import exchange_model
from mhl_jax.parallel.chunks import chunk_count, over_chunks
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.expert_parallel import ExpertParallelMoE
from mhl_jax.parallel.head_expert_parallel import HeadExpertParallelMoE
from mhl_jax.parallel.head_parallel import HeadParallelMoE
from mhl_jax.parallel.mesh import make_mesh

N, HEADS, DH, EXPERTS, DE, K = 128, 8, 8, 8, 16, 2  # 16 tokens per device on 8 devices


def inputs(seed: int = 0, heads: int = HEADS, dh: int = DH):
    """x (N, Nh, dh), routers far from ties (unit-variance W_r, a bias that moves the selection), experts, and the
    cotangent the loss sum(y * g) puts on y."""
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (N, heads, dh))
    w_r = jax.random.normal(ks[1], (heads, dh, EXPERTS))
    bias = 0.5 * jax.random.normal(ks[2], (heads, EXPERTS))
    w1 = 0.3 * jax.random.normal(ks[3], (heads, EXPERTS, dh, DE))
    w2 = 0.3 * jax.random.normal(ks[4], (heads, EXPERTS, DE, dh))
    g = jax.random.normal(ks[5], (N, heads, dh))
    return x, w_r, bias, w1, w2, g


def grouped(x: jax.Array, groups: int) -> jax.Array:
    """(N, Nh, c) -> (groups, N, Nh / groups, c): the head-group-major layout `grouped_project_in` emits."""
    n, h, c = x.shape
    return x.reshape(n, groups, h // groups, c).transpose(1, 0, 2, 3)


def forward(executor, args, groups: int = 1) -> np.ndarray:
    """y token-major of `executor` on `args` (`inputs`)."""
    x, w_r, bias, w1, w2, _ = args
    xs = x if groups == 1 else grouped(x, groups)
    y = jax.jit(lambda xs: executor(xs, xs, w_r, bias, w1, w2, K)[0])(xs)
    return np.asarray(y if groups == 1 else y.transpose(1, 0, 2, 3).reshape(x.shape))


def run(executor, args, groups: int = 1, ctx=None):
    """(y token-major, load, gradients of sum(y * g) for x, w_r, w1, w2) of `executor` on `args` (`inputs`)."""
    x, w_r, bias, w1, w2, g = args

    def loss(x, w_r, w1, w2):
        xs = x if groups == 1 else grouped(x, groups)
        y, load = executor(xs, xs, w_r, bias, w1, w2, K, ctx)
        y = y if groups == 1 else y.transpose(1, 0, 2, 3).reshape(x.shape)
        return jnp.sum(y * g), (y, load)

    (_, (y, load)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w_r, w1, w2)
    return np.asarray(y), np.asarray(load), [np.asarray(d) for d in grads]


@pytest.fixture(scope="module")
def one_device():
    return run(LocalMoE("reference"), inputs())


def mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    size = int(np.prod(shape))
    return Mesh(np.asarray(jax.devices()[:size]).reshape(shape), axes)


def assert_matches(got, unchunked, one_device):
    """Outputs bitwise the unchunked executor's (`forward`), per token; loads exactly one device's; outputs and
    gradients one device's to fp32 rounding."""
    y, load, grads = got
    np.testing.assert_array_equal(y, unchunked)
    np.testing.assert_array_equal(load, one_device[1])
    np.testing.assert_allclose(y, one_device[0], rtol=1e-5, atol=1e-5)
    for name, d, r in zip(("x", "w_r", "w1", "w2"), grads, one_device[2]):
        np.testing.assert_allclose(d, r, rtol=1e-4, atol=2e-5 * np.abs(r).max(), err_msg=name)


# data x hp (token-major and grouped; 2 and 4 chunks) and data x hp x ep (both layouts)
@pytest.mark.parametrize("data,hp,ep,chunks,groups", [(2, 4, 1, 2, 4), (1, 8, 1, 4, 1), (2, 2, 2, 2, 2)])
def test_chunked_hp_gives_unchunked_outputs_and_single_device_grads_and_loads(data, hp, ep, chunks, groups,
                                                                              one_device):
    if ep == 1:
        m = mesh((data, hp), ("data", "hp"))
        make = lambda c: HeadParallelMoE(m, "reference", chunks=c)  # noqa: E731
    else:
        m = mesh((data, hp, ep), ("data", "hp", "ep"))
        make = lambda c: HeadExpertParallelMoE(m, "reference", "padded", chunks=c)  # noqa: E731
    args = inputs()
    assert_matches(run(make(chunks), args, groups), forward(make(1), args, groups), one_device)


def test_chunked_ep_gives_unchunked_outputs_and_single_device_grads_and_loads(one_device):
    """data x ep (MoE / LatentMoE's executor, here on 8 heads; token-major): each chunk routes and exchanges its own
    counts."""
    m = mesh((1, 8), ("data", "ep"))
    args = inputs()
    assert_matches(run(ExpertParallelMoE(m, "reference", "padded", chunks=2), args),
                   forward(ExpertParallelMoE(m, "reference", "padded"), args), one_device)


def test_separate_routing_sub_tokens_travel_with_their_chunk():
    """x_route apart from x_expert (ffn.routing_tokens=separate): each chunk sends its own routing sub-tokens, so the
    outputs and loads are the unchunked ones bitwise (a chunk routed on another chunk's sub-tokens would differ)."""
    m = mesh((2, 4), ("data", "hp"))
    x, w_r, bias, w1, w2, _ = inputs()
    xr = grouped(jax.random.normal(jax.random.key(7), x.shape), 4)
    xe = grouped(x, 4)
    call = lambda c: jax.jit(HeadParallelMoE(m, "reference", chunks=c).__call__, static_argnums=6)  # noqa: E731
    got, want = call(2)(xr, xe, w_r, bias, w1, w2, K), call(1)(xr, xe, w_r, bias, w1, w2, K)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gradient_sums_are_added_once_over_the_chunks():
    """grad_acc (data x hp only) goes to one chunk: w1 / w2's gradients are acc + dW, not 2 acc + dW."""
    m = mesh((1, 8), ("data", "hp"))
    args = inputs()
    acc = (jnp.full(args[3].shape, 3.0), jnp.full(args[4].shape, -2.0))
    y1, _, plain = run(HeadParallelMoE(m, "reference"), args)
    y, _, summed = run(HeadParallelMoE(m, "reference", chunks=2), args, ctx=ExpertContext(grad_acc=acc))
    np.testing.assert_array_equal(y, y1)
    for d, p, a in zip(summed[2:], plain[2:], acc):
        np.testing.assert_allclose(d, np.asarray(a) + p, rtol=1e-6, atol=1e-6)


def test_step_context_on_the_triton_path(emulated):
    """The Triton experts (emulated on the CPU) with the step context: bf16 sub-tokens, the weights' bf16 casts read by
    every chunk, the gradient sums added once, in the fused core's backward (`accumulates_in_place`)."""
    m = mesh((1, 8), ("data", "hp"))
    x, w_r, bias, w1, w2, g = inputs(dh=16)
    args = (x.astype(jnp.bfloat16), w_r, bias, w1, w2, g.astype(jnp.bfloat16))
    ctx = ExpertContext(weights_cast=(w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)),
                        grad_acc=(jnp.full(w1.shape, 3.0), jnp.full(w2.shape, -2.0)))
    assert HeadParallelMoE(m, "triton").accumulates_in_place(jnp.bfloat16, jnp.float32, 16)
    y, load, grads = run(HeadParallelMoE(m, "triton", chunks=2), args, ctx=ctx)
    y1, load1, grads1 = run(HeadParallelMoE(m, "triton"), args, ctx=ctx)
    np.testing.assert_array_equal(y, y1)
    np.testing.assert_array_equal(load, load1)
    for d, r in zip(grads, grads1):  # fp32 sums in another order; x's gradient in bf16
        np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(r, np.float32), rtol=1e-2,
                                   atol=1e-2 * np.abs(np.asarray(r, np.float32)).max())


def test_over_chunks_puts_each_chunk_back_in_its_place():
    """A body that marks each chunk with its index: chunk i sees rows [i n/C, (i+1) n/C) and its output lands there;
    the loads add; a count that does not divide the tokens falls back to the largest one that does."""
    x = jnp.arange(24.0).reshape(2, 12)  # tokens on axis 1, as the grouped layout

    def body(i, a, b):
        return a + 100.0 * i + 0 * b, jnp.full((3,), a.shape[1], jnp.int32) + i

    y, load = over_chunks(body, (x, x), 3, axis=1)
    want = np.asarray(x) + 100.0 * (np.arange(12) // 4)
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(load), [3 * 4 + 0 + 1 + 2] * 3)
    assert [chunk_count(4, n) for n in (16, 6, 1)] == [4, 2, 1]
    with pytest.raises(ValueError, match="chunks=0: must be >= 1"):
        chunk_count(0, 16)


def test_config_reaches_every_executor():
    """parallel.hp_chunks from the config into the executor make_executor picks, for each kind of mesh with an
    exchange."""
    base = ["model.n_layers=1", "model.context=32", "parallel.hp_chunks=4", "parallel.devices=4"]
    for path, sets, kind in [("configs/tiny_mh_latent_moe.yaml", ["parallel.hp=4"], HeadParallelMoE),
                             ("configs/tiny_mh_latent_moe.yaml", ["parallel.hp=2", "parallel.ep=2"],
                              HeadExpertParallelMoE),
                             ("configs/tiny_moe.yaml", ["parallel.ep=4"], ExpertParallelMoE)]:
        cfg = load_config(path, base + sets)
        ex = make_executor(cfg, make_mesh(cfg))
        assert isinstance(ex, kind) and ex.chunks == 4, ex
    # data parallelism alone exchanges nothing: no chunks
    cfg = load_config("configs/tiny_mh_latent_moe.yaml", base + ["parallel.data=4"])
    ex = make_executor(cfg, make_mesh(cfg))
    assert isinstance(ex, HeadParallelMoE) and ex.chunks == 1, ex


def test_a2a_bench_times_the_chunked_layer_on_one_device_and_takes_a_three_axis_mesh(tmp_path):
    """bench.a2a --layer at a tiny shape on one device (the overhead of the chunks where nothing overlaps): a record
    per chunk count, the unchunked one first, the chunked outputs bitwise the unchunked ones. On data 2 x hp 2 x ep 2
    (not timed here: the chunked HP x EP executor runs in the tests above) its executor and inputs are those the
    training run would hold."""
    out = tmp_path / "layer.jsonl"
    tiny = ["--config", "configs/tiny_mh_latent_moe.yaml", "--set", "model.compute_dtype=float32"]
    a2a.main(["--layer", "--mesh", "1", "1", "1", "--chunks", "2", "--layer-tokens", "32", *tiny, "--repeats", "2",
              "--out", str(out)])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["params"]["chunks"] for r in recs] == [1, 2]
    assert all(r["params"]["mesh"] == {"data": 1, "hp": 1} and r["bitwise_vs_unchunked"] and r["ms"] > 0
               and r["ms_unchunked"] == recs[0]["ms"] for r in recs), recs
    assert "chunks=2" in recs[1]["executor"]
    cfg = a2a.layer_config(tiny[1], tiny[3:], (2, 2, 2))
    m = make_mesh(cfg, jax.devices())
    ex = a2a.layer_executor(cfg, m, 2)
    assert isinstance(ex, HeadExpertParallelMoE) and ex.chunks == 2 and m.devices.shape == (2, 2, 2)
    x, w_r, bias, w1, *_ = a2a.layer_inputs(cfg, m, 32, seed=0)
    assert x.shape == (2, 256, 2, 32) and x.sharding.spec == P(None, ("data", "hp", "ep"))
    assert w1.sharding.spec == P("hp", "ep", None, None) and w_r.sharding.spec == P("hp", None, "ep")


def test_train_scale_runs_hp_x_ep_with_chunks():
    """bench.train_scale --ep 2 with parallel.hp_chunks=2 on 4 devices: the mesh data 1 x hp 2 x ep 2, the chunked
    executor, a falling loss. (Its loss check: tests/e2e/test_bench_scripts.py; the chunked layer against one
    device: the tests above.)"""
    sets = ["model.compute_dtype=float32", "model.n_layers=1", "ffn.stem_layers=0", "model.context=32",
            "train.global_batch=16", "parallel.hp_chunks=2"]
    (r,) = train_scale.run(["configs/tiny_mh_latent_moe.yaml"], [4], steps=2, overrides=sets, ep=2,
                           emit=lambda r: None, log=lambda s: None)
    assert r["mesh"] == {"data": 1, "hp": 2, "ep": 2} and r["hp_chunks"] == 2 and "chunks=2" in r["executor"], r
    assert r["ok"] and r["losses"][1] < r["losses"][0]


def test_exchange_model_is_a_hand_count():
    """16 GPUs, 8 per node, the 2.2B shapes (16384 tokens per device, Nh 8 x dh 128, Ne 384, k 4, bf16)."""
    # 1 x 2 x 8: device 0's hp partner is device 8 (the other node), its ep group devices 0-7 (its node). HP sends the
    # 4 heads of the other group: 16384 x 4 x 128 x 2 B over the network at 50 GB/s; EP sends the 2 x 16384 tokens' 4
    # heads x 4 choices, 7/8 of them to other devices, 128 x 2 B each, over NVLink at 210 GB/s; four of each per layer
    # (MB / (GB/s) = ms)
    hp_mb, ep_mb = 16384 * 4 * 128 * 2 / 1e6, 2 * 16384 * 4 * 4 * 7 / 8 * 128 * 2 / 1e6
    x = exchange_model.exchange((1, 2, 8), 16384, 8, 128, 4, 384)
    assert (x.hp_peers_off_node, x.ep_peers_off_node) == (1, 0)
    np.testing.assert_allclose([x.hp_mb, x.ep_mb, x.ms], [hp_mb, ep_mb, 4 * (hp_mb / 50 + ep_mb / 210)])
    # 1 x 8 x 2: hp group 0, 2, ..., 14: 3 peers on the node, 4 off; the network's 4/7 of the bytes are the slower
    x = exchange_model.exchange((1, 8, 2), 16384, 8, 128, 4, 384)
    hp_mb = 16384 * 7 * 128 * 2 / 1e6
    assert x.hp_peers_off_node == 4
    np.testing.assert_allclose(x.ms, 4 * (hp_mb * 4 / 7 / 50 + x.ep_mb / 210))
    # 2 x 8 x 1: the data pair (0, 8) all-reduces its eighth of the layer's 201M fp32 expert gradients over the network
    np.testing.assert_allclose(exchange_model.expert_grad_allreduce_ms((2, 8, 1), 201326592), 201326592 / 8 * 4 / 50e6)
    assert exchange_model.expert_grad_allreduce_ms((1, 8, 2), 201326592) == 0.0
    # overlap: one chunk's share left when the compute is longer, else the excess over the compute beside it
    assert exchange_model.exposed_ms(1.0, 3.0, 4) == 0.25 and exchange_model.exposed_ms(3.0, 1.0, 4) == 2.25
    assert exchange_model.exposed_ms(3.0, 1.0, 1) == 3.0
    # each extra chunk's cost at hp 2: the measured 7.394 ms a step over 20 layer calls, plus the half of hp 2's
    # exchange (four all-to-alls of 16384 x 4 heads x 128 bf16 at 210 GB/s) that the second chunk hides; a quarter
    # of it at 8 cells (a quarter of the experts held)
    per_chunk = 7.394 / 20 + 4 * 16384 * 4 * 128 * 2 / 210e6 / 2
    assert exchange_model.chunk_overhead_ms(2, 1) == 0.0
    assert exchange_model.chunk_overhead_ms(2, 2) == pytest.approx(per_chunk, rel=1e-6)
    assert exchange_model.chunk_overhead_ms(8, 4) == pytest.approx(3 * per_chunk / 4, rel=1e-6)
    # docs/parallel.md shows the model's table as it is
    assert exchange_model.table() in (Path(__file__).resolve().parents[2] / "docs" / "parallel.md").read_text()
