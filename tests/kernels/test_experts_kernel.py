"""Expert kernels (kernels/triton/experts.py, kernels/gluon/experts_*.py), their bindings and the plan's choice of them.

CPU: the Triton kernels under the interpreter (fp32 torch tensors) against a float64 reference, padding handling,
sub-block tiling, the fused dX path, both dW kernels, the converting forward, deterministic weight gradients,
dropless under skew, and the FlexAttention oracle's forward (eager path); the tuning tables and the plan's rules.
GPU (marker gpu): the MH-LatentMoE layer in JAX with the Triton kernels against the PyTorch oracle and the pure-JAX
reference; each kernel path of the binding against an fp32 reference; the Gluon kernels against float64.
"""

import os
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.torch.experts import experts_fwd, pack_torch, triton_expert_ffn  # noqa: E402
from kernels.tuning import ExpertsConfig, Tile, default_config, dgates_in_kernels  # noqa: E402
from tests.references.torch_experts import (  # noqa: E402
    check_fwd_bwd_vs_f64,
    expert_ffn_f64,
    expert_inputs,
    weight_grads_twice,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(seed, n, h, k, ne, dh, de, skew=False):
    return expert_inputs(seed, n, h, k, ne, dh, de, skew, w_scale=0.25)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# pack block, fwd / dx / dw tiles (block_m, block_e): plain, sub-blocked rows, dX fused into the row-form dW kernel
# (dw block_e = de), the transposed dW kernel alone and fused with dX (then also the gate gradients), with two row
# steps per packing block; each once, random or skewed routing
CASES = [
    ("plain", ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 16)), False),
    ("subblock", ExpertsConfig(32, Tile(16, 32), Tile(32, 16), Tile(16, 16)), True),
    ("fused_dx", ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 32)), True),
    ("t", ExpertsConfig(32, Tile(16, 32), Tile(32, 16), Tile(16, 16), dw_form="t"), False),
    ("t_fused_dx", ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 32), dw_form="t"), True),
    ("t_fused_dx_sub", ExpertsConfig(32, Tile(16, 16), Tile(16, 16), Tile(16, 32), dw_form="t"), False),
]


