"""Router kernels (kernels/triton/router.py, kernels/gluon/router.py) through their torch launchers
(kernels/torch/router.py).

CPU: the Triton kernels under the interpreter (tests/conftest.py sets it without a GPU) against the float64
reference (tests/references/router.py): indices equal except near ties (and exact ties go to the lower index), values
and gradients within fp32 tolerance; N not a multiple of the token block, Ne not a multiple of the expert block, dh
not a power of 2, k = 2..8, skewed routing over many dW blocks, clear errors.
GPU (marker gpu): the warp-specialised Gluon forward bitwise equal to the Triton one and against float64, experts
for rows with NaN scores, its caster.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels.torch.router as ktr  # noqa: E402
import kernels.triton.router as kr  # noqa: E402
from kernels.tuning import RouterTiles, router_tiles  # noqa: E402
from tests.references.router import assert_close, check_topk, grads64, router_inputs, scores64  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="interpreter test (CPU)")


# ------------------------------------------------------------------------------- CPU: the kernels

SHAPES = [  # n, h, dh, ne, k, block_n, block_e, x dtype
    (37, 2, 32, 40, 3, 16, 16, "bf16"),  # N % 16 != 0, Ne % 16 != 0, k not a power of 2
    (50, 1, 24, 24, 5, 32, 16, "fp32"),  # dh not a power of 2, fp32 x (fp32 W_r, "ieee" dots), k = 5
    (33, 2, 32, 200, 8, 16, 64, "bf16"),  # k = 8 at the model's block width
    (40, 1, 32, 7, 6, 16, 16, "bf16"),  # Ne < block_e
    (37, 2, 32, 200, 2, 16, 16, "bf16"),  # k <= 2, Ne > 128: two row tiles per program by default
]


@interp
@pytest.mark.parametrize("shape", SHAPES, ids=[f"n{s[0]}-ne{s[3]}-k{s[4]}-{s[7]}" for s in SHAPES])
def test_forward_vs_float64(shape):
    n, h, dh, ne, k, bn, be, dtype = shape
    x, w, b = router_inputs(1000 + n + ne, n, h, dh, ne)
    if dtype == "fp32":
        x = x.float()
    tiles = router_tiles(ne, k, block_n=bn, block_e=be)
    vals, idx = ktr.router_fwd(x, w, b, k, tiles)
    assert vals.dtype == torch.float32 and idx.dtype == torch.int32
    assert torch.isfinite(vals).all()
    check_topk(idx, vals, scores64(x, w), b.double().numpy(), k, max_mismatch=0.0)


@interp
@pytest.mark.parametrize("n", [37, 50])  # the last program's second tile partly / wholly past N
def test_two_row_tiles_per_program_equal_one(n):
    """row_tiles = 2 (two row tiles share each W_r block) selects bitwise what row_tiles = 1 selects."""
    assert router_tiles(768, 2).row_tiles == 2 and router_tiles(768, 4).row_tiles == 1
    h, dh, ne, k = 2, 32, 40, 3
    x, w, b = router_inputs(300 + n, n, h, dh, ne)
    one = ktr.router_fwd(x, w, b, k, router_tiles(ne, k, block_n=16, block_e=16))
    two = ktr.router_fwd(x, w, b, k, router_tiles(ne, k, block_n=16, block_e=16, row_tiles=2))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    check_topk(two[1], two[0], scores64(x, w), b.double().numpy(), k, max_mismatch=0.0)


def test_row_tiles_checked():
    with pytest.raises(ValueError, match="row_tiles=3"):
        kr.check_router_args(8, 1, 16, 16, 2, router_tiles(16, 2, row_tiles=3))


@interp
def test_exact_ties_go_to_lower_index():
    """Duplicated weight columns and bias give bit-equal biased scores: lax.top_k's order (lower index first)."""
    n, h, dh, ne, k = 19, 2, 16, 24, 5  # odd k: the 5th slot holds one of a tied pair, the lower one
    x, w, b = router_inputs(7, n, h, dh, ne // 2)
    w = torch.cat([w, w], 2)[..., torch.arange(ne).remainder(2) * (ne // 2) + torch.arange(ne) // 2]
    b = torch.cat([b, b], 1)[..., torch.arange(ne).remainder(2) * (ne // 2) + torch.arange(ne) // 2]
    # now experts 2i and 2i+1 are identical
    vals, idx = ktr.router_fwd(x, w, b, k, router_tiles(ne, k, block_n=16, block_e=16))
    idx = idx.numpy()
    assert (idx[..., 0] % 2 == 0).all() and (idx[..., 1] == idx[..., 0] + 1).all()
    assert (idx[..., 2] % 2 == 0).all() and (idx[..., 3] == idx[..., 2] + 1).all()
    assert (idx[..., 4] % 2 == 0).all()
    v = vals.numpy()
    assert np.array_equal(v[..., 0], v[..., 1]) and np.array_equal(v[..., 2], v[..., 3])
    check_topk(idx, vals, scores64(x, w), b.double().numpy(), k, max_mismatch=0.0)


@interp
def test_exact_ties_across_blocks():
    """Experts e and e + Ne/2 identical (in other expert blocks): the lower index still goes first."""
    n, h, dh, ne, k = 19, 2, 16, 48, 7
    x, w, b = router_inputs(11, n, h, dh, ne // 2)
    w, b = torch.cat([w, w], 2), torch.cat([b, b], 1)
    vals, idx = ktr.router_fwd(x, w, b, k, router_tiles(ne, k, block_n=16, block_e=16))
    idx = idx.numpy()
    assert (idx[..., 0::2] < ne // 2).all() and (idx[..., 1::2] == idx[..., 0:-1:2] + ne // 2).all()
    check_topk(idx, vals, scores64(x, w), b.double().numpy(), k, max_mismatch=0.0)


@interp
def test_bias_selects_but_values_are_raw():
    n, h, dh, ne, k = 33, 2, 32, 48, 4
    x, w, b = router_inputs(3, n, h, dh, ne, bias_scale=3.0)  # bias dominates the selection
    vals, idx = ktr.router_fwd(x, w, b, k, router_tiles(ne, k, block_n=16, block_e=16))
    s64 = scores64(x, w)
    raw_top = np.argsort(-s64, -1, kind="stable")[..., :k]
    assert (np.sort(idx.numpy(), -1) != np.sort(raw_top, -1)).any()  # the bias changed selections
    check_topk(idx, vals, s64, b.double().numpy(), k, tol=4e-6, max_mismatch=0.0)


@interp
@pytest.mark.parametrize("skew", [False, True], ids=["random", "skew"])
def test_backward_vs_float64_and_deterministic(skew):
    n, h, dh, ne, k = 45, 2, 24, 20, 3
    x, w, b = router_inputs(11, n, h, dh, ne)
    if skew:  # every token picks experts {3, 7, 12}: one group spans many dW blocks
        b = torch.full((h, ne), -50.0)
        b[:, [3, 7, 12]] = 50.0
    tiles = router_tiles(ne, k, block_n=16, block_e=16, dx_block_n=16, dw_block=16, dw_sub=16, red_block_e=16)
    _, idx = ktr.router_fwd(x, w, b, k, tiles)
    dv = torch.from_numpy(np.random.default_rng(5).standard_normal((n, h, k), dtype=np.float32))
    dx, dw = ktr.router_bwd(x, w, idx, dv, tiles, dx_dtype=torch.float32)
    dx_ref, dw_ref = grads64(x, w, idx, dv)
    assert_close(dx, dx_ref)
    assert_close(dw, dw_ref)
    if skew:
        meta = ktr.dw_metadata(idx, ne, tiles.dw_block)
        assert int(meta.group_nblk.max()) >= 3
        assert int((meta.group_size > 0).sum()) == 3 * h
    dx2, dw2 = ktr.router_bwd(x, w, idx, dv, tiles, dx_dtype=torch.float32)
    assert torch.equal(dw, dw2) and torch.equal(dx, dx2)


@interp
def test_bf16_dx_and_autograd_binding():
    n, h, dh, ne, k = 24, 2, 16, 32, 2
    x, w, b = router_inputs(21, n, h, dh, ne)
    tiles = router_tiles(ne, k, block_n=16, block_e=16, dx_block_n=16, dw_block=32, dw_sub=16, red_block_e=16)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    vals, idx = ktr.route_topk_torch(xl, wl, b, k, tiles=tiles)
    dv = torch.from_numpy(np.random.default_rng(2).standard_normal((n, h, k), dtype=np.float32))
    (vals * dv).sum().backward()
    dx_ref, dw_ref = grads64(x, w, idx, dv)
    assert xl.grad.dtype == torch.bfloat16
    assert_close(xl.grad.float(), dx_ref, rtol=1e-2)  # one bf16 rounding
    assert_close(wl.grad, dw_ref)


@interp
def test_split_bf16_is_exact():
    w = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 64, 33), dtype=np.float32))
    parts = ktr.split_bf16(w, 3)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 4, 64, 33)
    assert torch.equal(parts.double().sum(0), w.double())


@interp
@pytest.mark.parametrize("bad", ["k0", "k_gt_ne", "shape", "tile"])
def test_errors(bad):
    x, w, b = router_inputs(0, 8, 2, 16, 12)
    with pytest.raises(ValueError, match=r"k=|shapes|block_e"):
        if bad == "k0":
            ktr.router_fwd(x, w, b, 0)
        elif bad == "k_gt_ne":
            ktr.router_fwd(x, w, b, 13)
        elif bad == "shape":
            ktr.router_fwd(x, w[:, :8], b, 2)
        else:
            ktr.router_fwd(x, w, b, 8, tiles=RouterTiles(block_e=24, row_tiles=1))


def test_ws_router_shapes_checked():
    """The warp-specialised Gluon forward's shape rule and launch constants, with errors that name the values."""
    from kernels.gluon.router import ws_router_constexprs, ws_router_supported

    assert ws_router_supported(128, 384, 4) and ws_router_supported(128, 16, 8)
    for dh, ne, k in [(64, 384, 4), (128, 100, 4), (128, 384, 9), (128, 8, 9)]:
        assert not ws_router_supported(dh, ne, k)
        with pytest.raises(ValueError, match=f"dh={dh}, Ne={ne}, k={k}"):
            ws_router_constexprs(100, 8, dh, ne, k)
    c = ws_router_constexprs(81920, 8, 128, 384, 4)
    assert (c["NC"], c["NST"], c["K"], c["PARTS"], c["CAST_N"]) == (3, 2, 4, 3, 0)
    c = ws_router_constexprs(81920, 8, 128, 768, 8)  # lists of 8: two consumers with more registers
    assert (c["NC"], c["NST"], c["CONSUMER_REGS"]) == (2, 3, 200)
    c = ws_router_constexprs(81920, 8, 128, 384, 4, cast_n=1000)  # the caster fits beside two consumers only
    assert (c["NC"], c["CAST_N"]) == (2, 1000)


# ----------------------------------------------------------------------------------------------- GPU

def _gpu_setup():

    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU JAX backend")
    from mhl_jax.moe.plan import import_jax_triton

    import_jax_triton()  # keeps TRITON_CACHE_DIR usable for the torch launches after it


WS_CASES = [  # n, h, ne, k, programs, ties
    (4099, 8, 384, 4, None, False),  # three consumers; N not a multiple of the 192-row items
    (1000, 2, 64, 1, 5, False),  # k = 1 (lists of one); five programs: many items each, buffers reused in turn
    (777, 3, 1000, 3, None, False),  # Ne % 64 != 0 (masked W_r columns), k odd (lists of 4)
    (2048, 4, 1536, 8, 7, False),  # k = 8: two consumers
    (999, 2, 200, 6, None, False),  # k = 6 (lists of 8)
    (300, 2, 16, 2, None, False),  # Ne < the 64-expert block
    (1500, 2, 256, 4, None, True),  # exact ties within and across expert blocks
    (1500, 2, 256, 8, 3, True),
    (1500, 2, 768, 8, None, "trend"),  # scores rising with the expert: many candidates, blocks through the networks
]


WS_IDS = [f"n{c[0]}-ne{c[2]}-k{c[3]}-{c[5] if isinstance(c[5], str) else 'ties' if c[5] else 'rand'}"
          for c in WS_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("case", WS_CASES, ids=WS_IDS)
def test_gpu_ws_router_vs_triton_and_float64(case):
    """The warp-specialised Gluon forward (kernels/gluon/router.py) against the Triton forward (bitwise: the same
    products in the same order, the same selection) and the float64 top-k (ties to the lower index)."""
    n, h, ne, k, programs, ties = case
    x, w, b = router_inputs(n + ne + k, n, h, 128, ne)
    if ties == "trend":  # a bias rising with the expert index: each block brings many new best scores
        b += torch.linspace(0.0, 6.0, ne)[None, :]
        ties = False
    if ties:  # experts 64-127 copy 0-63 (ties across blocks), 9 copies 5 (within one thread's 16 experts), 20 and 50
        # copy 5 too (ties between the four threads of a row: their butterfly merge), same bias
        w[:, :, 64:128] = w[:, :, 0:64]
        b[:, 64:128] = b[:, 0:64]
        for e in (9, 20, 50, 73, 84, 114):
            w[:, :, e] = w[:, :, 5]
            b[:, e] = b[:, 5]
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    vals, idx = ktr.gluon_router_fwd_ws(xc, wc, bc, k, programs=programs)
    tv, ti = ktr.router_fwd(xc, wc, bc, k)
    assert torch.equal(idx, ti) and torch.equal(vals, tv)
    s64 = scores64(x, w)
    frac = check_topk(idx.cpu(), vals.cpu(), s64, b.double().numpy(), k, tol=2e-6, max_mismatch=1e-3)
    if ties:  # the ties are exact in float64 too: every row must be the stable top-k
        assert frac == 0.0
    again = ktr.gluon_router_fwd_ws(xc, wc, bc, k, programs=programs)
    assert torch.equal(again[0], vals) and torch.equal(again[1], idx)


@pytest.mark.gpu
@pytest.mark.parametrize("ne,k", [(384, 4), (768, 8), (256, 2), (200, 3), (16, 2)])
def test_gpu_ws_router_nan_scores_select_experts(ne, k):
    """NaN scores (a diverged model): which experts such a row gets is unspecified, but they are experts (indices in
    [0, Ne): the backward gathers W_r rows by them; Ne 200 and 16 leave columns of the last 64-expert block past Ne),
    the same in every run, and the rows without a NaN equal the Triton forward's. NaN in a token's x (every score of
    its rows), and in one expert's W_r column of the first and of the last 64-expert block of head 0 (that expert's
    score in every row of the head)."""
    _gpu_setup()
    n, h = 1500, 2
    x, w, b = router_inputs(ne + k + 7, n, h, 128, ne)
    x[3] = float("nan")
    x[700, 1] = float("nan")
    w[0, :, 5] = float("nan")
    w[0, 17, ne - 3] = float("nan")
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    vals, idx = ktr.gluon_router_fwd_ws(xc, wc, bc, k)
    assert bool(((idx >= 0) & (idx < ne)).all()), idx[(idx < 0) | (idx >= ne)]
    again = ktr.gluon_router_fwd_ws(xc, wc, bc, k)
    assert torch.equal(again[1], idx) and torch.equal(again[0].nan_to_num(), vals.nan_to_num())
    tv, ti = ktr.router_fwd(xc, wc, bc, k)
    clean = torch.ones(n, h, dtype=torch.bool)
    clean[3] = clean[700, 1] = clean[:, 0] = False
    clean = clean.cuda()
    assert torch.equal(idx[clean], ti[clean]) and torch.equal(vals[clean], tv[clean])


@pytest.mark.gpu
@pytest.mark.parametrize("ne,k", [(1536, 8), (296, 6), (384, 4)])
def test_gpu_ws_router_caster(ne, k):
    """The Gluon forward with the caster warp group (two consumers): the Triton forward's top-k bitwise, and the
    two fp32 arrays (the expert weights' shape at de 128; then 8008 values, not a multiple of the 1024-value chunk)
    cast to bf16 exactly as torch casts them; through JAX (`route_topk_triton(cast=)`) the same."""
    n, h = 3000, 2
    x, w, b = router_inputs(ne + k, n, h, 128, ne)
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    g = torch.Generator(device="cuda").manual_seed(k)
    c1 = torch.randn(h, ne, 128, 128, device="cuda", generator=g)
    c2 = torch.randn(h, ne, 128, 128, device="cuda", generator=g) * 1e3
    vals, idx = ktr.router_fwd(xc, wc, bc, k)
    v2, i2, o1, o2 = ktr.gluon_router_fwd_ws(xc, wc, bc, k, cast=(c1, c2))
    assert torch.equal(v2, vals) and torch.equal(i2, idx)
    assert torch.equal(o1, c1.to(torch.bfloat16)) and torch.equal(o2, c2.to(torch.bfloat16))
    odd = torch.randn(1000 * 8 + 8, device="cuda", generator=g)  # a tail past the last whole chunk
    _, _, p1, p2 = ktr.gluon_router_fwd_ws(xc, wc, bc, k, cast=(odd, -odd))
    assert torch.equal(p1, odd.to(torch.bfloat16)) and torch.equal(p2, (-odd).to(torch.bfloat16))

    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.gpu.router import route_topk_triton

    _gpu_setup()
    xj, wj, bj = (jnp.asarray(t.float().numpy()) for t in (x, w, b))
    xj = xj.astype(jnp.bfloat16)
    a1, a2 = jnp.asarray(c1.cpu().numpy()), jnp.asarray(c2.cpu().numpy())
    jv, ji, (j1, j2) = jax.jit(lambda x, w, a, c: route_topk_triton(x, w, bj, k, cast=(a, c)))(xj, wj, a1, a2)
    pv, pi = jax.jit(lambda x, w: route_topk_triton(x, w, bj, k))(xj, wj)
    assert np.array_equal(jv, pv) and np.array_equal(ji, pi)
    assert np.array_equal(j1, a1.astype(jnp.bfloat16)) and np.array_equal(j2, a2.astype(jnp.bfloat16))
