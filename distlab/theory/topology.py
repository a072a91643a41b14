"""A ring on a network of two tiers: nodes whose links end at their rack's switch, racks joined to a
spine by one uplink each (``distlab.start(..., racks=2, uplink=...)``, and real clusters' fabrics).

A ring all-reduce moves 2(N-1)/N of the buffer over every edge of the ring at once (Thakur et al.
2005), so it runs at the pace of its slowest edge. An edge between ranks of one node stays on that
node's loopback; one between nodes crosses the sender's link out and the receiver's link in; one
between racks also crosses the sender's rack's uplink up and the receiver's rack's uplink down.
Edges that cross the same link end the same way share its rate equally (TCP's fair share). A ring
that visits the racks in order crosses each uplink once each way; one that hops between racks at
every step crosses each many times, and each crossing gets only a share of the uplink.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from .. import checks
from ._checks import checked_count, checked_non_negative, checked_positive
from .communication import ring_allreduce_time_s

__all__ = ["fsdp_uplink_bytes_per_step", "ring_edge_bandwidths", "ring_uplink_crossings", "tiered_allreduce_time_s"]

#: How FSDP's mesh sits on the racks: sharded over every rank, sharded inside each rack and replicated
#: across racks (HSDP, as meant), or the other way round (sharded across racks, replicated inside).
LAYOUTS = ("flat", "hsdp", "shard-across")
#: A ring reduce-scatter sends (N-1)/N of the buffer; gloo's sends an all-reduce's 2(N-1)/N
#: (measured in notebook 14).
REDUCE_SCATTERS = ("ring", "all_reduce")


def _placement(nodes: Sequence[int], racks: Sequence[int] | None) -> tuple[list[int], list[int]]:
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence) or not nodes:
        raise ValueError(f"nodes must list each rank's node in ring order, like [0, 0, 1, 1] (got {nodes!r})")
    node_of = [int(n) for n in nodes]
    if racks is None:
        return node_of, [0] * len(node_of)
    if isinstance(racks, (str, bytes)) or not isinstance(racks, Sequence) or len(racks) != len(node_of):
        raise ValueError(f"racks must list each rank's rack, one per rank as nodes does (got {racks!r} for {nodes!r})")
    rack_of = [int(r) for r in racks]
    for node in set(node_of):
        if len({rack_of[i] for i, n in enumerate(node_of) if n == node}) > 1:
            raise ValueError(f"node {node} is given two racks in {racks!r}: a node sits in one rack")
    return node_of, rack_of


def ring_uplink_crossings(racks: Sequence[int]) -> dict[int, int]:
    """{rack: edges of the ring that leave it}, for a ring visiting ranks in order, rank i in rack
    ``racks[i]`` (as many enter it). Racks visited in order: 1 each; alternating: up to N/R."""
    if isinstance(racks, (str, bytes)) or not isinstance(racks, Sequence) or not racks:
        raise ValueError(f"racks must list each rank's rack in ring order, like [0, 0, 1, 1] (got {racks!r})")
    rack_of = [int(r) for r in racks]
    n = len(rack_of)
    leaving = Counter(rack_of[i] for i in range(n) if rack_of[i] != rack_of[(i + 1) % n])
    return {rack: leaving.get(rack, 0) for rack in sorted(set(rack_of))}


def ring_edge_bandwidths(
    nodes: Sequence[int], link_bytes_per_s: float, racks: Sequence[int] | None = None,
    uplink_bytes_per_s: float | None = None,
) -> list[float]:
    """Each ring edge's rate (bytes/s), edge i from rank i to rank i+1 (the last back to rank 0).

    ``nodes[i]``, ``racks[i]``: rank i's node and rack, ranks in ring order. An edge within a node is
    ``inf`` (loopback is not the bottleneck). Otherwise the edge gets the smallest of its fair
    shares: of the sender's link (shared by the edges leaving that node), the receiver's (the edges
    entering it) and, between racks, of the two uplinks (the edges leaving and entering each rack).
    ``uplink_bytes_per_s`` None: uplinks as fast as the links.
    """
    node_of, rack_of = _placement(nodes, racks)
    link = checked_positive("link_bytes_per_s", link_bytes_per_s)
    uplink = link if uplink_bytes_per_s is None else checked_positive("uplink_bytes_per_s", uplink_bytes_per_s)
    n = len(node_of)
    edges = [(i, (i + 1) % n) for i in range(n) if n > 1]
    crossing = [(a, b) for a, b in edges if node_of[a] != node_of[b]]
    out_of_node = Counter(node_of[a] for a, _ in crossing)
    into_node = Counter(node_of[b] for _, b in crossing)
    up = Counter(rack_of[a] for a, b in crossing if rack_of[a] != rack_of[b])
    down = Counter(rack_of[b] for a, b in crossing if rack_of[a] != rack_of[b])
    rates = []
    for a, b in edges:
        if node_of[a] == node_of[b]:
            rates.append(math.inf)
            continue
        shares = [link / out_of_node[node_of[a]], link / into_node[node_of[b]]]
        if rack_of[a] != rack_of[b]:
            shares += [uplink / up[rack_of[a]], uplink / down[rack_of[b]]]
        rates.append(min(shares))
    return rates


def tiered_allreduce_time_s(
    size_bytes: float, nodes: Sequence[int], link_bytes_per_s: float, racks: Sequence[int] | None = None,
    uplink_bytes_per_s: float | None = None, latency_s: float = 0.0,
) -> float:
    """A ring all-reduce's time on two tiers: ``2(N-1)/N * S / B_slowest + 2(N-1) * a``, where
    B_slowest is the slowest edge's rate (:func:`ring_edge_bandwidths`). On a star of equal links
    with one rank per node this is :func:`ring_allreduce_time_s` at the link's rate."""
    size = checked_non_negative("size_bytes", size_bytes)
    rates = ring_edge_bandwidths(nodes, link_bytes_per_s, racks, uplink_bytes_per_s)
    slowest = min(rates, default=math.inf)
    n = len(nodes)
    if n == 1:
        return 0.0
    if math.isinf(slowest):  # every rank on one node: only the steps' latency is modelled
        return ring_allreduce_time_s(0.0, n, 1.0, latency_s)
    return ring_allreduce_time_s(size, n, slowest, latency_s)


