"""Independent float64 references of the router (numpy): the exact top-k and its gradients, and the inputs the
router tests draw (torch tensors: the kernels' torch launchers take them, the JAX tests convert)."""

import numpy as np
import torch


def router_inputs(seed, n, h, dh, ne, bias_scale=0.1):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((n, h, dh), dtype=np.float32)).to(torch.bfloat16)
    w = torch.from_numpy(rng.standard_normal((h, dh, ne), dtype=np.float32) / np.sqrt(dh))
    b = torch.from_numpy(bias_scale * rng.standard_normal((h, ne), dtype=np.float32))
    return x, w, b


def scores64(x, w):
    return np.einsum("nhd,hde->nhe", x.double().numpy(), w.double().numpy())


def check_topk(idx, vals, s64, b64, k, tol=2e-6, max_mismatch=0.01):
    """idx (N, H, k), vals (N, H, k) against float64 scores s64 (N, H, Ne) and bias b64 (H, Ne).

    The chosen biased scores must be the k largest order statistics (within tol x scale: near ties may
    swap); the indices must equal the exact (stable) top-k except on such near ties; the values must be
    the raw scores of the chosen experts."""
    idx, vals = np.asarray(idx).astype(np.int64), np.asarray(vals, np.float64)
    biased = s64 + b64[None]
    scale = np.abs(biased).max(-1, keepdims=True) + np.abs(s64).max(-1, keepdims=True)
    assert idx.shape == s64.shape[:2] + (k,)
    assert (idx >= 0).all() and (idx < s64.shape[2]).all()
    srt = np.sort(idx, -1)
    assert (np.diff(srt, axis=-1) > 0).all(), "repeated expert in one row"
    top = -np.sort(-biased, -1)[..., :k]
    got = np.take_along_axis(biased, idx, -1)
    err = np.abs(got - top) / scale
    assert err.max() <= tol, f"selected biased scores off the top-k by {err.max():.2e} of the scale"
    ref_idx = np.argsort(-biased, -1, kind="stable")[..., :k]
    mismatch = (idx != ref_idx).any(-1)
    assert mismatch.mean() <= max_mismatch, f"{mismatch.mean():.4f} of rows differ from the exact top-k"
    verr = np.abs(vals - np.take_along_axis(s64, idx, -1)) / scale
    assert verr.max() <= tol, f"values off the raw scores by {verr.max():.2e} of the scale"
    return mismatch.mean()


def grads64(x, w, idx, dv):
    """dx (N, H, dh), dw (H, dh, Ne) of sum(vals * dv) for the selection idx, in float64."""
    x64, w64, dv64 = x.double().numpy(), w.double().numpy(), np.asarray(dv, np.float64)
    idx = np.asarray(idx).astype(np.int64)
    n, h, k = idx.shape
    hs = np.arange(h)[None, :, None]
    dx = np.einsum("nhkd,nhk->nhd", np.swapaxes(w64, 1, 2)[hs, idx], dv64)
    dw = np.zeros(w64.shape)
    for j in range(k):
        for hh in range(h):
            np.add.at(dw[hh].T, idx[:, hh, j], dv64[:, hh, j, None] * x64[:, hh])
    return dx, dw


def assert_close(a, ref, rtol=1e-5):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(a, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
