"""A model of the MoE layers' exchange time on nodes of GPUs: NVLink inside a node, a slower link between nodes.

Per device, per MoE layer and micro-batch, forward + backward: the HP exchange (head -> token and back) and, on a
data x hp x ep mesh, the EP exchange inside it each run four all-to-alls (dispatch and combine forward; their
transposes backward), each moving the bytes of `traffic.hp_bytes` / `traffic.ep_bytes_uniform` in each direction. A
device sends equal shares to the other members of its group; the shares to members on its own node go over NVLink,
the others through its own network adapter, both at once, so one all-to-all takes

    max(bytes to peers on the node / NVLink rate, bytes to peers on other nodes / network rate)

(no latency term: at these sizes, tens of MB per all-to-all, it is small). The mesh lists devices in order (data,
hp, ep), ep innermost, process by process (`mesh.make_mesh`): device (d, h, e) is number (d hp + h) ep + e, and node
number // gpus_per_node. With `parallel.hp_chunks` = C the exchange of one chunk runs beside the router and experts of
another (`chunks.py`); what stays exposed is one chunk's share when the compute is the longer, else the excess
(`exposed_ms`), and each extra chunk adds its own cost (`chunk_overhead_ms`). The predictions and their assumptions:
docs/parallel.md (`python -m mhl_jax.parallel.exchange_model` prints its table).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from mhl_jax.parallel import traffic

# Effective per-direction rates per GPU, GB/s. NVLink: the HP exchange measured on 4 H200s (NVLink 4, 450 GB/s per
# direction nominal) moved 205-214 GB/s (`bench.a2a`; the file: docs/parallel.md). Network: InfiniBand NDR, one
# 400 Gb/s adapter per GPU, nominal (no measurement here: the times over it are lower bounds).
NVLINK_GBPS = 210.0
NETWORK_GBPS = 50.0
GPUS_PER_NODE = 8
ALL_TO_ALLS_PER_LAYER = 4  # dispatch and combine, forward and backward


class Exchange(NamedTuple):
    """One device's exchanges per MoE layer and micro-batch, forward + backward."""

    hp_mb: float  # MB the HP all-to-all sends per direction, one of the four
    ep_mb: float  # MB the EP all-to-all sends per direction (uniform routing), one of the four
    hp_peers_off_node: int  # members of the device's hp group on other nodes
    ep_peers_off_node: int
    ms: float  # the four HP and four EP all-to-alls, one after another


