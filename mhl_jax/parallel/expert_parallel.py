"""Expert Parallel (the baseline of paper §2.3, done properly): dropless, deterministic, static shapes.

Each device of an `ep` group owns Ne / P experts of every head (and the matching router columns and
biases). Inside `jax.shard_map` over the ('data', 'ep') mesh, per device with n local tokens:

    route locally           router and bias all-gathered over `ep` (their transpose, a reduce-scatter,
                            gives each device the gradient of its own router columns)
    sort slots              the n * H * k (token, head, choice) slots, stably by (destination, head,
                            local expert): the k-duplicated send buffer (M, c), M = n * H * k
    metadata                all_gather over `ep` of the per-(destination, local group) counts: every
                            device learns every sender's sizes, hence all offsets (and the loads)
    dispatch                ragged_all_to_all (GPU) or padded all_to_all (CPU): receive buffer of the
                            static worst case R = P * n * H * min(k, Ne / P) rows; unused rows carry
                            expert index -1 so the expert kernels skip them (no compute on padding)
    local experts           expert_ffn with k = 1 and gate 1 over the received rows
    combine                 the reverse exchange, un-sort, gate-weighted sum over the k choices in a
                            fixed order (deterministic: no atomics, no order-dependent reductions)

The traffic grows with k and with the skew of the routing, and the receive buffer must be sized for
the worst case: those are EP's real costs, measured in `bench/a2a.py`. The loads returned are the
global counts: the all-gathered metadata already sums over the ep group; a psum over `data` adds the
other groups; each device returns the counts of its own experts (output split over `ep`, like the
bias it updates).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mhl_jax.moe.context import ExpertContext
from mhl_jax.moe.core import expert_ffn, route_topk
from mhl_jax.moe.router import router_gates
from mhl_jax.parallel.chunks import checked_chunks, over_chunks

EP_IMPLS = ("auto", "ragged", "padded")


class ExchangePlan(NamedTuple):
    """Row counts and offsets of one device's side of an EP exchange; all (P,) int32 over ep peers.

    The send buffer holds this device's rows sorted by destination; the receive buffer holds the
    chunks of the senders in peer order (packed for ragged, at q * cap for padded).
    """

    send_sizes: jax.Array  # rows sent to each peer
    send_offsets: jax.Array  # start of each peer's chunk in the send buffer
    recv_sizes: jax.Array  # rows received from each peer
    recv_offsets: jax.Array  # start of each peer's chunk in this device's (packed) receive buffer
    remote_recv_offsets: jax.Array  # start of this device's chunk in each peer's receive buffer
    remote_send_offsets: jax.Array  # start of each peer's chunk for this device in its send buffer


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def make_plan(counts: jax.Array, me: jax.Array) -> ExchangePlan:
    """counts: (P, P) int32, counts[q, p] = rows peer q sends to peer p (all-gathered); me: () int32."""
    send = counts[me]
    recv = counts[:, me]
    return ExchangePlan(send_sizes=send, send_offsets=_exclusive_cumsum(send), recv_sizes=recv,
                        recv_offsets=_exclusive_cumsum(recv),
                        remote_recv_offsets=_exclusive_cumsum(counts, axis=0)[me],
                        remote_send_offsets=_exclusive_cumsum(counts, axis=1)[:, me])


def ep_crosses_processes(mesh: Mesh | None) -> bool:
    """Whether some `ep` group of the mesh holds devices of more than one process. `ep` is the last axis of both
    meshes that have one, ('data', 'ep') and ('data', 'hp', 'ep'): a group is a row of the devices' last axis."""
    if mesh is None:
        return False
    groups = mesh.devices.reshape(-1, mesh.devices.shape[-1])
    return any(len({d.process_index for d in row}) > 1 for row in groups)


