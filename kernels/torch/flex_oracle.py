"""The oracle: the paper's expert computation as block-sparse FlexAttention (section 3.4), in PyTorch.

Expert FFN as attention over the packed rows (one "attention head" holding every group):
  Q = packed rows (P, dh)                          (sub-tokens sorted by (head, expert), padded)
  K = W1 of every group, (G * de, dh)              K[g * de + e] = W1[g][:, e]
  V = W2 of every group, (G * de, dh)              V[g * de + e] = W2[g][e, :]
  block mask: row block b attends only the de / KVB key blocks of its group block_group[b]
  score_mod(s) = log(gelu(s) + 1), scale 1
FlexAttention returns O' = (gelu(s) + 1) V / l and log(l). Multiplying by l = exp(lse) and
subtracting the per-group sum of V gives gelu(X W1) W2 exactly; the gate-weighted combine over the
k slots follows. Everything is differentiable through torch autograd (FlexAttention's backward,
including the gradient through lse), so the oracle gives the output and every gradient.

`compiled=True` (GPU) runs torch.compile(flex_attention) (the block-sparse Triton kernels);
`compiled=False` runs FlexAttention's eager math path (small CPU checks).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kernels.torch.experts import TorchPacking, pack_torch

FLEX_RECOMPILE_LIMIT = 256  # compiled shapes per process (torch's default is 8)


@functools.cache
def _compiled_flex():
    """One compile per shape (dynamic=False). torch.compile stops recompiling after its recompile limit (8)
    and then runs FlexAttention eagerly, which materialises the whole rows x (G * de) score matrix: in a
    sweep that was every shape after the 4th (forward and fwd+bwd compile separately), asking for up to
    38 TiB. So the limit is raised for the oracle."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), FLEX_RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False)


def gelu_score_mod(score, b, h, q_idx, kv_idx):
    """score_mod(s) = log(gelu(s) + 1): softmax then yields (gelu(s) + 1) / l (gelu >= -0.17)."""
    return torch.log(F.gelu(score, approximate="tanh") + 1.0)


def expert_block_mask(pk: TorchPacking, num_groups: int, de: int, q_block: int, kv_block: int,
                      num_rows: int) -> BlockMask:
    """Row block b fully attends the key blocks [g * de / kv_block, (g + 1) * de / kv_block) of its
    group g = pk.block_group[b] (none for -1). Both directions are built from the packing directly:
    key block c is attended by the row blocks of group c // (de / kv_block) (for the backward)."""
    if de % kv_block:
        raise ValueError(f"expert_block_mask: de={de} must be a multiple of kv_block={kv_block}")
    per = de // kv_block
    bg = pk.block_group.long()
    nqb, dev = bg.shape[0], bg.device
    full_kv_num = torch.where(bg >= 0, per, 0).to(torch.int32).view(1, 1, nqb)
    full_kv_idx = (bg.clamp(min=0)[:, None] * per + torch.arange(per, device=dev)).to(torch.int32).view(1, 1, nqb, per)
    nkb = num_groups * per
    kv_group = torch.arange(nkb, device=dev) // per
    nblk, start = pk.group_nblocks.long()[kv_group], pk.group_block_start.long()[kv_group]
    width = max(int(pk.group_nblocks.max()), 1)
    full_q_idx = (start[:, None] + torch.arange(width, device=dev)).clamp(max=nqb - 1).to(torch.int32)
    full_q_num = nblk.to(torch.int32).view(1, 1, nkb)

    def mask_mod(b, h, q_idx, kv_idx):  # the same pattern element-wise (the eager path reads this)
        return bg[q_idx // q_block] == kv_idx // de

    zeros = functools.partial(torch.zeros, dtype=torch.int32, device=dev)
    return BlockMask(seq_lengths=(num_rows, nkb * kv_block),
                     kv_num_blocks=zeros(1, 1, nqb), kv_indices=zeros(1, 1, nqb, per),
                     full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_idx,
                     q_num_blocks=zeros(1, 1, nkb), q_indices=zeros(1, 1, nkb, width),
                     full_q_num_blocks=full_q_num, full_q_indices=full_q_idx.view(1, 1, nkb, width),
                     BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod)


def flex_expert_rows(rows: torch.Tensor, pk: TorchPacking, w1: torch.Tensor, w2: torch.Tensor, q_block: int,
                     kv_block: int = 128, compiled: bool = True) -> torch.Tensor:
    """rows: (P, dh) packed inputs; w1: (G, dh, de); w2: (G, de, dh) -> expert outputs (P, dh) fp32
    (zero on rows of all-padding blocks)."""
    p, dh = rows.shape
    g, _, de = w1.shape
    kv_block = min(kv_block, de)
    q = rows.view(1, 1, p, dh)
    k = w1.transpose(1, 2).reshape(1, 1, g * de, dh)
    v = w2.reshape(1, 1, g * de, dh)
    mask = expert_block_mask(pk, g, de, q_block, kv_block, p)
    fn = _compiled_flex() if compiled else flex_attention
    o, lse = fn(q, k, v, score_mod=gelu_score_mod, block_mask=mask, scale=1.0, return_lse=True)
    denom = torch.exp(lse.float()).view(p, 1)  # l: softmax denominator of each row
    sum_v = w2.float().sum(1)  # (G, dh): the "+1" term's contribution, 1 V
    row_group = pk.block_group.long().repeat_interleave(q_block)
    out = o.view(p, dh).float() * denom - sum_v[row_group.clamp(min=0)]
    return torch.where((row_group >= 0)[:, None], out, torch.zeros_like(out))


def flex_expert_ffn(x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    block: int = 128, kv_block: int = 128, compiled: bool = True) -> torch.Tensor:
    """The oracle's MH expert FFN. x: (N, H, dh); idx: (N, H, k) int; gates: (N, H, k) fp32;
    w1: (H, Ne, dh, de); w2: (H, Ne, de, dh), x and weights in the compute dtype -> y (N, H, dh) x.dtype."""
    n, h, dh = x.shape
    _, ne, _, de = w1.shape
    k = idx.shape[2]
    pk = pack_torch(idx, ne, block)
    slot = pk.row_slot.long()
    rows = x.reshape(n * h, dh)[slot.clamp(min=0) // k] * (slot >= 0)[:, None].to(x.dtype)
    out = flex_expert_rows(rows, pk, w1.reshape(h * ne, dh, de), w2.reshape(h * ne, de, dh), block, kv_block,
                           compiled)
    per_slot = out[pk.slot_row.long()].view(n, h, k, dh)
    return torch.einsum("nhkd,nhk->nhd", per_slot, gates.float()).to(x.dtype)
