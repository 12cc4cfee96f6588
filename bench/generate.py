"""Per-token time of `mhl_jax.infer.generate` with the KV cache (its decoding loop at each `--chunks` value of
DECODE_CHUNK: decoding steps per call of the device loop; 1 is a call per token) against without it (each token a
forward over the window), in one process, on one run's checkpoint or on a config's freshly initialised weights
(`--config`: no training run needed; the timing does not depend on the weights' values). JSON lines: one per (rows,
setting), the compile left out (each setting runs once to compile, then is timed), and per rows the count of greedy
ids that agree with the baseline's.

    python bench/generate.py RUN_DIR [--rows 1 4 16] [--tokens 128] [--chunks 1 32] [--out FILE]
    python bench/generate.py --config configs/mh_latent_moe_hp_2.2b.yaml [--set KEY=VALUE ...] ...
"""

import argparse
import json
import time
from datetime import date

import jax

from mhl_jax import infer
from mhl_jax.config import load_config
from mhl_jax.parallel.mesh import make_mesh
from mhl_jax.train.optimizer import make_optimizer
from mhl_jax.train.state import state_creator


def initialised(config: str, sets: list[str]) -> infer.Loaded:
    """A config's model at its step-0 weights (the train loop's initialisation), as `infer.load_run` gives one."""
    cfg = load_config(config, sets)
    mesh = make_mesh(cfg)
    graphdef, create, _ = state_creator(cfg, mesh, make_optimizer(cfg))
    state = create()
    del state["opt_state"]  # (AdamW's moments: not needed here)
    return infer.Loaded(cfg, mesh, graphdef, state["params"], state["biases"], 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--config", default=None, help="time a config's initial weights instead of a run's checkpoint")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--chunks", type=int, nargs="+", default=[infer.DECODE_CHUNK])
    ap.add_argument("--no-baseline", action="store_true", help="leave out the runs without the cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if (args.run_dir is None) == (args.config is None):
        ap.error("give exactly one of RUN_DIR and --config")
    if min(args.chunks) < 1:
        ap.error(f"--chunks {args.chunks}: each must be >= 1 (decoding steps per call)")
    loaded = infer.load_run(args.run_dir, args.sets) if args.config is None else initialised(args.config, args.sets)
    dev = jax.local_devices()[0]
    prompt = [256] + list(b"The ")  # byte-tokenizer ids: end-of-text, then the prompt
    tokens = min(args.tokens, loaded.cfg.model.context - len(prompt))  # all within the context: cached throughout
    if tokens < args.tokens:
        print(f"--tokens {args.tokens} cut to {tokens}: past model.context={loaded.cfg.model.context} the window "
              f"slides and tokens run without the cache")
    args.tokens = tokens
    settings = ([] if args.no_baseline else [None]) + args.chunks  # None: no cache
    for rows in args.rows:
        ids = {}
        for chunk in settings:
            if chunk is not None:
                infer.DECODE_CHUNK = chunk
            kw = dict(temperature=0, kv_cache=chunk is not None)
            first = time.perf_counter()
            infer.generate(loaded, [prompt] * rows, args.tokens, **kw)
            t0 = time.perf_counter()
            ids[chunk] = infer.generate(loaded, [prompt] * rows, args.tokens, **kw)
            t1 = time.perf_counter()
            rec = {"bench": "generate", "device": f"{jax.local_device_count()} x {dev.device_kind}",
                   "date": date.today().isoformat(), "config": loaded.cfg.name, "weights": "initial" if args.config
                   else f"step {loaded.step}", "context": loaded.cfg.model.context, "rows": rows,
                   "tokens": args.tokens, "kv_cache": chunk is not None, "decode_chunk": chunk,
                   "first_call_s": round(t0 - first, 3), "s": round(t1 - t0, 4),
                   "ms_per_token": round((t1 - t0) / args.tokens * 1e3, 3)}
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        base = ids[settings[0]]
        for chunk in settings[1:]:
            agree = sum(a == b for x, y in zip(base, ids[chunk]) for a, b in zip(x, y))
            print(json.dumps({"bench": "generate_agreement", "rows": rows, "of": rows * args.tokens,
                              "greedy_ids_equal": agree, "baseline": settings[0], "decode_chunk": chunk}), flush=True)


if __name__ == "__main__":
    main()
