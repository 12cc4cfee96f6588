"""The expert kernels compiled on a GPU (marker gpu): the MH-LatentMoE layer in JAX with the Triton kernels against
the PyTorch FlexAttention oracle and the pure-JAX reference; each kernel path of the binding against an fp32
reference; the Gluon kernels against float64 and the Triton ones. The Gluon bridge: tests/kernels/test_gluon_bridge.py.
"""

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.torch.experts import experts_fwd, pack_torch  # noqa: E402
from kernels.tuning import Tile, default_config  # noqa: E402
from tests.models import jax_expert_inputs  # noqa: E402
from tests.references.torch_experts import expert_inputs, rel  # noqa: E402


def _layer_jax(params, x, idx, expert_impl):
    """MH-LatentMoE layer with a given routing decision idx (N, Nh, k): x (N, d) -> W_in -> (N, Nh, dh)
    -> gates = softmax of the fp32 router scores at idx -> experts -> W_out -> (N, d)."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import expert_ffn

    w_in, w_r, bias, w1, w2, w_out = params
    n = x.shape[0]
    nh, dh = w_r.shape[0], w_r.shape[1]
    sub = jnp.dot(x, w_in.astype(x.dtype)).reshape(n, nh, dh)
    scores = jnp.einsum("nhd,hde->nhe", sub.astype(jnp.float32), w_r, precision=jax.lax.Precision.HIGHEST)
    gates = jax.nn.softmax(jnp.take_along_axis(scores, idx, axis=-1), axis=-1)
    y, _ = expert_ffn(sub, idx, gates, w1, w2, expert_impl)
    return jnp.dot(y.reshape(n, nh * dh), w_out.astype(x.dtype))


@pytest.mark.gpu
# the backward as the warp-specialised Gluon kernel on Hopper (de 256: one partial dX row per 128 de, summed by the
# binding; de 128: whole rows), packing blocks 128 (Ne 16) and 64 (Ne 128: the Triton forward converting the fp32
# weights as it loads them, at de 256 with its own tile, `ExpertsConfig.fwd_cast`)
@pytest.mark.parametrize("de,ne", [(256, 16), (128, 128)])
def test_gpu_layer_triton_vs_oracle_and_reference(de, ne, monkeypatch):
    import jax
    import jax.numpy as jnp

    import mhl_jax.moe.gpu.expert_kernels as ek

    n, d, nh, dh, k = 2048, 256, 4, 128, 4
    ks = jax.random.split(jax.random.key(0), 8)
    params = (jax.random.normal(ks[0], (d, nh * dh)) * 0.05, jax.random.normal(ks[1], (nh, dh, ne)) * 0.1,
              jax.random.normal(ks[2], (nh, ne)) * 0.01, jax.random.normal(ks[3], (nh, ne, dh, de)) * 0.08,
              jax.random.normal(ks[4], (nh, ne, de, dh)) * 0.06, jax.random.normal(ks[5], (nh * dh, d)) * 0.05)
    x = jax.random.normal(ks[6], (n, d)).astype(jnp.bfloat16)
    wy = jax.random.normal(ks[7], (n, d), jnp.float32)

    from mhl_jax.moe.router import route_topk_reference as route_topk

    # one routing decision (bf16 sub-tokens, fp32 scores) for every implementation
    sub = jnp.dot(x, params[0].astype(jnp.bfloat16)).reshape(n, nh, dh)
    idx = jax.jit(lambda s: route_topk(s, params[1], params[2], k)[1])(sub)

    def loss(params, x, impl, dtype):
        return jnp.sum(_layer_jax(params, x.astype(dtype), idx, impl).astype(jnp.float32) * wy)

    bwd_gluon = []
    real_bwd_gluon = ek._bwd_gluon
    monkeypatch.setattr(ek, "_bwd_gluon", lambda *a: bwd_gluon.append(1) or real_bwd_gluon(*a))
    res = {}
    for name, impl, dt in (("triton", "triton", jnp.bfloat16), ("reference", "reference", jnp.bfloat16),
                           ("fp32", "reference", jnp.float32)):
        with jax.default_matmul_precision("highest" if dt == jnp.float32 else "default"):
            f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
            val, grads = f(params, x, impl, dt)
        res[name] = (val, None, jax.tree.leaves(grads))
    assert len(bwd_gluon) == 1, bwd_gluon  # the Gluon backward (default at de 128 and 256; partial dX rows at 256)
    idx = np.asarray(idx)

    # the oracle, same weights and inputs, same routing decision (the binding's import_jax_triton
    # left TRITON_CACHE_DIR usable for FlexAttention's compile)
    from kernels.torch.flex_oracle import flex_expert_ffn

    dev = "cuda"
    tp = [torch.tensor(np.asarray(p), device=dev, requires_grad=True) for p in params]
    tx = torch.tensor(np.asarray(x.astype(jnp.float32)), device=dev).bfloat16().requires_grad_()
    w_in, w_r, bias, w1, w2, w_out = tp
    sub = (tx @ w_in.bfloat16()).view(n, nh, dh)
    scores = torch.einsum("nhd,hde->nhe", sub.float(), w_r)
    tidx = torch.tensor(idx, device=dev).long()
    gates = torch.softmax(scores.gather(-1, tidx), -1)
    ye = flex_expert_ffn(sub, tidx, gates, w1.bfloat16(), w2.bfloat16())
    yt = ye.reshape(n, nh * dh) @ w_out.bfloat16()
    (yt.float() * torch.tensor(np.asarray(wy), device=dev)).sum().backward()
    oracle = [tp[0].grad, tp[1].grad, tp[3].grad, tp[4].grad, tp[5].grad, tx.grad]

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    truth = res["fp32"][2]  # grads of params (w_in, w_r, bias, w1, w2, w_out) then x
    order = [0, 1, 3, 4, 5, 6]  # skip bias (no gradient)
    for name, g_list in (("triton", res["triton"][2]), ("reference", res["reference"][2])):
        for i in order:
            assert rel(g_list[i], truth[i]) < 2e-2, (name, i, rel(g_list[i], truth[i]))
    for j, i in enumerate(order):
        og = oracle[j].float().cpu().numpy()
        assert rel(og, truth[i]) < 2e-2, ("oracle", i, rel(og, truth[i]))
        assert rel(res["triton"][2][i], og) < 3e-2, ("triton-vs-oracle", i)
    assert abs(float(res["triton"][0]) - float(res["fp32"][0])) <= 2e-2 * abs(float(res["fp32"][0])) + 1e-3


@pytest.mark.gpu
# every kernel path of the binding once (on a Hopper GPU; elsewhere the Triton ones), against an fp32 reference:
# (case, de, skew, Ne: packing block 128 at Ne 16, 64 at Ne 128 / 384, 32 at Ne 1024), the config's changes
@pytest.mark.parametrize("case,de,skew,ne,change", [
    ("gluon_fwd_gluon_bwd_partials", 256, True, 16, {}),
    ("gluon_bwd_xw", 128, False, 16, {"bwd_xw": True}),
    ("cast_fwd_gluon_bwd", 256, False, 128, {}),
    ("cast_fwd_block64_mean43", 128, True, 384, {}),
    ("gluon_bwd_block32", 128, True, 1024, {}),
    ("triton_fwd_fused_bwd", 128, True, 16, {"fwd_ws": False, "bwd_ws": False}),
    ("triton_split_bwd", 256, False, 16, {"fwd_ws": False, "bwd_ws": False}),
    ("triton_split_gluon_dw", 256, False, 128, {"bwd_ws": False}),
    ("triton_rows_dw", 256, True, 1024, {"bwd_ws": False, "dw_ws": False})])
def test_gpu_expert_paths_vs_fp32(case, de, skew, ne, change):
    """The JAX binding on each kernel path the plan can pick (`plan.expert_fwd_kernel` / `expert_bwd_kernel`) against
    an fp32 reference: output and all four gradients, and bitwise-identical weight gradients across two runs."""
    import jax
    import jax.numpy as jnp

    from mhl_jax.moe.core import expert_ffn
    from mhl_jax.moe.gpu.experts import expert_ffn_triton

    n, h, dh, k = 4096, 4, 128, 4
    ks = jax.random.split(jax.random.key(de + skew), 6)
    x = jax.random.normal(ks[0], (n, h, dh)).astype(jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(ks[1], (n, h, ne)), axis=-1)[..., :k].astype(jnp.int32)
    if skew:  # one (head, expert) gets every token: a 32-block group next to near-empty ones
        idx = idx.at[:, :, 0].set(jnp.where(idx[:, :, 1:].min(-1) == 0, idx[:, :, 0], 0))
    gates = jax.nn.softmax(jax.random.normal(ks[2], (n, h, k)), axis=-1)
    w1 = jax.random.normal(ks[3], (h, ne, dh, de)) * dh ** -0.5
    w2 = jax.random.normal(ks[4], (h, ne, de, dh)) * de ** -0.5
    wy = jax.random.normal(ks[5], (n, h, dh))
    cfg = replace(default_config(n * h * k, h * ne, dh, de), **change)

    def grads(cfg, dtype=jnp.bfloat16, impl="triton"):
        def loss(x, g, a, b):
            y = (expert_ffn_triton(x, idx, g, a, b, cfg=cfg)[0] if impl == "triton"
                 else expert_ffn(x, idx, g, a, b, "reference")[0])
            return jnp.sum(y.astype(jnp.float32) * wy), y.astype(jnp.float32)

        # the output y itself, not the scalar loss: sum(y * wy) cancels (|loss| << sum |y * wy|), so its
        # relative error says nothing
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (_, y), g = f(x.astype(dtype), gates, w1, w2)
        return [y] + list(g)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    got, again = grads(cfg), grads(cfg)
    with jax.default_matmul_precision("highest"):
        ref = grads(None, jnp.float32, "reference")
    for i, name in enumerate(("y", "x", "gates", "w1", "w2")):
        assert rel(got[i], ref[i]) < 2e-2, (case, name, rel(got[i], ref[i]))
    for i in (3, 4):
        assert np.array_equal(np.asarray(got[i]), np.asarray(again[i])), case


@pytest.mark.gpu
@pytest.mark.parametrize("de,skew,programs,heads", [(256, False, None, 4), (256, True, 3, 1), (128, True, None, 1),
                                                    (128, False, 3, 4)])
def test_gpu_ws_forward_vs_triton_and_f64(de, skew, programs, heads):
    """The warp-specialised Gluon forward (torch launcher) against the Triton forward on the same packing: the
    same output rows bit for bit (same products in the same order: fp32 S over dh in k16 steps, the same gelu
    FMAs, A rounded to bf16, A W2 accumulated over de in order), padding rows zero in a NaN-poisoned output (the
    second halves of used blocks made only of padding stay NaN: never written), and within bf16 rounding
    of the float64 reference. Three programs: ~100 blocks each, so the producer's weight reuse across a group's
    blocks and its reloads at group changes both run many times. head_major: the programs take each head's blocks
    in turn (as the JAX binding launches it)."""
    from kernels.torch.experts import gluon_experts_fwd_ws

    n, h, k, ne, dh = 2048, 4, 4, 16, 128
    x, idx, gates, w1, w2 = (t.cuda() for t in expert_inputs(1, n, h, k, ne, dh, de, skew, w_scale=0.25))
    x = x.reshape(n * h, dh).bfloat16()
    w1, w2 = w1.reshape(h * ne, dh, de).bfloat16(), w2.reshape(h * ne, de, dh).bfloat16()
    cfg = default_config(n * h * k, h * ne, dh, de)
    assert cfg.pack_block == 128 and cfg.fwd_ws
    pk = pack_torch(idx, ne, cfg.pack_block)
    ref = experts_fwd(x, pk.row_slot, pk.block_group, w1, w2, k, cfg)
    out = torch.full_like(ref, float("nan"))
    gluon_experts_fwd_ws(x, pk, w1, w2, k, cfg.pack_block, programs=programs, out=out, heads=heads)
    valid = pk.row_slot >= 0
    blocks = pk.row_slot.view(-1, cfg.pack_block)
    half = cfg.pack_block // 2  # used blocks (a real first row) whose second half is padding only
    skipped = ((blocks[:, :1] >= 0) & (blocks[:, half:half + 1] < 0) &
               (torch.arange(cfg.pack_block, device="cuda") >= half)).reshape(-1)
    assert skipped.sum() >= 8 * half or skew  # (random: about every other group's last block; skew: 2048-row groups)
    assert torch.isnan(out[skipped]).all() and torch.isfinite(out[~skipped]).all()
    assert torch.equal(out[valid], ref[valid])
    assert (out[~valid & ~skipped] == 0).all()
    rows = x.double()[pk.row_slot[valid].long() // k]
    g = (torch.arange(h, device="cuda").view(1, h, 1) * ne + idx.long()).reshape(-1)[pk.row_slot[valid].long()]
    f64 = torch.einsum("re,red->rd", torch.nn.functional.gelu(
        torch.einsum("rd,rde->re", rows, w1.double()[g]), approximate="tanh"), w2.double()[g])
    assert rel(out[valid], f64) < 1e-2




@pytest.mark.gpu
def test_gpu_forward_head_major_through_jax(monkeypatch):
    """Through the JAX binding at k 8 (from `FWD_HEAD_MAJOR_MIN_K` on) the Gluon forward's programs take each
    head's blocks in turn: its launch gets the heads, and the output is bitwise the one with every program on a
    share of all heads' blocks (the same rows, each made by the same products in the same order)."""
    import jax

    import mhl_jax.moe.gpu.expert_kernels as ek
    from mhl_jax.moe.gpu.experts import expert_ffn_triton

    n, h, dh, k, ne, de = 4096, 4, 128, 8, 16, 128
    x, idx, gates, w1, w2 = jax_expert_inputs(3, n, h, dh, ne, de, k)
    cfg = default_config(n * h * k, h * ne, dh, de)
    assert cfg.fwd_ws and k >= ek.FWD_HEAD_MAJOR_MIN_K
    heads_seen = []
    real = ek._fwd_gluon
    monkeypatch.setattr(ek, "_fwd_gluon", lambda *a: heads_seen.append(a[-1]) or real(*a))
    head_major = jax.jit(lambda *a: expert_ffn_triton(*a, cfg=cfg)[0])(x, idx, gates, w1, w2)
    monkeypatch.setattr(ek, "FWD_HEAD_MAJOR_MIN_K", 1 << 30)
    all_heads = jax.jit(lambda *a: expert_ffn_triton(*a, cfg=cfg)[0])(x, idx, gates, w1, w2)
    assert heads_seen == [h, 1]
    assert np.isfinite(np.asarray(head_major, np.float32)).all()
    assert np.array_equal(np.asarray(head_major), np.asarray(all_heads))


