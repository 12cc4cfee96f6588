"""Grouped-GEMM expert kernels (kernels/triton/grouped.py) and their JAX binding (mhl_jax/moe/gpu/grouped.py).

CPU: the Triton kernels under the interpreter (fp32 torch tensors) against a float64 reference through
the torch autograd Function (output and the gradients of x, gates, w1, w2) for random and extreme-skew
routing, padding blocks, several K-loop steps, dh much wider than de, sub-block rows and swizzled
programs; poisoned output buffers (every element written, padding rows and empty groups zero); bitwise
deterministic weight gradients; the JAX binding's pure-JAX stand-ins against the interpreted kernels
launch by launch, and the binding (backend "emulate") against `expert_ffn(..., impl="reference")`
(value and all gradients, jitted); clear errors for bad shapes and tiles.
GPU (marker gpu): the binding on Triton in bf16 at dh = 1024, de = 256 against the fp32 reference, and
bitwise-deterministic weight gradients.
"""

import functools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.torch.experts import pack_torch  # noqa: E402
from kernels.torch.grouped import grouped_bwd, grouped_expert_ffn, grouped_fwd, rows_matmul  # noqa: E402
from kernels.triton.grouped import GATHER, GATHER_GATED, ROWS  # noqa: E402
from kernels.tuning import GemmTile, GroupedConfig  # noqa: E402
from tests.references.torch_experts import check_fwd_bwd_vs_f64, expert_inputs, rel, weight_grads_twice  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="interpreter test")


# name: (config, dh, de)
CASES = {
    # one tile = one packing block; K loop of 2 steps over dh
    "plain": (GroupedConfig(16, GemmTile(16, 16, 16, 4, 1), GemmTile(16, 16, 16, 4, 1)), 32, 16),
    # dh much wider than de: K loop of 4 steps over dh, 4 N tiles over dh, dW tiles (16, 16) on (64, 32)
    "wide_dh": (GroupedConfig(16, GemmTile(16, 16, 16, 4, 1), GemmTile(16, 16, 16, 4, 1)), 64, 32),
    # rows kernel on half packing blocks, swizzle bands of 3 row blocks (not dividing the count),
    # wgrad over 16-row steps of 32-row blocks with rectangular dW tiles
    "subblock": (GroupedConfig(32, GemmTile(16, 32, 16, 4, 1), GemmTile(32, 16, 16, 4, 1), group_m=3), 64, 32),
    # wide tiles: one N tile on de, one K step on de
    "wide_tiles": (GroupedConfig(32, GemmTile(32, 32, 32, 4, 1), GemmTile(16, 32, 32, 4, 1), group_m=1), 64, 32),
}


@interpreter_only
@pytest.mark.parametrize("case,skew", [("plain", True), ("wide_dh", False), ("subblock", True), ("wide_tiles", False)])
def test_kernels_fwd_bwd_vs_float64(case, skew):
    cfg, dh, de = CASES[case]
    x, idx, gates, w1, w2 = expert_inputs(0, 24, 2, 2, 3, dh, de, skew)
    pk = pack_torch(idx, 3, cfg.pack_block)
    assert (pk.block_group < 0).any()  # the static bound leaves blocks of padding only
    assert (pk.row_slot[: pk.num_blocks * cfg.pack_block] < 0).any()  # and padding rows in used blocks
    leaves = check_fwd_bwd_vs_f64(lambda *a: grouped_expert_ffn(*a, cfg=cfg), x, idx, gates, w1, w2)
    if skew:  # expert 2 gets no token in any head: its weight gradients are exactly zero
        assert (leaves[2].grad[:, 2] == 0).all() and (leaves[3].grad[:, 2] == 0).all()


