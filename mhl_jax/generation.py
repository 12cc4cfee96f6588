"""Text from a model: sampling (`sample_logits`), and `generate`, which continues prompts with a KV cache.

`generate` runs on a loaded checkpoint (`mhl_jax.runtime.restore.Loaded`) over its mesh: one forward pass over a
fixed window of `model.context` tokens (the prompts, padded at the end; causal attention and dropless routing make
the padding invisible to the real tokens) fills a KV cache, and each new token is then one decoding step against it,
up to DECODE_CHUNK of them per call of a loop on the device. A sequence longer than the context slides its window:
from there each token is a forward pass over the window. `python -m mhl_jax.infer generate` and lm-eval's
`generate_until` (`mhl_jax.harness`) sample through it.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mhl_jax.config import ConfigError
from mhl_jax.model.context import build_step_context
from mhl_jax.model.loss import head_logits
from mhl_jax.runtime.restore import Loaded


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, vocab: int,
                  top_p: float = 1.0) -> jax.Array:
    """Next ids (B,) from fp32 logits (B, V): ids >= `vocab` (the embedding's padding past the tokenizer's ids) never;
    temperature 0 takes the most likely id; otherwise a draw from softmax(logits / temperature) over the `top_k`
    most likely ids (0: all), and of those over the fewest most likely whose probability reaches `top_p` (nucleus
    sampling; 1: all)."""
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where(ids < vocab, logits, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # shifted so that the largest is 0: a tiny temperature gives -inf for the others, never inf - inf
    logits = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    if 0 < top_k < logits.shape[-1]:  # exactly k ids, ties at the k-th value broken as lax.top_k does
        keep = jax.lax.top_k(logits, top_k)[1]
        kept = jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None], keep].set(True)
        logits = jnp.where(kept, logits, -jnp.inf)
    if top_p < 1.0:  # an id stays if the ids more likely than it hold less than top_p (the most likely always stays)
        order = jnp.argsort(-logits, axis=-1, stable=True)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        rows = jnp.arange(logits.shape[0])[:, None]
        kept = jnp.zeros(logits.shape, bool).at[rows, order].set(before < top_p)
        logits = jnp.where(kept, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _next_logits(graphdef, params, biases, tokens, last):
    """tokens (B, T) int32, last (B,) the index of each row's last real token -> fp32 logits (B, V) of the token
    after it."""
    model = nnx.merge(graphdef, params, biases)
    return _at(model, model.hidden(tokens)[0], last)


def _at(model, x: jax.Array, last: jax.Array | None = None) -> jax.Array:
    """fp32 logits (B, V) of the head over x (B, T, d) at each row's position `last` (B,), or over x (B, d)."""
    xl = x[:, None] if last is None else jnp.take_along_axis(x, last[:, None, None], axis=1)  # (B, 1, d)
    return head_logits(xl, model.head[...].astype(model.dtype))[:, 0]


def _next_ids(graphdef, temperature, top_k, vocab, top_p, params, biases, tokens, last, key):
    return sample_logits(_next_logits(graphdef, params, biases, tokens, last), key, temperature, top_k, vocab, top_p)


def _prefill_logits(graphdef, params, biases, tokens, last):
    """`_next_logits` that also returns the KV caches of the windows' positions (`GPT.prefill`)."""
    model = nnx.merge(graphdef, params, biases)
    x, caches = model.prefill(tokens)
    return _at(model, x, last), caches


def _weight_casts(graphdef, params, biases):
    """A step context holding the expert weights in the compute dtype where the MoE layers read them cast, made once
    for all the decoding steps (`build_step_context`)."""
    return build_step_context(nnx.merge(graphdef, params, biases))


def _decode_logits(graphdef, params, biases, casts, caches, tokens, pos):
    """fp32 logits (B, V) of the token after tokens (B,) at positions pos, and the caches with them (`GPT.decode`;
    casts: `_weight_casts`)."""
    model = nnx.merge(graphdef, params, biases)
    x, caches = model.decode(tokens, pos, caches, casts)
    return _at(model, x), caches


# Decoding steps per call of generate's jitted decoding loop (`_decode_loop`): the steps run on the device one after
# another, with no return to Python between them; one compile serves any count up to it.
DECODE_CHUNK = 32


