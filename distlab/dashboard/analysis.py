"""What the records say, as plain data: stragglers, replica divergence, the link's fitted model,
the step-by-step trace, each rank's memory. Pure functions of ``TelemetryStore.records()`` and
``meta()``; the figures only draw what these return, and tests check these directly. Divergence is
``replica_divergence.py``'s and memory ``rank_memory.py``'s, named here too.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .. import theory
from ..byte_text import rate, rate_unit
from ..records import RecordKey, StepRecord, record_key
from .rank_memory import RankMemory, memory_by_rank, memory_message
from .replica_divergence import Divergence, Meta, divergence, total_norm

__all__ = [
    "Divergence",
    "LinkModel",
    "Meta",
    "RankMemory",
    "Straggler",
    "TraceRow",
    "complete_steps",
    "divergence",
    "link_model",
    "memory_by_rank",
    "memory_message",
    "stragglers",
    "summary",
    "timed_steps",
    "trace_rows",
]


def timed_steps(records: Sequence[StepRecord], last: int) -> list[int]:
    """The last ``last`` steps that have a timed collective, in order (what the timeline shows)."""
    return sorted({rec["step"] for rec in records if rec.get("allreduce") or rec.get("collectives")})[-last:]


def complete_steps(records: Sequence[StepRecord], ranks: Sequence[int]) -> list[int]:
    """Steps recorded by every one of ``ranks``, in order."""
    seen: dict[int, set[int]] = defaultdict(set)
    for rec in records:
        seen[rec["step"]].add(rec["rank"])
    want = set(ranks)
    return sorted(step for step, have in seen.items() if want <= have)


# ---------------------------------------------------------------------------------- stragglers


@dataclass(frozen=True)
class Straggler:
    """In one all-reduce, the rank the others waited for, and how long they waited."""

    step: int
    bucket: int
    rank: int
    lag_s: float


def stragglers(records: Sequence[StepRecord], min_lag_s: float = 0.002, min_fraction: float = 0.5) -> list[Straggler]:
    """All-reduces where one rank arrived late enough to make the others wait.

    An all-reduce ends at about the same moment on every rank, so a rank's time in it is how long
    it waited plus the transfer. The rank with the shortest time arrived last; the others' extra
    time is the lag. Clock-free: it compares durations, never timestamps across hosts. A lag counts
    when it is at least ``min_lag_s`` and ``min_fraction`` of the longest time.
    """
    times: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for rec in records:
        for b in rec.get("allreduce") or ():
            times[(rec["step"], b["bucket"])][rec["rank"]] = b["seconds"]
    found = []
    for (step, bucket), by_rank in sorted(times.items()):
        if len(by_rank) < 2:
            continue
        slowest = max(by_rank.values())
        late_rank = min(by_rank, key=lambda r: by_rank[r])
        lag = slowest - by_rank[late_rank]
        if lag >= min_lag_s and lag >= min_fraction * slowest:
            found.append(Straggler(step, bucket, late_rank, lag))
    return found


# ---------------------------------------------------------------------------------- link model


@dataclass(frozen=True)
class LinkModel:
    """Measured all-reduce bus bandwidth against the ring model fitted to the same measurements."""

    #: (bytes, busbw in bytes/s) per all-reduce, from its fastest rank.
    points: list[tuple[int, float]]
    fit: theory.LatencyBandwidthFit | None
    #: (bytes, busbw the fitted ring model predicts), across the measured sizes.
    line: list[tuple[float, float]]
    message: str

    @property
    def unit(self) -> tuple[str, float]:
        """(unit, bytes/s in one) its busbw is plotted in: the one its fastest point fits."""
        return rate_unit(max((b for _, b in (*self.points, *self.line)), default=0.0))


def link_model(records: Sequence[StepRecord], world_size: int, max_points: int = 400) -> LinkModel:
    """Fit ``theory.fit_latency_bandwidth`` to the recorded buckets and draw its busbw curve.

    Each all-reduce counts once, with its shortest time over the ranks: the last rank to arrive did
    not wait, so its time is closest to the transfer alone.
    """
    fastest: dict[tuple[int, int], tuple[int, float]] = {}
    for rec in records:
        for b in rec.get("allreduce") or ():
            key = (rec["step"], b["bucket"])
            if b["seconds"] > 0 and (key not in fastest or b["seconds"] < fastest[key][1]):
                fastest[key] = (b["bytes"], b["seconds"])
    timings = [fastest[k] for k in sorted(fastest)][-max_points:]
    if world_size < 2 or not timings:
        return LinkModel([], None, [], "busbw: no all-reduce timed yet")
    points = [(size, theory.busbw_bytes_per_s(size, t, world_size)) for size, t in timings]
    try:
        fit = theory.fit_latency_bandwidth(timings, workers=world_size)
    except ValueError as exc:
        return LinkModel(points, None, [], f"busbw (ring model not fitted: {exc})")
    low = max(1.0, min(s for s, _ in timings) / 2)
    high = max(s for s, _ in timings) * 2
    sizes = [low * (high / low) ** (i / 40) for i in range(41)]
    line = [(s, theory.busbw_bytes_per_s(s, fit.allreduce_time_s(s, world_size), world_size)) for s in sizes]
    message = (
        f"busbw vs ring model: latency {fit.latency_s * 1e6:.0f} us, "
        f"bandwidth {rate(fit.bandwidth_bytes_per_s)}"
    )
    return LinkModel(points, fit, line, message)


# ---------------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class TraceRow:
    """One line of the training round as a table (the curriculum's topic 2: notebooks/README.md)."""

    step: int
    epoch: str
    rank: int
    action: str
    local: str
    world: str


def trace_rows(records: Sequence[StepRecord], ranks: Sequence[int], last_steps: int = 2) -> list[TraceRow]:
    """The last ``last_steps`` steps every rank finished, three actions per rank per step."""
    by_key = {record_key(rec): rec for rec in records}
    steps = complete_steps(records, ranks)[-last_steps:]
    world = len(ranks)
    rows = []
    for step in steps:
        recs = [by_key[RecordKey(step, r)] for r in ranks]
        sums = {rec.get("checksum") for rec in recs}
        for rec in recs:
            epoch = "" if rec.get("epoch") is None else str(rec["epoch"])
            rank = rec["rank"]
            loss = rec.get("loss")
            grad = total_norm(rec.get("grad_norm"))
            local = (f"loss {loss:.4g}" if loss is not None else "loss not logged") + (
                f", grad norm {grad:.3g}" if grad is not None else ""
            )
            rows.append(TraceRow(step, epoch, rank, "forward + backward on its own batch", local,
                                 f"{world} ranks, one model each"))
            buckets = rec.get("allreduce") or []
            if buckets:
                size = sum(b["bytes"] for b in buckets)
                plural = "s" if len(buckets) != 1 else ""
                rows.append(TraceRow(
                    step, epoch, rank, f"all-reduce gradients ({len(buckets)} bucket{plural}, {size / 1e6:.2f} MB)",
                    f"waited {rec.get('comm_s', 0.0) * 1e3:.1f} ms after backward",
                    f"gradients averaged over {world} ranks",
                ))
            elif rec.get("collectives"):
                ops = Counter(c["op"] for c in rec["collectives"])
                size = sum(c["bytes"] for c in rec["collectives"])
                rows.append(TraceRow(
                    step, epoch, rank, ", ".join(f"{n} {op.replace('_', '-')}" for op, n in ops.items())
                    + f" ({size / 1e6:.2f} MB)",
                    f"collectives in flight {rec.get('comm_s', 0.0) * 1e3:.1f} ms",
                    "shards gathered and gradients reduced across ranks",
                ))
            else:
                rows.append(TraceRow(step, epoch, rank, "no gradient exchange", "its own gradients only",
                                     "each rank keeps different gradients"))
            ratio = rec.get("update_ratio") or {}
            local_update = (
                f"update/weight {max(ratio.values()):.2e} (largest layer)" if ratio
                else f"step took {rec.get('step_time_s', 0.0) * 1e3:.1f} ms"
            )
            if rec.get("checksum") is None or None in sums:
                state = "replicas not compared this step"
            elif len(sums) == 1:
                state = "replicas identical (checksums equal)"
            else:
                state = "replicas differ (checksums differ)"
            rows.append(TraceRow(step, epoch, rank, "optimizer update", local_update, state))
    return rows


# ---------------------------------------------------------------------------------- summary


def summary(records: Sequence[StepRecord], meta: Meta, world_size: int) -> list[str]:
    """A few lines of plain text that say what the dashboard shows: its static snapshot."""
    if not records:
        return ["distlab dashboard: no telemetry yet (call distlab.watch(model) in a %%ddp cell)"]
    ranks = sorted({rec["rank"] for rec in records})
    last = max(rec["step"] for rec in records)
    lines = [f"distlab dashboard: {len(ranks)} ranks, steps 0-{last}"]
    for r in ranks:
        mine = [rec for rec in records if rec["rank"] == r]
        losses = [rec["loss"] for rec in mine if rec.get("loss") is not None]
        times = sorted(rec["step_time_s"] for rec in mine)
        comm = sorted(rec["comm_s"] for rec in mine)
        median = times[len(times) // 2] * 1e3
        text = f"  rank {r}: loss {losses[-1]:.4g}" if losses else f"  rank {r}: loss not logged"
        waited = "exposed all-reduce" if r not in meta or meta[r].get("ddp") else "communication in flight"
        lines.append(f"{text}, step {median:.1f} ms (median), {waited} {comm[len(comm) // 2] * 1e3:.1f} ms")
    lines.append("  " + divergence(records, meta).message)
    lines.append("  " + link_model(records, world_size).message)
    if any(rec.get("memory") for rec in records):
        lines.append("  " + memory_message(memory_by_rank(records, meta), meta))
    late = stragglers(records)
    if late:
        counts: dict[int, int] = defaultdict(int)
        for s in late:
            counts[s.rank] += 1
        worst = max(counts, key=lambda r: counts[r])
        timed = {(rec["step"], b["bucket"]) for rec in records for b in rec.get("allreduce") or ()}  # the whole
        lines.append(f"  stragglers: rank {worst} arrived last, the others waiting for it, in {counts[worst]} of "
                     f"{len(timed)} all-reduces")
    return lines