@interpreter_only
def test_poisoned_outputs_every_element_written_padding_zero():
    """NaN-filled outputs of all six launches (seven outputs): each is fully written, padding rows,
    blocks of padding only and the weight gradients of an expert with no rows come back exactly zero."""
    x, idx, gates, w1, w2 = expert_inputs(1, 10, 2, 2, 4, 32, 16)
    idx = idx % 3  # expert 3 gets no rows
    idx[..., 1] = torch.where(idx[..., 1] == idx[..., 0], (idx[..., 0] + 1) % 3, idx[..., 1])
    cfg = GroupedConfig(16, GemmTile(16, 16, 16, 4, 1), GemmTile(16, 16, 16, 4, 1))
    pk = pack_torch(idx, 4, 16)
    assert (pk.block_group == -1).any() and (pk.group_nblocks == 0).any()
    g, p = 8, pk.row_slot.shape[0]
    nan = float("nan")
    xs, w1g, w2g = x.reshape(20, 32), w1.reshape(g, 32, 16), w2.reshape(g, 16, 32)
    hpre, act, out = grouped_fwd(xs, pk, w1g, w2g, 2, cfg, outs=dict(
        hpre=torch.full((p, 16), nan), act=torch.full((p, 16), nan), out=torch.full((p, 32), nan)))
    assert torch.allclose(act, torch.nn.functional.gelu(hpre, approximate="tanh"), rtol=1e-5, atol=1e-6)
    dy = torch.randn(20, 32)
    outs = dict(dh=torch.full((p, 16), nan), dx=torch.full((p, 32), nan), dw1=torch.full((g, 32, 16), nan),
                dw2=torch.full((g, 16, 32), nan))
    dh, dx, dw1, dw2 = grouped_bwd(xs, dy, gates.reshape(-1), hpre, act, pk, w1g, w2g, 2, cfg, outs=outs)
    pad = pk.row_slot < 0
    for name, t in (("H", hpre), ("Act", act), ("O", out), ("dH", dh), ("dX", dx), ("dW1", dw1), ("dW2", dw2)):
        assert torch.isfinite(t).all(), name
    for name, t in (("H", hpre), ("Act", act), ("O", out), ("dH", dh), ("dX", dx)):
        assert (t[pad] == 0).all(), name
        assert (t[~pad].abs().sum(1) > 0).all(), name  # and real rows are not zero
    empty = pk.group_nblocks == 0
    assert (dw1[empty] == 0).all() and (dw2[empty] == 0).all()
    assert (dw1[~empty].abs().sum((1, 2)) > 0).all()


@interpreter_only
def test_wgrad_accumulates_into_the_running_sums():
    """ACCUM: the wgrad kernel adds each group's gradient to what dW holds (the train step's running sums, aliased in
    place by the JAX binding): bitwise acc + the plain kernel's dW, for both weight gradients' operand modes (an
    expert with no rows keeps its sum)."""
    from kernels.torch.grouped import wgrad

    x, idx, gates, w1, w2 = expert_inputs(3, 10, 2, 2, 4, 32, 16)
    idx = idx % 3  # expert 3 gets no rows
    idx[..., 1] = torch.where(idx[..., 1] == idx[..., 0], (idx[..., 0] + 1) % 3, idx[..., 1])
    cfg = GroupedConfig(16, GemmTile(16, 16, 16, 4, 1), GemmTile(16, 16, 16, 4, 1))
    pk = pack_torch(idx, 4, 16)
    xs, w1g, w2g = x.reshape(20, 32), w1.reshape(8, 32, 16), w2.reshape(8, 16, 32)
    hpre, act, _ = grouped_fwd(xs, pk, w1g, w2g, 2, cfg)
    dy, g32 = torch.randn(20, 32), gates.reshape(-1).float()
    dh, _, _, _ = grouped_bwd(xs, dy, g32, hpre, act, pk, w1g, w2g, 2, cfg)
    for a, d, modes, shape in ((xs, dh, (GATHER, ROWS), (8, 32, 16)), (act, dy, (ROWS, GATHER_GATED), (8, 16, 32))):
        plain = wgrad(a, d, g32, pk, 2, cfg, a_mode=modes[0], d_mode=modes[1], dw_dtype=torch.float32)
        acc = torch.randn(shape)
        summed = wgrad(a, d, g32, pk, 2, cfg, a_mode=modes[0], d_mode=modes[1], dw_dtype=torch.float32,
                       out=acc.clone(), accumulate=True)
        assert torch.equal(summed, acc + plain)
        assert (plain[pk.group_nblocks == 0] == 0).all()
    with pytest.raises(ValueError, match="accumulate=True needs the running sums"):
        wgrad(xs, dh, g32, pk, 2, cfg, a_mode=GATHER, d_mode=ROWS, accumulate=True)


