"""A small-scale version of the paper's Table 2 and its two ablations, on real text (mostly English) that installs
offline.

    python -m bench.quality corpus --out data/debian_text
    python -m mhl_jax.data.prepare --input 'data/debian_text/*.jsonl' --train-tokenizer 16384 \\
        --val-fraction 0.02 --out data/debian_bpe16k
    python -m bench.quality run --data data/debian_bpe16k --seed 0 --out quality.jsonl   # docs/quality.md's run
    python -m bench.quality plot quality.jsonl --out quality.png

`corpus` writes the text of three Debian packages as JSON lines, one document per line: the Linux kernel's
documentation sources (`linux-doc-6.12`, reStructuredText), Python's documentation sources (`python3.11-doc`) and the
King James Bible (`bible-kjv`, one document per book). Packages not installed are fetched with `apt-get download`
and unpacked into `--cache`; the Bible is read through the `bible` program (`apt-get install bible-kjv`). The kernel's
documentation includes its translations (Documentation/translations: about 9% of the corpus's characters, Chinese,
Japanese, Korean and others). `--out/manifest.json` records each package's version and each file's size and sha256,
so a second corpus can be checked against the first.

`run` trains the models of `MODELS` one after another with train.py on the same token stream (same data seed, same
batches, same steps), each at the paper's shapes scaled down together: d = 512 (the paper's 1024 / 2), 8 layers of
which the first 2 are dense stems, context 512, k x de = d so that every sparse model's experts hold as many active
parameters per token as the dense MLP's hidden layer; Ne, k, Nh and de / d as in the paper's 2.2B configs. The
shared training settings are the paper's (AdamW 0.9 / 0.95, weight decay 0.1, clip 1, warmup 8/15 and decay 2/15 of
the steps) at a learning rate for this size (`--lr`). Each model writes its run directory under
`--runs/seed<S>/NAME` (an earlier run there is deleted first); one JSON line per model goes to `--out`:
`mhl_jax.compare.summarize`'s row plus the smallest expert load at the end (relative to uniform, beside the largest),
the validation curve, the settings, seed and device.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import JsonLines, device_name, today, user_env
from mhl_jax.compare import read_run, summarize
from mhl_jax.config import ConfigError
from mhl_jax.data.errors import DataError
from mhl_jax.data.tokenizers import read_ranks
from mhl_jax.plots import pyplot, save

ROOT = Path(__file__).resolve().parents[1]  # train.py and configs/ are found from here, whatever the working directory

PACKAGES = {  # corpus name -> (Debian package, where its text lies once unpacked, globs of its text files)
    "linux_doc": ("linux-doc-6.12", "usr/share/doc/linux-doc-6.12/Documentation", ("**/*.rst.gz", "**/*.txt.gz")),
    "python_doc": ("python3.11-doc", "usr/share/doc/python3.11/html/_sources", ("**/*.rst.txt",)),
}
BIBLE_RANGE = "gen1:1-rev22:21"  # every verse, for `bible -f`

# Each model is its paper config (configs/NAME.yaml) with every width scaled down together: d 1024 -> 512, the
# experts' de = d / 4 (k x de = d, the dense MLP's hidden), the MH sub-token width dh = d / Nh; Ne, k and Nh as there.
SHAPE = {"model.d_model": 512, "model.n_layers": 8, "model.n_heads": 8, "model.head_dim": 64, "model.context": 512,
         "ffn.stem_layers": 2, "ffn.stem_hidden": 2048}
MH = {"ffn.latent_dim": 512, "ffn.expert_hidden": 128, "ffn.head_dim": 64}
LR = 1e-3  # the usual peak rate at this size (the paper's 5e-4 is for its 0.2B-active models; checked in the docs)
MODELS = {  # name -> (paper config, its scaled-down widths)
    # Table 2's five models
    "mlp": ("mlp_0.2b", {"ffn.hidden": 512}),
    "moe": ("moe_ep_2.2b", {"ffn.expert_hidden": 128}),
    "latent_moe": ("latent_moe_ep_2.2b", {"ffn.expert_hidden": 128, "ffn.latent_dim": 512}),
    "mh_latent_moe": ("mh_latent_moe_hp_2.2b", MH),
    "mh_latent_moe_g": ("mh_latent_moe_hp_g_2.2b", {**MH, "ffn.expert_hidden": 64}),
    # the ablations: head configurations (Nh x dh = d kept) and separate routing sub-tokens
    "mh_16x32": ("mh_latent_moe_hp_2.2b_16x64", {**MH, "ffn.head_dim": 32}),
    "mh_4x128": ("mh_latent_moe_hp_2.2b_4x256", {**MH, "ffn.head_dim": 128}),
    "mh_separate_routing": ("mh_latent_moe_hp_2.2b", {**MH, "ffn.routing_tokens": "separate"}),
}
TABLE2 = ("mlp", "moe", "latent_moe", "mh_latent_moe", "mh_latent_moe_g")


def _documents_of(root: Path, patterns: tuple[str, ...]):
    for path in sorted(p for pattern in patterns for p in root.glob(pattern)):
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8", errors="replace").strip()
        if text:
            yield text


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """`cmd`, or exit with one line naming it (a missing program or a failed download is not a traceback)."""
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)
    except (OSError, subprocess.CalledProcessError) as e:
        err = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
        sys.exit(f"corpus: {' '.join(cmd)} failed: {err[-1] if err else e}")


def _unpacked(package: str, text_dir: str, cache: Path) -> tuple[Path, str]:
    """Where `package`'s text lies, and its version: installed under /, or else downloaded (alone in a fresh
    directory, so no older download is taken for it) and unpacked into `cache`."""
    if (Path("/") / text_dir).is_dir():
        return Path("/") / text_dir, _run(["dpkg-query", "-W", "-f=${Version}", package]).stdout
    root = cache / package
    if not (root / text_dir).is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            _run(["apt-get", "download", package], cwd=tmp)
            deb = str(next(Path(tmp).glob("*.deb")))
            _run(["dpkg-deb", "-x", deb, str(root)])
            (root / "VERSION").write_text(_run(["dpkg-deb", "-f", deb, "Version"]).stdout.strip())
    version = root / "VERSION"
    return root / text_dir, version.read_text() if version.is_file() else "unknown"


def bible_books() -> list[str]:
    """The King James Bible, one text per book (verse references dropped), through the `bible` program."""
    if shutil.which("bible") is None:
        sys.exit("corpus: the `bible` program is missing: apt-get install bible-kjv")
    out = _run(["bible", "-f", BIBLE_RANGE]).stdout
    books: dict[str, list[str]] = {}
    for line in out.splitlines():
        ref, _, verse = line.partition(" ")
        book = ref.rstrip("0123456789:")  # "Ge1:1" -> "Ge"
        if verse:
            books.setdefault(book, []).append(verse.strip())
    return ["\n".join(verses) for verses in books.values()]


def corpus(out: Path, cache: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sources, versions = {}, {}
    for name, (pkg, text_dir, patterns) in PACKAGES.items():
        where, versions[pkg] = _unpacked(pkg, text_dir, cache)
        sources[name] = _documents_of(where, patterns)
    sources["bible_kjv"] = iter(bible_books())
    versions["bible-kjv"] = _run(["dpkg-query", "-W", "-f=${Version}", "bible-kjv"]).stdout
    files = {}
    for name, docs in sources.items():
        n = chars = 0
        tmp = out / f"{name}.jsonl.tmp"
        with tmp.open("w") as f:
            for text in docs:
                f.write(json.dumps({"text": text}) + "\n")
                n, chars = n + 1, chars + len(text)
        tmp.replace(out / f"{name}.jsonl")
        data = (out / f"{name}.jsonl").read_bytes()
        files[f"{name}.jsonl"] = {"documents": n, "characters": chars, "bytes": len(data),
                                  "sha256": hashlib.sha256(data).hexdigest()}
        print(f"corpus: {name}: {n} documents, {chars / 1e6:.1f}M characters -> {out / name}.jsonl")
    (out / "manifest.json").write_text(json.dumps({"packages": versions, "files": files}, indent=1) + "\n")


def vocab_of(data: Path) -> int:
    """model.vocab_size for prepare's tokenizer in `data`: its ranks and the end-of-text id after them."""
    path = data / "tokenizer.tiktoken"
    if not path.is_file():
        sys.exit(f"--data {str(data)!r}: no tokenizer.tiktoken there (prepare it with --train-tokenizer)")
    try:
        return len(read_ranks(str(path))) + 1
    except DataError as e:
        sys.exit(f"--data {str(data)!r}: {e}")


