"""Tuning tables: the tiles and thresholds each kernel runs with, per shape, as measured on Hopper GPUs.

Kernel files hold the kernels; this module holds the numbers that pick their tiles, so a retune touches one file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

# ---------------------------------------------------------------------------------------------- expert kernels
# Vocabulary first (the launch shapes the tables hand out), then the tables: which packing block, which tiles and
# which of the warp-specialised Gluon kernels a shape gets. The kernels check the shapes they take; the plan
# (`mhl_jax.moe.plan`) reads these configs to say which kernel runs.


@dataclass(frozen=True)
class Tile:
    """Launch shape of one fused expert kernel: rows per program step, DE chunk, warps, software-pipeline depth."""

    block_m: int = 64
    block_e: int = 64
    num_warps: int = 4
    num_stages: int = 2


DW_FORMS = ("rows", "t")  # expert_dw_kernel | expert_dwt_kernel
PACK_IMPLS = ("argsort", "triton")  # the JAX key sort (mhl_jax.moe.packing) | kernels/triton/packing.py


def check_blocks(dh: int, de: int, pack_block: int, block_m: int, block_e: int) -> None:
    """Shape rules of the fused kernels (powers of two for tl.arange, tiles that divide DE and PACK_BLOCK)."""
    for name, v in (("dh", dh), ("pack_block", pack_block), ("block_m", block_m), ("block_e", block_e)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"expert kernels: {name}={v} must be a power of two >= 16")
    if pack_block % block_m:
        raise ValueError(f"expert kernels: block_m={block_m} must divide the packing block {pack_block}")
    if de % block_e:
        raise ValueError(f"expert kernels: de={de} must be a multiple of block_e={block_e}")


@dataclass(frozen=True)
class ExpertsConfig:
    """Packing row block and the tiles of the fused expert kernels (forward, its converting form's own where
    `fwd_cast` is set, dX, dW). dw.block_e == de fuses dX into the dW kernel. dw_form: which dW kernel ("rows":
    `expert_dw_kernel`, "t": the transposed `expert_dwt_kernel`); pack_impl: the packing ("argsort": the
    JAX key sort; "triton": kernels/triton/packing.py, emulated runs sort in JAX)."""

    pack_block: int = 128
    fwd: Tile = Tile(128, 64, 8, 2)
    dx: Tile = Tile(128, 64, 8, 2)
    dw: Tile = Tile(64, 64, 8, 2)
    dw_form: str = "rows"
    pack_impl: str = "argsort"
    # the forward as the warp-specialised Gluon kernel (kernels/gluon/experts_fwd.py) where it runs in bf16 on a
    # Hopper GPU (`gluon_fwd_supported` shapes)
    fwd_ws: bool = False
    # the converting forward's tile (`expert_fwd_cast_kernel`, fp32 weights converted as loaded); None: `fwd`'s
    fwd_cast: Tile | None = None
    # a split backward's weight gradients by the warp-specialised Gluon dW kernel (bf16, Hopper,
    # `gluon_dw_supported` shapes) where the whole Gluon backward does not run
    dw_ws: bool = False
    # the whole backward (dX rows, gate and weight gradients) as the warp-specialised Gluon kernel (bf16, Hopper,
    # `gluon_bwd_supported` shapes, gate gradients made in the kernels): in place of the fused Triton kernel at de =
    # 128 and of the split backward above (one partial dX row per 128 de, summed by the combine)
    bwd_ws: bool = False
    # with bwd_ws: the Gluon backward with a fourth warp group for the dX rows and gate gradients (same outputs)
    bwd_xw: bool = False

    def check(self, dh: int, de: int) -> None:
        for t in (self.fwd, self.cast_tile, self.dx, self.dw):
            check_blocks(dh, de, self.pack_block, min(t.block_m, self.pack_block), min(t.block_e, de))
        if self.dw_form not in DW_FORMS or self.pack_impl not in PACK_IMPLS:
            raise ValueError(f"expert kernels: dw_form={self.dw_form!r} (one of {DW_FORMS}), "
                             f"pack_impl={self.pack_impl!r} (one of {PACK_IMPLS})")

    def fit(self, de: int) -> ExpertsConfig:
        """Clamp tiles to the packing block and to de (small shapes in tests)."""
        def f(t: Tile) -> Tile:
            return Tile(min(t.block_m, self.pack_block), min(t.block_e, de), t.num_warps, t.num_stages)

        return replace(self, fwd=f(self.fwd), dx=f(self.dx), dw=f(self.dw),
                       fwd_cast=self.fwd_cast and f(self.fwd_cast))

    @property
    def cast_tile(self) -> Tile:
        """The converting forward's tile: `fwd_cast`, else `fwd`'s."""
        return self.fwd_cast or self.fwd


def dgates_in_kernels(cfg: ExpertsConfig, de: int) -> bool:
    """Whether a backward kernel also makes the gate gradients (DGATES): the dX kernel, or the transposed dW kernel
    when dX is fused into it (its programs then hold all of de for their rows). Else (dX fused into the row-form dW
    kernel) the binding reduces the kept output rows against dy."""
    return cfg.dw.block_e != de or cfg.dw_form == "t"


# Shapes the warp-specialised Gluon expert kernels take (and were measured at). The forward: dh 128, 128-row packing
# blocks (two 64-row consumer halves), de 128 or 256 (all of the weight chunks resident). The dW kernel and the whole
# backward: dh 128, tiles of 128 de, packing blocks of at least GLUON_DW_BLOCK_M rows.
GLUON_DW_BLOCK_M = 32  # the dW / backward kernels' row blocks: 64-row ones need ~250 registers a consumer and spill


def gluon_fwd_supported(dh: int, de: int, pack_block: int) -> bool:
    return dh == 128 and pack_block == 128 and de in (128, 256)


def gluon_dw_supported(dh: int, de: int, pack_block: int) -> bool:
    return dh == 128 and de % 128 == 0 and pack_block >= GLUON_DW_BLOCK_M


gluon_bwd_supported = gluon_dw_supported  # the fused backward has the dW kernel's tiles and ring

# The warp-specialised kernels' launch tables (H100, kernels alone): register budgets per partition (consumers,
# producer[, dX warp group]), the maxnreg they launch with, ring depths and weight buffers.
GLUON_FWD_BLOCK_E = 128  # de chunk; DE / 128 ring slots, each keeping its chunk
GLUON_FWD_REGS, GLUON_MAXNREG = (208, 88), 168
GLUON_DW_STAGES, GLUON_DW_WBUF, GLUON_DW_REGS = 6, 2, (240, 32)
GLUON_BWD_STAGES, GLUON_BWD_WBUF, GLUON_BWD_REGS = 3, 2, (232, 40)
# with the dX warp group: 16 warps, launched at maxnreg 128; the default consumer gets 512 - the workers' sum. At 56
# registers for the dX warp group ptxas serialises every wgmma of the kernel
GLUON_XW_STAGES, GLUON_XW_WBUF, GLUON_XW_HB, GLUON_XW_REGS, GLUON_XW_MAXNREG = 3, 2, 3, (208, 32, 64), 128

# Smallest packing block where the fused de = 128 Triton backward (dX and the gate gradients in the transposed dW
# kernel) beats the dX and dW kernels apart.
FUSED_BWD_MIN_PACK = 32
# Largest packing block where a split backward takes the Gluon dW kernel: at 128 the layer measured it slower.
DW_WS_MAX_PACK = 64
# Largest de where the Gluon backward (one partial dX row per 128 de) replaces the split one (measured at 256 only).
BWD_WS_WIDE_MAX_DE = 256
# Fewest routed slots where the Gluon backward runs with its dX warp group: level or ahead from 81920 tokens of the
# layer table on, behind at 8192; at the 2.2B step's 16384 tokens 3% behind on random routing, level on skewed
# (ahead only on collapsed routing: bench.tools.expert_bwd).
BWD_XW_MIN_SLOTS = 1 << 21
# Fewest mean rows per group where the packing block is 64 (32 below): at a mean of ~43 most groups take two 32-row
# blocks anyway, so the padding barely grows while the blocks halve.
PACK64_MIN_MEAN = 32
# Fewest mean rows per group where the converting forward takes 32-wide de chunks at packing block 64, de 256.
CAST_E32_MIN_MEAN = 64
# From k = FWD_HEAD_MAJOR_MIN_K on, the Gluon forward's programs take each head's row blocks in turn (all programs
# gather one head's x rows at a time, from L2); below it each program takes a contiguous share of all heads' blocks,
# keeping its weights across more of a group's blocks (faster at k 4).
FWD_HEAD_MAJOR_MIN_K = 8
# The router's Gluon kernel casts the fp32 expert weights to bf16 beside the selection (instead of an XLA pass) where
# the router runs long enough to hide the cast: its time grows as N x H x Ne, the cast's as H x Ne x dh x de, so from
# N >= ROUTER_CAST_MIN_TOKENS_PER_WEIGHT x dh x de tokens on (gains measured at 2.5 and 5 dh de, losses at 0.5).
ROUTER_CAST_MIN_TOKENS_PER_WEIGHT = 2


def experts_pack_block(num_slots: int, num_groups: int) -> int:
    """The packing block from the mean rows per group (padding waste ~ block / 2 per group)."""
    mean = num_slots / max(num_groups, 1)
    return 128 if mean >= 384 else 64 if mean >= PACK64_MIN_MEAN else 32 if mean >= 12 else 16


def default_config(num_slots: int, num_groups: int, dh: int, de: int) -> ExpertsConfig:
    """The fused expert kernels' config for num_slots routed slots over num_groups (head, expert) groups: the
    packing block from the mean rows per group, tiles that keep the accumulators in registers on Hopper, and the
    Gluon kernels where they take the shape. dh > 128: `wide_config`."""
    mean = num_slots / max(num_groups, 1)
    pack = experts_pack_block(num_slots, num_groups)
    if dh > 128:
        return wide_config(pack, de)
    fused_bwd = de == 128 and pack >= FUSED_BWD_MIN_PACK
    gluon_dw = not fused_bwd and gluon_dw_supported(dh, de, pack) and pack <= DW_WS_MAX_PACK
    gluon_bwd = gluon_bwd_supported(dh, de, pack) and (fused_bwd or de <= BWD_WS_WIDE_MAX_DE)
    form = "t" if pack >= 64 or fused_bwd else "rows"
    pack_impl = "triton" if pack >= 64 else "argsort"  # the Triton packing where it was measured faster
    # dX kernel: 64-row blocks, 32-wide de chunks (168 registers, 80 KB of shared memory: two programs per SM)
    dx = Tile(64, 32, 4, 3)
    # de = 128: one backward kernel (8 warps, each warp group 64 of the 128 de rows); fit clamps rows to the block
    fused = Tile(64, 128, 8, 3) if fused_bwd else None
    common = dict(dw_form=form, pack_impl=pack_impl, dw_ws=gluon_dw, bwd_ws=gluon_bwd,
                  bwd_xw=gluon_bwd and num_slots >= BWD_XW_MIN_SLOTS)
    if pack >= 128:
        return ExpertsConfig(pack, Tile(128, 32, 4, 3), dx, fused or Tile(64, 64, 4, 3),
                             fwd_ws=gluon_fwd_supported(dh, de, pack), **common).fit(de)
    bm = pack
    # at 64-row blocks and de 128 the forward takes the whole de per chunk in 2 stages; 64-wide chunks elsewhere
    fwd = Tile(bm, 128, 4, 2) if pack == 64 and de == 128 else Tile(bm, 64, 4, 3)
    # the converting forward at 64-row blocks and de 256 with ~two blocks per group: 32-wide de chunks (bitwise the
    # plain forward's rows; the plain forward measured slower with them)
    fwd_cast = Tile(bm, 32, 4, 3) if pack == 64 and de == 256 and mean >= CAST_E32_MIN_MEAN else None
    return ExpertsConfig(pack, fwd, dx if pack >= 64 else Tile(bm, 64, 4, 3), fused or Tile(min(bm, 64), 64, 4, 3),
                         fwd_cast=fwd_cast, **common).fit(de)


def wide_config(pack: int, de: int) -> ExpertsConfig:
    """Tiles for dh > 128 (the plan sends such experts to the grouped kernels; these serve explicit fused calls,
    measured at dh 256). The dh = 128 tiles keep (BLOCK_M, DH) and 2 x (BLOCK_E, DH) fp32 accumulators in registers;
    at DH = 256 with 4 warps those spill. Here: 8 warps, row blocks of at most 64 and a 32-wide de chunk in the dW
    kernel, i.e. 64 accumulator registers per thread at DH = 256. The JAX sort packs (the Triton packing was
    measured at dh 128 only)."""
    bm = min(pack, 64)
    return ExpertsConfig(pack_block=pack, fwd=Tile(bm, 64, 8, 2), dx=Tile(bm, 64, 8, 2), dw=Tile(bm, 32, 8, 2),
                         dw_form="t", pack_impl="argsort").fit(de)


@dataclass(frozen=True)
class GemmTile:
    """Launch shape of one grouped-GEMM kernel. rows kernel: block_m rows x block_n output columns per program,
    block_k reduction step; wgrad kernel: block_m x block_n tile of dW (I x J) per program, block_k rows per step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def _pow2(name: str, v: int) -> None:
    if not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"grouped experts: {name}={v!r} must be a power of two >= 16")


