"""Collectives: what one rank sends and receives in all-reduce, reduce-scatter, all-gather, all-to-all and
broadcast, their time in the latency-bandwidth model, and the bus-bandwidth factor that makes a
measured bandwidth comparable across world sizes.

The algorithms are those NCCL uses on a ring (bandwidth-optimal, pipelined in chunks), and the sizes
follow nccl-tests' conventions (nccl-tests, doc/PERFORMANCE.md): ``size_bytes`` is the tensor for
all-reduce and broadcast, the full input for reduce-scatter, the full output for all-gather, and what
each rank holds for all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ._checks import checked_count, checked_non_negative, checked_positive

# --------------------------------------------------------------------------------------------------
# Bytes per rank
# --------------------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


@dataclass(frozen=True)
class CollectiveBytes:
    """Bytes one rank sends and receives in one collective."""

    sent_bytes: float
    received_bytes: float


def busiest_rank_share(op: str, n: int) -> float:
    """The share of the buffer the busiest rank sends for ``op`` over ``n`` ranks (checked by the caller)."""
    # nccl-tests' busbw factors, which are also the share of S the busiest rank sends on a ring:
    # all-reduce is a reduce-scatter then an all-gather, each (N-1)/N * S; a chain broadcast
    # forwards the whole buffer once.
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def latency_steps(op: str, n: int) -> int:
    """How many times ``op`` over ``n`` ranks pays the link's latency (checked by the caller)."""
    # A ring phase is N-1 steps; all-reduce has two phases. All-to-all is N-1 pairwise exchanges.
    # A pipelined chain broadcast pays the latency of its N-1 hops once, while its chunks stream.
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def _rank_in(name: str, value: int, world: int) -> int:
    index = checked_count(name, value, minimum=0)
    if index >= world:
        raise ValueError(f"{name} must be below world_size ({world}), got {value!r}")
    return index


def collective_bytes(op: str, size_bytes: float, world_size: int, rank: int = 0, root: int = 0) -> CollectiveBytes:
    """Bytes ``rank`` sends and receives in one collective ``op`` over ``world_size`` ranks (S = size_bytes).

    * ``"all_reduce"`` (S = the tensor): ring reduce-scatter then ring all-gather, 2(N-1)/N * S each way;
    * ``"reduce_scatter"`` (S = the full input, each rank ends with S/N): (N-1)/N * S each way;
    * ``"all_gather"`` (S = the full output, each rank gives S/N): (N-1)/N * S each way;
    * ``"all_to_all"`` (S = what each rank holds): it keeps its own 1/N, sends and receives (N-1)/N * S;
    * ``"broadcast"`` (S = the tensor): a pipelined chain from ``root`` along the ring (root, root+1, ...):
      the root sends S and receives 0, every other rank receives S and forwards S, except the last of
      the chain (rank root-1), which only receives.

    ``rank`` and ``root`` matter only for broadcast. One rank moves nothing.
    """
    checks.choice("op", op, COLLECTIVES)
    size = checked_non_negative("size_bytes", size_bytes)
    n = checked_count("world_size", world_size)
    me = _rank_in("rank", rank, n)
    source = _rank_in("root", root, n)
    if n == 1:
        return CollectiveBytes(0.0, 0.0)
    if op == "broadcast":
        position = (me - source) % n  # place in the chain: 0 is the root, n-1 the last
        sent = size if position < n - 1 else 0.0
        received = size if position > 0 else 0.0
        return CollectiveBytes(sent, received)
    each_way = busiest_rank_share(op, n) * size
    return CollectiveBytes(each_way, each_way)


def collective_time_s(
    op: str, size_bytes: float, world_size: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Time of one collective in the latency-bandwidth model: steps * latency + bytes / bandwidth.

    Bytes are what the busiest rank sends (:func:`collective_bytes`); steps are N-1 per ring phase
    (all-reduce has two: 2(N-1)), N-1 for all-to-all, and the N-1 hops of the broadcast chain. Every
    step pays ``latency_s`` in full.

    For ``"all_reduce"`` this is :func:`ring_allreduce_time_s`: ``2(N-1)/N * S/B + 2(N-1) * a``, a
    reduce-scatter then an all-gather (Thakur, Rabenseifner and Gropp 2005).
    """
    checks.choice("op", op, COLLECTIVES)
    n = checked_count("world_size", world_size)
    size = checked_non_negative("size_bytes", size_bytes)
    bandwidth = checked_positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    latency = checked_non_negative("latency_s", latency_s)
    busiest_sent_bytes = busiest_rank_share(op, n) * size if n > 1 else 0.0
    return latency_steps(op, n) * latency + busiest_sent_bytes / bandwidth


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` (nccl-tests, doc/PERFORMANCE.md): 2(N-1)/N for all-reduce; (N-1)/N for
    reduce-scatter, all-gather and all-to-all; 1 for broadcast (whatever N, as nccl-tests reports it)."""
    checks.choice("op", op, COLLECTIVES)
    return busiest_rank_share(op, checked_count("world_size", world_size))
