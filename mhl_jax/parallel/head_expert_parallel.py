"""Head Parallel x Expert Parallel: past Nh devices, each head's experts split over `ep` inside its hp group.

Head Parallel alone stops at Nh devices (one head per device). On a ('data', 'hp', 'ep') mesh the heads are split
over `hp` as in `head_parallel.py`, and the Ne experts of each head over `ep` as in `expert_parallel.py` (dropless,
deterministic). Device (d, h, e) owns heads group h (Nh / hp heads: their routers' and biases' columns and experts
of expert group e) and holds token block (d, h, e) of the batch, n tokens (blocks in mesh order). Inside
`jax.shard_map`, per device:

    x (n, Nh, c)                     block (d, h, e): its own tokens, every head
    -> all_to_all over 'hp'          the HP exchange (head -> token), as `HeadParallelMoE`
    -> (hp * n, Nh / hp, c)          blocks (d, *, e): the tokens of its hp group, heads of group h only
    -> ep_moe_local over 'ep'        the ep group (d, h, *) holds blocks (d, *, *), all of data shard d's tokens for
                                     heads of group h; each (token, head, choice) slot goes to the device holding
                                     that expert (the EP exchange: k-duplicated rows and the count metadata)
    -> reverse all_to_all over 'hp'
    -> y (n, Nh, c)

The loads: EP's all-gathered counts sum over the ep group, so each device knows how many of data shard d's slots
went to each of its (head, expert) pairs; a psum over `data` adds the other shards, and the count is global. No sum
over `hp` or `ep` is needed (or correct): each (head, expert) pair is counted on the one device that owns it, and
the (Nh, Ne) load comes back split over ('hp', 'ep') like the bias it updates.

Traffic per device and layer, each way: the HP exchange sends (hp - 1) / hp * n * Nh * c elements (twice with
separate routing sub-tokens); the EP exchange sends the rows of the n * Nh * k slots that land on other ep devices
((ep - 1) / ep of them under uniform routing; c elements each) and (ep - 1) * Nh / hp * Ne int32 counts.
`traffic.comm_bytes_per_layer` computes both from the shapes.

Chunks (`parallel.hp_chunks`): the local tokens in C chunks, each through both exchanges and the experts on its own,
so that one chunk's exchanges overlap another's compute (`chunks.py`).

Gradients need no rule of their own: the all_to_all's transpose is the reverse all_to_all, EP's exchanges carry
their own (`expert_parallel.py`), the all-gathered router columns reduce-scatter their gradient over `ep`, and
shard_map sums the gradients of the data-replicated weights over `data`.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mhl_jax.moe.context import ExpertContext
from mhl_jax.parallel.chunks import checked_chunks, over_chunks
from mhl_jax.parallel.expert_parallel import ep_moe_local, resolve_ep_impl
from mhl_jax.parallel.head_parallel import (
    grouped_to_local_heads,
    grouped_to_local_tokens,
    to_local_heads,
    to_local_tokens,
)

AXES = ("data", "hp", "ep")


class HeadExpertParallelMoE:
    """MoE executor for MH-LatentMoE on a ('data', 'hp', 'ep') mesh.

    Called on global arrays (`mhl_jax.moe.core.MoEExecutor`): x_route (N, Nh, dr), x_expert (N, Nh, dh) token-major
    or (hp, N, Nh / hp, dh) head-group-major (`head_groups`), N split over every device; w_r (Nh, dr, Ne) split
    over `hp` on dim 0 and `ep` on dim 2; bias (Nh, Ne), w1 (Nh, Ne, dh, de), w2 (Nh, Ne, de, dh) over `hp` on dim
    0 and `ep` on dim 1. Returns y shaped and split like x_expert and the global load (Nh, Ne) int32 split over
    ('hp', 'ep'). Takes no step context (as `ExpertParallelMoE`: its experts cast their own weights). chunks: the
    local tokens in this many chunks whose exchanges overlap the others' compute (the module doc).
    """

    def __init__(self, mesh: Mesh, impl: str = "reference", ep_impl: str = "auto", check_vma: bool = False,
                 chunks: int = 1):
        if tuple(mesh.axis_names) != AXES:
            raise ValueError(f"HeadExpertParallelMoE: mesh axes must be {AXES}, got {mesh.axis_names}")
        self.mesh = mesh
        self.impl = impl
        self.chunks = checked_chunks(chunks, "HeadExpertParallelMoE")
        self.ep_impl = resolve_ep_impl(ep_impl, mesh)
        self.check_vma = check_vma  # off: custom kernels (jax-triton calls) carry no varying-axes rules

    @property
    def hp(self) -> int:
        return self.mesh.shape["hp"]

    @property
    def ep(self) -> int:
        return self.mesh.shape["ep"]

    @property
    def head_groups(self) -> int:
        """The model emits its sub-tokens as (hp, N, Nh / hp, dh) for this executor (`head_parallel.py`)."""
        return self.hp

    def __call__(self, x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array,
                 w1: jax.Array, w2: jax.Array, k: int,
                 ctx: ExpertContext | None = None) -> tuple[jax.Array, jax.Array]:
        if ctx is not None and (ctx.weights_cast is not None or ctx.grad_acc is not None):
            raise ValueError("HeadExpertParallelMoE: takes neither weights_cast nor grad_acc from a step context")
        grouped = x_expert.ndim == 4
        if grouped and x_expert.shape[0] != self.hp:
            raise ValueError(f"HeadExpertParallelMoE: grouped sub-tokens {x_expert.shape} have {x_expert.shape[0]} "
                             f"head groups, expected the hp size {self.hp}")
        n = x_expert.shape[1] if grouped else x_expert.shape[0]
        heads, ne = w1.shape[:2]
        if heads % self.hp:
            raise ValueError(f"HeadExpertParallelMoE: Nh={heads} heads are not divisible by the hp size {self.hp}")
        if ne % self.ep:
            raise ValueError(f"HeadExpertParallelMoE: Ne={ne} experts are not divisible by the ep size {self.ep}")
        if n % self.mesh.size:
            raise ValueError(f"HeadExpertParallelMoE: {n} tokens are not divisible by the {self.mesh.size} devices "
                             f"of the mesh {dict(self.mesh.shape)}")
        shared = x_route is x_expert
        tok = P(None, AXES) if grouped else P(AXES)
        send, back = (grouped_to_local_heads, grouped_to_local_tokens) if grouped else (to_local_heads,
                                                                                       to_local_tokens)
        experts = partial(ep_moe_local, k=k, impl=self.impl, ep_impl=self.ep_impl, axis="ep", data_axis="data")

        def local(xr, xe, w_r, bias, w1, w2):
            def chunk(i, xr, xe):
                xe_h = send(xe)
                xr_h = xe_h if shared else send(xr)
                y, load = experts(xr_h, xe_h, w_r, bias, w1, w2)
                return back(y), load

            return over_chunks(chunk, (xr, xe), self.chunks, axis=1 if grouped else 0)

        cell = P("hp", "ep")  # (head, expert) leaves: bias, w1, w2 and the load
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(tok, tok, P("hp", None, "ep"), cell, cell, cell),
                           out_specs=(tok, cell), check_vma=self.check_vma)
        return fn(x_route, x_expert, w_r, bias, w1, w2)

    def __repr__(self) -> str:
        return (f"HeadExpertParallelMoE(mesh={dict(self.mesh.shape)}, impl={self.impl!r}, "
                f"ep_impl={self.ep_impl!r}, chunks={self.chunks})")
