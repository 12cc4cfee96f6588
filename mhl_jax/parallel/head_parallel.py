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

Layouts. The executor takes the sub-tokens either token-major, x (N, Nh, dh) (each destination's
heads are strided, so XLA transposes them into contiguous blocks before the dispatch and back after
the combine: two extra passes over the sub-tokens each way), or head-group-major,
x (P, N, Nh / P, dh) as `grouped_project_in` emits it from W_in (`head_groups` tells the model to):
then block p already is destination p's data and the exchange is a plain contiguous all_to_all.

Gradients need no hand-written rule: the transpose of an all_to_all is the reverse all_to_all, and
shard_map sums the gradients of the data-replicated weights over `data`.

Chunks (`parallel.hp_chunks`): the local tokens in C chunks, each sent, routed, computed and returned on its own, so
that one chunk's exchange overlaps another's experts (`chunks.py`). The step context's casts serve every chunk; its
gradient sums go to the first chunk alone (the others' weight gradients add to what it returns), since C chunks each
returning sum + dW_i would count the sum C times.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mhl_jax.moe.context import ExpertContext
from mhl_jax.moe.core import accumulates_in_place, moe_heads, reads_weights_cast
from mhl_jax.parallel.chunks import checked_chunks, over_chunks


def to_local_heads(x: jax.Array, axis: str = "hp") -> jax.Array:
    """(n, Nh, c) every head of the local tokens -> (P * n, Nh / P, c) local heads of the group's tokens."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=0, tiled=True)


def to_local_tokens(y: jax.Array, axis: str = "hp") -> jax.Array:
    """Inverse of `to_local_heads`: (P * n, Nh / P, c) -> (n, Nh, c)."""
    return lax.all_to_all(y, axis, split_axis=0, concat_axis=1, tiled=True)


def grouped_to_local_heads(x: jax.Array, axis: str = "hp") -> jax.Array:
    """(P, n, Nh / P, c) local tokens, block p = head group p -> (P * n, Nh / P, c) local heads of the
    group's tokens (source-major). Each block is contiguous: a plain all_to_all, no transpose."""
    groups, n = x.shape[:2]
    y = lax.all_to_all(x, axis, split_axis=0, concat_axis=0, tiled=True)
    return y.reshape(groups * n, *x.shape[2:])


def grouped_to_local_tokens(y: jax.Array, axis: str = "hp") -> jax.Array:
    """Inverse of `grouped_to_local_heads`: (P * n, Nh / P, c) -> (P, n, Nh / P, c)."""
    groups = lax.axis_size(axis)
    y = y.reshape(groups, y.shape[0] // groups, *y.shape[1:])
    return lax.all_to_all(y, axis, split_axis=0, concat_axis=0, tiled=True)


class HeadParallelMoE:
    """MoE executor for MH-LatentMoE on a ('data', 'hp') mesh.

    Called on global arrays (`mhl_jax.moe.core.MoEExecutor`):
    x_route (N, Nh, dr), x_expert (N, Nh, dh) with N split over every device; w_r (Nh, dr, Ne),
    bias (Nh, Ne), w1 (Nh, Ne, dh, de), w2 (Nh, Ne, de, dh) split over `hp` by head.
    Returns y (N, Nh, dh) split like the tokens, and the global load (Nh, Ne) int32 split over `hp`.
    When x_route is x_expert (MH-LatentMoE routes each sub-token on itself) it is sent once. chunks: the local tokens
    in this many chunks whose exchanges overlap the others' compute (the module doc).
    """

    def __init__(self, mesh: Mesh, impl: str = "reference", check_vma: bool = False, chunks: int = 1):
        if tuple(mesh.axis_names) != ("data", "hp"):
            raise ValueError(f"HeadParallelMoE: mesh axes must be ('data', 'hp'), got {mesh.axis_names}")
        self.mesh = mesh
        self.impl = impl
        self.chunks = checked_chunks(chunks, "HeadParallelMoE")
        # check_vma=False: custom kernels (jax-triton custom calls) carry no varying-axes rules
        self.check_vma = check_vma

    @property
    def hp(self) -> int:
        return self.mesh.shape["hp"]

    @property
    def head_groups(self) -> int:
        """The model emits its sub-tokens as (hp, N, Nh / hp, dh) for this executor (see the module doc)."""
        return self.hp

    def reads_weights_cast(self, x_dtype, w_dtype, dh: int) -> bool:
        return reads_weights_cast(self.impl, x_dtype, w_dtype, dh)

    def accumulates_in_place(self, x_dtype, w_dtype, dh: int) -> bool:
        """Only without data parallelism: shard_map sums the weights' cotangents over `data` (replicated there), which
        would add the accumulators data-size times."""
        return self.mesh.shape["data"] == 1 and accumulates_in_place(self.impl, x_dtype, w_dtype, dh)

    def __call__(self, x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array,
                 w1: jax.Array, w2: jax.Array, k: int,
                 ctx: ExpertContext | None = None) -> tuple[jax.Array, jax.Array]:
        """Token-major x (N, Nh, c) -> y (N, Nh, dh), or head-group-major x (hp, N, Nh / hp, c) -> y
        (hp, N, Nh / hp, dh); both with the global load (Nh, Ne). ctx: the step context's weight casts and gradient
        sums, split over `hp` like w1 and w2 (sums only on a mesh without data parallelism: `accumulates_in_place`)."""
        ctx = ctx or ExpertContext()
        if ctx.grad_acc is not None and self.mesh.shape["data"] != 1:
            raise ValueError(f"HeadParallelMoE: grad_acc= needs a mesh without data parallelism, got "
                             f"{dict(self.mesh.shape)}")
        grouped = x_expert.ndim == 4
        if grouped:
            groups, n, hl = x_expert.shape[:3]
            if groups != self.hp:
                raise ValueError(f"HeadParallelMoE: grouped sub-tokens {x_expert.shape} have {groups} head "
                                 f"groups, expected the hp size {self.hp}")
            heads = groups * hl
        else:
            n, heads = x_expert.shape[:2]
        if heads % self.hp:
            raise ValueError(f"HeadParallelMoE: Nh={heads} heads are not divisible by the hp size {self.hp}")
        if n % self.mesh.size:
            raise ValueError(f"HeadParallelMoE: {n} tokens are not divisible by the {self.mesh.size} devices "
                             f"of the mesh {dict(self.mesh.shape)}")
        shared = x_route is x_expert
        tok = P(None, ("data", "hp")) if grouped else P(("data", "hp"))
        head = P("hp")
        impl = self.impl
        send, back = (grouped_to_local_heads, grouped_to_local_tokens) if grouped else (to_local_heads,
                                                                                       to_local_tokens)

        wc = () if ctx.weights_cast is None else tuple(ctx.weights_cast)
        acc = () if ctx.grad_acc is None else tuple(ctx.grad_acc)

        def local(xr, xe, w_r, bias, w1, w2, *extra):  # extra: this device's heads of the casts, then of the sums
            casts, sums = extra[:len(wc)] or None, extra[len(wc):] or None

            def chunk(i, xr, xe):
                xe_h = send(xe)
                xr_h = xe_h if shared else send(xr)
                y, load = moe_heads(xr_h, xe_h, w_r, bias, w1, w2, k, impl, weights_cast=casts,
                                    grad_acc=sums if i == 0 else None)
                return back(y), load

            y, load = over_chunks(chunk, (xr, xe), self.chunks, axis=1 if grouped else 0)
            return y, lax.psum(load, "data")

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(tok, tok) + (head,) * (4 + len(wc) + len(acc)),
                           out_specs=(tok, head), check_vma=self.check_vma)
        return fn(x_route, x_expert, w_r, bias, w1, w2, *wc, *acc)

    def __repr__(self) -> str:
        return f"HeadParallelMoE(mesh={dict(self.mesh.shape)}, impl={self.impl!r}, chunks={self.chunks})"