@dataclass(frozen=True)
class GroupedConfig:
    """Packing row block, the rows-kernel tile (all four row GEMMs), the wgrad tile, the program swizzle of the rows
    kernel (group_m row blocks per band) and the packing ("argsort": the JAX sort)."""

    pack_block: int = 128
    rows: GemmTile = GemmTile(128, 128, 64, 4, 3)
    wgrad: GemmTile = GemmTile(128, 128, 64, 4, 3)
    group_m: int = 8
    pack_impl: str = "argsort"

    def check(self, dh: int, de: int) -> None:
        """Raise ValueError naming the bad value unless the tiles fit widths dh and de."""
        _pow2("pack_block", self.pack_block)
        r, w = self.rows, self.wgrad
        for name, v in (("rows.block_m", r.block_m), ("rows.block_n", r.block_n), ("rows.block_k", r.block_k),
                        ("wgrad.block_m", w.block_m), ("wgrad.block_n", w.block_n), ("wgrad.block_k", w.block_k)):
            _pow2(name, v)
        for name, v in (("rows.block_m", r.block_m), ("wgrad.block_k", w.block_k)):
            if self.pack_block % v:
                raise ValueError(f"grouped experts: {name}={v} must divide pack_block={self.pack_block}")
        # rows kernel: N and KDIM are de and dh (H = X W1, dX = dH W1^T) or dh and de (O, dH)
        # wgrad kernel: (I, J) is (dh, de) for dW1 and (de, dh) for dW2
        for name, v in (("rows.block_n", r.block_n), ("rows.block_k", r.block_k), ("wgrad.block_m", w.block_m),
                        ("wgrad.block_n", w.block_n)):
            for dim, size in (("dh", dh), ("de", de)):
                if size % v:
                    raise ValueError(f"grouped experts: {dim}={size} must be a multiple of {name}={v}")
        if self.group_m < 1:
            raise ValueError(f"grouped experts: group_m={self.group_m} must be >= 1")
        if self.pack_impl not in PACK_IMPLS:
            raise ValueError(f"grouped experts: pack_impl={self.pack_impl!r}, expected one of {PACK_IMPLS}")

    def fit(self, dh: int, de: int) -> GroupedConfig:
        """Shrink tiles (halving, not below 16) to the packing block and to widths dh, de (small test shapes, or
        widths the default tiles do not divide)."""
        def shrink(v: int, *sizes: int) -> int:  # tiles that are no power of two are left to check()
            while v > 16 and not v & (v - 1) and any(s % v for s in sizes):
                v //= 2
            return v

        p = self.pack_block
        r, w = self.rows, self.wgrad
        rows = replace(r, block_m=shrink(r.block_m, p), block_n=shrink(r.block_n, dh, de),
                       block_k=shrink(r.block_k, dh, de))
        wgrad = replace(w, block_m=shrink(w.block_m, dh, de), block_n=shrink(w.block_n, dh, de),
                        block_k=shrink(w.block_k, p))
        return replace(self, rows=rows, wgrad=wgrad)