def resolve_ep_impl(ep_impl: str, mesh: Mesh | None = None) -> str:
    """'auto' -> 'ragged' on GPU (ragged_all_to_all), 'padded' elsewhere (XLA:CPU lacks it) and where an ep group
    spans processes: there XLA's ragged exchange falls back to NCCL send / recv, and the MoE 2.2B step at ep 2, one
    process per H200, ran at 135k tokens/s ragged against 202k padded (one process of both: 263k ragged, 199k
    padded)."""
    if ep_impl not in EP_IMPLS:
        raise ValueError(f"parallel.ep_impl={ep_impl!r}: expected one of {list(EP_IMPLS)}")
    if ep_impl == "auto":
        return "ragged" if jax.default_backend() == "gpu" and not ep_crosses_processes(mesh) else "padded"
    return ep_impl


# ----------------------------------------------------------------------------- the two exchanges


def split_updates(offsets: jax.Array, sizes: jax.Array, parts: int) -> tuple[jax.Array, jax.Array]:
    """(P,) chunk offsets and sizes -> (P * parts,) offsets and sizes of contiguous pieces.

    Piece u of chunk p covers rows [off_p + floor(u * size_p / parts), off_p + floor((u+1) * size_p / parts)):
    the sender and the receiver of a chunk compute the same pieces from the same count.
    """
    u = jnp.arange(parts + 1, dtype=jnp.int32)
    bounds = sizes[:, None] * u[None, :] // parts  # (P, parts + 1)
    return (offsets[:, None] + bounds[:, :-1]).reshape(-1), (bounds[:, 1:] - bounds[:, :-1]).reshape(-1)


def ragged_updates(plan: ExchangePlan, direction: str, parts: int) -> tuple[jax.Array, ...]:
    """(input_offsets, send_sizes, output_offsets, recv_sizes), each (P * parts,), for
    lax.ragged_all_to_all: 'send' (dispatch, send layout -> receive layout) or 'return' (combine).

    XLA's single-host GPU kernel gives each update (one peer's slice) one 128-thread block, so one
    update per peer copies at a few GB/s (measured: 2.75 GB/s on 2 x H200); `parts` pieces per peer
    put parts x more blocks to work."""
    if direction == "send":
        in_off, send = split_updates(plan.send_offsets, plan.send_sizes, parts)
        out_off, _ = split_updates(plan.remote_recv_offsets, plan.send_sizes, parts)
        _, recv = split_updates(plan.recv_offsets, plan.recv_sizes, parts)
    elif direction == "return":
        in_off, send = split_updates(plan.recv_offsets, plan.recv_sizes, parts)
        out_off, _ = split_updates(plan.remote_send_offsets, plan.recv_sizes, parts)
        _, recv = split_updates(plan.send_offsets, plan.send_sizes, parts)
    else:
        raise ValueError(f"ragged_updates: direction={direction!r}, expected 'send' or 'return'")
    return in_off, send, out_off, recv


