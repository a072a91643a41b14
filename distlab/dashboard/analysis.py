"""What the records say, as plain data: stragglers, replica divergence, the link's fitted model,
the step-by-step trace. Pure functions of ``TelemetryStore.records()`` and ``meta()``; the figures
only draw what these return, and tests check these directly.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .. import theory
from ..records import LayerValues, Layout, RecordKey, StepRecord, WatchMeta, record_key
from .units import rate, rate_unit

__all__ = [
    "Divergence",
    "LinkModel",
    "Straggler",
    "TraceRow",
    "complete_steps",
    "divergence",
    "link_model",
    "stragglers",
    "summary",
    "timed_steps",
    "trace_rows",
]

Meta = Mapping[int, WatchMeta]


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


# ---------------------------------------------------------------------------------- divergence


@dataclass(frozen=True)
class Divergence:
    """Whether the replicas' weights still agree, and if not where, since when and why."""

    diverged: bool
    message: str
    checked_steps: int = 0
    first_step: int | None = None
    ranks: list[int] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    cause: str | None = None
    started_apart: bool = False
    #: Steps whose checksums differ across ranks.
    mismatch_steps: list[int] = field(default_factory=list)
    #: {rank: [(step, |W_rank| / |W_ref| - 1)]} at sampled steps: how far apart, not just whether.
    spread: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


_CAUSE_START = (
    "the replicas started from different weights: seed every rank the same (torch.manual_seed) "
    "or broadcast rank {ref}'s weights (DDP does this when it wraps the model)"
)
_CAUSE_NO_AVERAGE = (
    "the replicas started equal and drifted apart: gradients are not averaged across ranks; wrap the "
    "model in DDP, or all-reduce the gradients and divide by world_size before the update"
)
_CAUSE_DDP = (
    "DDP keeps replicas equal, so something changed weights outside it: an update on some ranks only, "
    "or parameters edited by hand"
)


def divergence(records: Sequence[StepRecord], meta: Meta) -> Divergence:
    """Compare the ranks' exact checksums; name the ranks, the layers, the first step and the cause."""
    ranks = sorted({rec["rank"] for rec in records} | set(meta))
    if len(ranks) < 2:
        return Divergence(False, "one rank: nothing to compare")
    ref = ranks[0]
    ref_meta = meta.get(ref)
    if ref_meta and ref_meta.get("replicated") is False:
        return Divergence(False, "each rank's weights are its own (replicated=False): no replicas to compare")
    if ref_meta and ref_meta.get("layers") and set(ref_meta.get("sharded_layers") or ()) >= set(ref_meta["layers"]):
        return Divergence(False, "weights sharded across ranks (FSDP2, tensor parallel): no replicas to compare")
    by_step: dict[int, dict[int, StepRecord]] = defaultdict(dict)
    for rec in records:
        by_step[rec["step"]][rec["rank"]] = rec

    start_layers: set[str] = set()
    start_ranks: set[int] = set()
    ref_start = ref_meta.get("initial_checksums") if ref_meta else None
    for r in ranks[1:]:
        their_meta = meta.get(r)
        theirs = their_meta.get("initial_checksums") if their_meta else None
        if ref_start and theirs:
            differing = {name for name in ref_start if theirs.get(name) != ref_start[name]}
            if differing:
                start_layers |= differing
                start_ranks.add(r)

    checked, mismatches = 0, []
    bad_ranks: set[int] = set(start_ranks)
    bad_layers: set[str] = set(start_layers)
    for step in sorted(by_step):
        recs = by_step[step]
        if ref not in recs or recs[ref].get("checksum") is None:
            continue
        others = [r for r in ranks[1:] if r in recs and recs[r].get("checksum") is not None]
        if not others:
            continue
        checked += 1
        ref_layers = recs[ref].get("layer_checksums") or {}
        step_bad = False
        for r in others:
            if recs[r]["checksum"] != recs[ref]["checksum"]:
                step_bad = True
                bad_ranks.add(r)
                theirs = recs[r].get("layer_checksums") or {}
                bad_layers |= {name for name in ref_layers if theirs.get(name) != ref_layers[name]}
        if step_bad:
            mismatches.append(step)

    spread = _weight_spread(by_step, ranks)
    layer_order = list(_layers(meta, ref) or sorted(bad_layers))
    layers = [name for name in layer_order if name in bad_layers]
    if not mismatches and not start_ranks:
        if checked == 0:
            return Divergence(False, "replicas: no checksums compared yet", spread=spread)
        return Divergence(
            False, f"replicas agree: checksums equal on all {len(ranks)} ranks at {checked} steps",
            checked_steps=checked, spread=spread,
        )
    if start_ranks:
        cause, first = _CAUSE_START.format(ref=ref), (mismatches[0] if mismatches else None)
    elif not all(m and m.get("ddp") for m in map(meta.get, ranks)):
        cause, first = _CAUSE_NO_AVERAGE, mismatches[0]
    else:
        cause, first = _CAUSE_DDP, mismatches[0]
    when = "from the start" if start_ranks else f"since step {first}"
    total = len(_layers(meta, ref) or layers)
    message = (
        f"replicas diverge: rank {_ranks_text(sorted(bad_ranks))} differ{'s' if len(bad_ranks) == 1 else ''} "
        f"from rank {ref} in {len(layers)} of {total} layers ({', '.join(layers[:6])}"
        f"{', ...' if len(layers) > 6 else ''}) {when}: {cause}"
    )
    return Divergence(
        True, message, checked_steps=checked, first_step=first, ranks=sorted(bad_ranks), layers=layers,
        cause=cause, started_apart=bool(start_ranks), mismatch_steps=mismatches, spread=spread,
    )


