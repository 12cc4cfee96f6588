"""lm-evaluation-harness on our checkpoints (mhl_jax.harness): two tasks of our own, defined as lm-eval defines any
task (a YAML file over local JSON lines: no download), a multiple-choice one and a loglikelihood one, evaluated
through lm-eval's entry points and ours; every accuracy as computed again here from the model's own forward on the
same examples. Generation: greedy continuations against argmax decoding by repeated forwards."""

import functools
import json
import logging
import sys

import numpy as np
import pytest
from flax import nnx

from mhl_jax.data.tokenizers import BYTE_EOT
from tests.saved import saved_random_run

lm_eval = pytest.importorskip("lm_eval")
import datasets  # noqa: E402  (lm-eval's dependency)

from mhl_jax import harness  # noqa: E402  (after the skip: lm-eval is an optional dependency)
from mhl_jax.infer import main as infer_main  # noqa: E402

QUESTIONS = [("The cat sat on the", ["mat", "moon", "sky"], 0), ("Water is", ["wet", "dry", "loud"], 0),
             ("One, two,", ["three", "blue", "seven"], 0), ("The sun rises in the", ["east", "west", "bag"], 0),
             ("Bread is made from", ["flour", "stone", "glass"], 0), ("A dog says", ["woof", "meow", "moo"], 1)]
CLOZE = [("The quick brown fox jumps over the lazy", " dog"),  # 44 tokens: the last 33 are scored
         ("To be or not to", " be"), ("Once upon a", " time"), ("abcabcabcabc", "abc")]


def _tasks(tmp_path):
    """tmp_path/tasks: tiny_mc (multiple choice, acc) and tiny_cloze (loglikelihood: acc = greedy, perplexity)."""
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "mc.jsonl").write_text("".join(json.dumps({"q": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS))
    (d / "cloze.jsonl").write_text("".join(json.dumps({"ctx": c, "target": t}) + "\n" for c, t in CLOZE))
    (d / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (d / "tiny_cloze.yaml").write_text(f"""task: tiny_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'cloze.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{ctx}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
""")
    return d


def _own_scores(model, pairs: list[tuple[str, str]], context: int = 32) -> list[tuple[float, bool]]:
    """Each continuation's log-likelihood after [EOT] + its context, and whether argmax gives each of its tokens: the
    model's forward over each sequence's last `context` + 1 byte tokens (a model sees no more), all in one batch
    (rows padded at the end, which a causal model's earlier positions never see)."""
    seqs = [[BYTE_EOT, *ctx.encode(), *cont.encode()][-(context + 1):] for ctx, cont in pairs]
    batch = np.zeros((len(seqs), context), np.int32)
    for r, ids in enumerate(seqs):
        batch[r, :len(ids) - 1] = ids[:-1]
    logits = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, batch), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    out = []
    for r, ((_, cont), ids) in enumerate(zip(pairs, seqs)):
        span = range(len(ids) - 1 - len(cont.encode()), len(ids) - 1)
        out.append((sum(logp[r, i, ids[i + 1]] for i in span), all(logits[r, i].argmax() == ids[i + 1] for i in span)))
    return out


def test_lm_eval_tasks_give_the_accuracies_of_the_models_own_forward(tmp_path, monkeypatch, capsys):
    run, model, cfg = saved_random_run(tmp_path, "mh_latent_moe")
    tasks = _tasks(tmp_path)
    scores = iter(_own_scores(model, [(q, " " + c) for q, choices, _ in QUESTIONS for c in choices]))
    mc = np.mean([np.argmax([next(scores)[0] for _ in choices]) == a for _, choices, a in QUESTIONS])
    cloze = _own_scores(model, CLOZE)
    want = {"tiny_mc": {"acc": mc}, "tiny_cloze": {"acc": np.mean([g for _, g in cloze]),
                                                   "perplexity": np.exp(-np.mean([ll for ll, _ in cloze]))}}

    # ours: python -m mhl_jax.infer lm-eval, writing the results beside the run
    assert infer_main(["lm-eval", str(run), "--tasks", "tiny_mc,tiny_cloze", "--include-path", str(tasks),
                       "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert f"results: {run / 'lm_eval-step3.json'}" in out and "step 3 tiny_mc: acc " in out
    ours = json.loads((run / "lm_eval-step3.json").read_text())
    assert ours["step"] == 3
    for task, metrics in want.items():
        for name, value in metrics.items():
            assert ours["results"][task][f"{name},none"] == pytest.approx(value, rel=1e-5), (task, name)

    # lm-eval's: simple_evaluate with the registered name, and its command line
    tm = lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False)
    got = lm_eval.simple_evaluate(model="mhl_jax", model_args={"run_dir": str(run), "batch_size": 2},
                                  tasks=["tiny_mc"], task_manager=tm)
    assert got["results"]["tiny_mc"]["acc,none"] == pytest.approx(mc)
    # lm-eval's command line as a user runs it, but for indexing its own ~15k task files (which it does three times,
    # ~40 s here): only the task directory given is indexed
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                        include_defaults=False))
    monkeypatch.setattr(sys, "argv", ["lm_eval", "run", "--model", "mhl_jax", "--model_args", f"run_dir={run}",
                                      "--tasks", "tiny_cloze", "--include_path", str(tasks)])
    harness.main()
    assert "tiny_cloze" in capsys.readouterr().out


def test_generation_and_rolling_loglikelihood(tmp_path):
    """generate_until: the argmax continuation of repeated forwards, cut at the stop string; loglikelihood_rolling
    of a text longer than the context: the sum over lm-eval's windows, each as its own forward scores it."""
    run, model, cfg = saved_random_run(tmp_path, "mh_latent_moe")
    lm = harness.MHLJaxLM(str(run))
    ids = [BYTE_EOT, *b"Hello"]
    for _ in range(6):  # the most likely of the tokenizer's 257 ids; the end-of-text id ends the text
        logits = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, np.asarray([ids])))[0, -1]
        ids.append(int(logits[:257].argmax()))
        if ids[-1] == BYTE_EOT:
            break
    text = bytes(i for i in ids[6:] if i < 256).decode("utf-8", errors="replace")

    class Req:
        def __init__(self, *args):
            self.args = args

    stop = text[3] if len(text) > 3 else "\x00"
    got = lm.generate_until([Req("Hello", {"until": [stop], "max_gen_toks": 6})])
    assert got == [text[:text.find(stop)]]
    long = "The rain in Spain stays mainly in the plain. " * 2  # 90 bytes: 3 windows of the 32-token context
    windows = [lm_eval.utils.make_disjoint_window(w) for w in lm_eval.utils.get_rolling_token_windows(
        list(long.encode()), prefix_token=BYTE_EOT, max_seq_len=32, context_len=1)]
    assert len(windows) == 3
    want = 0.0
    for ctx, pred in windows:
        seq = ctx + pred
        logits = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, np.asarray([seq[:-1]])), np.float64)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        want += sum(logp[i, seq[i + 1]] for i in range(len(seq) - 1 - len(pred), len(seq) - 1))
    assert lm.loglikelihood_rolling([Req(long)]) == [pytest.approx(want, rel=1e-5)]