@interpreter_only
def test_weight_gradients_bitwise_deterministic():
    x, idx, gates, w1, w2 = expert_inputs(2, 40, 1, 2, 2, 32, 16)
    cfg = GroupedConfig(16, GemmTile(16, 16, 16, 4, 1), GemmTile(16, 16, 16, 4, 1))
    grads = weight_grads_twice(lambda *a: grouped_expert_ffn(*a, cfg=cfg), x, idx, gates, w1, w2)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_rows_matmul_rejects_mismatched_widths():
    x, idx, gates, w1, w2 = expert_inputs(3, 8, 1, 2, 2, 32, 16)
    cfg = GroupedConfig(16, GemmTile(16, 16, 16, 4, 1), GemmTile(16, 16, 16, 4, 1))
    pk = pack_torch(idx, 2, 16)
    with pytest.raises(ValueError, match="A width 32 != weight reduction dim 16"):
        rows_matmul(x.reshape(8, 32), gates.reshape(-1), pk, w2.reshape(2, 16, 32), 2, cfg, a_mode=GATHER)


# -------------------------------------------------------------------------------- JAX binding (CPU)

def _jax_inputs(seed, n, h, k, ne, dh, de, skew=False, dtype=None):
    import jax.numpy as jnp

    x, idx, gates, w1, w2 = expert_inputs(seed, n, h, k, ne, dh, de, skew)
    x = jnp.asarray(x.numpy())
    return (x if dtype is None else x.astype(dtype), jnp.asarray(idx.numpy(), jnp.int32),
            jnp.asarray(gates.numpy()), jnp.asarray(w1.numpy()), jnp.asarray(w2.numpy()))


