"""The causal flash attention kernels (kernels/triton/attention.py).

CPU: the kernels under the Triton interpreter (torch launcher) against float64 numpy: the output, the base-2 lse and
dq, dk, dv, at several tiles (many blocks per sequence, the diagonal split into sub-tiles, tiles the size of the
sequence), and the shape checks.
GPU (marker gpu): the JAX binding compiled against XLA's attention in fp32 (output and gradients, in the model's
layout, with sequences that need padding), gradients bitwise repeatable, and the jax-triton launch's output bitwise
equal to the torch launch's.
"""


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.tuning import ATTENTION_TILES, AttentionTiles  # noqa: E402
from tests.kernels.interpreted import INTERPRET, interp, interpreted  # noqa: E402

ka, kta = interpreted("kernels.triton.attention", "kernels.torch.attention")


def _inputs(seed, b, t, nh, hd):
    """bf16 q, k, v, g as torch tensors (fp32 holding the bf16 values under the interpreter, whose bf16 arithmetic
    is broken) and in float64 for the reference."""
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((b, t, nh, hd), dtype=np.float32) for _ in range(4))
    bf = [torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v, g)]
    ref = [x.float().numpy().astype(np.float64) for x in bf]
    return ([x.float() for x in bf] if INTERPRET else bf), ref