@pytest.mark.skipif(not INTERPRET, reason="interpreter test")
@pytest.mark.parametrize("cfg,skew", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernels_fwd_bwd_vs_float64(cfg, skew):
    x, idx, gates, w1, w2 = _inputs(0, 24, 2, 2, 3, 16, 32, skew)
    check_fwd_bwd_vs_f64(lambda *a: triton_expert_ffn(*a, cfg=cfg), x, idx, gates, w1, w2)


@pytest.mark.parametrize("dh", [128, 256])
def test_default_tiles_keep_accumulators_in_registers(dh):
    """default_config at every packing block: no kernel holds more than 128 fp32 accumulator values per
    thread (fwd / dX: BLOCK_M x DH; dW: two BLOCK_E x DH), the most the measured dh = 128 tiles hold.
    The dh = 128 tiles at DH = 256 held 256-512 and spilled (a d = 256 MoE never finished a step)."""
    for mean in (8, 16, 64, 512):
        cfg = default_config(mean * 96, 96, dh, 256)
        cfg.check(dh, 256)
        threads = lambda t: 32 * t.num_warps  # noqa: E731
        assert cfg.fwd.block_m * dh / threads(cfg.fwd) <= 128, (mean, cfg.fwd)
        assert cfg.dx.block_m * dh / threads(cfg.dx) <= 128, (mean, cfg.dx)
        assert 2 * cfg.dw.block_e * dh / threads(cfg.dw) <= 128, (mean, cfg.dw)


def test_converting_forward_tile_checked_fitted_and_launched(monkeypatch):
    """`ExpertsConfig.fwd_cast`: checked and clamped like the other tiles, and the JAX binding launches the converting
    forward at it (a recording stand-in for jax-triton) while the plain forward keeps `fwd`."""
    import types

    import jax
    import jax.numpy as jnp

    import mhl_jax.moe.gpu.expert_kernels as ek
    from mhl_jax.moe import plan

    cfg = ExpertsConfig(64, Tile(64, 64, 4, 3), Tile(64, 64), Tile(64, 64), fwd_cast=Tile(128, 512, 4, 3))
    assert cfg.fit(256).fwd_cast == Tile(64, 256, 4, 3) and cfg.fit(256).cast_tile == Tile(64, 256, 4, 3)
    with pytest.raises(ValueError, match="block_e=24"):
        replace(cfg, fwd_cast=Tile(64, 24)).check(128, 256)
    assert ExpertsConfig(64).cast_tile == ExpertsConfig(64).fwd  # unset: the forward's tile

    launches = []

    def triton_call(*args, kernel, out_shape, grid, **kw):
        launches.append((kernel.fn.__name__, grid, kw["BLOCK_M"], kw["BLOCK_E"], kw["num_warps"], kw["num_stages"]))
        shapes = out_shape if isinstance(out_shape, list) else [out_shape]
        outs = [jnp.zeros(o.shape, o.dtype) for o in shapes]
        return outs if isinstance(out_shape, list) else outs[0]

    monkeypatch.setattr(plan, "import_jax_triton", lambda: types.SimpleNamespace(triton_call=triton_call))
    cfg = replace(cfg, fwd_cast=Tile(64, 32, 4, 3))
    st = ek.Static(cfg, 4, "triton", "float32")
    meta = types.SimpleNamespace(row_slot=jnp.zeros((256,), jnp.int32), block_group=jnp.zeros((4,), jnp.int32),
                                 group_block_start=jnp.zeros((2,), jnp.int32))
    xs = jnp.zeros((64, 128), jnp.bfloat16)
    w1, w2 = jnp.zeros((2, 128, 256), jnp.float32), jnp.zeros((2, 256, 128), jnp.float32)
    jax.eval_shape(lambda: ek.fwd_triton(st, xs, meta, w1, w2, cast=True))
    jax.eval_shape(lambda: ek.fwd_triton(st, xs, meta, w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), cast=False))
    assert launches == [("expert_fwd_cast_kernel", (4,), 64, 32, 4, 3), ("expert_fwd_kernel", (4,), 64, 64, 4, 3)]


def test_default_forward_tile_at_block64():
    """The Triton forward's tile at packing block 64 (the 8192-token rows): the whole de = 128 in one chunk, 2 stages;
    64-wide chunks, 3 stages at de 256 and at block 32; the converting forward's own tile at de 256 with ~two blocks
    per group."""
    assert default_config(8192 * 8 * 8, 8 * 768, 128, 128).fwd == Tile(64, 128, 4, 2)  # mean 85
    assert default_config(8192 * 8 * 8, 8 * 1536, 128, 128).fwd == Tile(64, 128, 4, 2)  # mean 43
    assert default_config(8192 * 8 * 4, 8 * 384, 128, 256).fwd == Tile(64, 64, 4, 3)
    assert default_config(4096 * 8 * 8, 8 * 1536, 128, 128).fwd == Tile(32, 64, 4, 3)  # block 32: unchanged (fit)
    assert default_config(8192 * 8 * 4, 8 * 384, 128, 256).cast_tile == Tile(64, 32, 4, 3)
    assert default_config(8192 * 8 * 4, 8 * 768, 128, 256).cast_tile == Tile(64, 64, 4, 3)
    assert default_config(8192 * 8 * 8, 8 * 768, 128, 128).cast_tile == Tile(64, 128, 4, 2)


