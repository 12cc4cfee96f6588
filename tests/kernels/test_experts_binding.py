"""The expert kernels' plan and JAX binding (mhl_jax/moe/plan.py, mhl_jax/moe/gpu/), on the CPU.

Which kernel the plan picks per shape and how it reports it; the shapes each Gluon kernel accepts; the binding's
partial-dX rows and gate gradients against the reference; the tile schedule against the launch grid.
"""

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.tuning import default_config, dgates_in_kernels  # noqa: E402
from tests.models import np_expert_inputs  # noqa: E402


def test_plan_picks_expert_kernels(monkeypatch):
    """`mhl_jax.moe.plan`'s rules for the fused experts: the Gluon forward / backward only for configs that ask for
    them, in bf16, on a Hopper GPU, at shapes they take (the dW kernel where the whole Gluon backward does not run);
    the converting Triton forward only on fp32 weights with nothing cast before; the emulation on backend "emulate"."""
    import jax.numpy as jnp

    from mhl_jax.moe import plan

    bf, f32 = jnp.bfloat16, jnp.float32
    big = default_config(81920 * 8 * 4, 8 * 384, 128, 256)  # packing block 128: the Gluon forward
    small = default_config(8192 * 8 * 4, 8 * 384, 128, 256)  # block 64
    fused = default_config(8192 * 8 * 8, 8 * 768, 128, 128)  # de 128: the fused backward
    wide_de = default_config(8192 * 8 * 4, 8 * 384, 128, 512)  # de 512: the split backward, Gluon dW kernel
    assert plan.expert_fwd_kernel(big, bf, f32, "emulate", False) == "emulate"
    assert plan.expert_bwd_kernel(big, bf, 128, 256, "emulate") == "emulate"
    monkeypatch.setattr(plan, "hopper_sms", lambda: 0)  # an NVIDIA GPU other than Hopper: Triton only
    assert plan.expert_fwd_kernel(big, bf, f32, "triton", False) == "triton-cast"
    assert plan.expert_fwd_kernel(big, bf, f32, "triton", True) == "triton"
    assert plan.expert_bwd_kernel(big, bf, 128, 256, "triton") == "triton-split"
    assert plan.expert_bwd_kernel(fused, bf, 128, 128, "triton") == "triton-fused"
    monkeypatch.setattr(plan, "hopper_sms", lambda: 132)
    assert plan.expert_fwd_kernel(big, bf, f32, "triton", False) == "gluon-ws"
    assert plan.expert_fwd_kernel(big, f32, f32, "triton", False) == "triton"
    assert plan.expert_fwd_kernel(small, bf, f32, "triton", False) == "triton-cast"
    assert plan.expert_fwd_kernel(small, bf, bf, "triton", False) == "triton"
    assert plan.expert_bwd_kernel(big, bf, 128, 256, "triton") == "gluon-ws-xw"  # 2.6M slots: the dX warp group
    assert plan.expert_bwd_kernel(small, bf, 128, 256, "triton") == "gluon-ws"
    assert plan.expert_bwd_kernel(fused, bf, 128, 128, "triton") == "gluon-ws"
    assert plan.expert_bwd_kernel(fused, f32, 128, 128, "triton") == "triton-fused"
    assert plan.expert_bwd_kernel(replace(fused, bwd_ws=False), bf, 128, 128, "triton") == "triton-fused"
    assert plan.expert_bwd_kernel(replace(fused, dw_form="rows"), bf, 128, 128, "triton") == "triton-fused"
    assert plan.expert_bwd_kernel(wide_de, bf, 128, 512, "triton") == "triton-split-gluon-dw"
    assert plan.expert_bwd_kernel(replace(small, bwd_ws=False), bf, 128, 256, "triton") == "triton-split-gluon-dw"
    assert plan.expert_bwd_kernel(replace(small, bwd_ws=False), f32, 128, 256, "triton") == "triton-split"
    no_gluon = replace(small, bwd_ws=False, dw_ws=False)
    assert plan.expert_bwd_kernel(no_gluon, bf, 128, 256, "triton") == "triton-split"
    assert plan.expert_bwd_kernel(replace(small, bwd_ws=False), bf, 128, 192, "triton") == "triton-split"
    assert plan.out_combine("triton", "fused") == "triton" and plan.out_combine("triton", "grouped") == "xla"
    assert plan.out_combine("emulate", "fused") == "xla"


