"""`python -m mhl_jax.infer`: a checkpoint's validation loss and text sampled from it.

Evaluation is checked against the train loop's own records at the steps it evaluated; generation against an
independent forward pass of the model over the unpadded sequence at every new token (GPT.__call__ on the tokens so
far, the last `context` of them), and the sampler's rules on logits made up for it.
"""

import json
import os
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mhl_jax import generation
from mhl_jax.config import ConfigError, load_config
from mhl_jax.generation import generate, next_logits, sample_logits
from mhl_jax.infer import main
from mhl_jax.runtime.checkpoint import Checkpointer
from mhl_jax.runtime.checkpoint_meta import model_fingerprint
from mhl_jax.runtime.evaluate import evaluate_run
from mhl_jax.runtime.restore import load_run
from mhl_jax.runtime.state import state_creator
from mhl_jax.train.loop import train
from mhl_jax.train.optimizer import make_optimizer

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 32
TOKENIZER_VOCAB = 257  # byte tokenizer; the tiny model's embedding has 320 rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny MH-LatentMoE run of 60 steps on one device, checkpoints and evaluations at steps 30 and 60. One layer,
    an MoE one: every program here compiles in about half the time of two layers' (the caches of several layers:
    tests/e2e/test_kv_cache.py)."""
    d = tmp_path_factory.mktemp("infer") / "run"
    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "schedule.total_steps=60", "schedule.warmup_steps=5", "schedule.decay_steps=10", "model.n_layers=1",
        "ffn.stem_layers=0", f"model.context={CONTEXT}", "train.global_batch=8", "train.micro_batch=4",
        "data.val_sequences=12", "data.eval_every=30", "checkpoint.every=30", "checkpoint.async_save=false",
        "logging.progress_bar=false", f"logging.run_dir={d}", "parallel.devices=1"])
    train(cfg, log=lambda *a, **k: None)
    return d


@pytest.fixture(scope="module")
def two(run_dir):
    """The latest checkpoint on 2 devices at hp = 2 (3 rows padded to 4), shared by the generation tests: generate keeps
    its jitted functions per sampler in it (`Loaded.jitted`), so each sampler and shape compiles once for the file."""
    return load_run(run_dir, ["parallel.devices=2", "parallel.hp=2"])


@pytest.fixture(scope="module")
def forward(run_dir):
    """The reference: the model's own forward on one device (Head Parallel splits a batch's tokens evenly), logits
    (T, V) of one row of T real tokens; one compile per T."""
    one = load_run(run_dir)
    model = nnx.merge(one.graphdef, one.params, one.biases)
    return jax.jit(lambda toks: model(toks)[0][0])


def records(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_evaluate_gives_the_train_loops_validation_loss(run_dir):
    recs = records(run_dir)
    for step in (30, 60):
        r = evaluate_run(load_run(run_dir, step=step))
        assert r["step"] == step
        assert r["val_loss"] == recs[step]["val_loss"]  # same sequences, batches and step function: bitwise
        assert r["val_ppl"] == pytest.approx(np.exp(recs[step]["val_loss"]), rel=1e-12)
        assert (r["sequences"], r["context"]) == (12, CONTEXT)  # 3 batches of train.micro_batch = 4
    assert evaluate_run(load_run(run_dir))["step"] == 60  # the latest by default


def test_evaluate_on_another_mesh_and_validation_set(run_dir):
    base = evaluate_run(load_run(run_dir, ["data.val_sequences=8"]))
    two = evaluate_run(load_run(run_dir, ["data.val_sequences=8", "parallel.devices=2", "parallel.hp=2"]))
    assert base["sequences"] == two["sequences"] == 8  # 2 batches of 4, 1 of 4 x 2 devices
    assert two["val_loss"] == pytest.approx(base["val_loss"], rel=1e-5)
    other = evaluate_run(load_run(run_dir, ["data.val_sequences=4"]))  # one batch of 4, as base's
    assert other["sequences"] == 4 and abs(other["val_loss"] - base["val_loss"]) > 1e-6  # another set, another loss
    # a micro-batch the run's global batch (8) does not divide: the evaluation needs none; 2 of 10 left out, said so
    wide = evaluate_run(load_run(run_dir, ["data.val_sequences=10", "train.micro_batch=8"]))
    narrow = evaluate_run(load_run(run_dir, ["data.val_sequences=10"]))  # batches of 4: the same first 8 sequences
    assert (wide["batch"], wide["sequences"], wide["sequences_left_out"]) == (8, 8, 2)
    assert (narrow["batch"], narrow["sequences"], narrow["sequences_left_out"]) == (4, 8, 2)
    assert wide["val_loss"] == pytest.approx(narrow["val_loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="train.global_batch=8 is not a multiple of train.micro_batch=3"):
        load_run(run_dir, ["train.micro_batch=3", "train.global_batch=8"])  # an explicit global batch is kept


def test_load_reads_the_saved_parameters_and_biases(run_dir):
    cfg = load_config(str(run_dir / "config.yaml"))
    loaded = load_run(run_dir, step=30)
    _, _, abstract = state_creator(cfg, loaded.mesh, make_optimizer(cfg))
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint, model_fingerprint(cfg)) as ckpt:
        _, full = ckpt.restore(abstract, step=30)
    for ours, theirs in ((loaded.params, full["params"]), (loaded.biases, full["biases"])):
        a, b = jax.tree.leaves(ours), jax.tree.leaves(theirs)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.sharding == y.sharding
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(float(jnp.abs(b).max()) > 0 for b in jax.tree.leaves(loaded.biases))  # trained, not the initial 0s


def reference_logits(forward, prompt, out):
    """fp32 logits (len(out), TOKENIZER_VOCAB) of each of `out`'s tokens given what precedes it (the last CONTEXT
    tokens), from the model's own forward (the `forward` fixture) over unpadded windows of the real tokens: one window
    of the first CONTEXT tokens serves every step it covers (the model is causal), then one window per step that
    slides."""
    full = list(prompt) + list(out)
    head = np.asarray(forward(jnp.asarray([full[:CONTEXT]], jnp.int32)))
    rows = []
    for i in range(len(out)):
        n = len(prompt) + i  # tokens before out[i]
        if n <= CONTEXT:
            rows.append(head[n - 1])
        else:
            rows.append(np.asarray(forward(jnp.asarray([full[n - CONTEXT:n]], jnp.int32)))[-1])
    return np.stack(rows)[:, :TOKENIZER_VOCAB]


TEXT = list(b"The function returns the value of the object, or raises an exception if it is not found.")


def test_next_token_logits_are_the_unpadded_forwards(two, forward):
    """generate's padded, batched windows give the logits of the model's own forward over the real tokens only (on 2
    devices at hp = 2, so that rows are padded too; one device runs the same code without the padding rows)."""
    # within the context; one short of it; longer than it (the window slides); 3 rows padded to 4 on 2 devices
    seqs = [[256] + TEXT[:3], [256] + TEXT[:30], [256] + TEXT[:45]]
    ours = next_logits(two, seqs)
    assert ours.shape == (3, 320) and ours.dtype == np.float32
    # the first two are prefixes of the third's first CONTEXT tokens: the model is causal, so one forward over those
    # real tokens gives both (one shape, one compile)
    head = np.asarray(forward(jnp.asarray([seqs[2][:CONTEXT]], jnp.int32)))
    refs = [head[len(seqs[0]) - 1], head[len(seqs[1]) - 1],
            np.asarray(forward(jnp.asarray([seqs[2][-CONTEXT:]], jnp.int32)))[-1]]
    for row, ref in zip(ours, refs):
        np.testing.assert_allclose(row, ref, rtol=1e-5, atol=1e-5)
    assert np.abs(ours[0] - ours[1]).max() > 1e-2  # the rows differ: each reads its own last token


def cached_logits(loaded, seqs, steps):
    """Logits (steps + 1, len(seqs), V) through the KV cache: `_prefill_logits` over the padded windows of `seqs`,
    then `steps` decoding steps, each feeding every row the next byte of TEXT after it (so the rows stay real text),
    and the sequences at each of those points."""
    seqs = [list(q) for q in seqs]
    prefill = jax.jit(partial(generation._prefill_logits, loaded.graphdef))
    decode = jax.jit(partial(generation._decode_logits, loaded.graphdef))
    logits, caches = prefill(loaded.params, loaded.biases, *generation._windows(loaded, seqs))
    casts = jax.jit(partial(generation._weight_casts, loaded.graphdef))(loaded.params, loaded.biases)
    out, seen = [np.asarray(logits)[:len(seqs)]], [[list(q) for q in seqs]]
    for _ in range(steps):
        for q in seqs:
            q.append(TEXT[len(q) - 1])  # q = [256] + TEXT[:n]: its next byte
        toks, pos = generation._decode_inputs(loaded, seqs)  # generate's own: rows padded over the mesh
        assert [int(p) for p in pos][:len(seqs)] == [len(q) - 1 for q in seqs]
        logits, caches = decode(loaded.params, loaded.biases, casts, caches, toks, pos)
        out.append(np.asarray(logits)[:len(seqs)])
        seen.append([list(q) for q in seqs])
    return np.stack(out), seen


def test_kv_cache_decoding_gives_the_forwards_logits(two, forward):
    """A KV cache filled by one forward over the padded windows, then one decoding step per token: at every step
    each row's logits are the model's own forward over that row's real tokens (rows of 4, 21 and 11 tokens, up to
    the full context; 3 rows padded to 4 on 2 devices at hp = 2)."""
    seqs = [[256] + TEXT[:3], [256] + TEXT[:20], [256] + TEXT[:10]]
    steps = CONTEXT - 21  # the longest row reaches the context
    logits, seen = cached_logits(two, seqs, steps)
    assert logits.shape == (steps + 1, 3, 320)
    assert len(seen[-1][1]) == CONTEXT
    # each row's every step is a prefix of its last sequence: the model is causal, so one forward over that sequence
    # gives the logits after each prefix (zeros after the sequence change nothing before them; one shape, one compile)
    for r in range(3):
        final = seen[-1][r]
        ref = np.asarray(forward(jnp.asarray([final + [0] * (CONTEXT - len(final))], jnp.int32)))
        for step in range(steps + 1):
            seq = seen[step][r]
            assert seq == final[:len(seq)]
            np.testing.assert_allclose(logits[step, r], ref[len(seq) - 1], rtol=2e-5, atol=2e-5,
                                       err_msg=f"step {step} row {r}")


def recording_decodes(loaded, monkeypatch, calls):
    """Make generate's decoding loops (`_decode_loop`, jitted as generate jits it) append each call's (positions of the
    real and padded rows, count, steps run) to `calls`."""
    real = generation._generation_fns

    def fns(loaded_, sampler):
        step, prefill, decode, cast = real(loaded_, sampler)

        def recorded(*args):
            ids, caches, steps = decode(*args)
            calls.append((np.asarray(args[5]).tolist(), int(args[8]), int(steps)))
            return ids, caches, steps
        return step, prefill, recorded, cast
    monkeypatch.setattr(generation, "_generation_fns", fns)


def test_kv_cache_generation_is_generation_without_it(two, monkeypatch):
    """The same ids with and without the cache: greedy and sampled (the same seed), 3 rows padded to 4 on a 2-device
    mesh, one of which outgrows the context half-way (from there each token is a forward over sliding windows); a
    stop token that ends one row while the others go on; and a prompt of exactly the context (it slides from its
    second token: no cache is made). Decoding steps run in calls of the device loop of up to DECODE_CHUNK steps,
    here 4: calls of 4 steps and of 1, so that a call is cut by the chunk, then by the context (and by the stop too);
    the default chunk takes the same branches (the other generation tests run it)."""
    chunk = 4
    monkeypatch.setattr(generation, "DECODE_CHUNK", chunk)
    loaded = two
    prompts = [[256] + TEXT[:3], [256] + TEXT[:26], [256] + TEXT[10:15]]  # the second fills the context after 6
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        calls = []
        recording_decodes(loaded, monkeypatch, calls)
        a = generate(loaded, prompts, max_new_tokens=12, vocab=TOKENIZER_VOCAB, **kw)
        # the decoding steps: tokens 1..5 (token 0 from the prefill), the second row's positions 27..31, in calls of
        # up to `chunk` steps; each writes the cache only below the context (the ids alone may not show a step past
        # it: the tiny model's most likely ids barely move there)
        assert sum(n for *_, n in calls) == 5 and all(n == c <= chunk for _, c, n in calls), calls
        assert max(max(p) + c for p, c, _ in calls) == CONTEXT, calls  # the last write at CONTEXT - 1
        b = generate(loaded, prompts, max_new_tokens=12, vocab=TOKENIZER_VOCAB, kv_cache=False, **kw)
        assert a == b and [len(o) for o in a] == [12, 12, 12], kw
        assert kw["temperature"] == 0 or len(set(map(tuple, a))) == 3, kw  # sampled: each row its own draws
    stop = a[0][2]  # the sampled first row's third id
    a = generate(loaded, prompts, max_new_tokens=12, vocab=TOKENIZER_VOCAB, temperature=1.0, seed=3, stop=stop)
    b = generate(loaded, prompts, max_new_tokens=12, vocab=TOKENIZER_VOCAB, temperature=1.0, seed=3, stop=stop,
                 kv_cache=False)
    assert a == b and a[0][-1] == stop and len(a[0]) <= 3 and max(map(len, a)) > 3, (stop, a)
    full = [[256] + TEXT[:CONTEXT - 1]] * 3
    assert generate(loaded, full, 3, temperature=0, vocab=TOKENIZER_VOCAB) == generate(
        loaded, full, 3, temperature=0, vocab=TOKENIZER_VOCAB, kv_cache=False)


def test_greedy_generation_takes_the_most_likely_tokens(two, forward):
    # the second slides past the context after two tokens; 3 rows padded to 4 (the shapes the other tests compile)
    prompts = [[256] + TEXT[:3], [256] + TEXT[:30], [256] + TEXT[10:15]]
    outs = generate(two, prompts, max_new_tokens=9, temperature=0, vocab=TOKENIZER_VOCAB)
    assert [len(o) for o in outs] == [9, 9, 9]
    for prompt, out in zip(prompts, outs):
        for tok, ref in zip(out, reference_logits(forward, prompt, out)):
            assert ref[tok] >= ref.max() - 1e-5 * max(1.0, abs(ref.max())), (tok, int(ref.argmax()))


# Prompts longer than the context: every token is drawn by the step over the windows, which alone compiles for a new
# sampler; the decoding loop draws through the same `sample_logits` and the same keys (the same ids:
# test_kv_cache_generation_is_generation_without_it).
LONG = [256] + TEXT[:40]


def test_sampling_stays_in_the_top_k_and_repeats_with_its_seed(two, forward):
    prompt = LONG
    kw = dict(max_new_tokens=12, temperature=2.0, top_k=3, vocab=TOKENIZER_VOCAB)
    a = generate(two, [prompt, prompt, prompt], seed=1, **kw)  # 3 rows padded to 4 on 2 devices
    assert a == generate(two, [prompt, prompt, prompt], seed=1, **kw)
    assert a != generate(two, [prompt, prompt, prompt], seed=2, **kw)
    assert len({tuple(o) for o in a}) > 1  # each row draws its own tokens
    for out in a:
        for tok, ref in zip(out, reference_logits(forward, prompt, out)):
            kth = np.sort(ref)[-3]
            assert ref[tok] >= kth - 1e-5 * max(1.0, abs(kth)), (tok, np.argsort(ref)[-3:])


def test_generation_stops_at_the_stop_token_and_pads_rows_over_the_mesh(two):
    loaded = two
    prompt = [256, 84, 104, 101]
    greedy = generate(loaded, [prompt] * 3, max_new_tokens=8, temperature=0, vocab=TOKENIZER_VOCAB)[0]
    stop = greedy[3]
    first = greedy.index(stop)
    three = generate(loaded, [prompt] * 3, max_new_tokens=8, temperature=0, vocab=TOKENIZER_VOCAB, stop=stop)
    assert three == [greedy[:first + 1]] * 3  # 3 rows padded to 4 on 2 devices; each ends at its first stop
    with pytest.raises(ConfigError, match=r"stop=257: must be an id in \[0, 257\)"):
        generate(loaded, [prompt], 3, vocab=TOKENIZER_VOCAB, stop=TOKENIZER_VOCAB)


def test_decoding_loop_ends_when_the_real_rows_are_done(two, monkeypatch):
    """One sampled row on 2 devices (padded with a second row that draws its own ids): the device loop stops at the
    step that draws the stop id, not at the call's count, and never starts for a row already done."""
    loaded = two
    prompt = [256] + TEXT[:5]
    kw = dict(max_new_tokens=12, temperature=1.0, seed=5, vocab=TOKENIZER_VOCAB)
    free = generate(loaded, [prompt], **kw)[0]
    stop = free[3]
    first = free.index(stop)
    assert first >= 1, free  # drawn by a decoding step (token 0 is the prefill's)
    calls = []
    recording_decodes(loaded, monkeypatch, calls)
    assert generate(loaded, [prompt], stop=stop, **kw) == [free[:first + 1]]
    assert calls == [([len(prompt)] * 2, 11, first)], calls  # steps 1..first of 11 allowed, one call


