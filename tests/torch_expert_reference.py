"""float64 torch reference of the expert FFN, for the kernel tests (tests/test_experts_kernel.py,
tests/test_experts_grouped.py): one choice j at a time, no packing."""

import torch


def expert_ffn_f64(x, idx, gates, w1, w2):
    """x (N, H, dh), idx (N, H, k), gates (N, H, k), w1 (H, Ne, dh, de), w2 (H, Ne, de, dh) -> y float64,
    y[n, h] = sum_j gates[n, h, j] * gelu_tanh(x[n, h] W1[h, e_j]) W2[h, e_j]."""
    x, gates, w1, w2 = (t.double() for t in (x, gates, w1, w2))
    n, h, k = idx.shape
    hs = torch.arange(h)[None, :]
    y = torch.zeros_like(x)
    for j in range(k):
        hid = torch.einsum("nhd,nhde->nhe", x, w1[hs, idx[..., j]])
        act = torch.nn.functional.gelu(hid, approximate="tanh")
        y = y + gates[..., j:j + 1] * torch.einsum("nhe,nhed->nhd", act, w2[hs, idx[..., j]])
    return y
