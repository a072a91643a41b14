"""Communication cost: ring all-reduce (whole, bucketed, and overlapped with backward), the graphs
torch.compile cuts a DDP model into at its buckets, algorithm and bus
bandwidth, the parameter server, synchronous and asynchronous runs and their staleness, and the fit of
the ring model's latency and bandwidth to measured timings."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import checks
from ._checks import checked_count, checked_non_negative, checked_positive, checked_sequence
from .collectives import COLLECTIVES, busiest_rank_share, latency_steps

# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------


def _ring_factor(workers: int) -> float:
    return busiest_rank_share("all_reduce", checked_count("workers", workers))


def _ring_steps(workers: int) -> int:
    # The reduce-scatter's N-1 steps, then the all-gather's N-1: each pays the latency once.
    return latency_steps("all_reduce", checked_count("workers", workers))


def ring_allreduce_time_s(
    size_bytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Time of a ring all-reduce: ``2(N-1)/N * S/B + 2(N-1) * a``.

    A ring all-reduce is a reduce-scatter then an all-gather, N-1 steps each, one after another
    (Thakur, Rabenseifner and Gropp 2005): each worker sends 2(N-1)/N of the buffer over a link of
    ``bandwidth_bytes_per_s``, and each of the 2(N-1) steps pays ``latency_s``. The same model as
    :func:`collective_time_s` for ``"all_reduce"``. One worker has nothing to do: 0 s.
    """
    n = checked_count("workers", workers)
    size = checked_non_negative("size_bytes", size_bytes)
    bandwidth = checked_positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    latency = checked_non_negative("latency_s", latency_s)
    return _ring_factor(n) * size / bandwidth + _ring_steps(n) * latency


