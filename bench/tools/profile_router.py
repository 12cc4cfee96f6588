"""Per-kernel GPU times of the router (`bench.router`'s jitted forward and forward + backward of our router): which
kernels its milliseconds go to, at each Ne.

    python -m bench.tools.profile_router [--tokens 81920] [--ne 128 256 512 2048] [--calls 5] [--out FILE]

Per (Ne, part): `ms` the untraced call (`time_jax`), then `calls` back-to-back calls in one JAX profiler trace read
back from GPU 0's stream lines: each kernel's ms per call (template arguments and fusion numbers folded, largest
first, the first 14) and `busy`, their sum. ms - busy is the time the device waits between the call's launches.
"""

from __future__ import annotations

import collections

import jax

from bench.common import JsonLines, parser, time_jax, today
from bench.router import jax_fns, make_inputs
from bench.tools.profile_layer import short, trace_events


def profile(tokens: int, ne: int, k: int, calls: int) -> list[dict]:
    sets = [make_inputs(seed, tokens, ne, k) for seed in range(2)]
    fwd, fb = jax_fns("ours", k)
    recs = []
    for part, fn in (("fwd", fwd), ("fb", fb)):
        ms = time_jax(fn, sets, reps=15)
        events = trace_events(fn, sets[0], calls)[0]
        per = collections.defaultdict(float)
        for _, dur, name in events:
            per[short(name)] += dur / 1e6 / calls
        top = sorted(per.items(), key=lambda kv: -kv[1])
        recs.append(dict(bench="router_profile", device=jax.devices()[0].device_kind, date=today(), tokens=tokens,
                         nh=sets[0][0].shape[1], dh=sets[0][0].shape[2], k=k, ne=ne, part=part, ms=round(ms, 4),
                         busy=round(sum(per.values()), 4), kernels=[(n, round(v, 4)) for n, v in top[:14]]))
    return recs


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--ne", type=int, nargs="+", default=[128, 256, 512, 2048])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    out = JsonLines(args.out)
    for ne in args.ne:
        for rec in profile(args.tokens, ne, args.k, args.calls):
            out(rec)


if __name__ == "__main__":
    main()
