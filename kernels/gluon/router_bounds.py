"""The per-row thresholds of the Gluon router's selection (`kernels/gluon/router_select.py`): bounds that at least
KP of a row's scores, all of lower expert indices than the block at hand, reach, so that only the scores above them
need to enter the threads' lists.

- `_row_bound`: from the four threads' lists of a row (the later blocks of an item).
- `_block_bound`: from the block's own scores (an item's first block, where the lists are empty; KP <= 4). It propagates
  NaN, so that a row with a NaN score can be sent through the sorting networks instead.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language import PropagateNan

_NAN = gl.constexpr(PropagateNan.ALL)


@gluon.jit
def _shfl_bfly(x, LANES: gl.constexpr):
    """x (32-bit) of the lane LANES apart (shfl.sync.bfly over the full warp), elementwise."""
    if LANES == 1:
        y = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;", "=r,r", [x], dtype=x.dtype,
                                      is_pure=True, pack=1)
    else:
        y = gl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, -1;", "=r,r", [x], dtype=x.dtype,
                                      is_pure=True, pack=1)
    return y


@gluon.jit
def _row_bound(rv, KP: gl.constexpr):
    """A threshold per row from its four threads' lists rv (lanes 4r .. 4r + 3): KP of the row's scores, all of
    lower indices than the next block's, are at or above it. The tightest of three bounds that hold: the best of
    the four threads' KP-th; the second best of their (KP / 2)-th (two threads hold KP / 2 each); the worst of
    their (KP / 4)-th (each holds KP / 4). A tighter bound lets fewer scores through to the insertions."""
    if KP < 2:  # lists of one: the best of the four threads' only element
        thr = rv[KP - 1]
        thr = gl.maximum(thr, _shfl_bfly(thr, 1))
        return gl.maximum(thr, _shfl_bfly(thr, 2))
    a = rv[KP // 2 - 1]
    a1 = _shfl_bfly(a, 1)
    hi = gl.maximum(a, a1)
    lo = gl.minimum(a, a1)
    half = gl.maximum(gl.minimum(hi, _shfl_bfly(hi, 2)), gl.maximum(lo, _shfl_bfly(lo, 2)))
    if KP < 4:
        return half
    q = rv[KP // 4 - 1]
    q = gl.minimum(q, _shfl_bfly(q, 1))
    q = gl.minimum(q, _shfl_bfly(q, 2))
    return gl.maximum(half, q)


@gluon.jit
def _mx(a, b):
    """max that propagates NaN (so that a NaN score makes its row's `_block_bound` NaN)."""
    return gl.maximum(a, b, propagate_nan=_NAN)


@gluon.jit
def _mn(a, b):
    """min that propagates NaN."""
    return gl.minimum(a, b, propagate_nan=_NAN)


@gluon.jit
def _top2(lv):
    """Each thread's best two of its 16 leaves per row (values only, a tree of pairs: short dependency chains); both
    NaN where one of them is."""
    hi = ()
    lo = ()
    for u in gl.static_range(8):
        hi = hi + (_mx(lv[2 * u], lv[2 * u + 1]),)
        lo = lo + (_mn(lv[2 * u], lv[2 * u + 1]),)
    for lvl in gl.static_range(3):
        nh = ()
        nl = ()
        for u in gl.static_range(4 >> lvl):
            nh = nh + (_mx(hi[2 * u], hi[2 * u + 1]),)
            nl = nl + (_mx(_mn(hi[2 * u], hi[2 * u + 1]), _mx(lo[2 * u], lo[2 * u + 1])),)
        hi = nh
        lo = nl
    return hi[0], lo[0]


@gluon.jit
def _block_bound(lv, KP: gl.constexpr):
    """A threshold per row from the block itself, for its first block (the lists are empty then): the KP-th best of
    the eight values {each of the row's four threads' best two}, so at least KP of the row's scores are at or above
    it. Candidates at or above it are ~1 per thread row at KP 4 (the networks' first block sorts all 16); at KP 8
    most scores would be, so `select_block` does not ask for it there. NaN where the row has a NaN score in the
    block."""
    gl.static_assert(KP <= 4, "KP: the first block goes through the networks at KP 8")
    a1, a2 = _top2(lv)
    b1 = _shfl_bfly(a1, 1)
    b2 = _shfl_bfly(a2, 1)
    mid_hi = _mn(a1, b1)
    mid_lo = _mx(a2, b2)
    c = (_mx(a1, b1), _mx(mid_hi, mid_lo), _mn(mid_hi, mid_lo), _mn(a2, b2))
    d = (_shfl_bfly(c[0], 2), _shfl_bfly(c[1], 2), _shfl_bfly(c[2], 2), _shfl_bfly(c[3], 2))
    # the KP-th best of two better-first lists: the best over i of min(c's i-th, d's (KP - i)-th)
    if KP == 1:
        thr = _mx(c[0], d[0])
    elif KP == 2:
        thr = _mx(_mx(c[1], d[1]), _mn(c[0], d[0]))
    else:
        thr = _mx(_mx(c[3], d[3]), _mx(_mx(_mn(c[0], d[2]), _mn(c[1], d[1])), _mn(c[2], d[0])))
    return thr