def _decode_loop(graphdef, sampler, chunk, params, biases, casts, caches, tokens, pos, key, first, count, stop, done):
    """Up to `count` (<= chunk) decoding steps (`_decode_logits`) in one device loop: from tokens (B,) at positions
    pos (B,), each step draws the next ids (B,) with key folded with its token index (first, first + 1, ...:
    generate's keys) and feeds them back at pos + 1. Stops early once every row is done (done (B,) bool at the start;
    a row is done once it draws `stop`; -1: never). Returns (ids (B, chunk) int32, of which the first `steps` columns
    were drawn, the caches with those steps written in, steps)."""
    def cond(state):
        return (state[0] < count) & ~jnp.all(state[5])

    def body(state):
        j, tok, p, caches, ids, done = state
        logits, caches = _decode_logits(graphdef, params, biases, casts, caches, tok, p)
        new = sample_logits(logits, jax.random.fold_in(key, first + j), *sampler)
        ids = jax.lax.dynamic_update_slice_in_dim(ids, new[:, None], j, axis=1)
        return j + 1, new, p + 1, caches, ids, done | (new == stop)

    ids = jnp.zeros((tokens.shape[0], chunk), jnp.int32)
    steps, _, _, caches, ids, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), tokens, pos, caches, ids, done))
    return ids, caches, steps


def _sampled(fn, temperature, top_k, vocab, top_p):
    """fn(graphdef, params, biases, ...) -> (logits, caches) made to draw: (graphdef, ..., key) -> (ids, caches)."""
    def draw(graphdef, *args):
        logits, caches = fn(graphdef, *args[:-1])
        return sample_logits(logits, args[-1], temperature, top_k, vocab, top_p), caches
    return draw


def _generation_fns(loaded: Loaded, sampler: tuple):
    """generate's jitted functions (step over windows, prefill, the decoding loop of DECODE_CHUNK steps, the expert
    weight casts) for `loaded`'s model and a sampler (temperature, top_k, vocab, top_p), kept in `loaded.jitted` for
    later calls with the same (a notebook's, the tests'), so that they compile once; they go with `loaded`. Only the
    decoding loop depends on DECODE_CHUNK."""
    graphdef, opts = loaded.graphdef, loaded.compiler_options or None
    if sampler not in loaded.jitted:
        loaded.jitted[sampler] = (
            jax.jit(partial(_next_ids, graphdef, *sampler), compiler_options=opts),
            jax.jit(partial(_sampled(_prefill_logits, *sampler), graphdef), compiler_options=opts),
            jax.jit(partial(_weight_casts, graphdef), compiler_options=opts))
    if (sampler, DECODE_CHUNK) not in loaded.jitted:
        loaded.jitted[sampler, DECODE_CHUNK] = jax.jit(partial(_decode_loop, graphdef, sampler, DECODE_CHUNK),
                                                       compiler_options=opts, donate_argnums=(3,))  # the caches
    step, prefill, cast = loaded.jitted[sampler]
    return step, prefill, loaded.jitted[sampler, DECODE_CHUNK], cast