def _ref64(q, k, v, g):
    """Causal softmax attention in float64: o, lse (natural log, (B, nh, T)), and dq, dk, dv of sum(o * g)."""
    t, hd = q.shape[1], q.shape[-1]
    scale = hd ** -0.5
    s = np.einsum("bqnh,bknh->bnqk", q, k) * scale
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    p = e / e.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", p, v)
    dv = np.einsum("bnqk,bqnh->bknh", p, g)
    dp = np.einsum("bqnh,bknh->bnqk", g, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bnqk,bknh->bqnh", ds, k)
    dk = np.einsum("bnqk,bqnh->bknh", ds, q)
    return o, lse, dq, dk, dv


def _rel(a, ref):
    return float(np.max(np.abs(a.float().numpy() - ref)) / np.max(np.abs(ref)))


@interp
@pytest.mark.parametrize("t,hd,tiles", [
    (64, 16, AttentionTiles(32, 16, 4, 1, 16, 32, 16, 4, 1)),  # 2 q blocks, 2 kv sub-tiles on the diagonal
    (96, 32, AttentionTiles(32, 32, 4, 1, 16, 32, 32, 4, 1)),  # 3 blocks, square forward tiles
    (32, 16, AttentionTiles(32, 16, 4, 1, 32, 32, 16, 4, 1)),  # one block: only diagonal tiles
    (128, 32, ATTENTION_TILES),  # the model's tiles
])
def test_kernels_vs_float64(t, hd, tiles):
    """In fp32 (the interpreter's inputs) the kernels' error against float64 is ~2e-7: a tolerance of 1e-5 catches a
    factor off by 1e-3 on one block's terms."""
    (q, k, v, g), ref_in = _inputs(t + hd, 2, t, 3, hd)
    o_ref, lse_ref, *grads_ref = _ref64(*ref_in)
    o, lse = kta.attention_fwd_torch(q, k, v, tiles)
    assert _rel(o, o_ref) < 1e-5
    np.testing.assert_allclose(lse.numpy() / np.log2(np.e), lse_ref, atol=1e-5)  # stored in base 2
    grads = kta.attention_bwd_torch(q, k, v, o, lse, g, tiles)
    for name, d, d_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert _rel(d, d_ref) < 1e-5, name
    # the first query sees only the first key: its output is that value row, exactly
    assert torch.equal(o[:, 0], v[:, 0])


def _tiles(m, n, m1, n1, n2):
    return ATTENTION_TILES._replace(block_m=m, block_n=n, block_m1=m1, block_n1=n1, block_n2=n2)


@pytest.mark.parametrize("shape,tiles,message", [
    ((2, 128, 4, 48), _tiles(64, 64, 32, 64, 32), "head_dim=48 must be a power of two"),
    ((2, 96, 4, 64), _tiles(32, 32, 32, 32, 24), "block_n2=24 must be a power of two"),
    ((2, 96, 4, 64), _tiles(64, 32, 32, 32, 32), "sequence length 96 must be a multiple of block_m=64"),
    ((2, 128, 4, 64), _tiles(32, 64, 32, 64, 32), "block_n=64 must divide block_m=32"),
    ((2, 128, 4, 64), _tiles(32, 32, 64, 32, 32), "block_m1=64 and block_n2=32 must divide block_n1=32"),
    ((8, 65536, 32, 128), _tiles(64, 64, 64, 64, 32), "8 x 65536 x 32 x 128 elements per device"),
])
def test_shape_checks(shape, tiles, message):
    ka.check_shape(2, 128, 4, 64, _tiles(64, 32, 32, 64, 32))
    with pytest.raises(ValueError, match=message):
        ka.check_shape(*shape, tiles)
    with pytest.raises(ValueError, match=message):  # both launch plans check first
        ka.fwd_launch(shape, tiles)


def test_padding_to_the_tiles_is_exact(monkeypatch):
    """`flash_attention` pads T up to the tiles and cuts the output back: with XLA's attention standing in for the
    kernels' custom call (which needs a GPU), the output and the gradients at T = 5 and 40 (tile 64) are those of the
    unpadded attention, and the kernel call sees the padded length."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.model import flash_attention as fa

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    seen = []
    monkeypatch.setattr(fa, "_attention", lambda q, k, v, tiles: seen.append(q.shape[1]) or xla(q, k, v))
    for t in (5, 40):
        q, k, v, g = (jax.random.normal(key, (2, t, 2, 32)) for key in jax.random.split(jax.random.key(t), 4))
        got = jax.value_and_grad(lambda q, k, v, g: jnp.sum(fa.flash_attention(q, k, v) * g), (0, 1, 2))(q, k, v, g)
        want = jax.value_and_grad(lambda q, k, v, g: jnp.sum(xla(q, k, v) * g), (0, 1, 2))(q, k, v, g)
        assert seen[-1] == ATTENTION_TILES.tile()
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, b in zip(got[1], want[1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------- GPU


def _gpu_jax():
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU JAX backend")
    return jax


@pytest.mark.gpu
# 1000, 100, 4: padded to the tiles (4: shorter than one tile)
@pytest.mark.parametrize("b,t,nh,hd", [(2, 2048, 4, 128), (3, 1000, 2, 64), (2, 100, 2, 128), (1, 4, 2, 128)])
def test_binding_vs_xla_fp32(b, t, nh, hd):
    jax = _gpu_jax()
    import jax.numpy as jnp

    from mhl_jax.model.flash_attention import flash_attention

    q, k, v, g = (jax.random.normal(key, (b, t, nh, hd), jnp.float32) for key in jax.random.split(jax.random.key(t), 4))
    qb, kb, vb, gb = (x.astype(jnp.bfloat16) for x in (q, k, v, g))

    def loss(fn, *a):
        return jnp.sum(fn(*a).astype(jnp.float32) * gb.astype(a[0].dtype))

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.value_and_grad(lambda *a: loss(xla, *a), (0, 1, 2)))(
            *(x.astype(jnp.float32) for x in (qb, kb, vb)))
    step = jax.jit(jax.value_and_grad(lambda *a: loss(flash_attention, *a), (0, 1, 2)))
    got = step(qb, kb, vb)
    o = jax.jit(flash_attention)(qb, kb, vb).astype(jnp.float32)
    o_ref = jax.jit(xla)(*(x.astype(jnp.float32) for x in (qb, kb, vb)))
    assert float(jnp.max(jnp.abs(o - o_ref))) < 2e-2 * float(jnp.max(jnp.abs(o_ref)))
    for d, r in zip(got[1], ref[1]):
        assert float(jnp.max(jnp.abs(d.astype(jnp.float32) - r))) < 2e-2 * float(jnp.max(jnp.abs(r)))
    again = step(qb, kb, vb)
    for d, e in zip(got[1], again[1]):
        assert np.array_equal(np.asarray(d).view(np.uint16), np.asarray(e).view(np.uint16))


@pytest.mark.gpu
def test_binding_equals_torch_launch():
    jax = _gpu_jax()
    import jax.numpy as jnp

    from mhl_jax.model import flash_attention as fa

    (q, k, v, g), _ = _inputs(5, 2, 1024, 4, 128)
    tq = [x.cuda() for x in (q, k, v, g)]
    o_t, lse_t = kta.attention_fwd_torch(*tq[:3])
    grads_t = kta.attention_bwd_torch(*tq[:3], o_t, lse_t, tq[3])
    jq = [jnp.asarray(x.float().numpy()).astype(jnp.bfloat16) for x in (q, k, v, g)]
    o_j, vjp = jax.vjp(fa.flash_attention, *jq[:3])
    grads_j = vjp(jq[3])
    assert np.array_equal(o_t.cpu().view(torch.int16).numpy(), np.asarray(o_j).view(np.int16))
    # the gradients agree to their rounding only: each launcher sums delta = rowsum(o * do) its own way
    for a, b in zip(grads_t, grads_j):
        a, b = a.float().cpu().numpy(), np.asarray(b.astype(jnp.float32))
        assert np.max(np.abs(a - b)) < 1e-2 * np.max(np.abs(a))