def ragged_parts(peers: int) -> int:
    """Pieces per peer for ragged_all_to_all: about 256 updates in all (2 blocks per H200 SM)."""
    return max(1, 256 // peers)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ragged_send(x: jax.Array, plan: ExchangePlan, out_rows: int, axis: str) -> jax.Array:
    """Dispatch: x (M, c) sorted by destination -> (out_rows, c) chunks of the senders, packed in
    peer order; rows past the received ones are zero."""
    out = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
    updates = ragged_updates(plan, "send", ragged_parts(plan.send_sizes.shape[0]))
    return lax.ragged_all_to_all(x, out, *updates, axis_name=axis)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ragged_return(y: jax.Array, plan: ExchangePlan, out_rows: int, axis: str) -> jax.Array:
    """Combine: y (R, c) in receive layout -> (out_rows, c) in this device's send layout."""
    out = jnp.zeros((out_rows,) + y.shape[1:], y.dtype)
    updates = ragged_updates(plan, "return", ragged_parts(plan.send_sizes.shape[0]))
    return lax.ragged_all_to_all(y, out, *updates, axis_name=axis)


# Each exchange's transpose is the other one (explicit rules: no reliance on an autodiff rule for
# ragged_all_to_all, and unsent rows get an exact zero gradient).
def _send_fwd(x, plan, out_rows, axis):
    return _ragged_send(x, plan, out_rows, axis), (plan, x.shape[0])


def _send_bwd(out_rows, axis, res, g):
    plan, in_rows = res
    return _ragged_return(g, plan, in_rows, axis), None


def _return_fwd(y, plan, out_rows, axis):
    return _ragged_return(y, plan, out_rows, axis), (plan, y.shape[0])


def _return_bwd(out_rows, axis, res, g):
    plan, in_rows = res
    return _ragged_send(g, plan, in_rows, axis), None


_ragged_send.defvjp(_send_fwd, _send_bwd)
_ragged_return.defvjp(_return_fwd, _return_bwd)


def _padded_send(x: jax.Array, plan: ExchangePlan, cap: int, axis: str) -> jax.Array:
    """x (M, c) sorted by destination -> (P * cap, c): sender q's rows at [q * cap, q * cap + size)."""
    peers = plan.send_sizes.shape[0]
    j = jnp.arange(cap, dtype=jnp.int32)
    src = plan.send_offsets[:, None] + j[None, :]  # (P, cap)
    valid = j[None, :] < plan.send_sizes[:, None]
    buf = jnp.take(x, jnp.clip(src, 0, x.shape[0] - 1).reshape(-1), axis=0)
    buf = jnp.where(valid.reshape(-1, 1), buf, jnp.zeros_like(buf)).reshape(peers, cap, -1)
    return lax.all_to_all(buf, axis, 0, 0, tiled=True).reshape(peers * cap, -1)


def _padded_return(y: jax.Array, plan: ExchangePlan, cap: int, out_rows: int, axis: str) -> jax.Array:
    """Inverse of `_padded_send`: y (P * cap, c) -> (out_rows, c) in this device's send order."""
    peers = plan.send_sizes.shape[0]
    back = lax.all_to_all(y.reshape(peers, cap, -1), axis, 0, 0, tiled=True).reshape(peers * cap, -1)
    i = jnp.arange(out_rows, dtype=jnp.int32)
    dest = jnp.clip(jnp.searchsorted(plan.send_offsets + plan.send_sizes, i, side="right"), 0, peers - 1)
    return jnp.take(back, dest * cap + i - plan.send_offsets[dest], axis=0)


def recv_chunk_starts(plan: ExchangePlan, cap: int, impl: str) -> jax.Array:
    """(P,) start row of each sender's chunk in the receive buffer of `impl`."""
    if impl == "ragged":
        return plan.recv_offsets
    return jnp.arange(plan.recv_sizes.shape[0], dtype=jnp.int32) * cap


def dispatch(x: jax.Array, plan: ExchangePlan, cap: int, impl: str, axis: str = "ep") -> jax.Array:
    """x: (M, c) rows sorted by destination -> receive buffer (P * cap, c); rows not received are 0."""
    peers = plan.send_sizes.shape[0]
    if impl == "ragged":
        return _ragged_send(x, plan, peers * cap, axis)
    if impl == "padded":
        return _padded_send(x, plan, cap, axis)
    raise ValueError(f"dispatch: impl={impl!r}, expected 'ragged' or 'padded'")


def combine(y: jax.Array, plan: ExchangePlan, cap: int, out_rows: int, impl: str, axis: str = "ep") -> jax.Array:
    """y: receive buffer (P * cap, c) of expert outputs -> (out_rows, c) back in the send order."""
    if impl == "ragged":
        return _ragged_return(y, plan, out_rows, axis)
    if impl == "padded":
        return _padded_return(y, plan, cap, out_rows, axis)
    raise ValueError(f"combine: impl={impl!r}, expected 'ragged' or 'padded'")


def received_groups(group_counts: jax.Array, starts: jax.Array, rows: int) -> jax.Array:
    """Local group of every receive-buffer row, -1 for rows nothing was written to.

    group_counts: (P, G) int32 rows each sender sent to each local group (in that order within its
    chunk); starts: (P,) chunk starts; rows: receive buffer length. Returns (rows,) int32.
    """
    peers, groups = group_counts.shape
    seg_start = (starts[:, None] + _exclusive_cumsum(group_counts, axis=1)).reshape(-1)  # non-decreasing
    seg_size = group_counts.reshape(-1)
    r = jnp.arange(rows, dtype=jnp.int32)
    seg = jnp.clip(jnp.searchsorted(seg_start, r, side="right") - 1, 0, peers * groups - 1)
    valid = r < seg_start[seg] + seg_size[seg]
    return jnp.where(valid, seg % groups, -1).astype(jnp.int32)


def receive_capacity(tokens: int, heads: int, k: int, local_experts: int) -> int:
    """Worst-case rows one sender can send one receiver: every (token, head) sends all of its choices
    that fit on the receiver's experts (a token picks k distinct experts)."""
    return tokens * heads * min(k, local_experts)


# ----------------------------------------------------------------------------- the layer


def ep_moe_local(x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array, w1: jax.Array,
                 w2: jax.Array, k: int, impl: str, ep_impl: str, axis: str = "ep",
                 data_axis: str | None = "data") -> tuple[jax.Array, jax.Array]:
    """Per-device body (inside shard_map). Shapes are local:

    x_route (n, H, dr), x_expert (n, H, c) compute dtype; w_r (H, dr, Ne/P) fp32; bias (H, Ne/P) fp32;
    w1 (H, Ne/P, c, de), w2 (H, Ne/P, de, c) fp32 (this device's experts).
    Returns y (n, H, c) in x_expert.dtype and the global load of this device's experts (H, Ne/P) int32.
    """
    peers = lax.axis_size(axis)
    me = lax.axis_index(axis)
    n, heads, c = x_expert.shape
    ne_local = w1.shape[1]
    groups = heads * ne_local  # local (head, expert) groups, g = h * Ne/P + e_local

    # route on the full router (all-gathered: its transpose reduce-scatters the router gradient)
    with jax.named_scope("router"):
        w_full = lax.all_gather(w_r, axis, axis=2, tiled=True)
        b_full = lax.all_gather(bias, axis, axis=1, tiled=True)
        values, idx = route_topk(x_route, w_full, b_full, k, impl)
        gates = router_gates(values)  # (n, H, k) fp32

    with jax.named_scope("packing"):
        # sort the M = n * H * k slots by (destination, head, local expert); stable: token order inside
        dest = idx // ne_local
        local_group = jnp.arange(heads, dtype=jnp.int32)[None, :, None] * ne_local + idx % ne_local
        key = (dest * groups + local_group).reshape(-1)
        order = jnp.argsort(key, stable=True).astype(jnp.int32)  # sorted position -> slot
        my_counts = jnp.bincount(key, length=peers * groups).astype(jnp.int32).reshape(peers, groups)

        # metadata: every sender's counts per (destination, local group)
        counts = lax.all_gather(my_counts, axis)  # (P src, P dst, G)
        plan = make_plan(jnp.sum(counts, axis=2), me)
        cap = receive_capacity(n, heads, k, ne_local)

        # k-duplicate by broadcast, then permute: the transposes are a fixed-order sum over k and a
        # permutation, so the gradient needs no scatter-add over duplicate indices (deterministic on GPU)
        rows = jnp.take(jnp.repeat(x_expert.reshape(n * heads, c), k, axis=0), order, axis=0)  # (M, c)
        recv = dispatch(rows, plan, cap, ep_impl, axis)  # (P * cap, c)
        group = received_groups(counts[:, me, :], recv_chunk_starts(plan, cap, ep_impl), peers * cap)
    ones = jnp.ones((peers * cap, 1, 1), jnp.float32)
    with jax.named_scope("experts"):  # one slot per received row: its packing is the local experts' own
        out, _ = expert_ffn(recv[:, None, :], group[:, None, None], ones, w1.reshape(1, groups, c, -1),
                            w2.reshape(1, groups, -1, c), impl)
    with jax.named_scope("combine"):
        back = combine(out[:, 0, :], plan, cap, n * heads * k, ep_impl, axis)  # (M, c) sorted order
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
        per_slot = jnp.take(back, inverse, axis=0).reshape(n, heads, k, c)
        y = jnp.sum(per_slot.astype(jnp.float32) * gates[..., None], axis=2).astype(x_expert.dtype)

    load = jnp.sum(counts[:, me, :], axis=0).reshape(heads, ne_local)  # this device's experts, ep group
    if data_axis is not None:
        load = lax.psum(load, data_axis)
    return y, load


class ExpertParallelMoE:
    """MoE executor for MoE / LatentMoE on a ('data', 'ep') mesh.

    Called on global arrays (`mhl_jax.moe.core.MoEExecutor`): x_route (N, H, dr),
    x_expert (N, H, c) with N split over every device; w_r (H, dr, Ne) and bias (H, Ne) split over
    `ep` on the expert axis; w1 (H, Ne, c, de), w2 (H, Ne, de, c) split over `ep` on dim 1.
    Returns y (N, H, c) split like the tokens and the global load (H, Ne) int32 split over `ep`. chunks: the local
    tokens in this many chunks, each routed, exchanged and computed on its own, so that one chunk's exchange overlaps
    another's experts (`chunks.py`; each chunk exchanges its own counts, and its receive buffer is 1 / chunks of the
    unchunked one).
    """

    def __init__(self, mesh: Mesh, impl: str = "reference", ep_impl: str = "auto", check_vma: bool = False,
                 chunks: int = 1):
        if tuple(mesh.axis_names) != ("data", "ep"):
            raise ValueError(f"ExpertParallelMoE: mesh axes must be ('data', 'ep'), got {mesh.axis_names}")
        self.mesh = mesh
        self.impl = impl
        self.chunks = checked_chunks(chunks, "ExpertParallelMoE")
        self.ep_impl = resolve_ep_impl(ep_impl, mesh)
        self.check_vma = check_vma  # off: custom kernels (jax-triton calls) carry no varying-axes rules

    @property
    def ep(self) -> int:
        return self.mesh.shape["ep"]

    def __call__(self, x_route: jax.Array, x_expert: jax.Array, w_r: jax.Array, bias: jax.Array,
                 w1: jax.Array, w2: jax.Array, k: int,
                 ctx: ExpertContext | None = None) -> tuple[jax.Array, jax.Array]:
        """ctx: must hold nothing: without `reads_weights_cast` / `accumulates_in_place` this executor is given
        neither (its experts cast their own weights inside shard_map)."""
        if ctx is not None and (ctx.weights_cast is not None or ctx.grad_acc is not None):
            raise ValueError("ExpertParallelMoE: takes neither weights_cast nor grad_acc from a step context")
        n = x_expert.shape[0]
        ne = w1.shape[1]
        if ne % self.ep:
            raise ValueError(f"ExpertParallelMoE: Ne={ne} experts are not divisible by the ep size {self.ep}")
        if n % self.mesh.size:
            raise ValueError(f"ExpertParallelMoE: {n} tokens are not divisible by the {self.mesh.size} devices "
                             f"of the mesh {dict(self.mesh.shape)}")
        tok = P(("data", "ep"))
        layer = partial(ep_moe_local, k=k, impl=self.impl, ep_impl=self.ep_impl)

        def body(xr, xe, *weights):
            return over_chunks(lambda i, xr, xe: layer(xr, xe, *weights), (xr, xe), self.chunks, axis=0)

        fn = jax.shard_map(body, mesh=self.mesh,
                           in_specs=(tok, tok, P(None, None, "ep"), P(None, "ep"), P(None, "ep"), P(None, "ep")),
                           out_specs=(tok, P(None, "ep")), check_vma=self.check_vma)
        return fn(x_route, x_expert, w_r, bias, w1, w2)

    def __repr__(self) -> str:
        return (f"ExpertParallelMoE(mesh={dict(self.mesh.shape)}, impl={self.impl!r}, ep_impl={self.ep_impl!r}, "
                f"chunks={self.chunks})")
