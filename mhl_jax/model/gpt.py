"""Decoder-only pre-norm Transformer (paper appendix A): RoPE, RMSNorm, causal attention, untied head.

Layers [0, stem_layers) use a dense MLP of width `ffn.stem_hidden`; the rest use the configured FFN.
Master weights are fp32; matmuls run in `model.compute_dtype`; the residual stream, norms, router,
softmax and loss are fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mhl_jax.config import Config
from mhl_jax.gather import embed_lookup
from mhl_jax.model.attention import Attention
from mhl_jax.model.init import normal_param, residual_std
from mhl_jax.model.mlp import MLP
from mhl_jax.model.moe import ExpertBank, LatentMoE, MHLatentMoE, MoE
from mhl_jax.model.norms import RMSNorm
from mhl_jax.moe.core import LocalMoE, MoEExecutor
from mhl_jax.moe.plan import resolve_kernels


def make_ffn(cfg: Config, layer: int, rngs: nnx.Rngs, executor: MoEExecutor) -> nnx.Module:
    m, f = cfg.model, cfg.ffn
    std, out_std = m.init_std, residual_std(m.init_std, m.n_layers)
    if f.kind == "mlp" or layer < f.stem_layers:
        hidden = f.stem_hidden if layer < f.stem_layers else f.hidden
        return MLP(m.d_model, hidden, std, out_std, rngs)
    if f.kind == "moe":
        return MoE(m.d_model, f.num_experts, f.expert_hidden, f.top_k, std, out_std, rngs, executor)
    if f.kind == "latent_moe":
        return LatentMoE(m.d_model, f.latent_dim, f.num_experts, f.expert_hidden, f.top_k, std, out_std,
                         rngs, executor)
    if f.kind == "mh_latent_moe":
        return MHLatentMoE(m.d_model, f.num_heads, f.head_dim, f.num_experts, f.expert_hidden, f.top_k,
                           std, out_std, rngs, executor)
    raise ValueError(f"ffn.kind={f.kind!r}: expected mlp, moe, latent_moe or mh_latent_moe")


class Block(nnx.Module):
    def __init__(self, cfg: Config, layer: int, rngs: nnx.Rngs, executor: MoEExecutor, mesh: Mesh | None = None):
        m = cfg.model
        self.norm1 = RMSNorm(m.d_model, m.norm_eps)
        self.attn = Attention(m.d_model, m.n_heads, m.head_dim, m.rope_base, m.attention_impl, m.init_std,
                              residual_std(m.init_std, m.n_layers), rngs, mesh)
        self.norm2 = RMSNorm(m.d_model, m.norm_eps)
        self.ffn = make_ffn(cfg, layer, rngs, executor)
        self.dtype = jnp.dtype(m.compute_dtype)

    def __call__(self, h: jax.Array, weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array | None]:
        """h: (B, T, d) fp32 residual stream -> updated h, expert load (H, Ne) or None. weights_cast, grad_acc: this
        layer's entries of `GPT.hidden`'s (MoE layers only)."""
        h = h + self.attn(self.norm1(h).astype(self.dtype)).astype(jnp.float32)
        return self._ffn_residual(h, weights_cast, grad_acc)

    def prefill(self, h: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """`__call__` (no gradients) that also returns this layer's KV cache of the T positions."""
        a, kv = self.attn(self.norm1(h).astype(self.dtype), keep_kv=True)
        return self._ffn_residual(h + a.astype(jnp.float32))[0], kv

    def decode(self, h: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array,
               weights_cast=None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """h: (B, 1, d) fp32, one token per row at positions pos (B,), against this layer's cache -> (h, cache).
        weights_cast: this layer's entry of `GPT.expert_weight_casts()` (None: the layer casts its own)."""
        a, cache = self.attn.decode(self.norm1(h).astype(self.dtype), cache, pos)
        return self._ffn_residual(h + a.astype(jnp.float32), weights_cast)[0], cache

    def _ffn_residual(self, h: jax.Array, weights_cast=None, grad_acc=None) -> tuple[jax.Array, jax.Array | None]:
        """h + ffn(norm2(h)), and the expert load (`__call__`'s)."""
        x = self.norm2(h).astype(self.dtype)
        y, load = self.ffn(x) if weights_cast is None and grad_acc is None else self.ffn(x, weights_cast, grad_acc)
        return h + y.astype(jnp.float32), load


def check_positions(pos, tokens_shape: tuple[int, ...], length: int) -> None:
    """`GPT.decode`'s positions, where they are known (not under jit: there its callers keep them in range, as
    `mhl_jax.infer.generate` does): one per row, each in [0, length) of the caches. Out of range, the cache write
    would be dropped and the mask would show the token the whole cache, silently."""
    try:
        p = np.asarray(pos)
    except jax.errors.TracerArrayConversionError:
        return
    if p.shape != tuple(tokens_shape) or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"GPT.decode: pos {p.dtype} {p.shape}: expected integer positions of shape {tokens_shape}, "
                         "one per row of tokens")
    bad = (p < 0) | (p >= length)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(f"GPT.decode: pos of row {row} is {int(p[row])} ({int(bad.sum())} of {p.size} rows out of "
                         f"range): each must be in [0, {length}), the caches' length")