def test_sampler_rules():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0, 50.0, 50.0]] * 256, jnp.float32)  # ids 4, 5 past the vocab
    key = jax.random.key(0)
    assert set(np.asarray(sample_logits(logits, key, 0.0, 0, 4)).tolist()) == {3}
    drawn = np.asarray(sample_logits(logits, key, 1.0, 0, 4))
    assert drawn.max() < 4 and len(set(drawn.tolist())) >= 3
    assert set(np.asarray(sample_logits(logits, key, 1.0, 2, 4)).tolist()) == {2, 3}
    assert set(np.asarray(sample_logits(logits, key, 1.0, 2, 6)).tolist()) == {4, 5}
    assert set(np.asarray(sample_logits(logits, key, 100.0, 1, 4)).tolist()) == {3}
    assert set(np.asarray(sample_logits(logits, key, 1e-39, 0, 4)).tolist()) == {3}  # a tiny temperature: greedy
    ties = jnp.asarray([[0.0, 5.0, 5.0, 5.0, 1.0]] * 256, jnp.float32)
    assert len(set(np.asarray(sample_logits(ties, key, 1.0, 1, 5)).tolist())) == 1  # top-k keeps exactly k ids
    assert set(np.asarray(sample_logits(ties, key, 1.0, 2, 5)).tolist()) < {1, 2, 3}
    assert len(set(np.asarray(sample_logits(ties, key, 1.0, 2, 5)).tolist())) == 2
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="temperature="):
            generate(None, [[1]], 1, temperature=bad)
    # nucleus: probabilities 0.5, 0.3, 0.15, 0.05 (in shuffled id order); ids stay while those before hold < p
    probs = jnp.asarray([[0.15, 0.5, 0.05, 0.3]] * 512, jnp.float32)
    nucleus = lambda p, k=0: set(np.asarray(sample_logits(jnp.log(probs), key, 1.0, k, 4, p)).tolist())  # noqa: E731
    assert nucleus(0.49) == {1} and nucleus(0.51) == {1, 3} and nucleus(0.79) == {1, 3}  # away from the sums
    assert nucleus(0.81) == {0, 1, 3} and nucleus(1.0) == {0, 1, 2, 3} and nucleus(0.99, k=2) == {1, 3}
    assert nucleus(1e-6) == {1}  # the most likely always stays
    with pytest.raises(ConfigError, match=r"top_p=0: must be in \(0, 1\]"):
        generate(None, [[1]], 1, top_p=0)