def test_default_config_fuses_the_de128_backward():
    """At de = 128 (packing blocks >= 32) the default backward is one kernel: the transposed dW kernel with a
    de-wide tile, which then also makes dX and the gate gradients; packing block 16 and de = 256 keep the dX and dW
    kernels apart (the row-form dW kernel below block 64)."""
    for mean in (40, 100, 512):
        cfg = default_config(mean * 96, 96, 128, 128)
        assert cfg.dw_form == "t" and cfg.dw.block_e == 128 and dgates_in_kernels(cfg, 128), (mean, cfg)
    for cfg in (default_config(8 * 96, 96, 128, 128), default_config(512 * 96, 96, 128, 256)):
        assert cfg.dw.block_e < 128, cfg
    assert default_config(8 * 96, 96, 128, 256).dw_form == "rows"
    assert default_config(20 * 96, 96, 128, 256).dw_form == "rows"


@pytest.mark.skipif(not INTERPRET, reason="interpreter test")
def test_wide_default_config_fwd_bwd_vs_float64():
    """dh = 256 with the tiles default_config picks there (8 warps, 32-wide dW chunk)."""
    x, idx, gates, w1, w2 = _inputs(3, 40, 1, 2, 3, 256, 64)
    cfg = default_config(80, 3, 256, 64)
    assert cfg.dw.block_e == 32 and cfg.fwd.num_warps == 8
    check_fwd_bwd_vs_f64(lambda *a: triton_expert_ffn(*a, cfg=cfg), x, idx, gates, w1, w2)


@pytest.mark.skipif(not INTERPRET, reason="interpreter test")
def test_fwd_writes_every_row_and_zero_padding():
    """Poisoned output: every row is written; padding rows and all-padding blocks come back zero."""
    x, idx, gates, w1, w2 = _inputs(1, 10, 2, 2, 4, 16, 16)
    cfg = ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 16))
    pk = pack_torch(idx, 4, 16)
    assert (pk.block_group == -1).any()  # the static bound leaves all-padding blocks
    out = torch.full((pk.row_slot.shape[0], 16), float("nan"))
    out = experts_fwd(x.reshape(20, 16), pk.row_slot, pk.block_group, w1.reshape(8, 16, 16),
                      w2.reshape(8, 16, 16), 2, cfg, out=out)
    assert torch.isfinite(out).all()
    assert (out[pk.row_slot < 0] == 0).all()


@pytest.mark.skipif(not INTERPRET, reason="interpreter test")
@pytest.mark.parametrize("cfg", [ExpertsConfig(32, Tile(16, 32), Tile(16, 16), Tile(16, 16)),
                                 ExpertsConfig(32, Tile(32, 32), Tile(16, 16), Tile(16, 16), fwd_cast=Tile(16, 16))],
                         ids=["subblock", "cast_tile"])
def test_fwd_cast_kernel_equals_fwd_on_cast_weights(cfg):
    """expert_fwd_cast_kernel on fp32 weights: the output rows bitwise those of expert_fwd_kernel on weights cast
    beforehand (every row, padding rows 0), and the converted weights it stores equal the cast for every group with
    rows (groups of one, two and three or more blocks, and sub-blocks), the others left unwritten."""
    from kernels.torch.experts import experts_fwd_cast

    x, _, gates, w1, w2 = _inputs(4, 80, 2, 2, 6, 16, 32)
    h, ne, dh, de = w1.shape
    # uneven groups (expert e drawn with weight 0.4 ** e, two distinct per token; the last expert never): ~75 rows
    # down to none
    weights = torch.where(torch.arange(ne) < ne - 1, 0.4 ** torch.arange(ne, dtype=torch.float64), 0.0)
    idx = torch.multinomial(weights.expand(80 * h, ne), 2, generator=torch.Generator().manual_seed(0)).reshape(80, h, 2)
    pk = pack_torch(idx, ne, cfg.pack_block)
    w1g, w2g = w1.reshape(h * ne, dh, de).float(), w2.reshape(h * ne, de, dh).float()
    xs = x.reshape(-1, dh).half()  # the interpreter's bf16 arithmetic is broken: fp16 is the compute dtype here
    # the reference at the converting forward's tile (cast_tile: 16-wide de chunks vs the plain 32 sum differently)
    ref = experts_fwd(xs, pk.row_slot, pk.block_group, w1g.half(), w2g.half(), 2, replace(cfg, fwd=cfg.cast_tile))
    out, w1c, w2c = experts_fwd_cast(xs, pk, w1g, w2g, 2, cfg)
    assert torch.equal(out, ref) and bool((out[pk.row_slot < 0] == 0).all())
    used = pk.group_sizes > 0
    assert int(pk.group_nblocks.max()) >= 3 and not bool(used.all())
    assert {1, 2} <= set(pk.group_nblocks.tolist()) and bool((pk.block_group < 0).any())
    assert torch.equal(w1c[used], w1g[used].half()) and torch.equal(w2c[used], w2g[used].half())
    assert (w1c[~used] == 0).all() and (w2c[~used] == 0).all()


