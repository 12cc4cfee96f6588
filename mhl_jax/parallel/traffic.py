"""Bytes each device sends per MoE layer and direction (dispatch; the combine sends the same back).

Pure functions of shapes (and, for EP, of the routing counts): what the all-to-alls of
`head_parallel.py` and `expert_parallel.py` put on the links, not counting the rows a device keeps.

- HP: every sub-token of every head not owned locally leaves once:
  (P - 1) / P * tokens * Nh * dh * bytes, independent of k and of the routing; no metadata.
- EP: the k-duplicated rows routed to experts on other devices, plus the count metadata
  (an all-gather of P x H x Ne/P int32 per device). Uniform routing sends (P - 1) / P of the
  tokens * H * k rows; the worst case sends every choice that fits on other devices' experts.
- HP x EP (`head_expert_parallel.py`): the HP exchange as above, then EP over the hp * tokens
  the device holds after it, on its Nh / hp heads (the same n * Nh * k slots per device).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mhl_jax.config import Config


def _positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name}={v}: must be >= 1")


def hp_bytes(tokens: int, heads: int, head_dim: int, hp: int, itemsize: int) -> int:
    """Bytes one device sends in the HP dispatch of one layer (the combine sends as many back).

    tokens: tokens on the device before the all-to-all; heads, head_dim: Nh, dh; hp: P.
    """
    _positive(tokens=tokens, heads=heads, head_dim=head_dim, hp=hp, itemsize=itemsize)
    if heads % hp:
        raise ValueError(f"hp_bytes: Nh={heads} is not divisible by hp={hp}")
    return tokens * (heads - heads // hp) * head_dim * itemsize


def ep_bytes_from_counts(send_counts: np.ndarray, me: int, width: int, itemsize: int) -> int:
    """Bytes one device sends in the EP dispatch of one layer, from its per-destination row counts.

    send_counts: (P,) k-duplicated rows this device routes to each ep peer (its own index `me`
    included: those rows stay local). width: row width c (d for MoE, l for LatentMoE).
    """
    counts = np.asarray(send_counts, dtype=np.int64)
    if counts.ndim != 1 or not 0 <= me < counts.shape[0]:
        raise ValueError(f"ep_bytes_from_counts: send_counts shape {counts.shape}, me={me}: need (P,) and 0 <= me < P")
    return int((counts.sum() - counts[me]) * width * itemsize)


def ep_metadata_bytes(ep: int, heads: int, num_experts: int) -> int:
    """Bytes one device sends in the count exchange: its (P, H * Ne/P) int32 counts to P - 1 peers."""
    _positive(ep=ep, heads=heads, num_experts=num_experts)
    return (ep - 1) * heads * num_experts * 4


def ep_bytes_uniform(tokens: int, heads: int, k: int, ep: int, width: int, itemsize: int) -> int:
    """Expected EP dispatch bytes per device under uniform routing: (P - 1) / P of the tokens * H * k rows."""
    _positive(tokens=tokens, heads=heads, k=k, ep=ep, width=width, itemsize=itemsize)
    return tokens * heads * k * (ep - 1) * width * itemsize // ep


def ep_bytes_worst(tokens: int, heads: int, k: int, ep: int, num_experts: int, width: int, itemsize: int) -> int:
    """Worst-case EP dispatch bytes per device: every choice that can go to another device's experts."""
    _positive(tokens=tokens, heads=heads, k=k, ep=ep, num_experts=num_experts, width=width, itemsize=itemsize)
    remote_experts = num_experts - num_experts // ep
    return tokens * heads * min(k, remote_experts) * width * itemsize


