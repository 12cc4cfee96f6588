"""The LM head's loss and its logits' gradient in one kernel, from the fp32 logits of a chunk of tokens.

Per row r of the logits x (R, V) with target t_r and a scale s (1 / the tokens of the batch):

    lse_r = log sum_v exp(x_rv)          nll_r = lse_r - x_{r, t_r}
    d_rv  = (exp(x_rv - lse_r) - [v == t_r]) * s, rounded to d's dtype (bf16 in training)

The same expressions as the XLA form in `mhl_jax/model/loss.py` (`head_loss`), which reads the logits three times (the
row maxima, the sums of exponentials, then the gradient). Here a program reads its row twice: once for lse
by an online softmax (a running maximum and sum per lane, the sum rescaled as the maximum grows), once for d (a
persistent grid of a few programs per SM, each streaming one row at a time). The first read asks L2 to keep the row
and the second to drop it: with few rows in flight the second read finds it there, but the tuned grid keeps more
rows in flight than L2 holds, which hides more latency (kernels/tuning.py, `XentTiles`).
A target outside [0, V) gives a NaN nll (XLA's gather gives NaN above V and wraps negative targets around).

Parameters follow jax-triton's binding order: inputs, then one pointer per output, then constexprs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tuning import XentTiles


@triton.jit
def xent_kernel(x_ptr, t_ptr, d_ptr, nll_ptr, R: tl.constexpr, V: tl.constexpr, SCALE: tl.constexpr,
                BLOCK: tl.constexpr):
    """Rows pid, pid + programs, ...: lse by an online softmax in BLOCK-column steps, then d and nll (module
    docstring)."""
    offs = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * V
        # per lane a running maximum and sum, merged once at the row's end: no reduction (and no barrier) per block
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(x_ptr + base + cols, mask=cols < V, other=float("-inf"), eviction_policy="evict_last")
            m_new = tl.maximum(m, x)
            m_off = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane of only -inf so far keeps s = 0, not NaN
            s = s * tl.exp(m - m_off) + tl.exp(x - m_off)
            m = m_new
        m_row = tl.max(m, 0)
        s = tl.sum(s * tl.exp(m - m_row), 0)
        m = m_row
        lse = m + tl.log(s)
        tgt = tl.load(t_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(x_ptr + base + cols, mask=cols < V, other=0.0, eviction_policy="evict_first")
            p = tl.exp(x - lse)
            p = tl.where(cols == tgt, p - 1.0, p) * SCALE
            tl.store(d_ptr + base + cols, p.to(d_ptr.dtype.element_ty), mask=cols < V, eviction_policy="evict_first")
        ok = (tgt >= 0) & (tgt < V)
        xt = tl.load(x_ptr + base + tgt, mask=ok, other=float("nan"))
        tl.store(nll_ptr + row, lse - xt)


def check_shape(rows: int, v: int, tiles: XentTiles) -> None:
    """Raise a ValueError naming the values unless the block is a power of two and the logits fit int64 offsets
    with int32 row and column counts."""
    if tiles.block < 16 or tiles.block & (tiles.block - 1) or rows < 1 or v < 1 or v >= 2**31 or rows >= 2**31:
        raise ValueError(f"cross-entropy kernel: {rows} rows x {v} columns, block {tiles.block}; expected a "
                         "power-of-two block of at least 16 and 1 <= rows, columns < 2**31")


def xent_launch(rows: int, v: int, scale: float, tiles: XentTiles, sms: int) -> tuple[tuple[int], dict]:
    """(grid, keyword arguments) of `xent_kernel` for (rows, v) logits on a GPU of `sms` SMs: the constexprs, warps
    and stages. Raises on shapes the kernel does not take (`check_shape`)."""
    check_shape(rows, v, tiles)
    programs = min(rows, max(1, tiles.programs_per_sm * sms))
    return (programs,), dict(R=rows, V=v, SCALE=float(scale), BLOCK=tiles.block, num_warps=tiles.warps,
                             num_stages=tiles.stages)

