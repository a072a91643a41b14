"""The algorithm NCCL runs a collective with: ring, tree, NVLS or PAT, whichever it predicts fastest.

NCCL times every algorithm it may use for a call (its message size, its ranks and how they sit on
nodes) in the latency-bandwidth model and runs the fastest (NCCL 2.30, ``src/graph/tuning.cc``,
``ncclTopoGetAlgoTime``; ``src/enqueue.cc`` takes the minimum). A ring's latency grows with the ranks
(2(N-1) steps for an all-reduce), which overstates a 1,024-GPU all-reduce of a small message by orders
of magnitude; NCCL runs a tree there. This module keeps NCCL's shapes of each algorithm's time, on
per-step latencies and link bandwidths the caller gives (the predictor's hardware profiles):

* **ring** (every collective): 2(N-1) steps for an all-reduce, N-1 otherwise; of those, 2(nodes-1)
  (nodes-1) cross the network and pay its latency, the rest the node's link's. Bandwidth: the busiest
  link's (the network's where the ring leaves a node), ``busiest_rank_share`` of the buffer through it.
* **tree** (all-reduce, NCCL's double binary tree): up and down ``ranks_per_node - 1`` node hops and
  ``floor(log2(nodes))`` network hops, ``2 ((ppn-1) a_node + log2(nodes) a_net)``. Bandwidth: NCCL
  converts the tree's bus bandwidth to an algorithm bandwidth by halving it (each rank sends and
  receives the whole buffer once each way), at 0.92 of the ring's link (tuning.cc's tree refinement);
  its per-size correction factors (0.4 to 1.0 below a few MB) are not modelled.
* **NVLS** (all-reduce inside one NVSwitch node, Hopper and later): the switch reduces (NVLink SHARP).
  Latency: NCCL's 25 us (tuning.cc's NVLS hardware latency on NVLink, which replaces its base). Bus
  bandwidth 480 GB/s against a ring's 370 on an 8-GPU H100 node (nccl-tests issue 212, NVIDIA's
  answer): ``NVLS_GAIN`` = 1.3 times the ring's. Across nodes NVLS needs InfiniBand SHARP: not modelled.
* **PAT** (all-gather and reduce-scatter with one rank per node, NCCL 2.23 and later): latency
  ``8 us + log2(nodes) a_net / 3.5 + 2.8 us * N``; bus bandwidth at 0.75 of the ring's, with no
  (N-1)/N discount (tuning.cc).

NCCL's base latencies (about 8 us a call for ring and tree under its Simple protocol) are left out of
ring and tree alike, so the choice between them does not move; its LL and LL128 protocols (lower
latency, lower bandwidth) are not modelled, which overstates small messages' time for every algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import checks
from ._checks import checked_count, checked_non_negative, checked_positive
from .collectives import busiest_rank_share

__all__ = ["ALGORITHMS", "NVLS_GAIN", "AlgorithmTime", "algorithm_times", "nccl_collective_time_s"]

ALGORITHMS = ("ring", "tree", "nvls", "pat")
#: NVLS's all-reduce bus bandwidth over a ring's on one 8-GPU H100 node: 480 / 370 GB/s (nccl-tests #212).
NVLS_GAIN = 480 / 370
#: NCCL's NVLS latency on NVLink (tuning.cc, Simple protocol), in place of its base latency.
NVLS_LATENCY_S = 25e-6
#: The tree's bandwidth against the ring's link (tuning.cc: ``busBw * 0.92`` for a tree all-reduce).
TREE_BANDWIDTH = 0.92
#: PAT's bandwidth against the ring's link (tuning.cc: ``busBw * 0.75``) and its latency terms.
PAT_BANDWIDTH = 0.75
PAT_BASE_S, PAT_PER_RANK_S, PAT_NETWORK_DIVISOR = 8e-6, 2.8e-6, 3.5
_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class AlgorithmTime:
    """One algorithm's predicted time for one collective, in its two parts."""

    algorithm: str
    latency_s: float
    bandwidth_s: float

    @property
    def seconds(self) -> float:
        return self.latency_s + self.bandwidth_s


def algorithm_times(
    op: str,
    size_bytes: float,
    world_size: int,
    ranks_per_node: int,
    node_bytes_per_s: float,
    node_latency_s: float,
    network_bytes_per_s: float = 0.0,
    network_latency_s: float = 0.0,
    *,
    nvls: bool = False,
) -> list[AlgorithmTime]:
    """Every algorithm NCCL may run ``op`` with over ``world_size`` ranks, ``ranks_per_node`` on each node
    (the group's nodes: ``world_size / ranks_per_node``), fastest first. ``size_bytes`` as
    ``collective_time_s`` takes it (the tensor for all-reduce, the full input or output otherwise).
    ``nvls``: the node's GPUs sit on an NVSwitch that reduces (H100, H200 HGX)."""
    checks.choice("op", op, _OPS)
    n = checked_count("world_size", world_size)
    ppn = checked_count("ranks_per_node", ranks_per_node)
    if n % ppn:
        raise ValueError(f"ranks_per_node ({ppn}) must divide world_size ({n}): every node holds as many of the ranks")
    size = checked_non_negative("size_bytes", size_bytes)
    node_bw = checked_positive("node_bytes_per_s", node_bytes_per_s)
    node_lat = checked_non_negative("node_latency_s", node_latency_s)
    nodes = n // ppn
    if nodes > 1:
        net_bw = checked_positive("network_bytes_per_s", network_bytes_per_s)
        net_lat = checked_non_negative("network_latency_s", network_latency_s)
    else:
        net_bw, net_lat = node_bw, node_lat  # not crossed: every link is the node's
    if n == 1:
        return [AlgorithmTime("ring", 0.0, 0.0)]
    share = busiest_rank_share(op, n)
    phases = 2 if op == "all_reduce" else 1
    steps, network_steps = phases * (n - 1), phases * (nodes - 1)
    ring_latency = (steps - network_steps) * node_lat + network_steps * net_lat
    found = [AlgorithmTime("ring", ring_latency, share * size / net_bw)]
    if op == "all_reduce":
        hops = (ppn - 1) * node_lat + int(math.log2(nodes)) * net_lat
        found.append(AlgorithmTime("tree", 2 * hops, 2 * size / (TREE_BANDWIDTH * net_bw)))
        if nvls and nodes == 1:
            found.append(AlgorithmTime("nvls", NVLS_LATENCY_S, share * size / (NVLS_GAIN * node_bw)))
    elif ppn == 1:
        latency = PAT_BASE_S + int(math.log2(nodes)) * net_lat / PAT_NETWORK_DIVISOR + PAT_PER_RANK_S * n
        found.append(AlgorithmTime("pat", latency, size / (PAT_BANDWIDTH * net_bw)))
    return sorted(found, key=lambda a: a.seconds)


def nccl_collective_time_s(op: str, size_bytes: float, world_size: int, ranks_per_node: int, *links: float,
                           nvls: bool = False) -> float:
    """The time of the algorithm NCCL would pick for ``op`` (the fastest of :func:`algorithm_times`, whose
    arguments it takes: the node's bandwidth and latency, then the network's where the group spans nodes)."""
    return algorithm_times(op, size_bytes, world_size, ranks_per_node, *links, nvls=nvls)[0].seconds
