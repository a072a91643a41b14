"""Every rank's torch.profiler trace merged into one Chrome trace, and each rank's compute,
communication and their overlap read from it: what ``lab.profile`` shows. Pure (no torch).

The merged file is Chrome's trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing
open: one process per rank (``pid`` = the rank, named "rank R"), each with its threads (and, on a
GPU, its streams) as the rank's profiler recorded them, on one time axis.

The four numbers per rank follow Holistic Trace Analysis (HTA, pytorch/HolisticTraceAnalysis):
its "Communication Computation Overlap" (docs/source/features/comm_comp_overlap.rst) is
"(time spent in computation while communicating) / (time spent in communication)", computed in
``hta/analyzers/communication_analysis.py`` ``get_comm_comp_overlap`` on the merged (unioned)
intervals of communication kernels and of computation kernels; its "Temporal Breakdown"
(docs/source/features/temporal_breakdown.rst) counts communication that runs during computation
as compute time, so what is left of communication is the part nothing hides: here, exposed
communication. HTA classes kernels by name (``hta/utils/utils.py``: NCCL kernels are
communication, Memcpy/Memset memory, the rest computation). So, per rank:

- compute: the union of the compute intervals;
- communication: the union of the communication intervals;
- exposed communication: communication minus its intersection with compute;
- overlap: 100 x (communication intersected with compute) / communication;
- idle: the profiled steps' time with neither compute nor communication (HTA's temporal
  breakdown's idle time): a rank that waits for its data, or sleeps, shows it here.

HTA reads GPU kernels. A rank on a GPU is read as HTA does (events of category ``kernel``; those
named ``nccl*`` communication, Memcpy/Memset neither). A rank on a CPU (gloo) has no kernels: its
compute is the top-level aten ops (``cpu_op`` events with no ``cpu_op`` around them) of the thread
that ran the cell, c10d's collective calls left out (they only hand work to gloo), and its
communication the events gloo records around each collective on its own worker threads
(``gloo:all_reduce``, ``gloo:broadcast``, ...), which last as long as the collective does.
"""

from __future__ import annotations

import base64
import json
import textwrap
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..wire import ProfileTrace
from .static import compact_png

__all__ = [
    "Interval",
    "RankProfile",
    "analyse",
    "compute_and_communication",
    "intersect",
    "merge",
    "png_base64",
    "render_png",
    "subtract",
    "table_text",
    "total",
    "union",
]

Interval = tuple[float, float]

#: CPU ops that only hand a collective to the backend: communication's, not compute.
_COMM_CALLS = ("c10d::", "record_param_comms", "gloo:", "nccl:")
#: Kineto's own metadata of a process, replaced by the rank's.
_PROCESS_METADATA = ("process_name", "process_labels", "process_sort_index")
_FLOW_PHASES = ("s", "t", "f")


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged: sorted, none overlapping or touching another."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def total(intervals: Iterable[Interval]) -> float:
    """The length of a union (of intervals already merged)."""
    return sum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Where two unions overlap."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The parts of union ``a`` outside union ``b``."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, at = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > at:
                out.append((at, b[k][0]))
            at = max(at, b[k][1])
            k += 1
        if at < end:
            out.append((at, end))
    return out


def _spans(events: Iterable[Mapping[str, Any]]) -> list[Interval]:
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events]


def _top_level(ops: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ops no other op of the list encloses (one thread's ops nest; the outer one comes first)."""
    top: list[Mapping[str, Any]] = []
    end = float("-inf")
    for op in sorted(ops, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))):
        start = float(op["ts"])
        if start >= end:
            top.append(op)
            end = start + float(op.get("dur", 0.0))
    return top


def compute_and_communication(
    events: Sequence[Mapping[str, Any]], tid: int
) -> tuple[list[Interval], list[Interval], str]:
    """A rank's compute and communication unions, and what they were read from (see the module)."""
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    if kernels:
        comm = [k for k in kernels if str(k.get("name", "")).startswith("nccl")]
        comp = [k for k in kernels if not str(k.get("name", "")).startswith(("nccl", "Memcpy", "Memset"))]
        return union(_spans(comp)), union(_spans(comm)), "GPU kernels (NCCL's: communication)"
    ops = [e for e in complete if e.get("cat") == "cpu_op" and e.get("tid") == tid]
    comp_ops = [op for op in _top_level(ops) if not str(op.get("name", "")).startswith(_COMM_CALLS)]
    comm_events = [e for e in complete if str(e.get("name", "")).startswith("gloo:")]
    source = "CPU: top-level ops of the cell's thread; gloo's collectives"
    return union(_spans(comp_ops)), union(_spans(comm_events)), source