class GPT(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs, executor: MoEExecutor | None = None, mesh: Mesh | None = None):
        """mesh: the devices the batch is split over (None: the executor's, if it has one; else one device)."""
        m = cfg.model
        executor = executor or LocalMoE(resolve_kernels(cfg.ffn.kernels))
        mesh = mesh if mesh is not None else getattr(executor, "mesh", None)
        self.embed = normal_param(rngs, (m.vocab_size, m.d_model), m.init_std)
        self.blocks = nnx.List([Block(cfg, i, rngs, executor, mesh) for i in range(m.n_layers)])
        self.norm_f = RMSNorm(m.d_model, m.norm_eps)
        self.head = normal_param(rngs, (m.d_model, m.vocab_size), m.init_std)
        self.dtype = jnp.dtype(m.compute_dtype)
        self.batch_shards = 1 if mesh is None else mesh.size  # the batch is split over every device of the mesh
        self.remat = m.remat

    def expert_weight_casts(self) -> dict[int, tuple[jax.Array, jax.Array]]:
        """{layer: (w1, w2) in the compute dtype} for the MoE layers whose executor reads the expert weights cast
        (`ExpertBank.weight_casts`; the fused Triton experts with fp32 masters and bf16 compute), for `__call__`. The
        train step makes them once per step instead of once per micro-batch: XLA left the casts inside the micro-batch
        loop (7.9 ms per matrix and micro-batch in the 2.2B MH-LatentMoE step on one H100, bench/NOTES.md)."""
        casts = {i: bank.weight_casts(executor, self.dtype) for i, bank, executor in self._expert_banks()}
        return {i: c for i, c in casts.items() if c is not None}

    def expert_grad_accumulation(self) -> tuple[int, ...]:
        """The MoE layers whose expert backward can add w1's / w2's gradients to the caller's accumulators in place
        (`ExpertBank.accumulates_in_place`): the train step passes its running sums for them (`__call__`'s grad_acc)
        and takes the returned "gradients" as the new sums instead of adding (the expert weights' gradient adds were
        31.5 ms of a 326 ms 2.2B MH-LatentMoE step at 4 micro-batches on one H100, bench/NOTES.md)."""
        return tuple(i for i, bank, executor in self._expert_banks() if bank.accumulates_in_place(executor, self.dtype))

    def _expert_banks(self):
        """(layer, ExpertBank, its MoE executor) of every MoE layer."""
        for i, block in enumerate(self.blocks):
            bank = getattr(block.ffn, "experts", None)
            if isinstance(bank, ExpertBank):
                yield i, bank, block.ffn.executor

    def hidden(self, tokens: jax.Array, weights_cast: dict | None = None,
               grad_acc: dict | None = None) -> tuple[jax.Array, dict[int, jax.Array]]:
        """tokens: (B, T) int32 -> the final norm's output (B, T, d) in the compute dtype (the head's input), loads
        {layer index: (H, Ne) int32} per MoE layer. weights_cast: `expert_weight_casts()`, made by the caller (None:
        each MoE layer casts its own). grad_acc: {layer: (acc1, acc2)} for layers of `expert_grad_accumulation()`: the
        gradients of those layers' w1 / w2 come back as acc + dW (not differentiated themselves)."""
        h = embed_lookup(self.embed[...], tokens)  # deterministic gradient (mhl_jax/gather.py)
        loads = {}
        weights_cast, grad_acc = weights_cast or {}, grad_acc or {}
        call = _remat_block if self.remat == "block" else _call_block
        for i, block in enumerate(self.blocks):
            h, load = call(block, h, weights_cast.get(i), grad_acc.get(i))
            if load is not None:
                loads[i] = load
        return self.norm_f(h).astype(self.dtype), loads

    def prefill(self, tokens: jax.Array) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """tokens: (B, T) int32 -> `hidden`'s output (B, T, d) and each layer's KV cache (keys, values (B, T, nh, hd)
        in the compute dtype) for `decode` (generation; no gradients, no loads)."""
        h = embed_lookup(self.embed[...], tokens)
        caches = []
        for block in self.blocks:
            h, kv = block.prefill(h)
            caches.append(kv)
        return self.norm_f(h).astype(self.dtype), caches

    def decode(self, tokens: jax.Array, pos: jax.Array, caches: list[tuple[jax.Array, jax.Array]],
               weights_cast: dict | None = None) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """One token per row: tokens (B,) int32 at positions pos (B,) (each < the caches' length), after the
        positions before pos in `caches` -> `hidden`'s output for them (B, d) and the caches with them written in.
        The same as `hidden` over each row's tokens 0..pos up to rounding: the MoE layers route each token alone
        (dropless), so a token's output never depends on the others in its batch. weights_cast:
        `expert_weight_casts()`, made once for all the steps (None: each step casts the expert weights again)."""
        check_positions(pos, tokens.shape, caches[0][0].shape[1] if caches else 0)
        h = embed_lookup(self.embed[...], tokens[:, None])
        out, weights_cast = [], weights_cast or {}
        for i, (block, cache) in enumerate(zip(self.blocks, caches)):
            h, cache = block.decode(h, cache, pos, weights_cast.get(i))
            out.append(cache)
        return self.norm_f(h).astype(self.dtype)[:, 0], out

    def __call__(self, tokens: jax.Array, weights_cast: dict | None = None,
                 grad_acc: dict | None = None) -> tuple[jax.Array, dict[int, jax.Array]]:
        """tokens: (B, T) int32 -> logits (B, T, V) fp32, loads {layer index: (H, Ne) int32} per MoE layer
        (`hidden`'s arguments)."""
        x, loads = self.hidden(tokens, weights_cast, grad_acc)
        return head_logits(x, self.head[...].astype(self.dtype)), loads

    def loss(self, tokens: jax.Array, targets: jax.Array, weights_cast: dict | None = None,
             grad_acc: dict | None = None) -> tuple[jax.Array, dict[int, jax.Array]]:
        """Mean next-token NLL (fp32) of targets (B, T) after tokens (B, T), and the loads (`hidden`'s arguments):
        `head_loss` in chunks of about HEAD_LOSS_CHUNK tokens per device (0: `cross_entropy` of the whole logits)."""
        x, loads = self.hidden(tokens, weights_cast, grad_acc)
        w = self.head[...].astype(self.dtype)
        if HEAD_LOSS_CHUNK <= 0:
            return cross_entropy(head_logits(x, w), targets), loads
        shards = self.batch_shards if x.shape[0] % self.batch_shards == 0 else 1  # under jit x is the whole batch
        tc = loss_chunk_len(x.shape[0] // shards, x.shape[1], HEAD_LOSS_CHUNK)
        return head_loss(x, w, targets, tc, shards), loads


def _call_block(block: Block, h: jax.Array, weights_cast, grad_acc):
    return block(h, weights_cast, grad_acc)


def _remat_block(block: Block, h: jax.Array, weights_cast, grad_acc):
    """model.remat = "block": the backward keeps the block's inputs and recomputes its forward from them. The block
    goes in as (graph, state), functionally: the forward changes no variable (nnx.remat would write the state back
    into variables of the enclosing trace, which nnx refuses here)."""
    graph, state = nnx.split(block)

    def run(state, h, weights_cast, grad_acc):
        return _call_block(nnx.merge(graph, state), h, weights_cast, grad_acc)

    return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(state, h, weights_cast, grad_acc)


@jax.custom_vjp
def head_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (B, T, d) @ w (d, V), both in the compute dtype, accumulated and returned in fp32 (the loss's logits). The
    backward casts the logits' cotangent to the compute dtype for its two matmuls. Autodiff of the plain einsum would
    multiply the fp32 cotangent with the bf16 operands, which XLA runs as fp32 (TF32) GEMMs: 39.5 of a 346 ms step of
    the 2.2B MH-LatentMoE on one H100 (2026-11-26, bench/NOTES.md). The weight gradient comes back in w's dtype, as
    through the cast before the einsum (then to fp32 by the cast's own VJP)."""
    return jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)


def _head_fwd(x, w):
    return head_logits(x, w), (x, w)


def _head_bwd(res, g):
    # the transpose of the same einsum with the output in the compute dtype, so that it takes the cast cotangent: in
    # fp32 exactly plain autodiff's backward (the same dot_generals), and under shard_map its usual reductions; the
    # forward jax.vjp traces again is unused and dropped by XLA
    x, w = res
    _, vjp = jax.vjp(lambda a, b: jnp.einsum("btd,dv->btv", a, b, preferred_element_type=x.dtype), x, w)
    return vjp(g.astype(x.dtype))


head_logits.defvjp(_head_fwd, _head_bwd)


def _nll(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log-sum-exp, negative log-likelihood) per position of fp32 logits (..., V) and int targets (...)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse, lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits: (B, T, V) fp32; targets: (B, T) int32 -> mean negative log-likelihood (fp32)."""
    return jnp.mean(_nll(logits, targets)[1])


# Tokens per device in a chunk of the LM head's loss (`GPT.loss`): about this many tokens' logits exist at a time
# (fp32), and the differentiated loss makes its two gradients chunk by chunk instead of keeping the (B, T, V) logits
# or their gradient. 0: the whole (B, T, V) fp32 logits and XLA's autodiff of `cross_entropy` (the form before
# 2026-11-27).
HEAD_LOSS_CHUNK = 4096


def loss_chunk_len(batch: int, seq: int, tokens: int) -> int:
    """The chunk length along T for `head_loss`: the largest divisor of seq with batch * length <= tokens (at least
    1), so every chunk holds about `tokens` tokens of all `batch` sequences (the batch axis, which data parallelism
    shards, stays whole: pass the sequences per device)."""
    best = 1
    for c in range(1, seq + 1):
        if seq % c == 0 and batch * c <= max(tokens, batch):
            best = c
    return best


def _chunked(a: jax.Array, tc: int) -> jax.Array:
    """(B, T, ...) -> (T / tc, B, tc, ...): the chunks along T as the leading axis."""
    b, t = a.shape[:2]
    return jnp.swapaxes(a.reshape(b, t // tc, tc, *a.shape[2:]), 0, 1)


def _chunk_nll(xc: jax.Array, w: jax.Array, tc: jax.Array):
    """One chunk's logits (fp32, from x and w in the compute dtype), their log-sum-exp and NLL per token."""
    logits = jnp.einsum("btd,dv->btv", xc, w, preferred_element_type=jnp.float32)
    return (logits, *_nll(logits, tc))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def head_loss(x: jax.Array, w: jax.Array, targets: jax.Array, tc: int, shards: int = 1) -> jax.Array:
    """Mean NLL (fp32) of targets (B, T) under the logits x (B, T, d) @ w (d, V) (both in the compute dtype, fp32
    accumulation), computed in chunks of tc positions of every sequence (T % tc == 0): no (B, T, V) array.

    Differentiated, the forward also makes the gradients, chunk by chunk: the chunk's logits' gradient (softmax -
    onehot) / (B T), rounded to the compute dtype (what `head_logits`' backward casts the fp32 cotangent to), gives
    the chunk's dx (the same matmul as there, rounded once to the compute dtype) and its term of dW, summed over the
    chunks in order in fp32 and rounded once to w's dtype in the backward, which only multiplies both by the loss's
    cotangent (1 in the train step: exact). It keeps dx and dW, not the logits. Deterministic: fixed chunks, fixed
    order.

    shards: the devices the batch axis is split over (`GPT.batch_shards`). The chunk loop keeps one fp32 dW sum per
    shard of the batch, (shards, d, V) split as the batch is, and adds them after the loop: a sum over the whole batch
    inside the loop would make XLA all-reduce the (d, V) term of every chunk across the devices."""
    return _head_loss_fwd(x, w, targets, tc, shards, False)[0]


def _head_loss_fwd(x, w, targets, tc, shards=1, grads=True):
    if (x.dtype != w.dtype or x.shape[:2] != targets.shape or x.shape[1] % tc or shards < 1
            or x.shape[0] % shards):
        raise ValueError(f"head_loss: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, targets {targets.shape}, tc={tc}, "
                         f"shards={shards}; expected x and w in one dtype, targets (B, T) as x's first axes, T a "
                         "multiple of tc and B of shards")
    b, t = targets.shape
    scale = 1.0 / (b * t)
    xs, ts = _chunked(x, tc), _chunked(targets, tc)
    if not grads:  # the loss alone (evaluation; the primal of the custom VJP)
        nll = jax.lax.map(lambda a: _chunk_nll(a[0], w, a[1])[2], (xs, ts))
        return jnp.sum(nll) * scale, None

    def chunk(dw, args):
        xc, tgt = args
        logits, lse, nll = _chunk_nll(xc, w, tgt)
        d = jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(tgt, logits.shape[-1], dtype=jnp.float32)
        d = (d * scale).astype(x.dtype)
        dxc = jnp.einsum("btv,dv->btd", d, w, preferred_element_type=x.dtype)
        per_shard = lambda a: a.reshape(shards, b // shards, *a.shape[1:])  # noqa: E731
        dw = dw + jnp.einsum("sbtd,sbtv->sdv", per_shard(xc), per_shard(d), preferred_element_type=jnp.float32)
        return dw, (nll, dxc)

    dw, (nll, dx) = jax.lax.scan(chunk, jnp.zeros((shards, *w.shape), jnp.float32), (xs, ts))
    return jnp.sum(nll) * scale, (jnp.swapaxes(dx, 0, 1).reshape(x.shape), jnp.sum(dw, axis=0))


def _head_loss_bwd(tc, shards, res, g):
    dx, dw = res  # dx in the compute dtype (x's and w's), dw fp32
    return (dx.astype(jnp.float32) * g).astype(dx.dtype), (dw * g).astype(dx.dtype), None


head_loss.defvjp(_head_loss_fwd, _head_loss_bwd)


def build_model(cfg: Config, seed: int | None = None, executor: MoEExecutor | None = None,
                mesh: Mesh | None = None) -> GPT:
    seed = cfg.train.seed if seed is None else seed
    return GPT(cfg, nnx.Rngs(params=seed), executor, mesh)
