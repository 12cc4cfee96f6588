"""The LM head's cross-entropy kernel (kernels/triton/cross_entropy.py).

CPU: the kernel under the Triton interpreter (torch launcher) against float64 numpy: nll and the logits' gradient, at
blocks that split the rows unevenly, with persistent programs taking several rows, rows of large logits (the online
softmax's rescaling), and an out-of-range target; the shape checks.
GPU (marker gpu): the JAX binding compiled against the XLA form of the same quantities, bitwise repeatable.
"""


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.tuning import XentTiles  # noqa: E402
from tests.kernels.interpreted import interp, interpreted  # noqa: E402

kx, ktx = interpreted("kernels.triton.cross_entropy", "kernels.torch.cross_entropy")


def _ref64(x, t, scale):
    """float64 nll (R,) and d = (softmax - onehot) * scale (R, V)."""
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]
    d = np.exp(x - lse[:, None])
    d[np.arange(len(t)), t] -= 1.0
    return lse - x[np.arange(len(t)), t], d * scale


@interp
@pytest.mark.parametrize("rows,v,block,programs", [(5, 1000, 256, 2), (3, 64, 64, 1), (4, 777, 128, 4),
                                                   (2, 300, 512, 1)])
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_kernel_matches_float64(rows, v, block, programs, spread):
    rng = np.random.default_rng(rows * v + int(spread))
    x = (rng.standard_normal((rows, v)) * spread).astype(np.float32)
    x[0, -1] = x.max() + 5.0  # the row's maximum in its last, partial block: the running sum is rescaled late
    t = rng.integers(0, v, rows).astype(np.int32)
    t[0] = v - 1
    scale = 1.0 / (3 * rows)
    d, nll = ktx.xent_torch(torch.from_numpy(x), torch.from_numpy(t), scale, torch.float32,
                            XentTiles(block=block, warps=4, stages=1, programs_per_sm=programs), sms=1)
    nll_ref, d_ref = _ref64(x.astype(np.float64), t, scale)
    # lse is rounded to fp32: an ulp or two of it, absolutely, in nll = lse - x_t and in exp(x - lse) (at most 1)
    ulps = 4 * 2.0**-23 * np.abs(x).max()
    np.testing.assert_allclose(nll.numpy(), nll_ref, rtol=2e-6, atol=ulps)
    np.testing.assert_allclose(d.numpy(), d_ref, rtol=2e-5, atol=ulps * scale)


@interp
def test_out_of_range_target_gives_nan():
    x = np.zeros((3, 100), np.float32)
    d, nll = ktx.xent_torch(torch.from_numpy(x), torch.tensor([3, 100, -1], dtype=torch.int32), 0.5, torch.float32,
                            XentTiles(block=64, warps=4, stages=1, programs_per_sm=1), sms=1)
    assert np.isfinite(nll[0].item()) and np.isnan(nll[1].item()) and np.isnan(nll[2].item())
    np.testing.assert_allclose(d[1:].numpy(), np.full((2, 100), 0.005, np.float32), rtol=1e-6)


