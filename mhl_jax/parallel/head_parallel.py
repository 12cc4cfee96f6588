"""Head Parallel (paper §3.2): move the all-to-all before routing.

Each device of an `hp` group owns Nh / P whole heads: their routers, balancing biases and experts.
Inside `jax.shard_map` over the ('data', 'hp') mesh, per device:

    x (n, Nh, dh)                      local tokens, every head
    -> all_to_all(split=head, concat=token, 'hp', tiled)
    -> (P * n, Nh / P, dh)             every token of the hp group, local heads only
    -> route + experts (moe_heads)     the same function the single-device model runs
    -> reverse all_to_all
    -> y (n, Nh, dh)

Every token crosses the link once each way: the traffic is (P - 1) / P * n * Nh * dh elements per
direction, independent of k and of the routing, with no metadata exchange and no host sync.
Because each head lives on exactly one device of its hp group and that device sees all of the
group's tokens, the balancing loads only need a sum over `data` to become global.

Gradients need no hand-written rule: the transpose of an all_to_all is the reverse all_to_all, and
shard_map sums the gradients of the data-replicated weights over `data`.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mhl_jax.model.moe_core import moe_heads


def to_local_heads(x: jax.Array, axis: str = "hp") -> jax.Array:
    """(n, Nh, c) every head of the local tokens -> (P * n, Nh / P, c) local heads of the group's tokens."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=0, tiled=True)


def to_local_tokens(y: jax.Array, axis: str = "hp") -> jax.Array:
    """Inverse of `to_local_heads`: (P * n, Nh / P, c) -> (n, Nh, c)."""
    return lax.all_to_all(y, axis, split_axis=0, concat_axis=1, tiled=True)


class HeadParallelMoE:
    """MoE executor for MH-LatentMoE on a ('data', 'hp') mesh.

    Called on global arrays (the executor protocol of `moe_core.py`):
    x_route (N, Nh, dr), x_expert (N, Nh, dh) with N split over every device; w_r (Nh, dr, Ne),
    bias (Nh, Ne), w1 (Nh, Ne, dh, de), w2 (Nh, Ne, de, dh) split over `hp` by head.
    Returns y (N, Nh, dh) split like the tokens, and the global load (Nh, Ne) int32 split over `hp`.
    When x_route is x_expert (MH-LatentMoE routes each sub-token on itself) it is sent once.
    """

    def __init__(self, mesh: Mesh, impl: str = "reference", check_vma: bool = False):
        if tuple(mesh.axis_names) != ("data", "hp"):
            raise ValueError(f"HeadParallelMoE: mesh axes must be ('data', 'hp'), got {mesh.axis_names}")
        self.mesh = mesh
        self.impl = impl
        # check_vma=False: custom kernels (jax-triton custom calls) carry no varying-axes rules
        self.check_vma = check_vma

    @property
    def hp(self) -> int:
        return self.mesh.shape["hp"]

    def __call__(self, x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array,
                 w1: jax.Array, w2: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        n, heads = x_expert.shape[:2]
        if heads % self.hp:
            raise ValueError(f"HeadParallelMoE: Nh={heads} heads are not divisible by the hp size {self.hp}")
        if n % self.mesh.size:
            raise ValueError(f"HeadParallelMoE: {n} tokens are not divisible by the {self.mesh.size} devices "
                             f"of the mesh {dict(self.mesh.shape)}")
        shared = x_route is x_expert
        tok = P(("data", "hp"))
        head = P("hp")
        impl = self.impl

        def local(xr, xe, w_r, bias, w1, w2):
            xe_h = to_local_heads(xe)
            xr_h = xe_h if shared else to_local_heads(xr)
            y, load = moe_heads(xr_h, xe_h, w_r, bias, w1, w2, k, impl)
            return to_local_tokens(y), lax.psum(load, "data")

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(tok, tok, head, head, head, head),
                           out_specs=(tok, head), check_vma=self.check_vma)
        return fn(x_route, x_expert, w_r, bias, w1, w2)

    def __repr__(self) -> str:
        return f"HeadParallelMoE(mesh={dict(self.mesh.shape)}, impl={self.impl!r})"
