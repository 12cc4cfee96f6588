"""The Triton expert kernels (kernels/triton/experts.py) and their tiles (kernels/tuning.py), on the CPU.

The kernels under the interpreter (fp32 torch tensors) against a float64 reference: padding handling, sub-block
tiling, the fused dX path, both dW kernels, the converting forward, deterministic weight gradients, dropless under
skew; the FlexAttention oracle's forward (eager path); the tuning tables' rules. The plan's choice of kernels and the
JAX binding: tests/kernels/test_experts_binding.py; the compiled kernels on a GPU: tests/kernels/test_experts_gpu.py.
"""

import os
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernels.torch.experts import experts_fwd, pack_torch, triton_expert_ffn  # noqa: E402
from kernels.tuning import ExpertsConfig, Tile, default_config, dgates_in_kernels  # noqa: E402
from tests.references.torch_experts import (  # noqa: E402
    check_fwd_bwd_vs_f64,
    expert_ffn_f64,
    expert_inputs,
    rel,
    weight_grads_twice,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
    x, idx, gates, w1, w2 = expert_inputs(0, 24, 2, 2, 3, 16, 32, skew, w_scale=0.25)
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
    x, idx, gates, w1, w2 = expert_inputs(3, 40, 1, 2, 3, 256, 64, w_scale=0.25)
    cfg = default_config(80, 3, 256, 64)
    assert cfg.dw.block_e == 32 and cfg.fwd.num_warps == 8
    check_fwd_bwd_vs_f64(lambda *a: triton_expert_ffn(*a, cfg=cfg), x, idx, gates, w1, w2)


@pytest.mark.skipif(not INTERPRET, reason="interpreter test")
def test_fwd_writes_every_row_and_zero_padding():
    """Poisoned output: every row is written; padding rows and all-padding blocks come back zero."""
    x, idx, gates, w1, w2 = expert_inputs(1, 10, 2, 2, 4, 16, 16, w_scale=0.25)
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

    x, _, gates, w1, w2 = expert_inputs(4, 80, 2, 2, 6, 16, 32, w_scale=0.25)
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
    x, idx, gates, w1, w2 = expert_inputs(2, 40, 1, 2, 2, 16, 32, w_scale=0.25)
    cfg = ExpertsConfig(16, Tile(16, 16), Tile(16, 16), Tile(16, 16), dw_form=form)
    grads = weight_grads_twice(lambda *a: triton_expert_ffn(*a, cfg=cfg), x, idx, gates, w1, w2)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_flex_oracle_forward_eager():
    """The oracle (block mask, log(gelu+1) score_mod, lse correction) on FlexAttention's eager path."""
    from kernels.torch.flex_oracle import flex_expert_ffn

    x, idx, gates, w1, w2 = expert_inputs(3, 24, 2, 2, 3, 16, 32, w_scale=0.25)
    with torch.no_grad():
        y = flex_expert_ffn(x.double(), idx, gates.double(), w1.double(), w2.double(), block=16, kv_block=16,
                            compiled=False)
    assert rel(y, expert_ffn_f64(x, idx, gates, w1, w2)) < 1e-5