def test_plan_for_config_reports_each_op(monkeypatch):
    """`plan_for_config`: the choices at the config's per-device micro-batch (train.micro_batch x model.context
    tokens), Gluon on Hopper said in the summary; the grouped kernels for wide experts; reference on CPU."""
    from mhl_jax.config import Config
    from mhl_jax.moe import plan

    cfg = Config()
    assert plan.plan_for_config(cfg).summary().startswith("kernels: reference")  # CPU
    monkeypatch.setattr(plan, "resolve_kernels", lambda choice: "triton")
    monkeypatch.setattr(plan, "hopper_sms", lambda: 132)
    cfg.train.micro_batch, cfg.ffn.num_experts, cfg.ffn.top_k, cfg.ffn.expert_hidden = 40, 768, 8, 128
    p = plan.plan_for_config(cfg)
    assert (p.tokens, p.router, p.experts, p.experts_fwd, p.experts_bwd, p.packing) == (
        81920, "gluon", "fused", "gluon-ws", "gluon-ws-xw", "triton/128"), p
    assert "gluon-ws" in p.summary() and p.as_dict()["experts_bwd"] == "gluon-ws-xw"
    monkeypatch.setattr(plan, "hopper_sms", lambda: 0)
    p = plan.plan_for_config(cfg)
    assert (p.router, p.experts_fwd, p.experts_bwd) == ("triton", "triton", "triton-fused"), p
    cfg.ffn.kind = "moe"
    p = plan.plan_for_config(cfg)
    assert (p.router, p.experts, p.experts_bwd, p.combine) == ("split-bf16", "grouped", "grouped", "xla"), p
    cfg.model.compute_dtype = "float32"  # the wide router's split needs bf16 x: fp32 routes with the reference
    assert plan.plan_for_config(cfg).router == "reference"


def test_ws_forward_shapes_checked_and_chosen():
    """The warp-specialised Gluon forward takes dh 128, de 128 / 256 and 128-row packing blocks; anything else
    gets a clear error from its launch arguments, and default_config turns it on exactly there."""
    from kernels.gluon.experts_fwd import fwd_constexprs
    from kernels.tuning import gluon_fwd_supported

    assert fwd_constexprs(4, 128, 256, 3072, 100, 128)["NS"] == 2
    assert fwd_constexprs(8, 128, 128, 6144, 100, 128)["NS"] == 1
    # the programs take each head's blocks in turn: the groups must split into equal heads
    assert fwd_constexprs(8, 128, 128, 6144, 100, 128)["HEADS"] == 1
    assert fwd_constexprs(8, 128, 128, 6144, 100, 128, heads=8)["HEADS"] == 8
    for bad in (0, 5):
        with pytest.raises(ValueError, match=f"heads={bad} for 6144 groups"):
            fwd_constexprs(8, 128, 128, 6144, 100, 128, heads=bad)
    for dh, de, pack in ((128, 512, 128), (256, 256, 128), (128, 256, 64)):
        assert not gluon_fwd_supported(dh, de, pack)
        with pytest.raises(ValueError, match=f"dh={dh}, de={de}, pack_block={pack}"):
            fwd_constexprs(4, dh, de, 64, 10, pack)
    assert default_config(81920 * 8 * 4, 8 * 384, 128, 256).fwd_ws  # 128-row packing blocks
    assert not default_config(8192 * 8 * 4, 8 * 384, 128, 256).fwd_ws  # 64-row packing blocks
    assert not default_config(81920 * 8 * 4, 8 * 384, 128, 512).fwd_ws


