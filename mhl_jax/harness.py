"""lm-evaluation-harness for our checkpoints: the paper's zero-shot tasks (HellaSwag, PIQA, LAMBADA, ARC) on a run.

    python -m mhl_jax.infer lm-eval RUN_DIR --tasks hellaswag,piqa,lambada_openai,arc_easy,arc_challenge
    python -m mhl_jax.harness run --model mhl_jax --model_args run_dir=RUN_DIR --tasks piqa   # lm-eval's own CLI
    lm_eval.simple_evaluate(model="mhl_jax", model_args={"run_dir": RUN_DIR}, tasks=[...])  # after importing this

Importing this module registers the model class `MHLJaxLM` with lm-eval under the name "mhl_jax". It answers lm-eval's
three request kinds on the run's mesh, in batches:
- `loglikelihood(context, continuation)`: one forward over [EOT] + context + continuation (the last model.context + 1
  tokens), the sum of the continuation's token log-probabilities, and whether greedy decoding would give it;
- `loglikelihood_rolling(text)`: a text's whole log-likelihood over windows of model.context tokens (lm-eval's own
  rolling windows: every window after the first conditions on the full context before it);
- `generate_until(context, {until, max_gen_toks})`: greedy continuation with the KV cache
  (`mhl_jax.generation.generate`), cut at the first stop string.
A document starts with the end-of-text token, as the model was trained. Any trailing spaces of a context move to
the front of its continuation (lm-eval's convention: a byte or BPE tokenizer then sees " word" as it saw it in
training).
"""

from __future__ import annotations

import difflib
import json
import sys
from functools import partial
from pathlib import Path

import datasets
import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm_eval import simple_evaluate
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mhl_jax.config import ConfigError
from mhl_jax.data.errors import DataError
from mhl_jax.data.tokenizers import get_tokenizer
from mhl_jax.generation import generate
from mhl_jax.runtime.restore import Loaded, load_run


