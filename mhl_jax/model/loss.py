"""The LM head and its loss: logits in fp32 from compute-dtype operands, the loss in chunks along the sequence.

The head's (B, T, V) fp32 logits are the largest array of a step (3 GiB at 16384 tokens x 50304), and autodiff would
keep them and make a gradient as large. `head_loss` instead computes the loss in chunks of about
`LOSS_CHUNK_TOKENS` tokens per device and makes both gradients chunk by chunk in its forward, so neither exists whole.
On a GPU a Triton kernel makes each chunk's NLL and logits' gradient (`xent_impl`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mhl_jax.moe.plan import triton_available

# Tokens per device in a chunk of `lm_head_loss`: about this many tokens' fp32 logits exist at a time.
LOSS_CHUNK_TOKENS = 4096


@jax.custom_vjp
def head_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (B, T, d) @ w (d, V), both in the compute dtype, accumulated and returned in fp32. The backward casts the
    logits' cotangent to the compute dtype for its two matmuls: autodiff of the plain einsum would multiply the fp32
    cotangent with the bf16 operands, which XLA runs as fp32 (TF32) GEMMs, about a tenth of a 2.2B MH-LatentMoE step
    on an H100. The weight gradient comes back in w's dtype, as through the cast before the einsum (then to fp32 by
    the cast's own VJP)."""
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