def run_settings(name: str, data: Path, run_dir: Path, args: argparse.Namespace) -> dict:
    """Every config field a model's run sets on top of its paper config (then `--set` on top of these)."""
    eval_every = max(1, args.steps // args.evals)
    return {**SHAPE, **MODELS[name][1], "name": f"quality_{name}", "model.vocab_size": vocab_of(data),
            "train.seed": args.seed, "train.global_batch": args.batch, "train.micro_batch": args.batch,
            "schedule.total_steps": args.steps, "optimizer.lr": args.lr,
            "data.source": "bin", "data.path": str(data), "data.val_path": str(data), "data.tokenizer": "bpe",
            "data.tokenizer_file": str(data / "tokenizer.tiktoken"), "data.val_sequences": args.val_sequences,
            "data.eval_every": eval_every, "checkpoint.every": 0, "logging.run_dir": str(run_dir),
            "logging.log_every": 10, "logging.loads_every": eval_every, "logging.progress_bar": False}


def run_dir_of(name: str, args: argparse.Namespace) -> Path:
    return Path(args.runs) / f"seed{args.seed}" / name


def result(name: str, run_dir: Path, args: argparse.Namespace) -> dict:
    """`compare.summarize`'s row of a finished run, with the smallest load, the validation curve and the settings."""
    row = summarize(run_dir, smooth=10)
    _, recs, _ = read_run(run_dir)
    mins = [v for k, v in recs[-1].items() if k.startswith("load_min/")]
    row.update(model=name, seed=args.seed, lr=args.lr, overrides=args.extra_sets,
               load_min=min(mins) if mins else None,
               val_curve=[[r["step"], r["val_loss"]] for r in recs if r.get("val_loss") is not None],
               device=device_name(), date=today(), bench="quality")
    return row


def run(args: argparse.Namespace) -> int:
    data = Path(args.data).resolve()
    vocab_of(data)  # refused before any model trains
    failed = []
    with JsonLines(args.out) as emit:
        for name in args.models:
            if train(name, data, args):
                emit(result(name, run_dir_of(name, args), args))
            else:
                failed.append(name)
    if failed:
        print(f"quality: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def train(name: str, data: Path, args: argparse.Namespace) -> bool:
    """One model's run with train.py in a fresh process (a failure of one model does not stop the others). An earlier
    run in its directory is deleted first: resuming it would mix two runs' records."""
    run_dir = run_dir_of(name, args).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / f"{MODELS[name][0]}.yaml")]
    for key, value in run_settings(name, data, run_dir, args).items():
        cmd += ["--set", f"{key}={value}"]
    for kv in args.extra_sets:
        cmd += ["--set", kv]
    print(f"quality: {name}: {' '.join(cmd[2:])}", flush=True)
    return subprocess.run(cmd, env=user_env()).returncode == 0