def ep_bytes_from_loads(load: np.ndarray, ep: int, tokens: int, k: int, width: int, itemsize: int) -> dict[str, float]:
    """Per-device EP dispatch bytes implied by measured global loads (H, Ne), assuming every device
    routes like the global mix: device p sends tokens*H*k*(1 - f_p) rows and receives
    (P - 1) * tokens*H*k * f_p rows, f_p = share of the slots on p's experts.

    Returns {'send_max', 'recv_max'} in bytes (the slowest device sets the all-to-all time).
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] % ep:
        raise ValueError(f"ep_bytes_from_loads: load shape {load.shape} must be (H, Ne) with ep={ep} dividing Ne")
    heads = load.shape[0]
    share = load.reshape(heads, ep, -1).sum(axis=(0, 2))
    share = share / max(share.sum(), 1.0)
    slots = tokens * heads * k * width * itemsize
    return {"send_max": float(slots * (1.0 - share.min())), "recv_max": float((ep - 1) * slots * share.max())}


def comm_bytes_per_layer(cfg: Config, mesh: Mesh, tokens_per_device: int) -> dict[str, float]:
    """Metrics for the training log: bytes one device sends per MoE layer, each way, from shapes.

    tokens_per_device: tokens one device holds in one forward (micro_batch * context).
    HP: {'comm/a2a_bytes': exact} (the dispatch's; with separate routing sub-tokens the combine sends half of it).
    EP: {'comm/a2a_bytes_uniform', 'comm/a2a_bytes_worst', 'comm/meta_bytes'}. HP x EP: one set per link kind,
    `hp_ep_bytes`. MLP, or a single device on the model axis: {} (no exchange).
    """
    f = cfg.ffn
    if f.kind == "mlp" or mesh.size == 1:
        return {}
    itemsize = jnp.dtype(cfg.model.compute_dtype).itemsize
    if f.kind == "mh_latent_moe" and "ep" in mesh.axis_names:
        return hp_ep_bytes(tokens_per_device, f.num_heads, f.head_dim, f.top_k, f.num_experts, mesh.shape["hp"],
                           mesh.shape["ep"], itemsize, f.routing_tokens == "separate")
    if f.kind == "mh_latent_moe":
        hp = mesh.shape["hp"]
        # separate routing sub-tokens travel too, to the device of their head: twice the dispatch's bytes
        sent = hp_bytes(tokens_per_device, f.num_heads, f.head_dim, hp, itemsize)
        return {"comm/a2a_bytes": float(sent * (2 if f.routing_tokens == "separate" else 1))}
    ep = mesh.shape["ep"]
    width = cfg.model.d_model if f.kind == "moe" else f.latent_dim
    return {
        "comm/a2a_bytes_uniform": float(ep_bytes_uniform(tokens_per_device, 1, f.top_k, ep, width, itemsize)),
        "comm/a2a_bytes_worst": float(ep_bytes_worst(tokens_per_device, 1, f.top_k, ep, f.num_experts, width,
                                                     itemsize)),
        "comm/meta_bytes": float(ep_metadata_bytes(ep, 1, f.num_experts)),
    }


def hp_ep_bytes(tokens: int, heads: int, head_dim: int, k: int, num_experts: int, hp: int, ep: int, itemsize: int,
                separate_routing: bool = False) -> dict[str, float]:
    """Bytes one device sends per MoE layer on a data x hp x ep mesh, each way, per link kind.

    tokens: tokens on the device before the HP exchange. The HP exchange ('comm/hp_a2a_bytes': exact; doubled with
    separate routing sub-tokens, which travel to their head's devices too) leaves the device holding hp * tokens
    tokens on Nh / hp heads; the EP exchange sends their k-duplicated rows of width dh to the ep peers
    ('comm/ep_a2a_bytes_uniform', 'comm/ep_a2a_bytes_worst') after the counts ('comm/ep_meta_bytes'). The routing
    sub-tokens stay on their device for EP: it routes before it exchanges."""
    _positive(hp=hp, ep=ep)
    if heads % hp or num_experts % ep:
        raise ValueError(f"hp_ep_bytes: Nh={heads}, Ne={num_experts} must be divisible by hp={hp}, ep={ep}")
    local_tokens, local_heads = hp * tokens, heads // hp
    hp_sent = hp_bytes(tokens, heads, head_dim, hp, itemsize) * (2 if separate_routing else 1)
    return {
        "comm/hp_a2a_bytes": float(hp_sent),
        "comm/ep_a2a_bytes_uniform": float(ep_bytes_uniform(local_tokens, local_heads, k, ep, head_dim, itemsize)),
        "comm/ep_a2a_bytes_worst": float(ep_bytes_worst(local_tokens, local_heads, k, ep, num_experts, head_dim,
                                                        itemsize)),
        "comm/ep_meta_bytes": float(ep_metadata_bytes(ep, local_heads, num_experts)),
    }


def hp_gbps(tokens: int, heads: int, head_dim: int, hp: int, itemsize: int, ms: float) -> float:
    """Per-device link rate of a measured HP dispatch + combine (both directions' bytes / time)."""
    if ms <= 0 or not math.isfinite(ms):
        raise ValueError(f"hp_gbps: ms={ms} must be a positive time")
    return 2 * hp_bytes(tokens, heads, head_dim, hp, itemsize) / (ms * 1e6)