def _layers(meta: Meta, rank: int) -> list[str]:
    """The layers ``rank``'s watch named ([] before its first publish)."""
    mine = meta.get(rank)
    return (mine.get("layers") if mine else None) or []


def _weight_spread(by_step: dict[int, dict[int, StepRecord]], ranks: list[int]) -> dict[int, list[tuple[int, float]]]:
    ref = ranks[0]
    spread: dict[int, list[tuple[int, float]]] = {r: [] for r in ranks}
    for step in sorted(by_step):
        recs = by_step[step]
        base = _total_norm(_weight_norms(recs.get(ref)))
        if not base:
            continue
        for r in ranks:
            norm = _total_norm(_weight_norms(recs.get(r)))
            if norm is not None:
                spread[r].append((step, norm / base - 1.0))
    return spread


def _weight_norms(rec: StepRecord | None) -> LayerValues | None:
    return rec.get("weight_norm") if rec else None


def _total_norm(norms: LayerValues | None) -> float | None:
    """The 2-norm of the whole model from its layers' norms (None when there are none)."""
    return math.sqrt(sum(v * v for v in norms.values())) if norms else None


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


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
            grad = _total_norm(rec.get("grad_norm"))
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


# ---------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory at its latest recorded step, next to the theory's prediction (None: no model)."""

    rank: int
    step: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    theory: theory.ShardedMemory | None

    @property
    def resident_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def error(self) -> float | None:
        """(measured - theory) / theory of the resident model state."""
        if self.theory is None or not self.theory.total_bytes:
            return None
        return (self.resident_bytes - self.theory.total_bytes) / self.theory.total_bytes


def memory_by_rank(records: Sequence[StepRecord], meta: Meta) -> list[RankMemory]:
    """Each rank's latest memory record with ``theory.sharded_memory`` for the layout its watch read."""
    latest: dict[int, StepRecord] = {}
    for rec in records:
        if rec.get("memory") and (rec["rank"] not in latest or rec["step"] >= latest[rec["rank"]]["step"]):
            latest[rec["rank"]] = rec
    out = []
    for rank in sorted(latest):
        rec = latest[rank]
        mem = rec["memory"]
        assert mem is not None
        layout = _layout(meta, rank)
        predicted = theory.sharded_memory(**layout) if layout else None
        out.append(RankMemory(rank, rec["step"], mem["parameters_bytes"], mem["gradients_bytes"],
                              mem["optimizer_bytes"], mem["peak_bytes"], predicted))
    return out


def _layout(meta: Meta, rank: int) -> Layout | None:
    """The model configuration ``rank``'s watch read (None before its first update)."""
    mine = meta.get(rank)
    return mine.get("layout") if mine else None


def memory_message(rows: Sequence[RankMemory], meta: Meta) -> str:
    if not rows:
        return "memory: not recorded"
    peak = max(rows, key=lambda r: r.peak_bytes)
    text = (f"memory: model state {rows[0].resident_bytes / 1e6:.2f} MB on rank {rows[0].rank}, "
            f"peak {peak.peak_bytes / 1e6:.2f} MB (rank {peak.rank})")
    layout = _layout(meta, rows[0].rank)
    if rows[0].theory is not None and layout:
        error = rows[0].error
        text += (f"; theory ({layout['strategy']}, data x tensor parallel {layout['data_parallel']} x "
                 f"{layout['tensor_parallel']}, {layout['optimizer']}) {rows[0].theory.total_bytes / 1e6:.2f} MB"
                 + (f" ({error:+.1%})" if error is not None else ""))
    return text


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
