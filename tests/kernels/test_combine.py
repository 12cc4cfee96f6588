"""The backward's dX combine with the router's dX folded in (kernels/triton/combine.py) and the MoE core under one
custom_vjp that uses it (mhl_jax/moe/gpu/fused.py).

CPU: the kernel under the Triton interpreter against float64 numpy (partial rows, empty slots, rows not a multiple
of the block, dh not a power of 2, with and without the router term); the JAX stand-in against the same reference;
the fused MoE core (emulated kernels) against the router and expert ops apart: loss, dW_r, dW1, dW2 and the load
bitwise, dx within its rounding, and against the float64-checked reference path.
GPU (marker gpu): the same on the GPU's kernels, and the jax-triton launch bitwise equal to the torch launch.
"""


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.kernels.interpreted import interp, interpreted  # noqa: E402

(kc,) = interpreted("kernels.triton.combine")


def _case(seed, n, h, dh, ne, k, parts, empty=0.1):
    """Packed dX rows (P, parts, dh) bf16 and gate gradient rows (P, parts) fp32, with some slots empty (-1) and the
    packed order a permutation; router gates (softmax of random scores), idx (N * H, k), W_r^T (H, Ne, dh) fp32."""
    rng = np.random.default_rng(seed)
    m = n * h * k
    p = m + 13  # padding rows: never read
    rows = rng.standard_normal((p, parts, dh), dtype=np.float32)
    dgr = rng.standard_normal((p, parts), dtype=np.float32)
    slot_row = rng.permutation(p)[:m].astype(np.int32)
    slot_row[rng.random(m) < empty] = -1
    z = rng.standard_normal((n * h, k))
    gates = (np.exp(z) / np.exp(z).sum(-1, keepdims=True)).astype(np.float32)
    idx = np.stack([rng.choice(ne, k, replace=False) for _ in range(n * h)]).astype(np.int32)
    wt = rng.standard_normal((h, ne, dh), dtype=np.float32)
    return rows, dgr, slot_row, gates, idx, wt


def _ref64(rows, dgr, slot_row, gates, idx, wt, h, k, router=True):
    """dx (N * H, dh) and dv (N * H, k) in float64."""
    r = slot_row.shape[0] // k
    valid = (slot_row >= 0)[:, None]
    got = np.where(valid, rows.astype(np.float64).sum(1)[np.maximum(slot_row, 0)], 0.0)
    dx = got.reshape(r, k, -1).sum(1)
    if not router:
        return dx, None
    dg = np.where(valid, dgr.astype(np.float64).sum(1, keepdims=True)[np.maximum(slot_row, 0)], 0.0).reshape(r, k)
    g = gates.astype(np.float64)
    dv = g * (dg - (g * dg).sum(-1, keepdims=True))
    heads = np.arange(r) % h
    dx += np.einsum("rk,rkd->rd", dv, wt.astype(np.float64)[heads[:, None], idx])
    return dx, dv


def _bf16(a):
    return torch.from_numpy(a).to(torch.bfloat16)


def _launch(case, h, k, router, **kw):
    rows, dgr, slot_row, gates, idx, wt = case
    t = torch.from_numpy
    args = (t(dgr), t(gates), t(idx), t(wt)) if router else (None,) * 4
    return kc.dx_combine_torch(_bf16(rows), t(slot_row), *args, heads=h, k=k, **kw)