@dataclass
class RankProfile:
    """One rank's numbers (milliseconds) and the intervals they come from (for the picture)."""

    rank: int
    steps: int
    whole: bool
    compute_ms: float
    communication_ms: float
    exposed_ms: float
    #: The profiled steps' time with neither compute nor communication (the whole cell's, for "whole").
    idle_ms: float
    #: Percent of communication time that compute overlapped; None where there was no communication.
    overlap_pct: float | None
    source: str
    compute: list[Interval] = field(default_factory=list, repr=False)
    communication: list[Interval] = field(default_factory=list, repr=False)
    exposed: list[Interval] = field(default_factory=list, repr=False)
    step_starts: list[float] = field(default_factory=list, repr=False)

    def row(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "steps": self.steps, "compute_ms": round(self.compute_ms, 3),
            "communication_ms": round(self.communication_ms, 3), "exposed_ms": round(self.exposed_ms, 3),
            "idle_ms": round(self.idle_ms, 3),
            "overlap_pct": None if self.overlap_pct is None else round(self.overlap_pct, 1),
        }


def analyse(rank: int, events: Sequence[Mapping[str, Any]], got: ProfileTrace) -> RankProfile:
    """One rank's numbers from its events (``got``: what the rank said of its recording)."""
    compute, comm, source = compute_and_communication(events, got["tid"])
    overlapped = total(intersect(comm, compute))
    exposed = subtract(comm, compute)
    comm_us = total(comm)
    step_spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#") and e.get("tid") == got["tid"]
    )
    steps = [start for start, _ in step_spans]
    # The steps' time (or, with no step, from the first event to the last) that nothing filled.
    busy = union(compute + comm)
    spans = step_spans or ([(busy[0][0], busy[-1][1])] if busy else [])
    idle = subtract(union(spans), busy)
    return RankProfile(
        rank=rank, steps=got["steps"], whole=got["whole"], compute_ms=total(compute) / 1e3,
        communication_ms=comm_us / 1e3, exposed_ms=total(exposed) / 1e3, idle_ms=total(idle) / 1e3,
        overlap_pct=100.0 * overlapped / comm_us if comm_us > 0 else None, source=source,
        compute=compute, communication=comm, exposed=exposed, step_starts=steps,
    )


def merge(traces: Mapping[int, ProfileTrace]) -> tuple[dict[str, Any], list[RankProfile]]:
    """The ranks' traces as one Chrome trace (``pid`` = rank), and each rank's numbers.

    Each rank's times are put on the wall clock (kineto's ``baseTimeNanoseconds`` plus its
    ``ts``), so ranks on different hosts line up as well as their clocks do, and then counted from
    the first event of any rank. Flow ids (forward to backward, CPU to GPU) are made unique per
    rank. Kineto's spans of its own recording window, whose ``pid`` is a name, are left out.
    """
    loaded = {rank: json.loads(zlib.decompress(got["trace"])) for rank, got in sorted(traces.items())}
    if not loaded:
        return {"traceEvents": [], "displayTimeUnit": "ms"}, []
    bases = {rank: int(doc.get("baseTimeNanoseconds", 0)) for rank, doc in loaded.items()}
    first_base = min(bases.values())
    per_rank: dict[int, list[dict[str, Any]]] = {}
    for rank, doc in loaded.items():
        shift = (bases[rank] - first_base) / 1e3
        kept = per_rank[rank] = []
        for event in doc.get("traceEvents", []):
            if isinstance(event.get("pid"), str) or (event.get("ph") == "M" and event.get("name") in _PROCESS_METADATA):
                continue
            event["pid"] = rank
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift
            if event.get("ph") in _FLOW_PHASES and "id" in event:
                flow = event["id"]
                event["id"] = flow * len(loaded) + rank if isinstance(flow, int) else f"r{rank}:{flow}"
            kept.append(event)
    origin = min(
        (e["ts"] for events in per_rank.values() for e in events if "ts" in e and e.get("ph") != "M"), default=0.0
    )
    merged: list[dict[str, Any]] = []
    for rank, events in per_rank.items():
        merged.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        merged.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for event in events:
            if "ts" in event:
                event["ts"] = round(event["ts"] - origin, 3) if event.get("ph") != "M" else 0
            merged.append(event)
    profiles = [analyse(rank, events, traces[rank]) for rank, events in per_rank.items()]
    devices = {json.dumps(d, sort_keys=True): d for doc in loaded.values() for d in doc.get("deviceProperties", [])}
    document = {
        "traceEvents": merged,
        "displayTimeUnit": "ms",
        "deviceProperties": list(devices.values()),
        "distlab": {
            str(rank): {key: traces[rank][key] for key in ("steps", "whole", "optimizer_steps")} for rank in loaded
        },
    }
    return document, profiles