def label(row: dict) -> str:
    extra = [f"lr {row['lr']:g}"] if row.get("lr") != LR else []
    return " ".join([row["model"], *extra, *row.get("overrides", [])])


def plot(rows: list[dict], path: str) -> None:
    """Validation loss against tokens: Table 2's models (left; one line style per seed) and the MH-LatentMoE variants
    at seed 0 (right: head configurations, routing tokens, the learning-rate and balancing-rate checks)."""
    plt = pyplot("plot")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors: dict[str, str] = {}
    lows = [min(v for _, v in r["val_curve"]) for r in rows if r.get("val_curve")]
    for row in rows:
        if not row.get("val_curve"):
            continue
        per_step = row["tokens"] / row["step"]
        xs, ys = [s * per_step for s, _ in row["val_curve"]], [v for _, v in row["val_curve"]]
        table2 = row["model"] in TABLE2 and not row.get("overrides") and row.get("lr") == LR
        if table2:
            line, = left.plot(xs, ys, "-" if row["seed"] == 0 else "--", color=colors.get(row["model"]),
                              label=f"{row['model']} seed {row['seed']}")
            colors.setdefault(row["model"], line.get_color())
        if row["seed"] == 0 and row["model"].startswith("mh_"):
            right.plot(xs, ys, "-" if row["model"] == "mh_latent_moe" and table2 else "-.", label=label(row))
    for ax, title in ((left, "Table 2's models"), (right, "MH-LatentMoE (8 x 64) against its variants, seed 0")):
        ax.set_xlabel("training tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(min(lows) - 0.1, min(lows) + 1.0)  # the last stretch, where the models part; the start is off
    left.set_ylabel("validation loss (nats / token)")
    fig.tight_layout()
    save(fig, path, "plot --out", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="write the Debian text corpus as JSON lines")
    c.add_argument("--out", required=True)
    c.add_argument("--cache", default="data/debian_debs", help="where packages not installed are unpacked")
    r = sub.add_parser("run", help="train the models on a prepared corpus")
    r.add_argument("--data", required=True, help="prepare's --out: shards and tokenizer.tiktoken")
    r.add_argument("--runs", default="runs/quality",
                   help="run directories go to RUNS/seed<S>/<model> (one there already is deleted first)")
    r.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, default=700, help="700 x 32 x 512: 0.93 of the Debian corpus's epoch")
    r.add_argument("--batch", type=int, default=32, help="sequences per step (of model.context 512 tokens)")
    r.add_argument("--lr", type=float, default=LR)
    r.add_argument("--val-sequences", type=int, default=480, help="validation windows (the corpus's 2%% holds 491)")
    r.add_argument("--evals", type=int, default=10, help="validation points over the run")
    r.add_argument("--set", dest="extra_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="one more config override for every model, e.g. --set ffn.balance_gamma=0.01 (repeatable)")
    r.add_argument("--out", default=None, metavar="FILE.jsonl", help="also append the JSON lines to this file")
    p = sub.add_parser("plot", help="validation curves of `run`'s JSON lines as a PNG")
    p.add_argument("results", nargs="+", help="JSON lines files written by run --out")
    p.add_argument("--out", required=True, metavar="FILE.png")
    args = ap.parse_args(argv)
    if args.cmd == "plot":
        try:
            plot([json.loads(line) for f in args.results for line in Path(f).read_text().splitlines() if line],
                 args.out)
        except ConfigError as e:
            sys.exit(f"quality: {e}")
        return 0
    if args.cmd == "corpus":
        corpus(Path(args.out), Path(args.cache))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
