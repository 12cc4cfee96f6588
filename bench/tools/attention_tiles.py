"""The Triton flash attention's tiles, warps and pipeline stages on one GPU: its forward and its backward timed apart
(the backward from fixed residuals, so each pass gets its own launch settings), then the best of each pass together
beside cuDNN and the tiles the model runs (`kernels.tuning.ATTENTION_TILES`).

    python -m bench.tools.attention_tiles [--batch 8] [--seq 2048] [--heads 8] [--head-dim 128] [--out FILE]

One JSON line per configuration and pass (`attention_sweep`), the best tiles, then `bench.attention`'s records for
cudnn, triton (ATTENTION_TILES) and triton_best.
"""

from __future__ import annotations

import jax

from bench.attention import add_shape_args, inputs, measure
from bench.common import JsonLines, error_text, parser, time_jax, today
from kernels.tuning import ATTENTION_TILES
from mhl_jax.model import flash_attention as fa

FWD_FIELDS = ("block_m", "block_n", "fwd_warps", "fwd_stages")
BWD_FIELDS = ("block_m1", "block_n1", "block_n2", "bwd_warps", "bwd_stages")
FWD_GRID = [(m, n, w, st) for m in (64, 128) for n in (32, 64, 128) if m % n == 0 for w in (4, 8) for st in (2, 3, 4)]
BWD_GRID = [(m1, n1, n2, w, st) for n1 in (64, 128) for m1 in (16, 32, 64) for n2 in (16, 32, 64)
            if n1 % m1 == 0 and n1 % n2 == 0 for w in (4, 8) for st in (1, 2, 3)]


def sweep(shape, emit, qb, kb, vb, gb):
    """Forward configs timed alone, backward configs timed alone from fixed residuals: ATTENTION_TILES with each
    pass's fastest settings."""
    base = {"bench": "attention_sweep", "shape": list(shape), "device": jax.devices()[0].device_kind, "date": today(),
            "jax": jax.__version__}

    def best_of(pass_name, fields, grid, make, args):
        """Time jit(make(tiles)) on args for every setting of `fields` in `grid` (one JSON line each; a setting that
        fails, e.g. for want of shared memory, is reported and skipped) -> the fastest setting."""
        best = None
        for values in grid:
            cfg = dict(zip(fields, values))
            rec = dict(base, **{"pass": pass_name}, **cfg)
            try:
                rec["ms"] = time_jax(jax.jit(make(ATTENTION_TILES._replace(**cfg))), [args])
                if best is None or rec["ms"] < best[0]:
                    best = (rec["ms"], cfg)
            except Exception as e:
                rec["error"] = error_text(e)
            emit(rec)
        return best[1]

    best_f = best_of("fwd", FWD_FIELDS, FWD_GRID, lambda t: lambda q, k, v: fa._forward(q, k, v, t), (qb, kb, vb))
    o, lse = jax.jit(lambda q, k, v: fa._forward(q, k, v, ATTENTION_TILES))(qb, kb, vb)
    best_b = best_of("bwd", BWD_FIELDS, BWD_GRID,
                     lambda t: lambda q, k, v, o, lse, do: fa._attention_bwd(t, (q, k, v, o, lse), do),
                     (qb, kb, vb, o, lse, gb))
    return ATTENTION_TILES._replace(**best_f, **best_b)


def main(argv=None) -> None:
    ap = parser(__doc__)
    add_shape_args(ap)
    args = ap.parse_args(argv)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    ref, bf16_inputs = inputs(shape)
    with JsonLines(args.out) as emit:
        best = sweep(shape, emit, *bf16_inputs)
        emit({"bench": "attention_sweep", "best": best._asdict()})
        for impl, fn in (("cudnn", None), ("triton", None),
                         ("triton_best", lambda q, k, v: fa.flash_attention(q, k, v, best))):
            emit(measure(impl, shape, ref, bf16_inputs, fn))


if __name__ == "__main__":
    main()
