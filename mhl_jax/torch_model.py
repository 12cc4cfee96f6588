"""The exported model in plain PyTorch: the same logits as mhl_jax's, from `python -m mhl_jax.export`'s directory.

    from mhl_jax.torch_model import load          # or, in the export directory itself: from modeling import load
    model = load("exported/")                     # reads config.json and model.safetensors
    logits = model(torch.tensor([[50256, 464, 3290]]))  # (B, T) token ids -> (B, T, vocab) float32

Self-contained (torch and safetensors only, no Triton, nothing of mhl_jax): the export copies this file beside the
weights as `modeling.py`. It computes in float32 and routes every token on its own, dropless, with a loop over the
experts: written to be read and checked, not to be fast. A checkpoint trained in bf16 gives the logits of its fp32
master weights here, equal to mhl_jax's in fp32 and within bf16 rounding of the bf16 forward.

The model (mhl_jax/model/gpt.py): pre-norm decoder blocks of RMSNorm, causal attention with rotary embeddings (the two
halves of each head rotated) and an FFN; layers below `stem_layers` have a dense MLP, the rest the configured FFN:
  mlp            gelu(x W1) W2                       (tanh gelu, as jax.nn.gelu)
  moe            H = 1 MoE on x: route x, experts on x
  latent_moe     route x; experts on x W_down (d -> l); their sum W_up (l -> d)
  mh_latent_moe  x W_in split into Nh sub-tokens; head h is its own MoE; heads joined by W_out (with separate
                 routing sub-tokens, head h routes on x W_route's h-th sub-token instead of its own)
where an MoE of a (sub-)token: scores s = x_route W_r[h]; the k experts of largest s + bias (the balancing bias
takes part in the choice only); gates = softmax of their s; y = sum_j gate_j * gelu(x_expert W1[h,e_j]) W2[h,e_j].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """x: (B, T, nh, hd), positions 0..T-1: each head's two halves rotated by the position's angles."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def moe_heads(x_route: torch.Tensor, x_expert: torch.Tensor, w: dict, k: int) -> torch.Tensor:
    """x_route (N, H, dr), x_expert (N, H, dh) -> (N, H, dh): H independent MoEs, each token routed on its own."""
    scores = torch.einsum("nhd,hde->nhe", x_route, w["w_router"])
    idx = torch.topk(scores + w["bias"], k, dim=-1).indices  # (N, H, k): the bias chooses, it does not weigh
    gates = torch.softmax(torch.gather(scores, -1, idx), dim=-1)
    y = torch.zeros_like(x_expert)
    for h in range(x_expert.shape[1]):
        for e in range(w["w1"].shape[1]):
            rows, slot = (idx[:, h] == e).nonzero(as_tuple=True)
            if rows.numel():
                out = gelu(x_expert[rows, h] @ w["w1"][h, e]) @ w["w2"][h, e]
                y[rows, h] += gates[rows, h, slot, None] * out
    return y


class GPT(nn.Module):
    """The decoder of `config` (config.json's dict) holding `weights` (model.safetensors' names and tensors)."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        # buffers, so that .to(device) moves them; their names without dots (a module attribute name has none)
        for name, t in weights.items():
            self.register_buffer(name.replace(".", "__"), t.float())

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "__"))

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's tensors by their names inside it ('attn.w_qkv', 'ffn.experts.w1', ...)."""
        prefix = f"blocks__{i}__"
        return {n[len(prefix):].replace("__", "."): t for n, t in self.named_buffers() if n.startswith(prefix)}

    def attention(self, x: torch.Tensor, w: dict) -> torch.Tensor:
        qkv = torch.einsum("btd,dsnh->btsnh", x, w["attn.w_qkv"])
        base = self.config["rope_base"]
        q, k, v = rope(qkv[:, :, 0], base), rope(qkv[:, :, 1], base), qkv[:, :, 2]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return torch.einsum("bnth,nhd->btd", o, w["attn.w_o"])

    def ffn(self, x: torch.Tensor, w: dict, i: int) -> torch.Tensor:
        c, (b, t, d) = self.config, x.shape
        if c["ffn_kind"] == "mlp" or i < c["stem_layers"]:
            return gelu(x @ w["ffn.w1"]) @ w["ffn.w2"]
        experts = {n: w[f"ffn.experts.{n}"] for n in ("w_router", "bias", "w1", "w2")}
        xs = x.reshape(b * t, 1, d)
        if c["ffn_kind"] == "moe":
            y = moe_heads(xs, xs, experts, c["top_k"])
        elif c["ffn_kind"] == "latent_moe":
            y = moe_heads(xs, xs @ w["ffn.w_down"], experts, c["top_k"]) @ w["ffn.w_up"]
        else:  # mh_latent_moe; with separate routing sub-tokens (w_route), each head routes on its own projection
            sub = torch.einsum("nd,dhc->nhc", xs[:, 0], w["ffn.w_in"])
            route = torch.einsum("nd,dhc->nhc", xs[:, 0], w["ffn.w_route"]) if "ffn.w_route" in w else sub
            y = torch.einsum("nhc,hcd->nd", moe_heads(route, sub, experts, c["top_k"]), w["ffn.w_out"])
        return y.reshape(b, t, d)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab) float32."""
        eps = self.config["norm_eps"]
        h = self.w("embed")[tokens]
        for i in range(self.config["n_layers"]):
            w = self.layer(i)
            h = h + self.attention(rms_norm(h, w["norm1.scale"], eps), w)
            h = h + self.ffn(rms_norm(h, w["norm2.scale"], eps), w, i)
        return rms_norm(h, self.w("norm_f.scale"), eps) @ self.w("head")


def load(directory: str | Path) -> GPT:
    """The model an export wrote to `directory` (config.json, model.safetensors)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / CONFIG).read_text())
    return GPT(config["model"], load_file(str(directory / WEIGHTS))).eval()