def _bwd_inputs(seed: int, n: int, h: int, k: int, ne: int, dh: int, de: int, skew: bool):
    """CUDA inputs of the backward kernels' torch launchers: bf16 x / dy rows (n * h, dh), routing idx, fp32 gates
    (n * h * k,), bf16 W1 (h * ne, dh, de) / W2 (h * ne, de, dh)."""
    x, idx, gates, w1, w2 = (t.cuda() for t in expert_inputs(seed, n, h, k, ne, dh, de, skew, w_scale=0.25))
    dy = torch.randn(n * h, dh, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 1)).bfloat16()
    return (x.reshape(n * h, dh).bfloat16(), dy, idx, gates.reshape(-1).float().contiguous(),
            w1.reshape(h * ne, dh, de).bfloat16(), w2.reshape(h * ne, de, dh).bfloat16())


def _f64_bwd(x, dy, gates, pk, idx, w1, w2, k: int, h: int, ne: int):
    """Float64 backward of the packed expert rows from the packed assignment (every routed slot's row r of group e:
    H = x W1[e], dO = g dy, dW2[e] += gelu(H)^T dO, dW1[e] += x^T (dO W2[e]^T * gelu'(H)), dX_r = (dO W2^T *
    gelu'(H)) W1^T, dgate_r = <gelu(H) W2, dy>) -> (dW1, dW2, dX rows, dgate rows, group of each routed row); the
    rows in the order of pk.row_slot's routed entries."""
    import torch

    valid = pk.row_slot >= 0
    slot = pk.row_slot[valid].long()
    g = (torch.arange(h, device="cuda").view(1, h, 1) * ne + idx.long()).reshape(-1)[slot]
    xr, dyr, gr = x.double()[slot // k], dy.double()[slot // k], gates.double()[slot]
    (_, dh, de) = w1.shape
    ref1 = torch.zeros(h * ne, dh, de, dtype=torch.float64, device="cuda")
    ref2 = torch.zeros(h * ne, de, dh, dtype=torch.float64, device="cuda")
    dx = torch.zeros(xr.shape, dtype=torch.float64, device="cuda")
    dgate = torch.zeros(xr.shape[0], dtype=torch.float64, device="cuda")
    for e in torch.unique(g).tolist():
        m = g == e
        hid = xr[m] @ w1.double()[e]
        t = torch.tanh(0.7978845608028654 * (hid + 0.044715 * hid ** 3))
        act = 0.5 * hid * (1 + t)
        dgelu = 0.5 * (1 + t) + 0.5 * hid * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * hid * hid)
        ref2[e] = (act * gr[m, None]).T @ dyr[m]
        dh_ = (dyr[m] * gr[m, None]) @ w2.double()[e].T * dgelu
        ref1[e] = xr[m].T @ dh_
        dx[m] = dh_ @ w1.double()[e].T
        dgate[m] = ((act @ w2.double()[e]) * dyr[m]).sum(1)
    return ref1, ref2, dx, dgate, g