def peers_off_node(index: int, stride: int, size: int, gpus_per_node: int) -> tuple[int, int]:
    """(on the node, off it): the other members of the group of device `index` whose members are `stride` apart."""
    first = index - (index // stride) % size * stride
    nodes = [(first + i * stride) // gpus_per_node for i in range(size)]
    mine = index // gpus_per_node
    on = sum(n == mine for n in nodes) - 1
    return on, size - 1 - on


def all_to_all_ms(bytes_sent: float, group: int, on_node: int, nvlink_gbps: float, network_gbps: float) -> float:
    """One all-to-all: `bytes_sent` in equal shares to the group's other members, `on_node` of them over NVLink."""
    if group == 1:
        return 0.0
    share = bytes_sent / (group - 1)
    off_node = group - 1 - on_node
    return max(share * on_node / (nvlink_gbps * 1e6), share * off_node / (network_gbps * 1e6))


def exchange(mesh: tuple[int, int, int], tokens: int, heads: int, head_dim: int, k: int, num_experts: int,
             itemsize: int = 2, gpus_per_node: int = GPUS_PER_NODE, nvlink_gbps: float = NVLINK_GBPS,
             network_gbps: float = NETWORK_GBPS) -> Exchange:
    """The exchanges of device 0 (every device alike where the sizes divide the nodes evenly) on a (data, hp, ep) mesh,
    `tokens` per device before the HP exchange, sub-tokens of Nh x dh, k of Ne experts per head, bf16."""
    data, hp, ep = mesh
    if min(mesh) < 1 or heads % hp or num_experts % ep:
        raise ValueError(f"exchange: mesh (data, hp, ep)={mesh} with Nh={heads}, Ne={num_experts}: sizes >= 1 "
                         "dividing the heads and experts")
    hp_sent = traffic.hp_bytes(tokens, heads, head_dim, hp, itemsize) if hp > 1 else 0
    ep_sent = traffic.ep_bytes_uniform(hp * tokens, heads // hp, k, ep, head_dim, itemsize) if ep > 1 else 0
    hp_on, hp_off = peers_off_node(0, ep, hp, gpus_per_node)
    ep_on, ep_off = peers_off_node(0, 1, ep, gpus_per_node)
    one = (all_to_all_ms(hp_sent, hp, hp_on, nvlink_gbps, network_gbps)
           + all_to_all_ms(ep_sent, ep, ep_on, nvlink_gbps, network_gbps))
    return Exchange(hp_sent / 1e6, ep_sent / 1e6, hp_off, ep_off, ALL_TO_ALLS_PER_LAYER * one)


def exposed_ms(exchange_ms: float, compute_ms: float, chunks: int) -> float:
    """The exchange time left on the critical path when C chunks overlap it with `compute_ms` of router and experts:
    the first send and the last return (one chunk's share, exchange / C) when the compute is the longer, else the
    exchange less the compute it runs beside (exchange - compute (C - 1) / C). C = 1: all of it."""
    if chunks < 1:
        raise ValueError(f"exposed_ms: chunks={chunks}, expected >= 1")
    return max(exchange_ms / chunks, exchange_ms - compute_ms * (chunks - 1) / chunks)


def expert_grad_allreduce_ms(mesh: tuple[int, int, int], expert_params: int, gpus_per_node: int = GPUS_PER_NODE,
                             nvlink_gbps: float = NVLINK_GBPS, network_gbps: float = NETWORK_GBPS) -> float:
    """Per step and MoE layer: the ring all-reduce over `data` of the fp32 gradients of one device's expert weights
    (expert_params / (hp ep) of the layer's), over the network when the data group spans nodes. Zero at data 1: each
    expert weight lives on one device."""
    data, hp, ep = mesh
    if data == 1:
        return 0.0
    _, off = peers_off_node(0, hp * ep, data, gpus_per_node)
    rate = network_gbps if off else nvlink_gbps
    return 2 * (data - 1) / data * expert_params / (hp * ep) * 4 / (rate * 1e6)


# ----------------------------------------------------------------------------- the table of docs/parallel.md

# The 2.2B MH-LatentMoE (configs/mh_latent_moe_hp_2.2b.yaml) at micro-batch 8 x 2048 tokens per device
SHAPES = dict(tokens=8 * 2048, heads=8, head_dim=128, k=4, num_experts=384)
EXPERT_HIDDEN = 256
# per layer: Nh x Ne experts of two dh x de matrices
EXPERT_PARAMS = SHAPES["heads"] * SHAPES["num_experts"] * 2 * SHAPES["head_dim"] * EXPERT_HIDDEN
# One more chunk per MoE layer call, forward + backward: each chunk reads the device's bf16 expert weights in both
# passes and writes its own fp32 weight gradients, which are then added. Calibrated on one measurement
# (docs/parallel.md): the 2.2B MH-LatentMoE train step on 2 H200s at hp 2 (half of each layer's expert parameters per
# device; 10 MoE layers x 2 micro-batches = 20 layer calls a step) at C = 1 and C = 2.
CALIBRATION_STEP_S = (0.168285, 0.175679)  # the two steps, s (the run: docs/parallel.md)
CALIBRATION_CALLS = 20
CHUNK_MS_CELLS = 2


def chunk_overhead_ms(cells: int, chunks: int) -> float:
    """The extra time of `chunks` chunks over one, per MoE layer call, on a device holding 1 / cells (hp x ep) of the
    layer's experts: per extra chunk, `chunk_ms()` at CHUNK_MS_CELLS cells, in proportion to the expert weights
    held."""
    if chunks < 1 or cells < 1:
        raise ValueError(f"chunk_overhead_ms: cells={cells}, chunks={chunks}; expected both >= 1")
    return (chunks - 1) * chunk_ms() * CHUNK_MS_CELLS / cells


@functools.cache
def chunk_ms() -> float:
    """One extra chunk's cost per layer call at the calibration point: the measured step difference per layer call,
    plus the exchange time the model has the second chunk hide there (which the measurement netted out)."""
    measured = (CALIBRATION_STEP_S[1] - CALIBRATION_STEP_S[0]) * 1e3 / CALIBRATION_CALLS
    x = exchange((1, CHUNK_MS_CELLS, 1), **SHAPES)
    return measured + x.ms - exposed_ms(x.ms, compute_ms(CHUNK_MS_CELLS), 2)


MESHES = {8: [(1, 8, 1), (2, 4, 1), (1, 4, 2), (1, 2, 4), (1, 1, 8)],
          16: [(2, 8, 1), (1, 8, 2), (1, 2, 8), (2, 4, 2), (1, 4, 4), (4, 4, 1)]}


def compute_ms(cells: int) -> float:
    """Router and experts, forward + backward, one device, 16384 tokens, its 1 / cells of the experts (cells = hp x ep).

    docs/performance.md's layer table (one H200, Ne/k/de 384/4/256): 1.55 ms at 8192 tokens, 6.64 at 81920, the
    whole layer; linear in between: 2.12 ms at 16384; less its six dense GEMMs (W_in, W_out) at 800 TFLOP/s, 0.26 ms;
    less the bytes of the expert weights a device no longer holds (12 bytes per parameter per call, 2.4 GB: 0.56 ms at
    4.3 TB/s, times 1 - 1 / cells)."""
    whole = 1.55 + (6.64 - 1.55) * (SHAPES["tokens"] - 8192) / (81920 - 8192)
    dense = 6 * 2 * SHAPES["tokens"] * 1024 * 1024 / 800e12 * 1e3
    weights = 12 * EXPERT_PARAMS / 4.3e12 * 1e3
    return whole - dense - weights * (1 - 1 / cells)


def table() -> str:
    """The Markdown table of predictions for 8 and 16 GPUs (docs/parallel.md)."""
    lines = ["| GPUs | data x hp x ep | hp / ep peers off the node | HP / EP MB per all-to-all | exchange ms | "
             "compute ms | exposed + chunks' cost, ms at C = 1 / 2 / 4 | expert-gradient all-reduce ms per step |",
             "|" + "---|" * 8]
    for gpus, meshes in MESHES.items():
        for mesh in meshes:
            x, cells = exchange(mesh, **SHAPES), mesh[1] * mesh[2]
            c = compute_ms(cells)
            exposed = " / ".join(f"{exposed_ms(x.ms, c, n) + chunk_overhead_ms(cells, n):.2f}" for n in (1, 2, 4))
            lines.append(f"| {gpus} | {' x '.join(map(str, mesh))} | {x.hp_peers_off_node} / {x.ep_peers_off_node} | "
                         f"{x.hp_mb:.1f} / {x.ep_mb:.1f} | {x.ms:.2f} | {c:.2f} | {exposed} | "
                         f"{expert_grad_allreduce_ms(mesh, EXPERT_PARAMS):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