def table_text(profiles: Sequence[RankProfile], path: str | None = None) -> str:
    """The numbers as a text table, with what they were read from and where the trace is."""
    if not profiles:
        return "no rank was profiled"
    lines = [f"{'rank':>4}  {'steps':>5}  {'compute ms':>10}  {'comm ms':>9}  {'exposed comm ms':>15}  {'overlap':>7}"
             f"  {'idle ms':>9}"]
    for p in profiles:
        overlap = "-" if p.overlap_pct is None else f"{p.overlap_pct:.0f}%"
        steps = "whole" if p.whole else str(p.steps)
        lines.append(
            f"{p.rank:>4}  {steps:>5}  {p.compute_ms:>10.2f}  {p.communication_ms:>9.2f}  "
            f"{p.exposed_ms:>15.2f}  {overlap:>7}  {p.idle_ms:>9.2f}"
        )
    sources = sorted({p.source for p in profiles})
    lines.append("read from " + "; ".join(sources) + ("; 'whole': no optimizer step, the whole cell" if any(
        p.whole for p in profiles) else ""))
    if any(not p.whole and p.steps == 0 for p in profiles):
        lines.append("no step was recorded whole: the cell made too few optimizer steps for warmup + steps + 1")
    if path:
        lines.append(f"trace: {path} (open it in ui.perfetto.dev or chrome://tracing)")
    return "\n".join(lines)


_COMPUTE, _COMM, _EXPOSED = "#636EFA", "#FFA15A", "#EF553B"
_DPI = 80


def render_png(profiles: Sequence[RankProfile], text: str = "") -> bytes:
    """The merged timeline as one PNG: a row per rank, its compute and communication as bars,
    exposed communication in red over them, thin lines where steps start; ``text`` under it."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    lines = [wrapped for line in text.splitlines() for wrapped in textwrap.wrap(line, 150) or [""]]
    text_in = 0.17 * len(lines) + 0.2 if lines else 0.0
    plot_in = 1.0 + 0.8 * max(1, len(profiles))
    fig = Figure(figsize=(11, plot_in + text_in), dpi=_DPI, layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=[plot_in, max(text_in, 0.01)])
    ax = fig.add_subplot(grid[0])
    for row, p in enumerate(profiles):
        y = len(profiles) - 1 - row
        lanes = (
            (p.compute, 0.5, _COMPUTE, "compute"), (p.communication, 0.08, _COMM, "communication"),
            (p.exposed, 0.08, _EXPOSED, "exposed communication"),
        )
        for intervals, bottom, colour, label in lanes:
            ax.broken_barh(_ms(intervals), (y + bottom, 0.38), facecolors=colour, label=label if row == 0 else None)
        for start in p.step_starts:
            ax.vlines(start / 1e3, y + 0.02, y + 0.98, colors="black", linewidth=0.6)
    ax.set_yticks([len(profiles) - 1 - i + 0.5 for i in range(len(profiles))], [f"rank {p.rank}" for p in profiles])
    ax.set_ylim(0, max(1, len(profiles)))
    ax.set_xlabel("ms from the first event (thin lines: a step starts)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=3, frameon=False)
    ax.set_title(_title(profiles), fontsize=11, loc="left")
    words = fig.add_subplot(grid[1])
    words.set_axis_off()
    if lines:
        words.text(
            0, 1, "\n".join(lines), family="monospace", fontsize=8, va="top", ha="left", transform=words.transAxes
        )
    return compact_png(fig)


def _ms(intervals: Sequence[Interval]) -> list[tuple[float, float]]:
    return [(start / 1e3, (end - start) / 1e3) for start, end in intervals]


def _title(profiles: Sequence[RankProfile]) -> str:
    steps = sorted({p.steps for p in profiles if not p.whole})
    what = "the whole cell" if not steps else f"{'/'.join(map(str, steps))} step{'s' if steps != [1] else ''}"
    return f"distlab profile: {len(profiles)} rank{'s' if len(profiles) != 1 else ''}, {what}"


def png_base64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")