@pytest.mark.gpu
@pytest.mark.parametrize("ne,de,skew,programs", [(16, 256, True, None), (128, 256, False, 5), (512, 128, True, 5),
                                                 (128, 128, False, None)])
def test_gpu_ws_dw_vs_f64_and_triton(de, skew, programs, ne):
    """The warp-specialised Gluon weight gradients (torch launcher) against a float64 reference built from the packed
    assignment (every routed slot's row: H = x W1, dW2 += g gelu(H)^T dy, dW1 += x^T (g dy W2^T * gelu'(H))), and
    against the transposed Triton dW kernel on the same packing (which rounds g * dy to bf16 first, so not bitwise).
    Skewed routing leaves groups empty (their dW must come out zero: the outputs start NaN-poisoned); packing blocks
    128, 64 and 32 (Ne 16, 128, 512; the JAX binding takes the kernel at <= 64); five programs take many tiles
    each, so weight buffers and ring stages are reused many times."""
    from kernels.torch.experts import experts_dw, gluon_experts_dw_ws

    n, h, k, dh = 2048, 4, 4, 128
    x, dy, idx, gates, w1, w2 = _bwd_inputs(3, n, h, k, ne, dh, de, skew)
    cfg = default_config(n * h * k, h * ne, dh, de)
    assert cfg.pack_block == {16: 128, 128: 64, 512: 32}[ne]
    pk = pack_torch(idx, ne, cfg.pack_block)
    out = (torch.full(w1.shape, float("nan"), device="cuda"), torch.full(w2.shape, float("nan"), device="cuda"))
    dw1, dw2 = gluon_experts_dw_ws(x, dy, gates, pk, w1, w2, k, cfg.pack_block, programs=programs, out=out,
                                   heads=h)
    assert torch.isfinite(dw1).all() and torch.isfinite(dw2).all()
    ref1, ref2, _, _, g = _f64_bwd(x, dy, gates, pk, idx, w1, w2, k, h, ne)
    assert rel(dw1, ref1) < 1e-2 and rel(dw2, ref2) < 1e-2
    empty = torch.bincount(g, minlength=h * ne) == 0
    assert (dw1[empty] == 0).all() and (dw2[empty] == 0).all()
    if skew:
        assert empty.any()
    split = replace(cfg, dw=Tile(min(64, cfg.pack_block), 64, 4, 3), dw_form="t")
    t1, t2, _ = experts_dw(x, dy, gates, pk, w1, w2, k, split, torch.float32)
    assert rel(dw1, t1) < 1e-2 and rel(dw2, t2) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("ne,de,skew,programs,xw", [(16, 256, True, None, False), (128, 128, False, 5, False),
                                                    (512, 128, True, None, True), (128, 256, False, 5, True),
                                                    (16, 128, False, 5, False), (512, 256, True, None, False)])
