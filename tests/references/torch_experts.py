"""float64 torch reference of the expert FFN, for the kernel tests (tests/kernels/test_experts_*.py): one choice j at
a time, no packing."""

import numpy as np
import torch


def expert_inputs(seed, n, h, k, ne, dh, de, skew=False, w_scale=None):
    """Random fp32 (x, idx, gates, w1, w2) for the kernel tests: k distinct experts per sub-token, or
    (skew) every token on experts k-1..0; weights N(0, 1) times w_scale (None: dh^-1/2 for W1, de^-1/2
    for W2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, dh, generator=g)
    if skew:
        idx = torch.arange(k).flip(0).expand(n, h, k).clone()  # every token picks experts k-1..0
    else:
        idx = torch.argsort(torch.rand(n, h, ne, generator=g), -1)[..., :k]
    gates = torch.softmax(torch.randn(n, h, k, generator=g), -1)
    s1, s2 = (dh ** -0.5, de ** -0.5) if w_scale is None else (w_scale, w_scale)
    w1 = torch.randn(h, ne, dh, de, generator=g) * s1
    w2 = torch.randn(h, ne, de, dh, generator=g) * s2
    return x, idx, gates, w1, w2


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


def rel(a, b) -> float:
    """|a - b| / |b| (L2, in float64) of torch tensors (on any device) or arrays (numpy, JAX)."""
    a, b = (t.double() if isinstance(t, torch.Tensor) else torch.as_tensor(np.asarray(t, np.float64)) for t in (a, b))
    return float((a - b.to(a.device)).norm() / b.norm())


def check_fwd_bwd_vs_f64(ffn, x, idx, gates, w1, w2, tol: float = 1e-5) -> list:
    """Run `ffn(x, idx, gates, w1, w2)` (torch autograd) and `expert_ffn_f64` with the same upstream
    gradient; assert the output and the gradients of x, gates, w1, w2 agree to `tol` (relative L2).
    Returns the leaves (their .grad set) for further checks."""
    leaves = [t.clone().requires_grad_() for t in (x, gates, w1, w2)]
    y = ffn(leaves[0], idx, *leaves[1:])
    refs = [t.clone().double().requires_grad_() for t in (x, gates, w1, w2)]
    y_ref = expert_ffn_f64(refs[0], idx, *refs[1:])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    y.backward(dy)
    y_ref.backward(dy.double())
    assert rel(y.detach(), y_ref.detach()) < tol
    for name, a, b in zip(("x", "gates", "w1", "w2"), leaves, refs):
        assert torch.isfinite(a.grad).all(), name
        assert rel(a.grad, b.grad) < tol, (name, rel(a.grad, b.grad))
    return leaves


def weight_grads_twice(ffn, x, idx, gates, w1, w2) -> list:
    """The gradients of w1, w2 of sum(ffn(...)^2), computed twice: [(dw1, dw2), (dw1, dw2)]."""
    grads = []
    for _ in range(2):
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        ffn(x, idx, gates, a, b).square().sum().backward()
        grads.append((a.grad, b.grad))
    return grads