def test_unknown_tasks_and_task_directories_are_refused_before_the_model_is_loaded(tmp_path, monkeypatch, capsys):
    """One line, exit 2, and no model loaded: a task name that neither lm-eval nor --include-path knows (lm-eval's
    own piqa and the directory's tiny_mc are known), an --include-path that is missing or a file."""
    tasks = _tasks(tmp_path)
    monkeypatch.setattr(harness, "load_run", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "afile").write_text("")
    for argv, line in [
        (["--tasks", "piqa,tiny_mc,nonexistent_task", "--include-path", str(tasks)],
         "config error: --tasks: unknown lm-eval task 'nonexistent_task' (not a task, group or tag of lm-eval or of "
         f"--include-path '{tasks}', nor a task YAML file); `python -m mhl_jax.harness ls tasks --include_path "
         f"{tasks}` lists them"),
        (["--tasks", "tiny_mc", "--include-path", str(tmp_path / "none")],
         f"config error: --include-path '{tmp_path / 'none'}' does not exist (expected a directory of task YAML "
         "files)"),
        (["--tasks", "tiny_mc", "--include-path", str(tmp_path / "afile")],
         f"config error: --include-path '{tmp_path / 'afile'}' is a file, not a directory (expected a directory of "
         "task YAML files)"),
    ]:
        capsys.readouterr()
        assert infer_main(["lm-eval", str(tmp_path), *argv]) == 2
        assert capsys.readouterr().err.splitlines() == [line]


def test_task_data_that_cannot_be_fetched_is_a_data_error(tmp_path, monkeypatch, capsys):
    """Offline, `datasets` cannot reach the Hub for a task's data: one `data error:` line, exit 2, no results file;
    huggingface_hub's and datasets' warnings (a download's retries) print once, through their own handlers."""
    run, _, _ = saved_random_run(tmp_path, "mh_latent_moe")
    tasks = _tasks(tmp_path)

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    hub, data = logging.getLogger("huggingface_hub"), logging.getLogger("datasets")
    monkeypatch.setattr(hub, "propagate", True)
    monkeypatch.setattr(data, "propagate", True)
    capsys.readouterr()
    assert infer_main(["lm-eval", str(run), "--tasks", "tiny_mc", "--include-path", str(tasks)]) == 2
    # the last line: lm-eval's own log lines come before it
    assert capsys.readouterr().err.splitlines()[-1] == ("data error: lm-eval tasks tiny_mc: Couldn't reach "
                                                        "'baber/piqa' on the Hub (LocalEntryNotFoundError)")
    assert not list(run.glob("lm_eval-*.json"))
    assert not hub.propagate and not data.propagate