@interpreter_only
def test_emulate_stand_ins_match_interpreted_kernels():
    """Each pure-JAX stand-in of the binding (backend "emulate") computes what its kernel launch
    computes: the six launches (seven outputs) of the forward and backward, on the same packing, against the kernels."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe import packing
    from mhl_jax.moe.gpu import grouped as eg

    cfg, dh, de = CASES["subblock"]
    x, idx, gates, w1, w2 = _jax_inputs(4, 24, 2, 2, 3, dh, de)
    g, k = 6, 2
    st = eg.Static(cfg, k, "emulate", "float32")
    xs, g32 = x.reshape(48, dh), gates.reshape(-1)
    w1g, w2g = w1.reshape(g, dh, de), w2.reshape(g, de, dh)
    dy = jnp.asarray(np.random.default_rng(0).standard_normal((48, dh), dtype=np.float32))
    common = dict(epi_gelu=False, hpre=None, out_dtype=jnp.float32)

    @jax.jit
    def stand_ins(idx, xs, g32, w1g, w2g, dy):  # one program: one compile, not one per eager op
        jp = packing.pack(idx, 3, cfg.pack_block)
        hpre, act = eg._rows_emulate(st, xs, g32, jp, w1g, a_mode=GATHER, transpose_w=False,
                                     **dict(common, epi_gelu=True))
        out = eg._rows_emulate(st, act, g32, jp, w2g, a_mode=ROWS, transpose_w=False, **common)
        dh_rows = eg._rows_emulate(st, dy, g32, jp, w2g, a_mode=GATHER_GATED, transpose_w=True,
                                   **dict(common, hpre=hpre))
        dx_rows = eg._rows_emulate(st, dh_rows, g32, jp, w1g, a_mode=ROWS, transpose_w=True, **common)
        wg = dict(num_groups=g, dw_dtype=jnp.float32)
        dw1 = eg._wgrad_emulate(st, xs, dh_rows, g32, jp, a_mode=GATHER, d_mode=ROWS, **wg)
        dw2 = eg._wgrad_emulate(st, act, dy, g32, jp, a_mode=ROWS, d_mode=GATHER_GATED, **wg)
        return jp, (hpre, act, out, dh_rows, dx_rows, dw1, dw2)

    with jax.default_matmul_precision("highest"):
        jp, (hpre, act, out, dh_rows, dx_rows, dw1, dw2) = stand_ins(idx, xs, g32, w1g, w2g, dy)

    tp = pack_torch(torch.tensor(np.asarray(idx)), 3, cfg.pack_block)
    assert np.array_equal(tp.row_slot.numpy(), np.asarray(jp.row_slot))
    t = [torch.tensor(np.asarray(a)) for a in (xs, g32, w1g, w2g, dy)]
    th, ta, to = grouped_fwd(t[0], tp, t[2], t[3], k, cfg)
    tdh, tdx, tdw1, tdw2 = grouped_bwd(t[0], t[4], t[1], th, ta, tp, t[2], t[3], k, cfg)
    for name, a, b in (("H", hpre, th), ("Act", act, ta), ("O", out, to), ("dH", dh_rows, tdh), ("dX", dx_rows, tdx),
                       ("dW1", dw1, tdw1), ("dW2", dw2, tdw2)):
        assert rel(a, b) < 1e-5, (name, rel(a, b))


@functools.cache
def _binding_vs_reference():
    """One jitted program for both cases of test_jax_binding_emulate_vs_reference (idx an argument: one compile):
    value, load and the gradients of x, gates, w1, w2 of the binding at the test's config and of the reference,
    and the outputs of the binding at the default config fitted to the shapes and of the reference."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import expert_ffn
    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    cfg = GroupedConfig(32, GemmTile(16, 32, 16), GemmTile(32, 16, 16), group_m=3)

    def loss(fn, idx, wy):
        def f(x, g, a, b):
            y, load = fn(x, idx, g, a, b)
            return jnp.sum(y * wy), load

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)

    @jax.jit
    def run(x, idx, gates, w1, w2, wy):
        args = (x, gates, w1, w2)
        return (loss(lambda *a: expert_ffn_grouped(*a, cfg=cfg, backend="emulate"), idx, wy)(*args),
                loss(lambda *a: expert_ffn(*a, impl="reference"), idx, wy)(*args),
                expert_ffn_grouped(x, idx, gates, w1, w2, backend="emulate")[0], expert_ffn(x, idx, gates, w1, w2)[0])

    return run


@pytest.mark.parametrize("skew", [False, True], ids=["random", "skew"])
def test_jax_binding_emulate_vs_reference(skew):
    """Value and the gradients of x, gates, w1, w2 (fp32, highest precision, jitted) against the pure-JAX
    reference; padding blocks, sub-block rows, K loop over several steps; and the binding at its default config
    fitted to the shapes."""
    import jax

    x, idx, gates, w1, w2 = _jax_inputs(5, 24, 2, 2, 3, 64, 32, skew)
    wy = jax.numpy.asarray(np.random.default_rng(1).standard_normal(x.shape, dtype=np.float32))
    with jax.default_matmul_precision("highest"):
        ((v, load), grads), ((v_ref, load_ref), grads_ref), y, y_ref = _binding_vs_reference()(x, idx, gates, w1,
                                                                                              w2, wy)
    assert np.array_equal(np.asarray(load), np.asarray(load_ref))
    assert abs(float(v) - float(v_ref)) <= 1e-5 * abs(float(v_ref))
    for name, a, b in zip(("x", "gates", "w1", "w2"), grads, grads_ref):
        assert a.dtype == b.dtype, name
        assert rel(a, b) < 1e-5, (name, rel(a, b))
    assert rel(y, y_ref) < 1e-5