@pytest.mark.skipif(not INTERPRET, reason="interpreter test")
@pytest.mark.parametrize("form", ["rows", "t"])
def test_weight_gradients_bitwise_deterministic(form):
    x, idx, gates, w1, w2 = _inputs(2, 40, 1, 2, 2, 16, 32)
    cfg = ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 16), dw_form=form)
    grads = weight_grads_twice(lambda *a: triton_expert_ffn(*a, cfg=cfg), x, idx, gates, w1, w2)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_flex_oracle_forward_eager():
    """The oracle (block mask, log(gelu+1) score_mod, lse correction) on FlexAttention's eager path."""
    from kernels.torch.flex_oracle import flex_expert_ffn

    x, idx, gates, w1, w2 = _inputs(3, 24, 2, 2, 3, 16, 32)
    with torch.no_grad():
        y = flex_expert_ffn(x.double(), idx, gates.double(), w1.double(), w2.double(), block=16, kv_block=16,
                            compiled=False)
    assert _rel(y, expert_ffn_f64(x, idx, gates, w1, w2)) < 1e-5


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
    assert (p.router, p.experts, p.experts_bwd, p.combine) == ("reference", "grouped", "grouped", "xla"), p


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


def _jax_expert_inputs(seed: int, n: int, h: int, dh: int, ne: int, de: int, k: int):
    """JAX inputs of the expert op: bf16 x (n, h, dh), k distinct experts per sub-token at random, softmax gates,
    fp32 W1 (h, ne, dh, de) / W2 (h, ne, de, dh) at unit-variance scale."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (n, h, dh)).astype(jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(ks[1], (n, h, ne)), axis=-1)[..., :k].astype(jnp.int32)
    gates = jax.nn.softmax(jax.random.normal(ks[2], (n, h, k)), axis=-1)
    w1 = jax.random.normal(ks[3], (h, ne, dh, de)) * dh ** -0.5
    w2 = jax.random.normal(ks[4], (h, ne, de, dh)) * de ** -0.5
    return x, idx, gates, w1, w2


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
    x, idx, gates, w1, w2 = _jax_expert_inputs(3, n, h, dh, ne, de, k)

    def grads():
        def loss(x, g, a, b):
            y = expert_ffn_triton(x, idx, g, a, b, cfg=cfg, backend="emulate")[0]
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, gates, w1, w2)

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


def test_tile_schedule_deals_largest_groups_evenly_head_by_head():
    """The persistent dW / backward kernels' schedule: offsets of each program's tiles, then every (group, 128 de) tile
    exactly once; each program goes through the heads in order, within a head largest
    groups first; each program's rows within a few tiles of the mean (dealt in alternating, rotated rounds), where
    striding over the tiles in group order does worse on skewed groups. The JAX schedule (the binding's) equals the
    torch launchers'."""
    import jax.numpy as jnp
    import torch

    from kernels.gluon.schedule import deal_schedule, tile_schedule_torch
    from mhl_jax.moe.gpu.expert_kernels import tile_schedule

    for t, h, p in [(6144, 8, 132), (12, 1, 4), (8, 2, 4), (3, 1, 5), (132, 4, 132), (300, 3, 132)]:
        perm, starts = deal_schedule(t, h, p)
        assert sorted(perm.tolist()) == list(range(t)) and starts[0] == 0 and starts[-1] == t and len(starts) == p + 1
    for bad in [(10, 3, 4), (12, 0, 4), (12, 2, 0)]:
        with pytest.raises(ValueError, match=f"{bad[0]} tiles, heads={bad[1]}, programs={bad[2]}"):
            deal_schedule(*bad)
    # exact small deals: rounds of alternating direction, each head's first program rotated by programs / heads
    for (t, h, p), want in {(12, 1, 4): [[0, 7, 8], [1, 6, 9], [2, 5, 10], [3, 4, 11]],
                            (16, 2, 4): [[0, 7, 10, 13], [1, 6, 11, 12], [2, 5, 8, 15], [3, 4, 9, 14]]}.items():
        perm, starts = deal_schedule(t, h, p)
        assert [perm[starts[q]:starts[q + 1]].tolist() for q in range(p)] == want, (t, h, p)
    perm, starts = deal_schedule(12, 2, 4, deal=False)  # the comparisons' strided order
    assert [perm[starts[q]:starts[q + 1]].tolist() for q in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    with pytest.raises(ValueError, match="12 groups, heads=5, programs=4"):
        tile_schedule(jnp.zeros(12, jnp.int32), 1, 5, 4)
    with pytest.raises(ValueError, match="12 groups, heads=2, programs=25"):
        tile_schedule_torch(torch.zeros(12, dtype=torch.int32), 2, 2, 25)
    rng = np.random.default_rng(0)
    heads, ne = 8, 384
    nblocks = rng.lognormal(2.0, 0.6, heads * ne).astype(np.int32)
    nblocks[::97] = 0  # empty groups: last in their head
    for nt, programs in [(2, 132), (1, 132), (2, 7)]:
        sched = tile_schedule(jnp.asarray(nblocks), nt, heads, programs)
        assert sched.dtype == jnp.int32
        assert np.array_equal(np.asarray(sched), tile_schedule_torch(torch.from_numpy(nblocks), nt, heads,
                                                                     programs).numpy())
        sched = np.asarray(sched)
        starts, tiles = sched[:programs + 1] - (programs + 1), sched[programs + 1:]
        assert sorted(tiles.tolist()) == list(range(heads * ne * nt)) and starts[0] == 0 and starts[-1] == tiles.size
        loads = np.zeros(programs)
        for q in range(programs):
            mine = tiles[starts[q]:starts[q + 1]]
            group, head = mine // nt, mine // nt // ne
            assert (np.diff(head) >= 0).all(), q  # head by head
            for hh in np.unique(head):  # within a head: largest first
                assert (np.diff(nblocks[group[head == hh]]) <= 0).all(), (q, hh)
            loads[q] = nblocks[group].sum()
        strided = np.bincount(np.arange(tiles.size) % programs, weights=np.repeat(nblocks, nt), minlength=programs)
        assert loads.max() - loads.mean() <= nblocks.max() and loads.max() < strided.max(), (nt, programs)


def test_binding_schedule_matches_launch_grid(monkeypatch):
    """The JAX binding deals the dW / backward kernels' tiles for exactly the programs it launches: with the Gluon call
    replaced by a recorder (no GPU here) and 132, 5 or 1000 SMs, the schedule argument has programs + 1 offsets that
    count from its start, the last one its length, and every (group, 128 de) tile once."""
    import jax
    import jax.numpy as jnp

    import mhl_jax.moe.gpu.expert_kernels as ek
    import mhl_jax.moe.gpu.experts as et
    from mhl_jax.moe import plan
    from mhl_jax.moe.gpu import gluon as gluon_bridge

    n, h, dh, de, ne, k = 64, 2, 128, 256, 8, 2
    cfg = default_config(n * h * k, h * ne, dh, de)
    idx = jnp.argsort(jax.random.uniform(jax.random.key(0), (n, h, ne)), axis=-1)[..., :k].astype(jnp.int32)
    _, meta = et.packed_meta(idx, ne, cfg.pack_block, cfg.pack_impl, "emulate", None, "test")
    st = ek.Static(cfg, k, "triton", "float32")
    xs = jnp.zeros((n * h, dh), jnp.bfloat16)
    gates = jnp.zeros((n * h * k,), jnp.float32)
    w1, w2 = jnp.zeros((h * ne, dh, de), jnp.bfloat16), jnp.zeros((h * ne, de, dh), jnp.bfloat16)
    calls = []

    def record(*args, kernel, out_shape, programs, **constexprs):
        calls.append((np.asarray(args[6]), programs))
        return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    monkeypatch.setattr(gluon_bridge, "gluon_call", record)
    tiles = h * ne * (de // 128)
    for sms in (132, 5, 1000):
        monkeypatch.setattr(plan, "hopper_sms", lambda sms=sms: sms)
        ek._bwd_gluon(st, xs, xs, gates, meta, w1, w2, jnp.float32, h, False)
        ek._dw_gluon(st, xs, xs, gates, meta, w1, w2, jnp.float32, h)
        for sched, programs in calls[-2:]:
            assert programs == min(sms, tiles) and sched.size == programs + 1 + tiles
            offsets = sched[:programs + 1]
            assert offsets[0] == programs + 1 and offsets[-1] == sched.size and (np.diff(offsets) >= 0).all()
            assert sorted(sched[programs + 1:].tolist()) == list(range(tiles))


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
    # the measurement probes (bench only): bits 1, 2, 4, 8, 16, 32, 64; the kernel itself at 0
    assert consts["PROBE"] == 0 and bwd_xw_constexprs(8, 128, 256, 64, probe=96)["PROBE"] == 96
    for bad in (-1, 128):
        with pytest.raises(ValueError, match=f"probe={bad}, expected 0..127"):
            bwd_xw_constexprs(8, 128, 256, 64, probe=bad)
    # 64-row blocks (a probe: they spill at the kernel's registers) must divide the packing block
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


# ------------------------------------------------------------------------------------------- GPU

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
    x, idx, gates, w1, w2 = (t.cuda() for t in _inputs(1, n, h, k, ne, dh, de, skew))
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
    assert _rel(out[valid], f64) < 1e-2




@pytest.mark.gpu
def test_gpu_forward_head_major_through_jax(monkeypatch):
    """Through the JAX binding at k 8 (from `FWD_HEAD_MAJOR_MIN_K` on) the Gluon forward's programs take each
    head's blocks in turn: its launch gets the heads, and the output is bitwise the one with every program on a
    share of all heads' blocks (the same rows, each made by the same products in the same order)."""
    import jax

    import mhl_jax.moe.gpu.expert_kernels as ek
    from mhl_jax.moe.gpu.experts import expert_ffn_triton

    n, h, dh, k, ne, de = 4096, 4, 128, 8, 16, 128
    x, idx, gates, w1, w2 = _jax_expert_inputs(3, n, h, dh, ne, de, k)
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
    x, idx, gates, w1, w2 = (t.cuda() for t in _inputs(seed, n, h, k, ne, dh, de, skew))
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
    assert _rel(dw1, ref1) < 1e-2 and _rel(dw2, ref2) < 1e-2
    empty = torch.bincount(g, minlength=h * ne) == 0
    assert (dw1[empty] == 0).all() and (dw2[empty] == 0).all()
    if skew:
        assert empty.any()
    split = replace(cfg, dw=Tile(min(64, cfg.pack_block), 64, 4, 3), dw_form="t")
    t1, t2, _ = experts_dw(x, dy, gates, pk, w1, w2, k, split, torch.float32)
    assert _rel(dw1, t1) < 1e-2 and _rel(dw2, t2) < 1e-2


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
    assert _rel(dw1, ref1) < 1e-2 and _rel(dw2, ref2) < 1e-2
    assert _rel(dx[valid], rdx) < 1e-2 and _rel(dgate[valid], rdg) < 1e-2
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
    assert _rel(dw1, t1) < 1e-2 and _rel(dw2, t2) < 1e-2
    assert _rel(dx[valid], tdx[valid]) < 1e-2 and _rel(dgate[valid], tdg[valid]) < 1e-2


def test_redirect_global_scratch_rewrites_the_one_load():
    """`gluon_bridge.redirect_global_scratch` on a hand-written PTX entry (own parameters 0..2, hidden 3 and 4): the
    hidden global-scratch load reads parameter 2 instead; no scratch needed: unchanged; a kernel declaring too little,
    or whose PTX never loads the hidden pointer, gets an error naming it."""
    from mhl_jax.moe.gpu.gluon import redirect_global_scratch

    params = ",\n".join(f"\t.param .u64 .ptr .global .align 1 k_param_{i}" for i in range(5))
    body = "ld.param.b64 \t%rd1, [k_param_0];\n\tld.param.b64 \t%rd9, [k_param_3];\n\tld.param.b64 %rd7, [k_param_3];"
    ptx = f".visible .entry k(\n{params}\n)\n{{\n\t{body}\n}}"
    assert redirect_global_scratch(ptx, "k", 0, 0) == ptx
    out = redirect_global_scratch(ptx, "k", 128, 256)
    assert "[k_param_3]" not in out and out.count("[k_param_2]") == 2 and "[k_param_0]" in out
    assert out.replace("[k_param_2]", "[k_param_3]") == ptx  # nothing else touched
    with pytest.raises(ValueError, match="k needs 128 bytes of global scratch per program .* declares 64"):
        redirect_global_scratch(ptx, "k", 128, 64)
    with pytest.raises(ValueError, match="never loads"):
        redirect_global_scratch(ptx.replace("[k_param_3]", "[k_param_1]"), "k", 128, 128)


@pytest.mark.gpu
def test_gpu_gluon_kernel_with_global_scratch():
    """A Gluon kernel that makes its TMA descriptor on the device, through jax-triton with the bridge (its global
    scratch from its last parameter, an int8 output of programs x 128 bytes): each program stores the input tile at
    its rows by TMA; the output is the tile repeated, bitwise."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU JAX backend")
    from mhl_jax.moe.gpu.gluon import gluon_call
    from tests.kernels.gluon_bridge_check import tma_store_kernel

    fn = tma_store_kernel()
    fn.mhl_global_scratch = 128
    programs = 4
    x = jnp.arange(32 * 32, dtype=jnp.float32).reshape(32, 32) / 7
    out, _ = jax.jit(lambda x: gluon_call(
        x, kernel=fn, out_shape=[jax.ShapeDtypeStruct((programs * 32, 32), jnp.float32),
                                 jax.ShapeDtypeStruct((programs * 128,), jnp.int8)],
        programs=programs, N=programs * 32))(x)
    np.testing.assert_array_equal(np.asarray(out), np.tile(np.asarray(x), (programs, 1)))


def test_gluon_bridge_routes_jax_triton_compile_and_launch():
    """`gluon_bridge.install` on a stand-in for jax-triton's internals with the real Triton compiler behind it
    (tests/kernels/gluon_bridge_check.py, in a process of its own: kernels compiled, not interpreted)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, os.path.join(root, "tests", "kernels", "gluon_bridge_check.py")], env=env,
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.stdout[-2000:], p.stderr[-3000:])
