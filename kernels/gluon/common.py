"""Gluon building blocks shared by the warp-specialised kernels (kernels/gluon/experts_fwd.py, experts_bwd.py,
experts_bwd_fused.py, router.py): the gelu arithmetic of `kernels.triton.experts` (so the Gluon and Triton kernels
agree bitwise), the register layouts of wgmma products and cp.async copies, and the mbarrier pairs that hand shared
buffers over."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _tanh(u, FAST_TANH: gl.constexpr):
    """tanh of fp32 u: the one `tanh.approx.f32` instruction, or the sigmoid form (`kernels.triton.experts._tanh`)."""
    if FAST_TANH:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=gl.float32, is_pure=True,
                                      pack=1)
    else:
        t = 2.0 / (1.0 + gl.exp(-2.0 * u)) - 1.0
    return t


@gluon.jit
def _gelu(h, FAST_TANH: gl.constexpr):
    """tanh-approximate gelu of fp32 h, the arithmetic of `kernels.triton.experts._gelu`."""
    t = _tanh(h * gl.fma(h * h, 0.7978845608028654 * 0.044715, 0.7978845608028654), FAST_TANH)
    hh = 0.5 * h
    return gl.fma(hh, t, hh)


@gluon.jit
def _gelu_and_grad(h, FAST_TANH: gl.constexpr):
    """(gelu(h), gelu'(h)) of fp32 h: the arithmetic of `kernels.triton.experts._gelu_and_grad`."""
    h2 = h * h
    t = _tanh(h * gl.fma(h2, 0.7978845608028654 * 0.044715, 0.7978845608028654), FAST_TANH)
    hh = 0.5 * h
    act = gl.fma(hh, t, hh)
    du = gl.fma(h2, 3.0 * 0.7978845608028654 * 0.044715, 0.7978845608028654)
    grad = gl.fma(hh * gl.fma(-t, t, 1.0), du, gl.fma(t, 0.5, 0.5))
    return act, grad


@gluon.constexpr_function
def _wgmma_layout(n, num_warps):
    """Accumulator layout of (rows, n) wgmma products of one warp group's warps (m16 x n x k16 instructions)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _copy_layout(cols, num_warps):
    """A blocked register layout for cp.async of a row-major (rows, cols) 16-bit tile: 16-byte vectors."""
    tpc = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [num_warps, 1], [1, 0])


@gluon.jit
def _ws_copy_rows(smem, base, ROWS: gl.constexpr, COLS: gl.constexpr, STRIDE: gl.constexpr, PASS: gl.constexpr,
                  num_warps: gl.constexpr):
    """cp.async the rows base + r * STRIDE + [0, COLS), r < ROWS, into smem (ROWS, COLS), PASS rows at a time
    (bounds the producer's address registers)."""
    l: gl.constexpr = _copy_layout(COLS, num_warps)
    r = gl.arange(0, PASS, layout=gl.SliceLayout(1, l))
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, l))
    for r0 in gl.static_range(0, ROWS, PASS):
        async_copy.async_copy_global_to_shared(smem.slice(r0, PASS, dim=0),
                                               base + (r0 + r)[:, None] * STRIDE + c[None, :])



@gluon.jit
def _ws_barriers(N: gl.constexpr, READY: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """N (ready, empty) mbarrier pairs: ready completes after READY arrivals (one per producer thread, by
    cp.async), empty after one arrival per consumer (CONSUMERS)."""
    ready = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty



@gluon.jit
def _store_rows(ptr, rows, vals, DH: gl.constexpr, NW: gl.constexpr):
    """Store vals (rows, DH) at ptr + rows * DH as 16-byte vectors, whole 32-byte sectors (stored from the wgmma
    layout they go out as 4-byte pairs: half sectors, twice the L2 writes)."""
    ls: gl.constexpr = _copy_layout(DH, NW)
    cols = gl.arange(0, DH, layout=gl.SliceLayout(0, ls))
    rows = gl.convert_layout(rows, gl.SliceLayout(1, ls))
    gl.store(ptr + rows[:, None] * DH + cols[None, :], gl.convert_layout(vals, ls))