def test_gpu_ws_fused_bwd_vs_f64_and_triton(skew, programs, de, ne, xw):
    """The warp-specialised fused backward (torch launcher): dW1, dW2, the dX rows and the gate gradients of every
    routed row (at de 256 the sums of the two tiles' partials) against the float64 reference (`_f64_bwd`) and against
    the Triton kernels on the same packing (the fused one at de 128, the dX and transposed dW kernels at 256; within
    bf16 rounding: the sums over de run in other orders). The outputs start NaN-poisoned: empty groups' dW must come
    out zero; the padding rows of the kernel's 32-row blocks that hold a group's rows dX = 0 and gate gradient 0, the
    32-row blocks made only of padding unwritten (still NaN). Packing blocks 128, 64, 32; five programs take
    many tiles each (the dH^T buffers and barriers shared by the two consumers go round many times). xw: the kernel
    with the dX warp group, which computes the same products and sums in the same order: bitwise the other kernel's
    outputs, and bitwise its own on a second run with another ring depth, weight buffering and stage count."""
    from kernels.torch.experts import experts_dw, experts_dx, gluon_experts_bwd_ws
    from kernels.tuning import GLUON_DW_BLOCK_M

    n, h, k, dh = 2048, 4, 4, 128
    x, dy, idx, gates, w1, w2 = _bwd_inputs(5, n, h, k, ne, dh, de, skew)
    cfg = default_config(n * h * k, h * ne, dh, de)
    assert cfg.pack_block == {16: 128, 128: 64, 512: 32}[ne] and (cfg.dw.block_e == de) == (de == 128)
    pk = pack_torch(idx, ne, cfg.pack_block)
    p, parts = pk.row_slot.shape[0], de // 128
    nan = float("nan")
    out = (torch.full(w1.shape, nan, device="cuda"), torch.full(w2.shape, nan, device="cuda"),
           torch.full((p, parts, dh), nan, device="cuda", dtype=torch.bfloat16),
           torch.full((p, parts), nan, device="cuda"))
    dw1, dw2, dxp, dgp = gluon_experts_bwd_ws(x, dy, gates, pk, w1, w2, k, cfg.pack_block, programs=programs,
                                              out=out, heads=h, xw=xw)
    if xw:
        base = gluon_experts_bwd_ws(x, dy, gates, pk, w1, w2, k, cfg.pack_block, programs=programs, heads=h)
        other = gluon_experts_bwd_ws(x, dy, gates, pk, w1, w2, k, cfg.pack_block, programs=programs, heads=h, xw=True,
                                     hb=2, wbuf=1, stages=4)
        for a, b, c in zip((dw1, dw2, dxp, dgp), base, other):  # where `out` was written (unwritten rows stay NaN)
            assert torch.equal(a[~a.isnan()], b[~a.isnan()]) and torch.equal(a[~a.isnan()], c[~a.isnan()])
    ref1, ref2, rdx, rdg, g = _f64_bwd(x, dy, gates, pk, idx, w1, w2, k, h, ne)
    valid = pk.row_slot >= 0
    rows = torch.arange(p, device="cuda")
    grp = pk.block_group.long()[rows // cfg.pack_block]  # -1 past the blocks in use
    gs = grp.clamp(min=0)
    local = rows - pk.group_block_start.long()[gs] * cfg.pack_block
    bm = GLUON_DW_BLOCK_M
    written = (grp >= 0) & (local < (pk.group_sizes.long()[gs] + bm - 1) // bm * bm)
    assert torch.isfinite(dw1).all() and torch.isfinite(dw2).all()
    assert torch.isfinite(dxp[written]).all() and torch.isfinite(dgp[written]).all()
    skipped = (grp >= 0) & ~written  # 32-row blocks made only of padding
    assert dxp[skipped].isnan().all() and dgp[skipped].isnan().all()
    dx, dgate = dxp.float().sum(1), dgp.sum(1)
    assert rel(dw1, ref1) < 1e-2 and rel(dw2, ref2) < 1e-2
    assert rel(dx[valid], rdx) < 1e-2 and rel(dgate[valid], rdg) < 1e-2
    pad = written & ~valid
    assert (dxp[pad] == 0).all() and (dgp[pad] == 0).all()
    empty = torch.bincount(g, minlength=h * ne) == 0
    assert (dw1[empty] == 0).all() and (dw2[empty] == 0).all()
    if skew:
        assert empty.any()
    if de == 128:
        tdx = torch.zeros(p, dh, device="cuda", dtype=torch.bfloat16)
        t1, t2, tdg = experts_dw(x, dy, gates, pk, w1, w2, k, cfg, torch.float32, tdx)
    else:
        tdx, tdg = experts_dx(x, dy, gates, pk, w1, w2, k, cfg)
        split = replace(cfg, dw=Tile(min(64, cfg.pack_block), 64, 4, 3), dw_form="t")
        t1, t2, _ = experts_dw(x, dy, gates, pk, w1, w2, k, split, torch.float32)
    assert rel(dw1, t1) < 1e-2 and rel(dw2, t2) < 1e-2
    assert rel(dx[valid], tdx[valid]) < 1e-2 and rel(dgate[valid], tdg[valid]) < 1e-2