def _target_logprobs(graphdef, params, biases, tokens, targets):
    """tokens, targets (B, T) int32 -> each target's log-probability after the tokens up to it, and whether it is
    the most likely id there: (B, T) fp32, (B, T) bool."""
    logits = nnx.merge(graphdef, params, biases)(tokens)[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def split_space(context: str, continuation: str) -> tuple[str, str]:
    """Trailing spaces of the context moved to the front of the continuation."""
    stripped = context.rstrip(" ")
    return stripped, context[len(stripped):] + continuation


@register_model("mhl_jax")
class MHLJaxLM(LM):
    """A run's checkpoint as an lm-eval model. model_args: run_dir (required), step or checkpoint (default: the
    latest), batch_size (sequences per forward, rounded up to a multiple of the mesh's devices; default 8), overrides
    (`key=value` config overrides joined by ';', e.g. "parallel.devices=1;ffn.kernels=reference")."""

    def __init__(self, run_dir: str, step: int | None = None, checkpoint: str | None = None, batch_size: int = 8,
                 overrides: str = "", **_ignored) -> None:
        super().__init__()
        sets = [o for o in str(overrides).split(";") if o.strip()]
        self.loaded: Loaded = load_run(run_dir, sets, None if step in (None, "") else int(step), checkpoint or None)
        cfg = self.loaded.cfg
        self.tok = get_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_file)
        devices = self.loaded.mesh.size
        self.batch = -(-max(int(batch_size), 1) // devices) * devices
        self.context = cfg.model.context
        self._fn = jax.jit(partial(_target_logprobs, self.loaded.graphdef),
                           compiler_options=self.loaded.compiler_options or None)

    @property
    def step(self) -> int:
        return self.loaded.step

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tok.encode(text)]

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (the continuation's log-likelihood, whether greedy gives it), each over
        the last model.context + 1 ids of context + continuation (a continuation longer than that: its last ids)."""
        t, out = self.context, []
        rows = NamedSharding(self.loaded.mesh, P(tuple(self.loaded.mesh.axis_names), None))
        for first in range(0, len(pairs), self.batch):
            chunk = pairs[first:first + self.batch]
            tokens = np.zeros((self.batch, t), np.int32)
            targets = np.zeros((self.batch, t), np.int32)
            spans = []
            for r, (ctx, cont) in enumerate(chunk):
                seq = (ctx + cont)[-(t + 1):]
                tokens[r, :len(seq) - 1], targets[r, :len(seq) - 1] = seq[:-1], seq[1:]
                spans.append((len(seq) - 1 - min(len(cont), len(seq) - 1), len(seq) - 1))
            lp, greedy = self._fn(self.loaded.params, self.loaded.biases, jax.device_put(tokens, rows),
                                  jax.device_put(targets, rows))
            lp, greedy = np.asarray(lp, np.float64), np.asarray(greedy)
            out += [(float(lp[r, a:b].sum()), bool(greedy[r, a:b].all())) for r, (a, b) in enumerate(spans)]
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = split_space(*req.args)
            pairs.append(([self.tok.eot] + self._encode(context), self._encode(continuation)))
        return self.score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for req in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self._encode(req.args[0]), prefix_token=self.tok.eot, max_seq_len=self.context, context_len=1)]
            out.append(sum(ll for ll, _ in self.score(windows)))
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = generate(self.loaded, [[self.tok.eot] + self._encode(context)],
                           int(kwargs.get("max_gen_toks", 256)), temperature=0.0, vocab=self.tok.vocab_size,
                           stop=self.tok.eot)[0]
            text = self.tok.decode([i for i in ids if i != self.tok.eot])
            cut = min([text.find(s) for s in until if s and s in text], default=len(text))
            out.append(text[:cut])
        return out


def _known(manager: TaskManager, task: str) -> bool:
    """Whether simple_evaluate can load `task`: a task, group or tag name `manager` indexed, or a task YAML file."""
    return task in manager.task_index or Path(task).expanduser().is_file()


def task_manager(tasks: list[str], include_path: str | None = None) -> TaskManager:
    """The TaskManager that knows every one of `tasks`. ConfigError for an --include-path that is not a directory or
    a task none knows: refused here, before a model is loaded, not by simple_evaluate after it."""
    if not tasks:
        raise ConfigError("--tasks: no task names given (e.g. --tasks piqa,arc_easy)")
    if include_path is not None:
        where = Path(include_path).expanduser()
        if not where.is_dir():
            what = "is a file, not a directory" if where.exists() else "does not exist"
            raise ConfigError(f"--include-path {include_path!r} {what} (expected a directory of task YAML files)")
        include_path = str(where)
        # lm-eval's own ~15k task files take seconds to index: only when the directory's do not cover `tasks`
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.task_index for t in tasks):  # (a YAML file named in --tasks may need lm-eval's own tasks)
            return own
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not _known(manager, t)]
    if unknown:
        close = [m for t in unknown for m in difflib.get_close_matches(t, manager.all_tasks, n=1, cutoff=0.8)]
        where = f" or of --include-path {include_path!r}" if include_path is not None else ""
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        ls = "ls tasks" + (f" --include_path {include_path}" if include_path is not None else "")
        raise ConfigError(f"--tasks: unknown lm-eval task{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(map(repr, unknown))} (not a task, group or tag of lm-eval{where}, nor a task "
                          f"YAML file{hint}); `python -m mhl_jax.harness {ls}` lists them")
    return manager


def evaluate_tasks(run_dir: str, tasks: list[str], *, overrides=(), step=None, checkpoint=None, batch_size=8,
                   num_fewshot=None, limit=None, include_path=None) -> dict:
    """lm_eval.simple_evaluate of the run's checkpoint on `tasks` (task names, or tasks of YAML files under
    `include_path`): its results dict, with the step and the run added. DataError for an OSError while lm-eval
    fetches or reads task data (offline, a missing data file, a full cache disk)."""
    manager = task_manager(tasks, include_path)
    lm = MHLJaxLM(run_dir, step, checkpoint, batch_size, ";".join(overrides))
    try:
        results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                  log_samples=False)
    except OSError as e:  # what `datasets` raises for data it cannot download (ConnectionError) or find
        raise DataError(f"lm-eval tasks {','.join(tasks)}: {e}") from e
    return {"run": str(run_dir), "step": lm.step, "tasks": tasks, "results": results["results"],
            "versions": results.get("versions"), "n-shot": results.get("n-shot")}


def write_results(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(out)


def _hf_logs_once() -> None:
    """Print each warning of huggingface_hub and datasets (a download's retries) once: each library has its own
    stderr handler and also propagates to the root logger, which absl's first log call gives a handler too."""
    huggingface_hub.utils.logging.disable_propagation()
    datasets.utils.logging.disable_propagation()


def cli(args) -> None:
    """`python -m mhl_jax.infer lm-eval`: evaluate, write the results JSON, print one line per task."""
    _hf_logs_once()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    r = evaluate_tasks(args.run_dir, tasks, overrides=args.overrides, step=args.step, checkpoint=args.checkpoint,
                       batch_size=args.batch_size, num_fewshot=args.num_fewshot, limit=args.limit,
                       include_path=args.include_path)
    out = Path(args.out) if args.out else Path(args.run_dir) / f"lm_eval-step{r['step']}.json"
    write_results(r, out)
    if args.json:
        print(json.dumps(r, default=str))
        return
    for task, metrics in r["results"].items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and "stderr" not in k)
        print(f"step {r['step']} {task}: {shown}")
    print(f"results: {out}")


def main() -> None:
    """lm-eval's own command line, with the model "mhl_jax" registered (this module's import)."""
    _hf_logs_once()
    cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())
