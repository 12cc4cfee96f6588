"""Use a trained run's checkpoint: its validation loss, and text sampled from it.

    python -m mhl_jax.infer evaluate RUN_DIR [--step N] [--set data.val_sequences=256 ...]
    python -m mhl_jax.infer generate RUN_DIR --prompt "Once upon a time" [--max-new-tokens 200]
                                     [--temperature 0.8] [--top-k 50] [--num-samples 4] [--seed 0]
    python -m mhl_jax.infer lm-eval RUN_DIR --tasks piqa,arc_easy [--limit 500] [--include-path my_tasks/]

RUN_DIR is a `logging.run_dir` written by train.py: its `config.yaml` gives the model, data and mesh, and its
`checkpoints/` the weights (the latest, or `--step N`, or `--checkpoint PATH`). `--set key=value` overrides the saved
config as in train.py (another validation set, micro-batch, mesh or kernels; a change to the model itself is refused
by the checkpoint's fingerprint). Only the parameters and balancing biases are read (not the optimizer state), and
nothing in RUN_DIR is written or cleaned up but lm-eval's results file: safe while the run is still training there.
`lm-eval` runs lm-evaluation-harness tasks (`mhl_jax.harness`) and writes their results JSON beside the run.

`evaluate` computes the mean next-token NLL over the config's fixed validation sequences exactly as the train loop
does (the same sequences, batches and step function: at a step where the run evaluated, the same `val_loss` as its
metrics.jsonl). `generate` samples continuations of a prompt: one forward pass over a fixed window of
`model.context` tokens (the prompt, padded at the end; causal attention and dropless routing make the padding
invisible to the real tokens) fills a KV cache, and each new token is then one decoding step against it. A sample
longer than the context slides its window: from there each token is a forward pass over the window
(`--no-kv-cache`: every token so).

One process: the command runs over the devices this process sees (for a checkpoint of a run of several hosts, set
`--set parallel.devices=...` and the mesh to what one host holds). On GPUs it compiles with the run's XLA autotuning
results (`<RUN_DIR>/xla_autotune.txt`, read only) when they are there, as the run's own resumed processes do.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from mhl_jax.config import ConfigError
from mhl_jax.data import DataError
from mhl_jax.data.tokenizers import get_tokenizer
from mhl_jax.generation import generate
from mhl_jax.runtime.errors import EXIT_BAD_INPUT, EXIT_OK, INPUT_ERRORS, input_error_line
from mhl_jax.runtime.evaluate import evaluate_run
from mhl_jax.runtime.restore import load_run, run_config

EOT_MARK = "<|endoftext|>"


def _read_prompt(args) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text ({e})") from e
    except OSError as e:
        raise DataError(f"--prompt-file {args.prompt_file!r} cannot be read ({e.strerror or e})") from e


def _generate_cli(args) -> None:
    cfg = run_config(args.run_dir, args.overrides)  # the tokenizer and prompt checked before the weights are read
    tok = get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_file)
    text = _read_prompt(args)
    # documents are trained as [EOT] + text: a prompt starts a document the same way
    prompt = [tok.eot] + [int(i) for i in tok.encode(text)]
    if len(prompt) > cfg.model.context:
        print(f"note: the prompt is {len(prompt)} tokens (with the end-of-text token before it), more than "
              f"model.context={cfg.model.context}: the model sees the last {cfg.model.context}", file=sys.stderr)
    loaded = load_run(args.run_dir, args.overrides, args.step, args.checkpoint, cfg)
    outs = generate(loaded, [prompt] * args.num_samples, args.max_new_tokens, args.temperature, args.top_k,
                    args.seed, vocab=tok.vocab_size, stop=None if args.no_stop_at_eot else tok.eot, top_p=args.top_p,
                    kv_cache=not args.no_kv_cache)
    for n, ids in enumerate(outs):
        ended = bool(ids) and ids[-1] == tok.eot and not args.no_stop_at_eot
        pieces, piece = [], []
        for i in ids[:-1] if ended else ids:  # documents after an end-of-text token shown after a marker
            if i == tok.eot:
                pieces.append(tok.decode(piece))
                piece = []
            else:
                piece.append(i)
        body = EOT_MARK.join([*pieces, tok.decode(piece)])
        if args.json:
            print(json.dumps({"step": loaded.step, "sample": n, "prompt": text, "text": body, "ids": ids,
                              "ended_at_eot": ended, "temperature": args.temperature, "top_k": args.top_k,
                              "top_p": args.top_p, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
                              "kv_cache": not args.no_kv_cache, "stop_at_eot": not args.no_stop_at_eot}))
        else:
            print(f"--- sample {n + 1}/{args.num_samples} (step {loaded.step}, {len(ids)} tokens"
                  f"{', end of text' if ended else ''}) ---")
            print(text + body)


def _lm_eval_cli(args) -> None:
    try:
        from mhl_jax import harness
    except ImportError as e:
        raise ConfigError(f"lm-eval needs the lm-eval package (pip install -e '.[eval]'): {e}") from e
    harness.cli(args)


def _check_numbers(args, parser: argparse.ArgumentParser) -> None:
    """Numbers out of range refused by the command's `parser` (its usage, one error line, status 2): before anything
    is read, lm-eval's task index or the model."""
    if args.command == "generate":
        if args.num_samples < 1:
            parser.error(f"--num-samples {args.num_samples}: must be >= 1")
        if args.max_new_tokens < 1:  # 0 would print the prompt alone, as if the model had ended the text
            parser.error(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        if not (math.isfinite(args.temperature) and args.temperature >= 0):
            parser.error(f"--temperature {args.temperature}: must be a number >= 0 (0: the most likely token)")
        if args.top_k < 0:
            parser.error(f"--top-k {args.top_k}: must be >= 0 (0: no cut)")
        if not 0 < args.top_p <= 1:
            parser.error(f"--top-p {args.top_p}: must be in (0, 1] (1: no cut)")
    elif args.command == "lm-eval":
        if args.limit is not None and args.limit < 1:
            parser.error(f"--limit {args.limit}: must be >= 1 (leave it out: every example)")
        if args.batch_size < 1:
            parser.error(f"--batch-size {args.batch_size}: must be >= 1")
        if args.num_fewshot is not None and args.num_fewshot < 0:
            parser.error(f"--num-fewshot {args.num_fewshot}: must be >= 0 (leave it out: the task's own)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mhl_jax.infer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("run_dir", metavar="RUN_DIR", help="a logging.run_dir written by train.py")
    common.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the latest)")
    common.add_argument("--checkpoint", default=None, metavar="PATH",
                        help="a checkpoint elsewhere: a step directory, or a directory of them (its latest)")
    common.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the run's config.yaml (repeatable)")
    common.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    sub.add_parser("evaluate", parents=[common], help="validation loss and perplexity of a checkpoint")
    g = sub.add_parser("generate", parents=[common], help="sample text from a checkpoint")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="", help="the text to continue (default: empty, a new document)")
    src.add_argument("--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE (UTF-8)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    g.add_argument("--top-k", type=int, default=50,
                   help="sample among the k most likely tokens (0, or k past the vocabulary: all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="then among the fewest most likely tokens whose probability reaches p (1: all)")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-kv-cache", action="store_true",
                   help="read every token from a forward over the whole window (slower; the same tokens up to "
                        "rounding)")
    g.add_argument("--no-stop-at-eot", action="store_true",
                   help=f"go on past the end-of-text token (shown as {EOT_MARK})")
    h = sub.add_parser("lm-eval", parents=[common], help="lm-evaluation-harness tasks on a checkpoint "
                       "(mhl_jax.harness; pip install -e '.[eval]')")
    h.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (e.g. piqa,arc_easy)")
    h.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    h.add_argument("--limit", type=int, default=None, help="at most this many examples per task")
    h.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    h.add_argument("--include-path", default=None, metavar="DIR", help="a directory of task YAML files of your own")
    h.add_argument("--out", default=None, metavar="FILE",
                   help="the results JSON (default: RUN_DIR/lm_eval-step<N>.json, beside the run's records)")
    args = ap.parse_args(argv)
    _check_numbers(args, sub.choices[args.command])
    try:
        if args.command == "evaluate":
            r = evaluate_run(load_run(args.run_dir, args.overrides, args.step, args.checkpoint))
            left = (f"; {r['sequences_left_out']} more left out: not a whole batch" if r["sequences_left_out"]
                    else "")
            print(json.dumps(r) if args.json else
                  f"step {r['step']}: val_loss {r['val_loss']:.4f} val_ppl {r['val_ppl']:.2f} ({r['sequences']} "
                  f"validation sequences of {r['context']} tokens, in batches of {r['batch']}{left})")
        elif args.command == "lm-eval":
            _lm_eval_cli(args)
        else:
            _generate_cli(args)
    except INPUT_ERRORS as e:
        print(input_error_line(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a run directory or prompt file that cannot be read
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