def ring_allreduce_sent_bytes(size_bytes: float, workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``size_bytes``: 2(N-1)/N * S."""
    return _ring_factor(workers) * checked_non_negative("size_bytes", size_bytes)


def bucketed_allreduce_time_s(
    size_bytes: float,
    bucket_bytes: float,
    workers: int,
    bandwidth_bytes_per_s: float,
    latency_s: float = 0.0,
) -> float:
    """Ring all-reduce of ``size_bytes`` sent in buckets of ``bucket_bytes``, one after another.

    Every bucket is an all-reduce of its own and pays the latency term, 2(N-1) * a, again, so many tiny
    buckets (or tensors reduced one by one) are latency-bound; the bandwidth term is the same whatever
    the bucket size.
    """
    bandwidth_term_s = ring_allreduce_time_s(size_bytes, workers, bandwidth_bytes_per_s)
    buckets = math.ceil(size_bytes / checked_positive("bucket_bytes", bucket_bytes))
    return bandwidth_term_s + buckets * _ring_steps(workers) * checked_non_negative("latency_s", latency_s)


#: The size DDP and torch.compile give the first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``):
#: small, so that the first all-reduce starts early in backward.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


def compiled_ddp_graph_bytes(
    op_param_bytes: Sequence[float], bucket_cap_bytes: float, first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES
) -> list[float]:
    """The graphs ``torch.compile`` splits a DDP model into, as the parameter bytes each holds, in forward order.

    torch's DDPOptimizer (``torch/_dynamo/backends/distributed.py``) cuts the compiled graph where DDP's
    buckets end, so that each piece's backward hands its gradients to the reducer as it finishes and the
    all-reduce still overlaps backward. It walks the ops from the last to the first, adding each op's
    parameters to the current bucket, and opens a new bucket before an op once the current one holds
    ``bucket_cap_bytes`` (``bucket_cap_mb`` MiB), the first one ``first_bucket_bytes``.
    ``op_param_bytes``: the bytes of the parameters each op uses, in forward order (a linear layer's
    weight and bias together, one entry). One graph when the cap exceeds the model.
    """
    sizes = [checked_positive("op_param_bytes", b) for b in checked_sequence("op_param_bytes", op_param_bytes)]
    cap = checked_positive("bucket_cap_bytes", bucket_cap_bytes)
    first = checked_positive("first_bucket_bytes", first_bucket_bytes)
    if first > cap:
        raise ValueError(f"first_bucket_bytes ({first:g}) is larger than bucket_cap_bytes ({cap:g}): DDP's first "
                         f"bucket is the smaller one; pass a first_bucket_bytes at most the cap")
    buckets = [0.0]
    for size in reversed(sizes):
        if buckets[-1] >= (first if len(buckets) == 1 else cap):
            buckets.append(0.0)
        buckets[-1] += size
    return buckets[::-1]


def compiled_ddp_graphs(
    op_param_bytes: Sequence[float], bucket_cap_bytes: float, first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES
) -> int:
    """How many graphs ``torch.compile`` makes of a DDP model's forward (see :func:`compiled_ddp_graph_bytes`)."""
    return len(compiled_ddp_graph_bytes(op_param_bytes, bucket_cap_bytes, first_bucket_bytes))


def overlapped_backward_time_s(
    backward_s: float,
    bucket_bytes: Sequence[float],
    workers: int,
    bandwidth_bytes_per_s: float,
    latency_s: float = 0.0,
) -> float:
    """From the start of backward to the end of the last bucket's all-reduce, when each bucket's ring
    all-reduce is launched as soon as backward has produced it (DDP's overlap).

    ``bucket_bytes`` lists the buckets in the order backward fills them (DDP's: last layers first).
    Backward produces gradient bytes at a steady rate, so a bucket is ready once backward has produced
    it and every bucket before it; the link carries one all-reduce at a time. One bucket: backward,
    then the whole all-reduce (nothing overlaps); many small ones: about backward plus the last
    bucket's all-reduce, or, if the link is the slower, the first bucket's wait plus all of them.
    The exposed communication is this time minus ``backward_s``.
    """
    backward = checked_non_negative("backward_s", backward_s)
    sizes = [checked_non_negative("bucket_bytes", b) for b in checked_sequence("bucket_bytes", bucket_bytes)]
    total = sum(sizes)
    produced, link_free = 0.0, 0.0
    for size in sizes:
        produced += size
        ready = backward * produced / total if total else backward
        link_free = max(ready, link_free) + ring_allreduce_time_s(size, workers, bandwidth_bytes_per_s, latency_s)
    return max(backward, link_free)


def algbw_bytes_per_s(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth of a collective: the buffer size over the time it took (nccl-tests' algbw)."""
    return checked_non_negative("size_bytes", size_bytes) / checked_positive("time_s", time_s)


def busbw_bytes_per_s(size_bytes: float, time_s: float, workers: int, op: str = "all_reduce") -> float:
    """Bus bandwidth of a collective: algbw times :func:`bus_bandwidth_factor` (2(N-1)/N for an all-reduce),
    comparable with the link's speed whatever N is. ``size_bytes`` as nccl-tests counts it for ``op``."""
    checks.choice("op", op, COLLECTIVES)
    return algbw_bytes_per_s(size_bytes, time_s) * busiest_rank_share(op, checked_count("workers", workers))


def parameter_server_received_bytes(size_bytes: float, workers: int, servers: int = 1) -> float:
    """Bytes one parameter server receives per synchronous step: every worker pushes its gradients.

    With ``servers`` shards each takes 1/servers of every push; it sends as many bytes back (fresh weights).
    """
    n = checked_count("workers", workers)
    return n * checked_non_negative("size_bytes", size_bytes) / checked_count("servers", servers)


def parameter_server_time_s(size_bytes: float, workers: int, bandwidth_bytes_per_s: float, servers: int = 1) -> float:
    """Communication time of a parameter-server step, bound by the server's link (full duplex: push and
    pull overlap). Grows with the number of workers, unlike a ring all-reduce."""
    received = parameter_server_received_bytes(size_bytes, workers, servers)
    return received / checked_positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)


def synchronous_step_time_s(worker_times_s: Sequence[float]) -> float:
    """A synchronous step ends when the slowest worker is done: the maximum of the workers' times."""
    times = [checked_non_negative("worker_times_s", t) for t in checked_sequence("worker_times_s", worker_times_s)]
    return max(times)


def synchronous_run_time_s(updates: int, worker_times_s: Sequence[float]) -> float:
    """Time of ``updates`` synchronous updates, each needing one gradient from every worker, when
    worker i takes ``worker_times_s[i]`` per gradient: every update waits for the slowest."""
    return checked_count("updates", updates, minimum=0) * synchronous_step_time_s(worker_times_s)


def asynchronous_run_time_s(updates: int, worker_times_s: Sequence[float]) -> float:
    """Time until an asynchronous server has applied ``updates`` gradients, when worker i delivers one
    every ``worker_times_s[i]`` and never waits for the others (about updates / sum(1/t_i)).

    Worker i's k-th gradient arrives at k * t_i; the answer is the arrival time of the updates-th
    gradient of all the workers together.
    """
    times = [checked_positive("worker_times_s", t) for t in checked_sequence("worker_times_s", worker_times_s)]
    wanted = checked_count("updates", updates, minimum=0)
    arrival, next_k = 0.0, [(t, i, 1) for i, t in enumerate(times)]  # (time, worker, its k-th gradient)
    heapq.heapify(next_k)
    for _ in range(wanted):
        arrival, i, k = heapq.heappop(next_k)
        heapq.heappush(next_k, ((k + 1) * times[i], i, k + 1))
    return arrival


def worker_staleness_updates(worker_times_s: Sequence[float]) -> list[float]:
    """For asynchronous workers taking ``worker_times_s[i]`` per gradient, how many updates the others
    apply while worker i computes one: sum over j != i of t_i / t_j.

    Equally fast workers: N-1 each (:func:`expected_staleness_updates`); a straggler's gradients are
    staler (t_slow / t_fast for two workers), a fast worker's fresher. The mean over all updates stays
    N-1: every update lands inside one computation of each other worker.
    """
    times = [checked_positive("worker_times_s", t) for t in checked_sequence("worker_times_s", worker_times_s)]
    return [sum(t_i / t_j for j, t_j in enumerate(times) if j != i) for i, t_i in enumerate(times)]


def expected_staleness_updates(workers: int) -> int:
    """Updates that land between a worker reading the weights and its own update arriving, for
    ``workers`` equally fast asynchronous workers: the N-1 others each update once."""
    return checked_count("workers", workers) - 1


@dataclass(frozen=True)
class LatencyBandwidthFit:
    """Link parameters fitted from all-reduce timings."""

    latency_s: float
    bandwidth_bytes_per_s: float

    def allreduce_time_s(self, size_bytes: float, workers: int) -> float:
        """The ring all-reduce time this fit predicts."""
        return ring_allreduce_time_s(size_bytes, workers, self.bandwidth_bytes_per_s, self.latency_s)


def fit_latency_bandwidth(
    measurements: Iterable[Sequence[float]], workers: int | None = None, op: str = "all_reduce"
) -> LatencyBandwidthFit:
    """Fit latency ``a`` and bandwidth ``B`` of the ring model to measured all-reduce times (or another
    ``op``'s: its steps and bus factor as :func:`collective_time_s` has them, S the whole tensor).

    ``measurements`` holds ``(workers, size_bytes, time_s)`` triples, or ``(size_bytes, time_s)`` pairs
    when ``workers`` is given. The model ``T = 2(N-1)/N * S * (1/B) + 2(N-1) * a`` is linear in 1/B and a,
    so this is least squares on two unknowns; a fitted negative latency (noise on a fast link) is
    clamped to 0 and the bandwidth refitted alone.
    """
    checks.choice("op", op, COLLECTIVES)
    rows: list[tuple[float, float, float]] = []  # (x_bandwidth, x_latency, time)
    for index, item in enumerate(measurements):
        values = list(checked_sequence(f"measurements[{index}]", item))
        if len(values) == 2 and workers is not None:
            values = [workers, *values]
        if len(values) != 3:
            shape = "(size_bytes, time_s)" if workers is not None else "(workers, size_bytes, time_s)"
            raise ValueError(f"measurements[{index}] must be {shape}, got {item!r}")
        n = checked_count(f"workers of measurements[{index}]", values[0], minimum=2)
        size = checked_non_negative(f"size_bytes of measurements[{index}]", values[1])
        time = checked_positive(f"time_s of measurements[{index}]", values[2])
        rows.append((busiest_rank_share(op, n) * size, float(latency_steps(op, n)), time))
    if len({(x, y) for x, y, _ in rows}) < 2:
        raise ValueError("need measurements at two or more different sizes to separate latency from bandwidth")

    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    if det <= 1e-12 * sxx * syy:
        # The sizes and world sizes move together, so no fit can tell latency from bandwidth.
        raise ValueError("latency and bandwidth cannot be separated: vary the size at a fixed number of workers")
    inverse_bandwidth = (sxt * syy - syt * sxy) / det
    latency = (sxx * syt - sxy * sxt) / det
    if latency < 0:
        latency, inverse_bandwidth = 0.0, (sxt / sxx if sxx else 0.0)
    if inverse_bandwidth <= 0:
        raise ValueError("the times do not grow with the size: measure larger buffers (e.g. 1 MB to 256 MB)")
    return LatencyBandwidthFit(latency_s=latency, bandwidth_bytes_per_s=1.0 / inverse_bandwidth)