@interp
@pytest.mark.parametrize("n,h,dh,ne,k,parts,block_r", [
    (37, 2, 32, 12, 3, 1, 16),  # rows not a multiple of the block, k not a power of 2
    (20, 3, 24, 9, 2, 2, 8),  # dh not a power of 2, two partials per row
    (16, 2, 16, 40, 8, 1, 32),  # k 8, one program
])
@pytest.mark.parametrize("router", [True, False], ids=["router", "experts-only"])
def test_kernel_vs_float64(n, h, dh, ne, k, parts, block_r, router):
    case = _case(n + dh, n, h, dh, ne, k, parts)
    case = (_bf16(case[0]).float().numpy(),) + case[1:]  # the values the kernel sees
    tiles = kc.CombineTiles(block_r, 4)
    dx, dv = _launch(case, h, k, router, out_dtype=torch.float32, tiles=tiles)
    ref_dx, ref_dv = _ref64(*case, h, k, router)
    np.testing.assert_allclose(dx.numpy(), ref_dx, rtol=1e-5, atol=1e-5 * np.abs(ref_dx).max())
    if router:
        np.testing.assert_allclose(dv.numpy().reshape(-1, k), ref_dv, rtol=1e-5, atol=1e-6 * np.abs(ref_dv).max())
    else:
        assert dv is None
    # fixed summation order per row, whatever the block
    for other in (kc.CombineTiles(2 * block_r, 4), kc.CombineTiles(4, 4)):
        dx2, dv2 = _launch(case, h, k, router, out_dtype=torch.float32, tiles=other)
        assert np.array_equal(dx.numpy(), dx2.numpy()), other
        assert not router or np.array_equal(dv.numpy(), dv2.numpy()), other
    bf, _ = _launch(case, h, k, router, tiles=tiles)
    # rounded once to bf16 (the interpreter truncates, the GPU rounds to nearest: within one bf16 ulp)
    assert bf.dtype == torch.bfloat16
    np.testing.assert_allclose(bf.float().numpy(), dx.numpy(), rtol=2 ** -7, atol=0)
    if router:  # the gate gradients given per slot instead of per packed row: the same dv and dx
        rows, dgr, slot_row, gates, idx, wt = case
        per_slot = np.where(slot_row >= 0, dgr.sum(1)[np.maximum(slot_row, 0)], 0.0).astype(np.float32)
        dx3, dv3 = _launch((rows, per_slot, slot_row, gates, idx, wt), h, k, True, out_dtype=torch.float32,
                           tiles=tiles, dg_by_slot=True)
        if parts == 1:
            assert np.array_equal(dx3.numpy(), dx.numpy()) and np.array_equal(dv3.numpy(), dv.numpy())
        np.testing.assert_allclose(dv3.numpy().reshape(-1, k), ref_dv, rtol=1e-5, atol=1e-6 * np.abs(ref_dv).max())


def _out_ref64(rows, slot_row, gates, k):
    """The forward combine in float64: (R, dh) = sum_j gates[r, j] rows[slot_row[r K + j]] (empty slots add 0)."""
    got = np.where((slot_row >= 0)[:, None], rows.astype(np.float64)[np.maximum(slot_row, 0)], 0.0)
    return (got.reshape(-1, k, rows.shape[1]) * gates.astype(np.float64).reshape(-1, k, 1)).sum(1)


@interp
@pytest.mark.parametrize("r,dh,k,block_r", [(37 * 2, 32, 3, 16), (60, 24, 2, 8), (32, 16, 8, 32), (6, 1024, 4, 4)])
def test_out_combine_kernel_vs_float64(r, dh, k, block_r):
    """The forward's combine (`out_combine_kernel`): rows not a multiple of the block, dh not a power of 2, k 8, the
    grouped experts' width; empty slots; the same fp32 sums whatever the block; rounded once to bf16."""
    rows, _, slot_row, gates, *_ = _case(r + dh, r, 1, dh, 16, k, 1)
    rows = _bf16(rows[:, 0]).float().numpy()  # the values the kernel sees
    t = torch.from_numpy
    out = kc.out_combine_torch(t(rows).to(torch.bfloat16), t(slot_row), t(gates), k, out_dtype=torch.float32,
                               tiles=kc.CombineTiles(block_r, 4))
    ref = _out_ref64(rows, slot_row, gates, k)
    assert (slot_row < 0).any()
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    for other in (kc.CombineTiles(2 * block_r, 4), kc.CombineTiles(2, 4)):
        out2 = kc.out_combine_torch(t(rows).to(torch.bfloat16), t(slot_row), t(gates), k, out_dtype=torch.float32,
                                    tiles=other)
        assert np.array_equal(out.numpy(), out2.numpy()), other
    bf = kc.out_combine_torch(t(rows).to(torch.bfloat16), t(slot_row), t(gates), k, tiles=kc.CombineTiles(block_r, 4))
    assert bf.dtype == torch.bfloat16
    np.testing.assert_allclose(bf.float().numpy(), out.numpy(), rtol=2 ** -7, atol=0)


def test_combine_args_checked():
    with pytest.raises(ValueError, match="not a multiple of H=3"):
        kc.check_combine_args(10, 3, 16, 4, 2, 1, kc.CombineTiles())
    with pytest.raises(ValueError, match="block_r=24"):
        kc.check_combine_args(12, 3, 16, 4, 2, 1, kc.CombineTiles(24, 4))
    assert kc.combine_grid(37 * 3, kc.CombineTiles(16, 4)) == (7,)