def test_binding_sums_partial_dx_rows_and_gate_gradients(monkeypatch):
    """The Gluon backward at de > 128 returns one dX row and gate gradient per 128-de tile, (P, parts, dh) and
    (P, parts); the binding must sum the parts with the k slots. Here the emulated kernels' outputs are split into
    two exact halves (bf16 / fp32 halving is exact): x and gates gradients as with whole rows, weight gradients
    bitwise the same."""
    import jax
    import jax.numpy as jnp

    import mhl_jax.moe.gpu.expert_kernels as ek
    from mhl_jax.moe.gpu.experts import expert_ffn_triton

    n, h, dh, de, ne, k = 64, 2, 16, 32, 4, 2
    cfg = default_config(n * h * k, h * ne, dh, de)  # the transposed dW kernel: the kernels make the dgates
    assert cfg.dw_form == "t" and dgates_in_kernels(cfg, de)
    x, idx, gates, w1, w2 = np_expert_inputs(3, n, h, dh, ne, de, k)

    def grads():  # jitted: one compile, not one per eager op (the backward is traced with the _bwd_emulate of now)
        def loss(x, g, a, b):
            y = expert_ffn_triton(x, idx, g, a, b, cfg=cfg, backend="emulate")[0]
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, gates, w1, w2)

    whole = grads()
    real = ek._bwd_emulate

    def halves(*a):
        dx, dw1, dw2, dg = real(*a)
        assert dg is not None
        return jnp.stack([dx * 0.5, dx * 0.5], axis=1), dw1, dw2, jnp.stack([dg * 0.5, dg * 0.5], axis=1)

    monkeypatch.setattr(ek, "_bwd_emulate", halves)
    parts = grads()
    for name, a, b in zip(("x", "gates"), whole[:2], parts[:2]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-6,
                                   err_msg=name)
    assert float(jnp.abs(whole[1] - parts[1]).max()) <= 1e-6  # the gate gradients: fp32 throughout
    for a, b in zip(whole[2:], parts[2:]):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_binding_schedule_matches_launch_grid(monkeypatch):
    """The JAX binding deals the dW / backward kernels' tiles for exactly the programs it launches: with the Gluon call
    replaced by a recorder (no GPU here) and 132, 5 or 1000 SMs, the schedule argument has programs + 1 item offsets
    and its items give every (group, 128 de) tile's row blocks (the chunk sum after it stubbed too)."""
    import jax
    import jax.numpy as jnp

    import mhl_jax.moe.gpu.expert_kernels as ek
    import mhl_jax.moe.gpu.experts as et
    from kernels.gluon.schedule import EXTRA_CHUNKS_PER_PROGRAM
    from mhl_jax.moe import plan
    from mhl_jax.moe.gpu import gluon as gluon_bridge

    n, h, dh, de, ne, k = 64, 2, 128, 256, 8, 2
    cfg = default_config(n * h * k, h * ne, dh, de)
    idx = np_expert_inputs(0, n, h, dh, ne, de, k)[1]
    meta = jax.jit(et.expert_packing, static_argnums=(1, 2, 3, 4, 5, 6))(idx, ne, cfg.pack_block, cfg.pack_impl,
                                                                        "emulate", None, "test")
    st = ek.Static(cfg, k, "triton", "float32")
    xs = jnp.zeros((n * h, dh), jnp.bfloat16)
    gates = jnp.zeros((n * h * k,), jnp.float32)
    w1, w2 = jnp.zeros((h * ne, dh, de), jnp.bfloat16), jnp.zeros((h * ne, de, dh), jnp.bfloat16)
    calls = []

    def record(*args, kernel, out_shape, programs, **constexprs):
        calls.append((np.asarray(args[4]), programs, constexprs["BLOCK_M"]))
        return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    monkeypatch.setattr(gluon_bridge, "gluon_call", record)
    monkeypatch.setattr(ek, "_add_chunks", lambda sched, parts, dw1, dw2, *a: (dw1, dw2))
    tiles = h * ne * (de // 128)
    for sms in (132, 5, 1000):
        monkeypatch.setattr(plan, "hopper_sms", lambda sms=sms: sms)
        ek._bwd_gluon(st, xs, xs, gates, meta, w1, w2, jnp.float32, h, False)
        ek._dw_gluon(st, xs, xs, gates, meta, w1, w2, jnp.float32, h)
        for sched, programs, bm in calls[-2:]:
            m = tiles + EXTRA_CHUNKS_PER_PROGRAM * programs  # the layout of kernels.gluon.schedule
            assert programs == min(sms, tiles) and sched.size == programs + 1 + 4 * m + 3 * (m - tiles)
            offsets = sched[:programs + 1]
            assert offsets[0] == 0 and tiles <= offsets[-1] <= m and (np.diff(offsets) >= 0).all()
            items = sched[programs + 1:programs + 1 + 4 * m].reshape(m, 4)[:offsets[-1]]
            blocks = np.zeros(tiles, int)
            np.add.at(blocks, items[:, 0], items[:, 2])
            assert (blocks == np.repeat(-(-np.asarray(meta.group_sizes) // bm), de // 128)).all()


def test_ws_bwd_shapes_checked():
    """The warp-specialised fused backward takes dh 128, de a multiple of 128 and packing blocks of >= 32 rows;
    anything else gets a clear error naming the shape from its launch arguments."""
    from kernels.gluon.experts_bwd_fused import bwd_ws_constexprs, bwd_xw_constexprs
    from kernels.tuning import gluon_bwd_supported

    consts = bwd_ws_constexprs(8, 128, 128, 64)
    assert consts["BLOCK_M"] == 32 and consts["DE"] == 128 and consts["NST"] >= 2
    for dh, de, pack in ((128, 192, 64), (256, 128, 64), (128, 128, 16)):
        assert not gluon_bwd_supported(dh, de, pack)
        with pytest.raises(ValueError, match=f"dh={dh}, de={de}, pack_block={pack}"):
            bwd_ws_constexprs(8, dh, de, pack)
        with pytest.raises(ValueError, match=f"dh={dh}, de={de}, pack_block={pack}"):
            bwd_xw_constexprs(8, dh, de, pack)
    # the kernel with the dX warp group: three worker register counts, a dH^T ring of at least two slots
    consts = bwd_xw_constexprs(8, 128, 256, 64)
    assert (consts["HB"], consts["DX_REGS"], consts["BLOCK_M"]) == (3, 64, 32)
    for bad in (dict(regs=(232, 40)), dict(hb=1)):
        with pytest.raises(ValueError, match="three worker register counts .* hb >= 2"):
            bwd_xw_constexprs(8, 128, 256, 64, **bad)
    # 64-row blocks (a tile sweep's: they spill at the kernel's registers) must divide the packing block
    assert bwd_xw_constexprs(8, 128, 256, 128, block_m=64)["BLOCK_M"] == 64
    with pytest.raises(ValueError, match="pack_block=32, block_m=64"):
        bwd_xw_constexprs(8, 128, 256, 32, block_m=64)


def test_ws_dw_shapes_checked_and_chosen():
    """The warp-specialised Gluon dW kernel takes dh 128, de a multiple of 128 and packing blocks of >= 32 rows (a
    multiple of its 32-row blocks); anything else gets a clear error from its launch arguments. default_config
    turns it on for the split backward where it takes the shape at packing blocks <= 64 (where it was measured
    faster in the layer); de 128 keeps the fused backward."""
    from kernels.gluon.experts_bwd import dw_ws_constexprs

    assert dw_ws_constexprs(4, 128, 256, 64)["BLOCK_M"] == 32
    for dh, de, pack in ((128, 192, 128), (256, 256, 128), (128, 256, 16)):
        with pytest.raises(ValueError, match=f"dh={dh}, de={de}, pack_block={pack}"):
            dw_ws_constexprs(4, dh, de, pack)
    # (tokens, Ne, k, de) -> (packing block, dw_ws, fused backward, fused backward on Gluon, with the dX warp group:
    # from 2M slots on, the 81920-token rows where it was measured faster)
    expected = {(81920, 384, 4, 256): (128, False, False, True, True),
                (81920, 768, 8, 128): (128, False, True, True, True),
                (81920, 384, 4, 512): (128, False, False, False, False),
                (8192, 384, 4, 256): (64, True, False, True, False),
                (8192, 768, 8, 128): (64, False, True, True, False),
                (8192, 768, 4, 256): (64, True, False, True, False),
                (8192, 1536, 8, 128): (64, False, True, True, False),
                (4096, 768, 4, 256): (32, True, False, True, False),
                (8192, 384, 4, 512): (64, True, False, False, False)}
    for (tokens, ne, k, de), want in expected.items():
        cfg = default_config(tokens * 8 * k, 8 * ne, 128, de)
        got = (cfg.pack_block, cfg.dw_ws, cfg.dw.block_e == de, cfg.bwd_ws, cfg.bwd_xw)
        assert got == want, (tokens, ne, k, de, cfg)
    assert not default_config(8192 * 8 * 4, 8 * 384, 256, 256).dw_ws  # wide experts: the grouped kernels' tiles