def test_generation_draws_only_ids_of_the_tokenizer(two):
    outs = generate(two, [LONG] * 4, max_new_tokens=8, temperature=1.0, top_k=0, vocab=2)  # (LONG: see above)
    assert {i for o in outs for i in o} <= {0, 1}
    free = generate(two, [LONG] * 4, max_new_tokens=8, temperature=1.0, top_k=0, vocab=TOKENIZER_VOCAB)
    assert not {i for o in free for i in o} <= {0, 1}


def test_cli_evaluate_and_generate(run_dir, capsys):
    assert main(["evaluate", str(run_dir), "--step", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 30 and out["val_loss"] == records(run_dir)[30]["val_loss"]
    assert main(["evaluate", str(run_dir), "--set", "data.val_sequences=10"]) == 0
    assert "(8 validation sequences of 32 tokens, in batches of 4; 2 more left out: not a whole batch)" in \
        capsys.readouterr().out
    assert main(["generate", str(run_dir), "--prompt", "The ", "--num-samples", "2", "--max-new-tokens", "5",
                 "--temperature", "0", "--no-stop-at-eot", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2 and lines[0]["ids"] == lines[1]["ids"] and len(lines[0]["ids"]) == 5
    assert (lines[0]["temperature"], lines[0]["top_k"], lines[0]["top_p"], lines[0]["seed"]) == (0.0, 50, 1.0, 0)
    assert (lines[0]["max_new_tokens"], lines[0]["kv_cache"], lines[0]["stop_at_eot"], lines[0]["ended_at_eot"]) == (
        5, True, False, False)
    assert all(i < TOKENIZER_VOCAB for i in lines[0]["ids"])
    assert main(["generate", str(run_dir), "--prompt", "The ", "--max-new-tokens", "5", "--temperature", "0",
                 "--no-stop-at-eot", "--json", "--no-kv-cache"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["ids"] == lines[0]["ids"]
    # the text output (greedy, 2 samples: the programs of the first generate, in the persistent compilation cache)
    assert main(["generate", str(run_dir), "--prompt", "The ", "--num-samples", "2", "--max-new-tokens", "5",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("The ")


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["lm-eval", "--tasks", "piqa", "--limit", "0"], "--limit 0: must be >= 1 (leave it out: every example)"),
    (["lm-eval", "--tasks", "piqa", "--limit", "-1"], "--limit -1: must be >= 1 (leave it out: every example)"),
    (["lm-eval", "--tasks", "piqa", "--batch-size", "0"], "--batch-size 0: must be >= 1"),
    (["lm-eval", "--tasks", "piqa", "--num-fewshot", "-1"], "--num-fewshot -1: must be >= 0 (leave it out: the "
     "task's own)"),
])
def test_cli_refuses_numbers_out_of_range(tmp_path, capsys, argv, message):
    """By argparse (its usage, then one error line; exit 2), before any run directory is read."""
    with pytest.raises(SystemExit) as e:
        main([argv[0], str(tmp_path / "nowhere"), *argv[1:]])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


def test_a_run_directory_that_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["evaluate", str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"config error: run directory '{tmp_path / 'afile'}' is a file, "
                                                    "not a directory (expected a logging.run_dir written by train.py)"]


def test_reading_leaves_the_run_directory_alone(run_dir):
    """Safe beside a run still training there: nothing written, no leftover temporary directory cleaned up."""
    leftover = run_dir / "checkpoints" / "90.orbax-checkpoint-tmp-1234"
    leftover.mkdir()
    try:
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
        evaluate_run(load_run(run_dir))
        load_run(run_dir, checkpoint=run_dir / "checkpoints" / "30")
        assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    finally:
        os.rmdir(leftover)



@pytest.mark.gpu
def test_gpu_evaluate_gives_the_record_and_generate_reads_the_unpadded_logits(tmp_path):
    """On a GPU (Triton MoE kernels and attention, bf16): the evaluation, with the run's autotuning results
    loaded, repeats the run's own val_loss bitwise; the padded windows' logits, and the KV cache's decoding steps',
    are the unpadded forward's."""
    d = tmp_path / "run"
    cfg = load_config(str(ROOT / "configs/tiny_mh_latent_moe.yaml"), [
        "schedule.total_steps=20", "schedule.warmup_steps=5", "schedule.decay_steps=5", "model.context=128",
        "model.compute_dtype=bfloat16", "train.global_batch=8", "train.micro_batch=8", "data.val_sequences=16",
        "data.eval_every=20", "checkpoint.every=20", "checkpoint.async_save=false", "logging.progress_bar=false",
        f"logging.run_dir={d}", "parallel.devices=1"])
    train(cfg, log=lambda *a, **k: None)
    assert (d / "xla_autotune.txt").is_file()
    loaded = load_run(d)
    assert loaded.compiler_options == {"xla_gpu_load_autotune_results_from": str((d / "xla_autotune.txt").resolve())}
    assert evaluate_run(loaded)["val_loss"] == records(d)[20]["val_loss"]
    model = nnx.merge(loaded.graphdef, loaded.params, loaded.biases)
    forward = jax.jit(lambda toks: model(toks)[0][0, -1])
    text = list(b"The function returns the value of the object, or raises an exception if it is not found. ") * 2
    seqs = [[256] + text[:3], [256] + text[:127], [256] + text[:150]]
    for seq, row in zip(seqs, next_logits(loaded, seqs)):
        np.testing.assert_allclose(row, np.asarray(forward(jnp.asarray([seq[-128:]], jnp.int32))), rtol=2e-2,
                                   atol=2e-2)
    outs = generate(loaded, seqs, max_new_tokens=16, temperature=0.8, top_k=20, vocab=TOKENIZER_VOCAB)
    assert [len(o) for o in outs] == [16] * 3 and max(max(o) for o in outs) < TOKENIZER_VOCAB
    # the KV cache's decoding steps (XLA attention over the cache, the Triton MoE kernels on one token per row)
    logits, seen = cached_logits(loaded, [[256] + TEXT[:3], [256] + TEXT[:40]], steps=8)
    for step in range(9):
        for r, seq in enumerate(seen[step]):
            ref = np.asarray(forward(jnp.asarray([seq], jnp.int32)))
            np.testing.assert_allclose(logits[step, r], ref, rtol=2e-2, atol=2e-2, err_msg=f"step {step} row {r}")
