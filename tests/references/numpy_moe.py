"""Independent float64 numpy references: a naive per-token, per-expert loop for every FFN variant."""

import numpy as np


def gelu(z):
    """tanh-approximate gelu (jax.nn.gelu's default)."""
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z ** 3)))


def f64(a):
    return np.asarray(a, dtype=np.float64)


def moe_token(x_route, x_expert, w_r, bias, w1, w2, k):
    """One token, one head. x_route (dr,), x_expert (dh,), w_r (dr, Ne), bias (Ne,), w1 (Ne, dh, de),
    w2 (Ne, de, dh)."""
    s = x_route @ w_r
    chosen = np.argsort(-(s + bias), kind="stable")[:k]
    g = np.exp(s[chosen] - s[chosen].max())
    g /= g.sum()
    out = np.zeros(w2.shape[-1])
    for gate, e in zip(g, chosen):
        out += gate * (gelu(x_expert @ w1[e]) @ w2[e])
    return out, chosen, g


def moe_ref(x, w_r, bias, w1, w2, k):
    """x (N, d); MoE with one head."""
    x, w_r, bias, w1, w2 = map(f64, (x, w_r, bias, w1, w2))
    return np.stack([moe_token(t, t, w_r[0], bias[0], w1[0], w2[0], k)[0] for t in x])


def latent_moe_ref(x, w_down, w_up, w_r, bias, w1, w2, k):
    x, w_down, w_up, w_r, bias, w1, w2 = map(f64, (x, w_down, w_up, w_r, bias, w1, w2))
    return np.stack([moe_token(t, t @ w_down, w_r[0], bias[0], w1[0], w2[0], k)[0] @ w_up for t in x])


def mh_latent_moe_ref(x, w_in, w_out, w_r, bias, w1, w2, k):
    """x (N, d); w_in (d, H, dh); w_out (H, dh, d); per-head w_r (H, dh, Ne), w1 (H, Ne, dh, de), ..."""
    x, w_in, w_out, w_r, bias, w1, w2 = map(f64, (x, w_in, w_out, w_r, bias, w1, w2))
    out = []
    for t in x:
        sub = np.einsum("d,dhc->hc", t, w_in)
        heads = [moe_token(sub[h], sub[h], w_r[h], bias[h], w1[h], w2[h], k)[0] for h in range(sub.shape[0])]
        out.append(np.einsum("hc,hcd->d", np.stack(heads), w_out))
    return np.stack(out)


def mlp_ref(x, w1, w2):
    return gelu(f64(x) @ f64(w1)) @ f64(w2)