def test_jax_binding_bf16_dtypes():
    """bf16 activations with fp32 master weights: y and dx in bf16, weight gradients in fp32, close to
    the reference at the same dtypes."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import expert_ffn
    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    x, idx, gates, w1, w2 = _jax_inputs(6, 24, 2, 2, 3, 32, 16, dtype=jnp.bfloat16)

    def grads(fn, *args):
        f = lambda x, g, a, b: jnp.sum(fn(x, idx, g, a, b)[0].astype(jnp.float32) ** 2)
        return jax.value_and_grad(f, argnums=(0, 1, 2, 3))(*args)

    # the binding and the reference in one program: one compile
    (v, (dx, dg, dw1, dw2)), (v_ref, ref) = jax.jit(lambda *args: (
        grads(lambda *a: expert_ffn_grouped(*a, backend="emulate"), *args),
        grads(lambda *a: expert_ffn(*a, impl="reference"), *args)))(x, gates, w1, w2)
    assert (dx.dtype, dg.dtype, dw1.dtype, dw2.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32)
    assert abs(float(v) - float(v_ref)) <= 2e-2 * abs(float(v_ref))
    for name, a, b in zip(("x", "gates", "w1", "w2"), (dx, dg, dw1, dw2), ref):
        assert rel(a, b) < 2e-2, (name, rel(a, b))


def test_config_and_binding_errors():
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    ok = GroupedConfig(32, GemmTile(16, 16, 16), GemmTile(16, 16, 16))
    ok.check(64, 32)
    bad = {
        "rows.block_n=24": GroupedConfig(32, GemmTile(16, 24, 16), GemmTile(16, 16, 16)),
        "wgrad.block_k=8": GroupedConfig(32, GemmTile(16, 16, 16), GemmTile(16, 16, 8)),
        "pack_block=48": GroupedConfig(48, GemmTile(16, 16, 16), GemmTile(16, 16, 16)),
        "rows.block_m=64 must divide pack_block=32": GroupedConfig(32, GemmTile(64, 16, 16), GemmTile(16, 16, 16)),
        "de=32 must be a multiple of wgrad.block_n=64": GroupedConfig(32, GemmTile(16, 16, 16),
                                                                      GemmTile(16, 64, 16)),
        "group_m=0": GroupedConfig(32, GemmTile(16, 16, 16), GemmTile(16, 16, 16), group_m=0),
        "pack_impl='radix'": GroupedConfig(32, GemmTile(16, 16, 16), GemmTile(16, 16, 16), pack_impl="radix"),
    }
    for msg, cfg in bad.items():
        with pytest.raises(ValueError, match=msg):
            cfg.check(64, 32)
    # fit shrinks power-of-two tiles to the packing block and the widths, and the result passes check
    fitted = GroupedConfig().fit(48, 16)
    fitted.check(48, 16)
    assert (fitted.rows.block_n, fitted.rows.block_k, fitted.wgrad.block_m) == (16, 16, 16)

    x, idx, gates, w1, w2 = _jax_inputs(7, 8, 1, 2, 2, 32, 16)
    with pytest.raises(ValueError, match="backend='cuda'"):
        expert_ffn_grouped(x, idx, gates, w1, w2, backend="cuda")
    with pytest.raises(ValueError, match="shapes disagree"):
        expert_ffn_grouped(x, idx, gates, w2.reshape(1, 2, 32, 16)[..., :8], w2, backend="emulate")
    with pytest.raises(ValueError, match="shapes disagree"):
        expert_ffn_grouped(x, idx[:, :, :1], gates, w1, w2, backend="emulate")
    with pytest.raises(ValueError, match="must share a dtype"):
        expert_ffn_grouped(x, idx, gates, w1, w2.astype(jnp.bfloat16), backend="emulate")
    with pytest.raises(ValueError, match="dh=40 must be a multiple"):
        xw, _, _, w1w, w2w = _jax_inputs(7, 8, 1, 2, 2, 40, 16)
        expert_ffn_grouped(xw, idx, gates, w1w, w2w, backend="emulate")


# ------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_grouped_binding_wide_experts_vs_fp32():
    """The paper's wide experts (dh = 1024, de = 256) on Triton in bf16 against the fp32 reference:
    value and the four gradients (rel < 2e-2), and bitwise-identical weight gradients over two runs."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import expert_ffn
    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    n, h, dh, de, ne, k = 4096, 1, 1024, 256, 16, 4
    ks = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(ks[0], (n, h, dh))
    idx = jnp.argsort(jax.random.uniform(ks[1], (n, h, ne)), axis=-1)[..., :k].astype(jnp.int32)
    gates = jax.nn.softmax(jax.random.normal(ks[2], (n, h, k)), axis=-1)
    w1 = jax.random.normal(ks[3], (h, ne, dh, de)) * dh ** -0.5
    w2 = jax.random.normal(ks[4], (h, ne, de, dh)) * de ** -0.5
    wy = jax.random.normal(ks[5], (n, h, dh))

    def grads(fn, dtype):
        def loss(x, g, a, b):
            return jnp.sum(fn(x, idx, g, a, b)[0].astype(jnp.float32) * wy)

        v, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x.astype(dtype), gates, w1, w2)
        return [v] + list(g)

    got = grads(lambda *a: expert_ffn_grouped(*a, backend="triton"), jnp.bfloat16)
    again = grads(lambda *a: expert_ffn_grouped(*a, backend="triton"), jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        ref = grads(lambda *a: expert_ffn(*a, impl="reference"), jnp.float32)
    for i, name in enumerate(("loss", "x", "gates", "w1", "w2")):
        assert bool(jnp.all(jnp.isfinite(got[i]))), name
        assert rel(got[i].astype(jnp.float32), ref[i]) < 2e-2, (name, rel(got[i].astype(jnp.float32), ref[i]))
    for i in (3, 4):
        assert np.array_equal(np.asarray(got[i]), np.asarray(again[i]))


@pytest.mark.parametrize("binding", ["grouped", "fused"])
def test_empty_slots_give_zero_and_match_reference(binding):
    """idx = -1 marks an empty slot (the unused tail of an expert-parallel receive buffer): no row, no
    output, no gradient. Both JAX bindings (emulate backend) against the reference, value and grads,
    with every slot of some sub-tokens empty (their output must be exactly zero)."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import expert_ffn
    from mhl_jax.moe.gpu.experts import expert_ffn_triton
    from mhl_jax.moe.gpu.grouped import expert_ffn_grouped

    x, idx, gates, w1, w2 = _jax_inputs(7, 24, 2, 2, 3, 32, 16)
    idx = np.array(idx)
    idx[5:][np.arange(24 - 5) % 3 == 0] = -1  # some slots empty
    idx[-4:] = -1  # the last 4 tokens: all slots empty, and they are the highest packed slots
    idx = jnp.asarray(idx)
    fn = ((lambda *a: expert_ffn_grouped(*a, backend="emulate")) if binding == "grouped"
          else (lambda *a: expert_ffn_triton(*a, backend="emulate")))
    wy = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape, dtype=np.float32))

    def run(f, x, gates, w1, w2):
        loss = lambda x, g, a, b: jnp.sum(f(x, idx, g, a, b)[0] * wy)  # noqa: E731
        return f(x, idx, gates, w1, w2), jax.grad(loss, argnums=(0, 1, 2, 3))(x, gates, w1, w2)

    with jax.default_matmul_precision("highest"):  # the binding and the reference in one program: one compile
        ((y, load), grads), ((y_ref, load_ref), grads_ref) = jax.jit(
            lambda *a: (run(fn, *a), run(lambda *b: expert_ffn(*b, impl="reference"), *a)))(x, gates, w1, w2)
    assert np.array_equal(np.asarray(load), np.asarray(load_ref))
    assert int(np.asarray(load).sum()) == int((np.asarray(idx) >= 0).sum())
    assert np.all(np.asarray(y[-4:]) == 0) and np.all(np.asarray(grads[0][-4:]) == 0)
    assert rel(y, y_ref) < 1e-5
    for name, a, b in zip(("x", "gates", "w1", "w2"), grads, grads_ref):
        assert rel(a, b) < 1e-5, (name, rel(a, b))