def default_grouped_config(num_slots: int, num_groups: int, dh: int, de: int) -> GroupedConfig:
    """Packing block from the mean rows per group (as `default_config`, its 64-row threshold at a mean of 48),
    128 x 128 x 64 tiles, 4 warps, 3 stages (bf16: 96 KB of shared memory per program), fitted to dh, de. From a
    sweep at dh 1024, de 256 on an H100 (the rows kernels at ~300 TFLOP/s, 8 warps slower)."""
    mean = num_slots / max(num_groups, 1)
    pack = 128 if mean >= 384 else 64 if mean >= 48 else 32 if mean >= 12 else 16
    return GroupedConfig(pack_block=pack, rows=GemmTile(min(128, pack), 128, 64, 4, 3),
                         wgrad=GemmTile(128, 128, min(64, pack), 4, 3)).fit(dh, de)


class CombineTiles(NamedTuple):
    """Rows per program and warps of the combine kernels (kernels/triton/combine.py). The dx combine's 16 rows: with
    two partial dX rows, 64 spill and 32 measured slower."""

    block_r: int = 16
    num_warps: int = 4


def out_combine_tiles(dh: int) -> CombineTiles:
    """`out_combine_kernel`'s tiles: 32 rows x dh 128 per 4-warp program (32 fp32 accumulators per thread); wider rows
    in fewer rows per program, the same registers."""
    dhp = max(16, 1 << (max(dh, 1) - 1).bit_length())
    return CombineTiles(block_r=max(1, min(32, 4096 // dhp)))


# ------------------------------------------------------------------------------------------ router and packing
#
# The router (kernels/triton/router.py, kernels/gluon/router.py) and the packing (kernels/triton/packing.py).
# Figures are kernel-alone times on an H100 at 81920 tokens x 8 heads unless said otherwise.


class RouterTiles(NamedTuple):
    """Tiles and launch settings of the Triton router kernels; `router_tiles` fills block_e and row_tiles by shape."""

    block_n: int = 64  # forward: tokens per row tile
    block_e: int = 0  # forward: experts per streamed W_r block (power of 2, >= k rounded up); 0: by Ne
    fwd_warps: int = 4
    fwd_stages: int = 3
    row_tiles: int = 0  # forward: row tiles per program sharing each W_r block (1 or 2); 0: by k and Ne
    dx_block_n: int = 16  # backward dX: tokens per program (k gathered fp32 rows in flight: keep small)
    dx_warps: int = 4
    dw_block: int = 512  # backward dW: most slots per partial block
    dw_sub: int = 128  # backward dW: slots per step inside a block (summed into one row per step)
    dw_warps: int = 2  # both dW kernels 0.25 ms at Ne 768 k 8; 0.36 with a (64-slot, dh) accumulator at 4 warps
    red_block_e: int = 32  # backward dW reduce: experts per program
    red_warps: int = 4


def router_tiles(ne: int, k: int, **overrides) -> RouterTiles:
    """The router's tiles for Ne experts and top-k. W_r blocks of 128 experts up to Ne 128, else 64 (never below
    16 nor the running list's width). Two row tiles per program at k <= 2 and Ne > 128: the forward is bound by
    streaming W_r from L2 there (Ne 768, k 1: 0.90 vs 1.11 ms); at larger k the second tile's registers halve the
    programs per SM and it loses (k 8: 2.42 vs 2.30 ms)."""
    t = RouterTiles()._replace(**overrides)
    kp = max(2, _pow2_at_least(k))
    block_e = max(16, kp, min(t.block_e or (128 if ne <= 128 else 64), _pow2_at_least(ne)))
    row_tiles = t.row_tiles or (2 if k <= 2 and ne > 128 else 1)
    return t._replace(block_e=block_e, row_tiles=row_tiles)


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


# The warp-specialised Gluon router forward. Three consumer warp groups (192-row items: a third of the W_r stream
# per row) with two ring stages at k <= 4 (Ne 768 k 4: 1.24 vs 1.34 ms with two); two consumers with three stages
# at k > 4, where lists of 8 want the registers (Ne 1536 k 8: 3.13 vs 3.48 ms). Four consumers do not fit in shared
# memory beside the layout conversion's scratch.
WS_ROUTER_MAX_K3 = 4  # the largest k at which three consumers run
WS_ROUTER_STAGES = {2: 3, 3: 2}  # W_r ring stages by consumer count
# Worker registers (consumer, producer) by consumer count, and the launch limit per thread: all partitions share
# one SM's 64K registers (setmaxnreg moves registers within the launch allocation); the default-partition consumer
# gets what is left (168 at three consumers, 256 at two).
WS_ROUTER_REGS = {2: (200, 40), 3: (152, 40)}
WS_ROUTER_MAXNREG = {2: 168, 3: 128}
# Two consumers and the caster warp group (the expert weights' bf16 cast beside the selection): four warp groups
# in 64K registers, the default consumer gets 512 - 200 - 40 - 40.
WS_ROUTER_CAST_REGS = 40
WS_ROUTER_CAST_MAXNREG = 128
# Most rounds of threshold insertions per W_r block; a block with more candidates in some thread row goes through
# the sorting networks (Ne 768 k 8: 1.45 vs 1.59 ms with the networks in every block).
WS_ROUTER_THR = 8

# The Triton packing.
PACK_CHUNK = 1024  # local slots per chunk, sorted in registers by one program
PACK_SORT_WARPS = 8  # the scatter kernel's warps: 0.18 vs 0.21 ms at 4 warps (Ne 768 k 8); 1, 2, 16, 32 slower
# Histogram bins from which the chunk histograms are integer atomic adds: tl.histogram costs ~bins / 32 instructions
# per slot (0.22 vs 0.09 ms at Ne 1536 k 8) but wins at few bins (0.020 vs 0.036 ms at Ne 384 k 4).
HIST_ATOMIC_MIN_BINS = 1024
PACK_OFFSETS_EB = 32  # expert columns per program of the offsets kernel
BLOCK_GROUP_TILE = 1024  # row blocks per program of the block-group search
GROUP_SCAN_STEP = 1024  # groups per step of the one-program group scan

# ------------------------------------------------------------------------------------------------------ attention


class AttentionTiles(NamedTuple):
    """The causal flash attention's launch shapes (kernels/triton/attention.py): forward q / kv tiles, warps and
    pipeline stages; backward dK-dV pass q tile (m1) and kv tile (n1, also the dQ pass's q tile) and the dQ pass's kv
    tile (n2), warps, stages."""

    block_m: int = 64
    block_n: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    block_m1: int = 64
    block_n1: int = 64
    block_n2: int = 32
    bwd_warps: int = 4
    bwd_stages: int = 2

    def tile(self) -> int:
        """The sequence length must be a multiple of this (every tile divides it; the kernels' rules nest the others
        in these two)."""
        return math.lcm(self.block_m, self.block_n1)


# The fastest of each pass in `python -m bench.tools.attention_tiles` (H200, 8 x 2048 tokens x 8 heads x 128): forward
# 0.237 ms (128 x 128 tiles with 8 warps next, 0.245), backward 0.653 ms (dQ kv tile 64 next, 0.673).
ATTENTION_TILES = AttentionTiles()


class XentTiles(NamedTuple):
    """The LM head's cross-entropy kernel (kernels/triton/cross_entropy.py): columns per step, warps, pipeline
    stages, and persistent programs per SM, each streaming one row (201 KB at V 50304) at a time: fewer rows in
    flight would keep the second read in L2, more hide more memory latency, which the sweep below prefers."""

    block: int = 4096
    warps: int = 16
    stages: int = 2
    programs_per_sm: int = 4


# The fastest over the grid of `python -m bench.loss --sweep` (H200, 4096 x 50304 fp32 logits, docs/performance.md):
# 0.50 ms against XLA's 0.77 (block 4096 at 8 per SM next, 0.52; one per SM, 0.63-1.4 ms).
XENT_TILES = XentTiles()