def lm_head_loss(x: jax.Array, w: jax.Array, targets: jax.Array, shards: int = 1,
                 chunk_tokens: int = LOSS_CHUNK_TOKENS, mesh: Mesh | None = None) -> jax.Array:
    """Mean next-token NLL (fp32) of targets (B, T) int32 under the logits x (B, T, d) @ w (d, V), both in the
    compute dtype: `head_loss` in chunks of about chunk_tokens tokens per device. shards: the devices the batch is
    split over (a B they do not divide, as a whole batch traced outside the mesh, is taken as one shard); mesh: those
    devices, for the kernel's calls (`xent_impl`)."""
    shards = shards if x.shape[0] % shards == 0 else 1
    tc = loss_chunk_len(x.shape[0] // shards, x.shape[1], chunk_tokens)
    return head_loss(x, w, targets, tc, shards, xent_impl(mesh, split=shards > 1))


def xla_xent(logits: jax.Array, targets: jax.Array, scale: float, dtype) -> tuple[jax.Array, jax.Array]:
    """A chunk's logits' gradient and NLL: (..., V) fp32 logits, (...) targets -> (d = (softmax - onehot) * scale in
    dtype, nll fp32), in XLA (three passes over the logits: their maxima, the sums of exponentials, d)."""
    lse, nll = _nll(logits, targets)
    d = jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
    return (d * scale).astype(dtype), nll


def xent_impl(mesh: Mesh | None = None, split: bool = False) -> Callable:
    """head_loss's chunk step: the Triton kernel on a GPU with jax-triton (`mhl_jax.model.cross_entropy`: the same
    quantities with one read of the logits fewer), else `xla_xent`. split: the batch is split over the devices of
    `mesh`, where the kernel runs per device under shard_map; a split batch without its mesh takes XLA's form, which
    XLA partitions itself (the kernel call would have every chunk's logits gathered to every device)."""
    if not triton_available() or (split and mesh is None):
        return xla_xent
    from mhl_jax.model.cross_entropy import KernelXent  # needs triton (the `kernels` extra)

    return KernelXent(mesh if split else None)


def loss_chunk_len(batch: int, seq: int, tokens: int) -> int:
    """The chunk length along T for `head_loss`: the largest divisor of seq with batch * length <= tokens (at least
    1), so every chunk holds about `tokens` tokens of all `batch` sequences (the batch axis, which data parallelism
    shards, stays whole: pass the sequences per device)."""
    best = 1
    for c in range(1, seq + 1):
        if seq % c == 0 and batch * c <= max(tokens, batch):
            best = c
    return best


def _nll(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log-sum-exp, negative log-likelihood) per position of fp32 logits (..., V) and int targets (...)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse, lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _chunked(a: jax.Array, tc: int) -> jax.Array:
    """(B, T, ...) -> (T / tc, B, tc, ...): the chunks along T as the leading axis."""
    b, t = a.shape[:2]
    return jnp.swapaxes(a.reshape(b, t // tc, tc, *a.shape[2:]), 0, 1)


def _chunk_logits(xc: jax.Array, w: jax.Array) -> jax.Array:
    """One chunk's logits, fp32, from x and w in the compute dtype."""
    return jnp.einsum("btd,dv->btv", xc, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def head_loss(x: jax.Array, w: jax.Array, targets: jax.Array, tc: int, shards: int = 1,
              xent: Callable = xla_xent) -> jax.Array:
    """Mean NLL (fp32) of targets (B, T) under the logits x (B, T, d) @ w (d, V) (both in the compute dtype, fp32
    accumulation), computed in chunks of tc positions of every sequence (T % tc == 0): no (B, T, V) array.

    Differentiated, the forward also makes the gradients, chunk by chunk: the chunk's logits' gradient (softmax -
    onehot) / (B T), rounded to the compute dtype (what `head_logits`' backward casts the fp32 cotangent to), gives
    the chunk's dx (the same matmul as there, rounded once to the compute dtype) and its term of dW, summed over the
    chunks in order in fp32 and rounded once to w's dtype in the backward, which only multiplies both by the loss's
    cotangent (1 in the train step: exact). It keeps dx and dW, not the logits. Deterministic: fixed chunks, fixed
    order.

    shards: the devices the batch axis is split over (`lm_head_loss`). The chunk loop keeps one fp32 dW sum per
    shard of the batch, (shards, d, V) split as the batch is, and adds them after the loop: a sum over the whole batch
    inside the loop would make XLA all-reduce the (d, V) term of every chunk across the devices.

    xent: a chunk's (logits, targets, scale, dtype) -> (d, nll), `xla_xent` or the kernel's (`xent_impl`); static."""
    return _head_loss_fwd(x, w, targets, tc, shards, xent, False)[0]


def _head_loss_fwd(x, w, targets, tc, shards=1, xent=xla_xent, grads=True):
    if (x.dtype != w.dtype or x.shape[:2] != targets.shape or x.shape[1] % tc or shards < 1
            or x.shape[0] % shards):
        raise ValueError(f"head_loss: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, targets {targets.shape}, tc={tc}, "
                         f"shards={shards}; expected x and w in one dtype, targets (B, T) as x's first axes, T a "
                         "multiple of tc and B of shards")
    b, t = targets.shape
    scale = 1.0 / (b * t)
    xs, ts = _chunked(x, tc), _chunked(targets, tc)
    if not grads:  # the loss alone (evaluation; the primal of the custom VJP)
        nll = jax.lax.map(lambda a: _nll(_chunk_logits(a[0], w), a[1])[1], (xs, ts))
        return jnp.sum(nll) * scale, None

    def chunk(dw, args):
        xc, tgt = args
        d, nll = xent(_chunk_logits(xc, w), tgt, scale, x.dtype)
        dxc = jnp.einsum("btv,dv->btd", d, w, preferred_element_type=x.dtype)
        per_shard = lambda a: a.reshape(shards, b // shards, *a.shape[1:])  # noqa: E731
        dw = dw + jnp.einsum("sbtd,sbtv->sdv", per_shard(xc), per_shard(d), preferred_element_type=jnp.float32)
        return dw, (nll, dxc)

    dw, (nll, dx) = jax.lax.scan(chunk, jnp.zeros((shards, *w.shape), jnp.float32), (xs, ts))
    return jnp.sum(nll) * scale, (jnp.swapaxes(dx, 0, 1).reshape(x.shape), jnp.sum(dw, axis=0))


def _head_loss_bwd(tc, shards, xent, res, g):
    dx, dw = res  # dx in the compute dtype (x's and w's), dw fp32
    return (dx.astype(jnp.float32) * g).astype(dx.dtype), (dw * g).astype(dx.dtype), None


head_loss.defvjp(_head_loss_fwd, _head_loss_bwd)