def fsdp_uplink_bytes_per_step(
    parameters_bytes: float, racks: int, ranks_per_rack: int, layout: str = "hsdp",
    reshard_after_forward: bool = True, reduce_scatter: str = "ring",
) -> float:
    """Bytes each rack sends up its uplink in one FSDP step, ranks numbered rack by rack.

    FSDP all-gathers the parameters (Psi = ``parameters_bytes``) inside each shard group for forward
    and again for backward (once without ``reshard_after_forward``) and reduce-scatters the gradients
    there; HSDP then all-reduces each gradient shard across the replicas. Every collective is a ring
    over its group's ranks in order: a ring edge between racks carries what its sender sends, and
    each rack's uplink carries the edges that leave it. ``layout``:

    - ``"flat"``: one shard group of all R*k ranks: its ring crosses each uplink once, so each
      uplink carries ``(2 + 1) (N-1)/N * Psi``.
    - ``"hsdp"``: shard groups inside racks (no uplink), replicas across: k all-reduces of Psi/k,
      each crossing each uplink once, ``2(R-1)/R * Psi`` in all, independent of k.
    - ``"shard-across"``: shard groups across racks (k groups of R ranks, each crossing), replicas
      inside: k * ``(2 + 1) (R-1)/R * Psi``.

    ``reduce_scatter="all_reduce"``: a reduce-scatter that moves an all-reduce's bytes (gloo's).
    """
    size = checked_non_negative("parameters_bytes", parameters_bytes)
    r, k = checked_count("racks", racks), checked_count("ranks_per_rack", ranks_per_rack)
    checks.choice("layout", layout, LAYOUTS, error=ValueError)
    checks.choice("reduce_scatter", reduce_scatter, REDUCE_SCATTERS, error=ValueError)
    checks.flag("reshard_after_forward", reshard_after_forward)
    rack_of = [rank // k for rank in range(r * k)]
    grid = [[rack * k + i for i in range(k)] for rack in range(r)]  # grid[rack][i]: rank i of the rack
    if layout == "flat":
        shard_groups, replica_groups = [list(range(r * k))], []
    elif layout == "hsdp":
        shard_groups, replica_groups = grid, [list(column) for column in zip(*grid)]
    else:
        shard_groups, replica_groups = [list(column) for column in zip(*grid)], grid
    passes = (2 if reshard_after_forward else 1) + (2 if reduce_scatter == "all_reduce" else 1)
    up = [0.0] * r

    def ring(ranks: list[int], sent_per_rank: float) -> None:
        for a, b in zip(ranks, ranks[1:] + ranks[:1]):
            if rack_of[a] != rack_of[b]:
                up[rack_of[a]] += sent_per_rank

    for group in shard_groups:
        n = len(group)
        ring(group, passes * (n - 1) / n * size)
    for group in replica_groups:
        n, shard = len(group), size / len(shard_groups[0])
        ring(group, 2 * (n - 1) / n * shard)
    return max(up)
