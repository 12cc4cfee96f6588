"""ffn.routing_tokens=separate (the paper's ablation): each head routes on a second sub-token, projected for routing
alone. On the kernel path (the Triton bindings emulated: the router and experts apart, since the fused core takes one
array for both) and under Head Parallel (which then sends both sub-tokens), the loss, loads and gradients of the
reference path on one device. (The layer itself against an independent implementation: tests/e2e/test_export.py.)"""

import jax
import numpy as np

from mhl_jax.moe.core import LocalMoE
from mhl_jax.parallel.executors import make_executor
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.parallel.traffic import comm_bytes_per_layer
from tests.models import loss_and_grads, small, tokens

SEPARATE = ("ffn.latent_dim=64", "ffn.head_dim=16", "ffn.routing_tokens=separate", "ffn.kernels=reference")


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for layer in want[1]:
        np.testing.assert_array_equal(got[1][layer], want[1][layer])
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got[2]), jax.tree.leaves(want[2])):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_separate_routing_tokens_on_the_kernels_under_head_parallel(emulated):
    """hp 2 x data 2 with the (emulated) Triton router and experts against the reference on one device: the exchange
    of both sub-tokens and the kernels on sub-tokens routed apart, in one case (each device runs the one-device
    op on its heads). The routing projection gets a gradient (through the gates)."""
    one = small("mh_latent_moe", *SEPARATE)
    t = tokens(one)
    want = loss_and_grads(one, LocalMoE("reference"), t)
    assert np.abs(want[2]["blocks"][1]["ffn"]["w_route"][...]).max() > 0
    cfg = small("mh_latent_moe", *SEPARATE, "parallel.hp=2", "parallel.devices=4")
    executor = make_executor(cfg, make_mesh(cfg))
    executor.impl = "triton"  # what ffn.kernels=auto resolves to on a GPU
    _assert_same(loss_and_grads(cfg, executor, t), want)


def test_separate_routing_tokens_double_the_head_parallel_dispatch():
    """The logged HP bytes: both sub-tokens of every head go to its device, (P - 1) / P x tokens x 2 x Nh x dh."""
    shared = small("mh_latent_moe", "ffn.latent_dim=64", "ffn.head_dim=16", "parallel.hp=4", "parallel.devices=4")
    separate = small("mh_latent_moe", *SEPARATE, "parallel.hp=4", "parallel.devices=4")
    got = [comm_bytes_per_layer(c, make_mesh(c), 64)["comm/a2a_bytes"] for c in (shared, separate)]
    assert got == [3 / 4 * 64 * 4 * 16 * 4, 3 / 4 * 64 * 2 * 4 * 16 * 4]  # fp32 activations in the tiny configs