def _decode_inputs(loaded: Loaded, seqs: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    """A decoding step's input: (tokens (B,), positions (B,)), each row's last token and its index, rows padded to a
    multiple of the mesh's devices as `_windows` pads them (rows past len(seqs) repeat the first)."""
    rows, sh = _padded(loaded, seqs), NamedSharding(loaded.mesh, P(tuple(loaded.mesh.axis_names)))
    return (jax.device_put(np.asarray([q[-1] for q in rows], np.int32), sh),
            jax.device_put(np.asarray([len(q) - 1 for q in rows], np.int32), sh))


def _padded(loaded: Loaded, seqs: list[list[int]]) -> list[list[int]]:
    """`seqs` and copies of the first, to a multiple of the mesh's devices (the batch is split over every device)."""
    n = -(-len(seqs) // loaded.mesh.size) * loaded.mesh.size
    return [seqs[r if r < len(seqs) else 0] for r in range(n)]


def _windows(loaded: Loaded, seqs: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    """The model's input for the next token of each sequence: (tokens (B, T), last (B,)) with B a multiple of the
    mesh's devices (rows past len(seqs) repeat the first), each row the sequence's last T tokens padded at the end."""
    t, mesh = loaded.cfg.model.context, loaded.mesh
    padded = _padded(loaded, seqs)
    window = np.zeros((len(padded), t), np.int32)
    last = np.zeros(len(padded), np.int32)
    for r, seq in enumerate(padded):
        w = seq[-t:]
        window[r, :len(w)] = w
        last[r] = len(w) - 1
    rows = tuple(mesh.axis_names)
    return (jax.device_put(window, NamedSharding(mesh, P(rows, None))),
            jax.device_put(last, NamedSharding(mesh, P(rows))))


def next_logits(loaded: Loaded, seqs: list[list[int]]) -> np.ndarray:
    """fp32 logits (len(seqs), V) of the token after each sequence (of at least one id), as `generate` reads them."""
    tokens, last = _windows(loaded, seqs)
    fn = jax.jit(partial(_next_logits, loaded.graphdef), compiler_options=loaded.compiler_options or None)
    return np.asarray(fn(loaded.params, loaded.biases, tokens, last))[:len(seqs)]


def generate(loaded: Loaded, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, vocab: int | None = None, stop: int | None = None,
             top_p: float = 1.0, kv_cache: bool = True) -> list[list[int]]:
    """Continue each prompt (token ids, at least one each) by up to `max_new_tokens` ids, sampled as
    `sample_logits` says; a row ends early at the id `stop` (kept in its output). Returns the new ids of each row.
    The same seed gives the same ids.

    Each token's logits are those of the model over the sequence's last `model.context` tokens. kv_cache: while
    every sequence fits the context, one forward over the padded windows fills a KV cache (`GPT.prefill`) and each
    later token is one decoding step against it (`GPT.decode`); once a sequence outgrows the context (its window
    slides, so every position's rotary angle changes), and with kv_cache False, each token is a forward over the
    windows. No prompts: no rows, [] back."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"temperature={temperature}: must be a number >= 0 (0: the most likely token)")
    if top_k < 0:
        raise ConfigError(f"top_k={top_k}: must be >= 0 (0: no cut)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p}: must be in (0, 1] (1: no cut)")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token")
    vocab = loaded.cfg.model.vocab_size if vocab is None else vocab
    if stop is not None and not 0 <= stop < vocab:
        raise ConfigError(f"stop={stop}: must be an id in [0, {vocab}) (one that can be drawn), or None")
    rows = len(prompts)
    seqs = [list(p) for p in prompts]
    step, prefill, decode, cast = _generation_fns(loaded, (float(temperature), int(top_k), int(vocab), float(top_p)))
    key = jax.random.key(seed)
    out: list[list[int]] = [[] for _ in range(rows)]
    done = np.zeros(rows, bool)
    caches = casts = None
    t = loaded.cfg.model.context
    i = 0
    while i < max_new_tokens and not done.all():
        longest = max(map(len, seqs))
        if not kv_cache or longest > t or (caches is None and longest == t):  # a window slides (now or next): none
            caches = casts = None  # freed
            ids = np.asarray(step(loaded.params, loaded.biases, *_windows(loaded, seqs), jax.random.fold_in(key, i)))
            ids = ids[:, None]
        elif caches is None:
            ids, caches = prefill(loaded.params, loaded.biases, *_windows(loaded, seqs), jax.random.fold_in(key, i))
            ids = np.asarray(ids)[:, None]
            casts = cast(loaded.params, loaded.biases)
        else:  # decoding steps while the longest sequence still fits the cache, DECODE_CHUNK at most per call
            count = min(max_new_tokens - i, t - longest + 1, DECODE_CHUNK)
            tokens, pos = _decode_inputs(loaded, seqs)
            held = np.ones(tokens.shape[0], bool)  # done at the start; the rows past len(seqs) never hold the loop up
            held[:rows] = done
            ids, caches, steps = decode(loaded.params, loaded.biases, casts, caches, tokens, pos, key, i, count,
                                        -1 if stop is None else stop, held)
            ids = np.asarray(ids)[:, :int(steps)]
        for column in ids[:rows].T:
            for r in range(rows):
                seqs[r].append(int(column[r]))
                if not done[r]:
                    out[r].append(int(column[r]))
                    done[r] = stop is not None and int(column[r]) == stop
            i += 1
            if done.all():
                break
    return out
