"""Per-token time of `mhl_jax.generation.generate` with the KV cache against without it (each token a forward over the
window), in one process, on one run's checkpoint or on a config's freshly initialised weights (`--config`: no
training run needed; the timing does not depend on the weights' values).

    python -m bench.generate RUN_DIR [--rows 1 4 16] [--tokens 128] [--no-baseline] [--out FILE]
    python -m bench.generate --config configs/mh_latent_moe_hp_2.2b.yaml [--set KEY=VALUE ...] ...

JSON lines: one per (rows, cache or not), the compile left out (each setting runs once to compile, then is timed),
and per rows the count of greedy ids of the cached run that agree with the uncached one's.
"""

from __future__ import annotations

import time

import jax

from bench.common import JsonLines, parser, today
from mhl_jax import generation
from mhl_jax.config import load_config
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.runtime.restore import Loaded, load_run
from mhl_jax.runtime.state import state_creator
from mhl_jax.train.optimizer import make_optimizer


def initialised(config: str, sets: list[str]) -> Loaded:
    """A config's model at its step-0 weights (the train loop's initialisation), as `load_run` gives one."""
    cfg = load_config(config, sets)
    mesh = make_mesh(cfg)
    graphdef, create, _ = state_creator(cfg, mesh, make_optimizer(cfg))
    state = create()
    del state["opt_state"]  # (AdamW's moments: not needed here)
    return Loaded(cfg, mesh, graphdef, state["params"], state["biases"], 0)


def main(argv=None) -> None:
    ap = parser(__doc__)
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--config", default=None, help="time a config's initial weights instead of a run's checkpoint")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-baseline", action="store_true", help="leave out the runs without the cache")
    args = ap.parse_args(argv)
    if (args.run_dir is None) == (args.config is None):
        ap.error("give exactly one of RUN_DIR and --config")
    loaded = load_run(args.run_dir, args.sets) if args.config is None else initialised(args.config, args.sets)
    dev = jax.local_devices()[0]
    prompt = [256] + list(b"The ")  # byte-tokenizer ids: end-of-text, then the prompt
    tokens = min(args.tokens, loaded.cfg.model.context - len(prompt))  # all within the context: cached throughout
    if tokens < args.tokens:
        print(f"--tokens {args.tokens} cut to {tokens}: past model.context={loaded.cfg.model.context} the window "
              f"slides and tokens run without the cache")
    settings = [True] if args.no_baseline else [False, True]  # with the KV cache or not
    with JsonLines(args.out) as emit:
        for rows in args.rows:
            ids = {}
            for cached in settings:
                kw = dict(temperature=0, kv_cache=cached)
                first = time.perf_counter()
                generation.generate(loaded, [prompt] * rows, tokens, **kw)
                t0 = time.perf_counter()
                ids[cached] = generation.generate(loaded, [prompt] * rows, tokens, **kw)
                t1 = time.perf_counter()
                emit({"bench": "generate", "device": f"{jax.local_device_count()} x {dev.device_kind}",
                      "date": today(), "config": loaded.cfg.name,
                      "weights": "initial" if args.config else f"step {loaded.step}",
                      "context": loaded.cfg.model.context, "rows": rows, "tokens": tokens, "kv_cache": cached,
                      "decode_chunk": generation.DECODE_CHUNK if cached else None, "first_call_s": round(t0 - first, 3),
                      "s": round(t1 - t0, 4), "ms_per_token": round((t1 - t0) / tokens * 1e3, 3)})
            if len(settings) == 2:
                agree = sum(a == b for x, y in zip(ids[False], ids[True]) for a, b in zip(x, y))
                emit({"bench": "generate_agreement", "rows": rows, "of": rows * tokens, "greedy_ids_equal": agree})


if __name__ == "__main__":
    main()