@pytest.mark.parametrize("by_slot", [False, True], ids=["per-row", "per-slot"])
def test_jax_emulate_vs_float64(by_slot):
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.fused import dx_combine

    n, h, dh, ne, k, parts = 21, 2, 16, 10, 3, 2
    rows, dgr, slot_row, gates, idx, wt = _case(5, n, h, dh, ne, k, parts)
    ref_dx, ref_dv = _ref64(rows, dgr, slot_row, gates, idx, wt, h, k)
    if by_slot:
        dgr = np.where(slot_row >= 0, dgr.sum(1)[np.maximum(slot_row, 0)], 0.0).astype(np.float32).reshape(n, h, k)
    dx, dv = dx_combine(jnp.asarray(rows), jnp.asarray(slot_row), jnp.asarray(dgr), jnp.asarray(gates.reshape(n, h, k)),
                        jnp.asarray(idx.reshape(n, h, k)), jnp.asarray(wt), jnp.float32, kc.CombineTiles(), "emulate",
                        by_slot)
    np.testing.assert_allclose(np.asarray(dx).reshape(n * h, dh), ref_dx, rtol=1e-5, atol=1e-5 * np.abs(ref_dx).max())
    np.testing.assert_allclose(np.asarray(dv).reshape(n * h, k), ref_dv, rtol=1e-5, atol=1e-6 * np.abs(ref_dv).max())


def _fused_vs_apart(backend, n, h, dh, ne, k, de, seed=3, cfg=None, one_program=False):
    """Loss and gradients of `mhl_jax.moe.core.moe_heads_triton` on sub-tokens routed on themselves (the fused core,
    `plan.fused_core`) and on a copy of them (the router's and the experts' ops apart, XLA adding their dx): loss,
    load, dW1, dW2 bitwise, dW_r within fp32 rounding, dx within the rounding of x's dtype (and the fused core was
    traced once: for the first only). one_program: both in one jitted program (on the CPU: one compile, 40% less
    time than two)."""
    import jax
    import jax.numpy as jnp

    import mhl_jax.moe.core as mc
    from mhl_jax.moe.gpu import fused as moe_triton

    rng = np.random.default_rng(seed)  # numpy's generator: JAX's compiles a program per shape

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))

    x = jnp.asarray(rng.standard_normal((n, h, dh), dtype=np.float32).astype(jnp.bfloat16))
    w_r = normal((h, dh, ne), dh ** -0.5)
    b = normal((h, ne), 0.1)
    w1 = normal((h, ne, dh, de), dh ** -0.5)
    w2 = normal((h, ne, de, dh), de ** -0.5)
    wy = normal((n, h, dh))

    def loss(x, w_r, w1, w2, fuse):
        x_route = x if fuse else x * 1  # another array of the same values: routed apart from x
        y, load = mc.moe_heads_triton(x_route, x, w_r, b, w1, w2, k, cfg=cfg, backend=backend)
        return jnp.vdot(y.astype(jnp.float32), wy), load

    traced, real = [], moe_triton._moe
    try:
        moe_triton._moe = lambda *a: traced.append(1) or real(*a)
        grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
        if one_program:
            out = jax.jit(lambda *a: [grads(*a, fuse) for fuse in (True, False)])(x, w_r, w1, w2)
        else:
            out = [jax.jit(grads, static_argnums=4)(x, w_r, w1, w2, fuse) for fuse in (True, False)]
    finally:
        moe_triton._moe = real
    assert traced == [1]
    (l1, load1), g1 = out[0]
    (l0, load0), g0 = out[1]
    assert float(l1) == float(l0) and np.array_equal(load1, load0) and int(load1.sum()) == n * h * k
    for name, a, c in zip(("w1", "w2"), g1[2:], g0[2:]):
        assert a.dtype == c.dtype and np.array_equal(np.asarray(a), np.asarray(c)), name
    # dW_r: the same kernels fed dvalues from the combine kernel's softmax backward instead of XLA's (fp32 rounding)
    dw1, dw0 = np.asarray(g1[1]), np.asarray(g0[1])
    assert g1[1].dtype == g0[1].dtype == jnp.float32
    np.testing.assert_allclose(dw1, dw0, rtol=1e-5, atol=1e-5 * np.abs(dw0).max())
    dx1, dx0 = np.asarray(g1[0], np.float32), np.asarray(g0[0], np.float32)
    assert g1[0].dtype == jnp.bfloat16
    # one rounding against three (two bf16 terms, then their sum): within a few bf16 ulps of the row's scale
    np.testing.assert_allclose(dx1, dx0, rtol=0, atol=2 ** -6 * np.abs(dx0).max())
    assert np.mean(dx1 == dx0) > 0.5
    return g1


def test_fused_core_emulate_vs_apart():
    _fused_vs_apart("emulate", 64, 2, 32, 12, 4, 16, one_program=True)  # small: the gate gradients per slot, from XLA