@interp
def test_minus_infinity_logits():
    """-inf logits (a masked vocabulary entry) take no probability, also filling whole blocks of a row: the online
    softmax's lanes that have seen only -inf stay out of the sum."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    x[0, 5] = -np.inf
    x[1, :128] = -np.inf  # the first two 64-column blocks
    x[2, 64:] = -np.inf
    t = np.array([7, 200, 3], np.int32)
    d, nll = ktx.xent_torch(torch.from_numpy(x), torch.from_numpy(t), 0.25, torch.float32,
                            XentTiles(block=64, warps=4, stages=1, programs_per_sm=1), sms=1)
    nll_ref, d_ref = _ref64(x.astype(np.float64), t, 0.25)
    np.testing.assert_allclose(nll.numpy(), nll_ref, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(d.numpy(), d_ref, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("rows,v,tiles,match", [
    (4, 100, XentTiles(block=100), "power-of-two block"),
    (4, 100, XentTiles(block=8), "power-of-two block"),
    (0, 100, XentTiles(), "1 <= rows"),
    (4, 2**31, XentTiles(), "columns < 2\\*\\*31"),
])
def test_shape_check(rows, v, tiles, match):
    with pytest.raises(ValueError, match=match):
        kx.xent_launch(rows, v, 1.0, tiles, sms=132)


def test_launch_plan():
    grid, kw = kx.xent_launch(4096, 50304, 1 / 16384, XentTiles(block=4096, warps=8, stages=2, programs_per_sm=2),
                              sms=132)
    assert grid == (264,) and kw == dict(R=4096, V=50304, SCALE=1 / 16384, BLOCK=4096, num_warps=8, num_stages=2)
    assert kx.xent_launch(10, 50304, 1.0, XentTiles(programs_per_sm=2), sms=132)[0] == (10,)


# ---------------------------------------------------------------------------------------------------------- GPU


def _gpu_jax():
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU JAX backend")
    return jax


@pytest.mark.gpu
@pytest.mark.parametrize("rows,v", [(4096, 50304), (300, 1000), (7, 50)])
def test_binding_vs_xla(rows, v):
    """The kernel's d (bf16) and nll against the XLA form (`xla_xent`) of the same logits: d within a bf16 rounding,
    nll within fp32 roundings of lse; bitwise repeatable, and bitwise the torch launch's."""
    jax = _gpu_jax()
    import jax.numpy as jnp

    from mhl_jax.model.cross_entropy import xent_rows
    from mhl_jax.model.loss import xla_xent

    k1, k2 = jax.random.split(jax.random.key(rows))
    logits = jax.random.normal(k1, (rows, v), jnp.float32) * 4.0
    tgt = jax.random.randint(k2, (rows,), 0, v, jnp.int32)
    scale = 1.0 / (4 * rows)
    d, nll = jax.jit(lambda a, b: xent_rows(a, b, scale, jnp.bfloat16))(logits, tgt)
    d_ref, nll_ref = jax.jit(lambda a, b: xla_xent(a, b, scale, jnp.bfloat16))(logits, tgt)
    np.testing.assert_allclose(np.asarray(nll), np.asarray(nll_ref), rtol=1e-5, atol=1e-5)
    d32, r32 = np.asarray(d.astype(jnp.float32)), np.asarray(d_ref.astype(jnp.float32))
    np.testing.assert_allclose(d32, r32, rtol=2**-7, atol=1e-6 * scale)
    d2, nll2 = jax.jit(lambda a, b: xent_rows(a, b, scale, jnp.bfloat16))(logits, tgt)
    assert np.array_equal(np.asarray(d).view(np.uint16), np.asarray(d2).view(np.uint16))
    assert np.array_equal(np.asarray(nll), np.asarray(nll2))
    dt, nllt = ktx.xent_torch(torch.from_numpy(np.array(logits)).cuda(), torch.from_numpy(np.array(tgt)).cuda(),
                              scale)
    assert np.array_equal(dt.cpu().view(torch.int16).numpy(), np.asarray(d).view(np.int16))
    assert np.array_equal(nllt.cpu().numpy(), np.asarray(nll))


@pytest.mark.gpu
def test_binding_past_int32_offsets():
    """Logits of more than 2^31 elements (the kernel's offsets are int64): the last rows against XLA's form of them
    alone."""
    jax = _gpu_jax()
    import jax.numpy as jnp

    from mhl_jax.model.cross_entropy import xent_rows
    from mhl_jax.model.loss import xla_xent

    rows, v = 42800, 50304  # 2.15e9 elements
    logits = jax.random.normal(jax.random.key(0), (rows, v), jnp.float32)
    tgt = jnp.arange(rows, dtype=jnp.int32) % v
    d, nll = jax.jit(lambda a, b: xent_rows(a, b, 1.0, jnp.bfloat16))(logits, tgt)
    d_ref, nll_ref = jax.jit(lambda a, b: xla_xent(a[-8:], b[-8:], 1.0, jnp.bfloat16))(logits, tgt)
    np.testing.assert_allclose(np.asarray(nll[-8:]), np.asarray(nll_ref), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(d[-8:].astype(jnp.float32)), np.asarray(d_ref.astype(jnp.float32)),
                               rtol=2**-7, atol=1e-9)
