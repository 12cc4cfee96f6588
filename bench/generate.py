"""Per-token time of `mhl_jax.infer.generate` with the KV cache against without it (each token a forward over the
window), in one process on one run's checkpoint. JSON lines: one per (rows, kv_cache), the compile left out (each
setting runs once to compile, then is timed).

    python bench/generate.py RUN_DIR [--rows 1 4 16] [--tokens 128] [--out FILE]
"""

import argparse
import json
import time
from datetime import date

import jax

from mhl_jax.infer import generate, load_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_run(args.run_dir)
    dev = jax.local_devices()[0]
    prompt = [256] + list(b"The ")  # byte-tokenizer ids: end-of-text, then the prompt
    tokens = min(args.tokens, loaded.cfg.model.context - len(prompt))  # all within the context: cached throughout
    if tokens < args.tokens:
        print(f"--tokens {args.tokens} cut to {tokens}: past model.context={loaded.cfg.model.context} the window "
              f"slides and tokens run without the cache")
    args.tokens = tokens
    for rows in args.rows:
        ids = {}
        for kv in (False, True):  # the baseline first
            first = time.perf_counter()
            generate(loaded, [prompt] * rows, args.tokens, temperature=0, kv_cache=kv)
            t0 = time.perf_counter()
            ids[kv] = generate(loaded, [prompt] * rows, args.tokens, temperature=0, kv_cache=kv)
            t1 = time.perf_counter()
            rec = {"bench": "generate", "device": f"{jax.local_device_count()} x {dev.device_kind}",
                   "date": date.today().isoformat(), "config": loaded.cfg.ffn.kind, "context": loaded.cfg.model.context,
                   "rows": rows, "tokens": args.tokens, "kv_cache": kv, "first_call_s": round(t0 - first, 3),
                   "s": round(t1 - t0, 4), "ms_per_token": round((t1 - t0) / args.tokens * 1e3, 3)}
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        agree = sum(a == b for x, y in zip(ids[False], ids[True]) for a, b in zip(x, y))
        print(json.dumps({"bench": "generate_agreement", "rows": rows, "greedy_ids_equal": agree,
                          "of": rows * args.tokens}), flush=True)


if __name__ == "__main__":
    main()
