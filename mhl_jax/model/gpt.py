"""Decoder-only pre-norm Transformer (paper appendix A): RoPE, RMSNorm, causal attention, untied head.

Layers [0, stem_layers) use a dense MLP of width `ffn.stem_hidden`; the rest use the configured FFN.
Master weights are fp32; matmuls run in `model.compute_dtype`; the residual stream, norms, router,
softmax and loss are fp32.

Each part runs under a `jax.named_scope` (embed, norm, attention, residual, mlp, lm_head_loss here; moe_proj, moe,
router, packing, experts, combine in the MoE layers): names in the compiled program's metadata only, by which
`bench/step_profile.py` splits a train step's time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mhl_jax.config import Config
from mhl_jax.gather import embed_lookup
from mhl_jax.model.attention import Attention, attention_impl
from mhl_jax.model.init import normal_param, residual_std
from mhl_jax.model.loss import head_logits, lm_head_loss, xent_impl, xla_xent
from mhl_jax.model.mlp import MLP
from mhl_jax.model.moe import LatentMoE, MHLatentMoE, MoE
from mhl_jax.model.norms import RMSNorm
from mhl_jax.moe.context import StepContext
from mhl_jax.moe.core import LocalMoE, MoEExecutor
from mhl_jax.moe.plan import resolve_kernels


def make_ffn(cfg: Config, layer: int, rngs: nnx.Rngs, executor: MoEExecutor) -> nnx.Module:
    m, f = cfg.model, cfg.ffn
    std, out_std = m.init_std, residual_std(m.init_std, m.n_layers)
    if f.kind == "mlp" or layer < f.stem_layers:
        hidden = f.stem_hidden if layer < f.stem_layers else f.hidden
        return MLP(m.d_model, hidden, std, out_std, rngs)
    if f.kind == "moe":
        return MoE(m.d_model, f.num_experts, f.expert_hidden, f.top_k, std, out_std, rngs, executor, layer)
    if f.kind == "latent_moe":
        return LatentMoE(m.d_model, f.latent_dim, f.num_experts, f.expert_hidden, f.top_k, std, out_std,
                         rngs, executor, layer)
    if f.kind == "mh_latent_moe":
        return MHLatentMoE(m.d_model, f.num_heads, f.head_dim, f.num_experts, f.expert_hidden, f.top_k,
                           std, out_std, rngs, executor, layer, f.routing_tokens)
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

    def __call__(self, h: jax.Array, ctx: StepContext | None = None) -> tuple[jax.Array, jax.Array | None]:
        """h: (B, T, d) fp32 residual stream -> updated h, expert load (H, Ne) int32 or None (dense FFN)."""
        a = self.attn(self.norm1(h).astype(self.dtype))
        with jax.named_scope("residual"):
            h = h + a.astype(jnp.float32)
        return self._ffn_residual(h, ctx)

    def prefill(self, h: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """`__call__` (no gradients) that also returns this layer's KV cache of the T positions."""
        a, kv = self.attn(self.norm1(h).astype(self.dtype), keep_kv=True)
        return self._ffn_residual(h + a.astype(jnp.float32))[0], kv

    def decode(self, h: jax.Array, cache: tuple[jax.Array, jax.Array], pos: jax.Array,
               ctx: StepContext | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """h: (B, 1, d) fp32, one token per row at positions pos (B,), against this layer's cache -> (h, cache)."""
        a, cache = self.attn.decode(self.norm1(h).astype(self.dtype), cache, pos)
        return self._ffn_residual(h + a.astype(jnp.float32), ctx)[0], cache

    def _ffn_residual(self, h: jax.Array, ctx: StepContext | None = None) -> tuple[jax.Array, jax.Array | None]:
        """h + ffn(norm2(h)), and the expert load (`__call__`'s)."""
        y, load = self.ffn(self.norm2(h).astype(self.dtype), ctx)
        with jax.named_scope("residual"):
            return h + y.astype(jnp.float32), load


def check_positions(pos, tokens_shape: tuple[int, ...], length: int) -> None:
    """`GPT.decode`'s positions, where they are known (not under jit: there its callers keep them in range, as
    `mhl_jax.generation.generate` does): one per row, each in [0, length) of the caches. Out of range, the cache write
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
        self.mesh = mesh
        self.remat = m.remat

    def hidden(self, tokens: jax.Array, ctx: StepContext | None = None) -> tuple[jax.Array, dict[int, jax.Array]]:
        """tokens: (B, T) int32 -> the final norm's output (B, T, d) in the compute dtype (the head's input), loads
        {layer index: (H, Ne) int32} per MoE layer. ctx: the step context, for the expert layers (None: each casts its
        own expert weights, and their gradients are plain gradients)."""
        with jax.named_scope("embed"):
            h = embed_lookup(self.embed[...], tokens)  # deterministic gradient (mhl_jax/gather.py)
        loads = {}
        call = _remat_block if self.remat == "block" else _call_block
        for i, block in enumerate(self.blocks):
            h, load = call(block, h, ctx)
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
               ctx: StepContext | None = None) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """One token per row: tokens (B,) int32 at positions pos (B,) (each < the caches' length), after the
        positions before pos in `caches` -> `hidden`'s output for them (B, d) and the caches with them written in.
        The same as `hidden` over each row's tokens 0..pos up to rounding: the MoE layers route each token alone
        (dropless), so a token's output never depends on the others in its batch. ctx: a step context holding the
        expert weights cast once for all the decoding steps (None: each step casts them again)."""
        check_positions(pos, tokens.shape, caches[0][0].shape[1] if caches else 0)
        h = embed_lookup(self.embed[...], tokens[:, None])
        out = []
        for block, cache in zip(self.blocks, caches):
            h, cache = block.decode(h, cache, pos, ctx)
            out.append(cache)
        return self.norm_f(h).astype(self.dtype)[:, 0], out

    def __call__(self, tokens: jax.Array, ctx: StepContext | None = None) -> tuple[jax.Array, dict[int, jax.Array]]:
        """tokens: (B, T) int32 -> logits (B, T, V) fp32, loads {layer index: (H, Ne) int32} per MoE layer."""
        x, loads = self.hidden(tokens, ctx)
        return head_logits(x, self.head[...].astype(self.dtype)), loads

    def loss(self, tokens: jax.Array, targets: jax.Array,
             ctx: StepContext | None = None) -> tuple[jax.Array, dict[int, jax.Array]]:
        """Mean next-token NLL (fp32) of targets (B, T) after tokens (B, T), and the loads (`lm_head_loss`: the LM
        head's loss in chunks along T)."""
        x, loads = self.hidden(tokens, ctx)
        with jax.named_scope("lm_head_loss"):
            return lm_head_loss(x, self.head[...].astype(self.dtype), targets, self.batch_shards,
                                mesh=self.mesh), loads


def _call_block(block: Block, h: jax.Array, ctx: StepContext | None):
    return block(h, ctx)


def _remat_block(block: Block, h: jax.Array, ctx: StepContext | None):
    """model.remat = "block": the backward keeps the block's inputs and recomputes its forward from them. The block
    goes in as (graph, state), functionally: the forward changes no variable (nnx.remat would write the state back
    into variables of the enclosing trace, which nnx refuses here)."""
    graph, state = nnx.split(block)

    def run(state, h, ctx):
        return _call_block(nnx.merge(graph, state), h, ctx)

    return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(state, h, ctx)


def implementations(cfg: Config) -> dict[str, str]:
    """Which attention and LM-head loss a config's model runs on this process's backend (chosen by the backend, the
    dtype and the installed extras; the MoE ops are the kernel plan's, `mhl_jax.moe.plan`): shown at a run's start,
    kept in run.json and in the benchmarks' records."""
    return {"attention_impl": attention_impl(cfg.model.attention_impl, cfg.model.compute_dtype),
            "loss_impl": "xla" if xent_impl() is xla_xent else "triton"}


def build_model(cfg: Config, seed: int | None = None, executor: MoEExecutor | None = None,
                mesh: Mesh | None = None) -> GPT:
    seed = cfg.train.seed if seed is None else seed
    return GPT(cfg, nnx.Rngs(params=seed), executor, mesh)
