"""Tuning tables: the tiles and thresholds each kernel runs with, per shape, as measured on Hopper GPUs.

Kernel files hold the kernels; this module holds the numbers that pick their tiles, so a retune touches one file.
"""

from __future__ import annotations

from typing import NamedTuple

# ---------------------------------------------------------------------------------------------- expert kernels


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