def test_fused_core_emulate_vs_apart_kernel_dgates():
    """The per-packed-row branch of the fused backward (the kernels make the gate gradients, as at the GPU's shapes):
    the transposed dW form forced at a CPU-sized shape."""
    from dataclasses import replace

    from kernels.tuning import default_config, dgates_in_kernels

    n, h, dh, ne, k, de = 64, 2, 32, 12, 4, 16
    cfg = replace(default_config(n * h * k, h * ne, dh, de), dw_form="t")
    assert dgates_in_kernels(cfg, de)
    _fused_vs_apart("emulate", n, h, dh, ne, k, de, cfg=cfg, one_program=True)


@pytest.mark.gpu
@pytest.mark.parametrize("ne,k,de", [(64, 8, 128), (48, 4, 256)], ids=["k8-de128", "k4-de256-partials"])
def test_gpu_fused_core_vs_apart(ne, k, de):
    """On the GPU's kernels (Gluon expert backward; at de 256 its two dX partials per row go to the combine)."""
    _fused_vs_apart(None, 2048, 4, 128, ne, k, de)


@pytest.mark.gpu
def test_gpu_jax_launch_equals_torch_launch():
    """Both launches bitwise equal, and within bf16 rounding of float64 (k 8, two partials per row)."""
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.fused import dx_combine

    n, h, dh, ne, k, parts = 4099, 4, 128, 96, 8, 2
    case = _case(9, n, h, dh, ne, k, parts)
    rows, dgr, slot_row, gates, idx, wt = case
    rows_bf = _bf16(rows)
    tiles = kc.CombineTiles()
    dx, dv = dx_combine(jnp.asarray(rows_bf.float().numpy()).astype(jnp.bfloat16), jnp.asarray(slot_row),
                        jnp.asarray(dgr), jnp.asarray(gates.reshape(n, h, k)), jnp.asarray(idx.reshape(n, h, k)),
                        jnp.asarray(wt), jnp.bfloat16, tiles, "triton")
    t = lambda a: torch.from_numpy(a).to("cuda")  # noqa: E731
    tdx, tdv = kc.dx_combine_torch(rows_bf.to("cuda"), t(slot_row), t(dgr), t(gates), t(idx), t(wt), heads=h, k=k,
                                   tiles=tiles)
    assert np.array_equal(np.asarray(dx.astype(jnp.float32)).reshape(n * h, dh), tdx.float().cpu().numpy())
    assert np.array_equal(np.asarray(dv).reshape(-1), tdv.cpu().numpy())
    r_dx, r_dv = _ref64(rows_bf.float().numpy(), dgr, slot_row, gates, idx, wt, h, k)
    np.testing.assert_allclose(tdx.float().cpu().numpy(), r_dx, rtol=1e-2, atol=1e-2 * np.abs(r_dx).max())
    np.testing.assert_allclose(tdv.cpu().numpy().reshape(-1, k), r_dv, rtol=1e-5, atol=1e-6 * np.abs(r_dv).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dh,k", [(128, 8), (1024, 4)], ids=["heads", "grouped-width"])
def test_gpu_out_combine_binding_vs_torch_launch_and_xla(dh, k):
    """The forward combine through jax-triton (`mhl_jax.moe.gpu.experts.combine_rows`, its tiles picked from dh)
    bitwise the torch launch with the same tiles; within one bf16 rounding of XLA's combine and of float64."""
    import jax.numpy as jnp

    import mhl_jax.moe.gpu.experts as et

    n, h = 4099, 2
    rows, _, slot_row, gates, *_ = _case(11, n * h, 1, dh, 16, k, 1)
    rows_bf = _bf16(rows[:, 0])
    args = (jnp.asarray(rows_bf.float().numpy()).astype(jnp.bfloat16), jnp.asarray(slot_row),
            jnp.asarray(gates.reshape(n, h, k)))
    y = et.combine_rows(*args, jnp.bfloat16, "triton")
    y_xla = et.combine_rows(*args, jnp.bfloat16, "emulate")
    assert y.shape == y_xla.shape == (n, h, dh) and y.dtype == jnp.bfloat16
    ty = kc.out_combine_torch(rows_bf.to("cuda"), torch.from_numpy(slot_row).to("cuda"),
                              torch.from_numpy(gates).to("cuda"), k, tiles=kc.out_combine_tiles(dh))
    assert np.array_equal(np.asarray(y.astype(jnp.float32)).reshape(n * h, dh), ty.float().cpu().numpy())
    ref = _out_ref64(rows_bf.float().numpy(), slot_row, gates, k)
    got, xla = (np.asarray(a.astype(jnp.float32)).reshape(n * h, dh) for a in (y, y_xla))
    for a in (got, xla):
        np.testing.assert_allclose(a, ref, rtol=2 ** -7, atol=2 ** -7 * np.abs(ref).max())
