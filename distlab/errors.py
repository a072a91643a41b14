"""Errors distlab raises, and the rank-range parsing and grouping they rely on.

A failed cell on N ranks must read like one error, not N: identical tracebacks are grouped
("ranks 0-3: ZeroDivisionError: division by zero") and each distinct one is shown once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from .wire import CELL_FILE, CollectiveEntry, PointToPointEntry

__all__ = [
    "ABSENT",
    "FAILED",
    "FINISHED",
    "STUCK",
    "CellTimeout",
    "DistlabError",
    "LabUsageError",
    "RankError",
    "RankFailure",
    "diagnose_collectives",
    "format_ranks",
    "parse_ranks",
]


class DistlabError(RuntimeError):
    """Base class of the errors distlab raises about a running lab."""


class LabUsageError(ValueError):
    """A call distlab refused before changing anything; the message names the problem and the fix."""


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: the exception's name and message, and its traceback as text."""

    rank: int
    ename: str
    evalue: str
    traceback: str = ""
    #: When the rank raised it (seconds since the epoch; 0: not known): the report leads with the first.
    at: float = 0.0

    @property
    def headline(self) -> str:
        return f"{self.ename}: {self.evalue}" if self.evalue else self.ename


class RankError(DistlabError):
    """A cell failed on one or more ranks.

    ``failures`` maps rank -> RankFailure; ``str(err)`` groups ranks whose failures are identical,
    each distinct traceback shown once under its headline (:meth:`render`), for outside IPython the
    message is all a script's user or a log sees; ``summary`` is the headlines alone.
    ``notes`` carries what distlab did afterwards (e.g. "process group rebuilt").
    """

    def __init__(self, failures: Mapping[int, RankFailure], notes: Iterable[str] = ()):
        self.failures = dict(sorted(failures.items()))
        self.notes = list(notes)
        super().__init__(self._render(with_tracebacks=True))

    @property
    def summary(self) -> str:
        """One line per group of identical failures, then the notes: the report without its tracebacks."""
        return self._render(with_tracebacks=False)

    @property
    def ranks(self) -> list[int]:
        return list(self.failures)

    def groups(self) -> list[tuple[list[int], RankFailure]]:
        """Failures grouped by identical (ename, evalue, traceback), the cause first: ranks that died,
        then those that raised (the first to raise first), then those distlab stopped because of them."""
        grouped: dict[tuple[str, str, str], list[int]] = {}
        for rank, failure in self.failures.items():
            key = (failure.ename, failure.evalue, _normalise_traceback(failure.traceback, rank))
            grouped.setdefault(key, []).append(rank)
        groups = [(ranks, self.failures[ranks[0]]) for ranks in grouped.values()]

        def cause_first(group: tuple[list[int], RankFailure]) -> tuple[int, float, int]:
            ranks, failure = group
            kind = 0 if failure.ename == "EngineError" else 2 if failure.ename in STOPPED else 1
            return kind, min(self.failures[r].at for r in ranks) or float("inf"), ranks[0]

        return sorted(groups, key=cause_first)

    def _render(self, with_tracebacks: bool) -> str:
        lines = []
        for ranks, failure in self.groups():
            label = "rank" if len(ranks) == 1 else "ranks"
            lines.append(f"{label} {format_ranks(ranks)}: {failure.headline}")
            # A rank distlab stopped takes its one line: where it was is in it, and its frames
            # (torch's own, mostly) stay for %dist debug.
            if with_tracebacks and failure.traceback and failure.ename not in STOPPED:
                lines.append(_indent(_short_paths(failure.traceback.rstrip())))
        lines.extend(self.notes)
        return "\n".join(lines)

    def render(self) -> str:
        """The full report: each distinct traceback once, labelled with the ranks that raised it."""
        return self._render(with_tracebacks=True)

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing its own traceback of distlab's internals.
        return self.render().splitlines()


class CellTimeout(RankError):
    """A cell ran past its deadline on some ranks; they were interrupted."""


# The flight recorder names dtypes as c10 does ("Float"); torch users know them as these.
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


def _describe_op(entry: CollectiveEntry) -> str:
    """'all_reduce of [7] float32' from a flight-recorder entry (bootstrap.collective_trace)."""
    shapes = entry.get("shapes") or []
    dtypes = entry.get("dtypes") or []
    parts = [
        "[" + ", ".join(str(d) for d in shape) + "]" + (f" {_DTYPES.get(dtype, dtype)}" if dtype else "")
        for shape, dtype in zip(shapes, [*dtypes, *[""] * len(shapes)])
    ]
    return f"{entry.get('op', '?')} of {', '.join(parts)}" if parts else str(entry.get("op", "?"))


#: What a rank was doing when a cell was stopped, as ``diagnose_collectives`` is told it.
STUCK, FAILED, FINISHED, ABSENT = "still in the cell", "its cell failed", "its cell had finished", "not in this cell"


def diagnose_collectives(
    traces: Mapping[int, Sequence[CollectiveEntry]], doing: Mapping[int, str]
) -> str | None:
    """Who never arrived at a collective, and where the others waited, in each process group; None if
    nothing is amiss.

    ``traces``: each rank's latest collectives in every group it belongs to (``rank.flight.collective_trace``),
    read after the cell was stopped; ``doing``: each rank's state then (STUCK, FAILED, FINISHED or
    ABSENT). In a group, the members whose latest collective is the furthest one were waiting in it;
    a member behind never reached it. If every member reached the same collective but they disagree
    on its op or shapes, that mismatch is the hang. A hang in a sub-group (a device mesh's
    dimension) names the group; the default group's note reads as it always did.
    """
    # A group's members, as any rank read them: a rank whose group was already torn down to release
    # it reads none. Unknown, they are the ranks with entries in it (all ranks, for the default group).
    groups: dict[str, tuple[str, list[int]]] = {}  # name -> (description, members)
    for entries in traces.values():
        for e in entries:
            name, members = e.get("group", "0"), list(e.get("members") or [])
            if name not in groups or (members and not groups[name][1]):
                groups[name] = (e.get("desc", "default_pg"), members)
    found = []
    for name, (desc, members) in sorted(groups.items(), key=lambda g: (g[0] != "0", g[0])):
        if not members:
            members = sorted(r for r in traces if name == "0" or any(e.get("group", "0") == name for e in traces[r]))
        mine = {r: [e for e in traces[r] if e.get("group", "0") == name] for r in traces if r in members}
        label = "" if name == "0" else f" in group {desc or name} of ranks {format_ranks(members)}"
        note = _diagnose_group(mine, doing, label)
        if note is not None:
            found.append(note)
        found.extend(_diagnose_point_to_point(mine, doing, label))
    return "\n".join(found) or None


def _diagnose_point_to_point(
    traces: Mapping[int, Sequence[CollectiveEntry]], doing: Mapping[int, str], label: str
) -> list[str]:
    """A stuck rank's send that its peer never received, or receive that its peer never sent: a
    rank's n-th send to a peer in a group is matched by the peer's n-th receive from it (or from any
    source), as gloo and NCCL match them."""
    # Each rank's count of sends to / receives from each peer, with the latest one (PointToPointEntry).
    posted: dict[int, dict[tuple[str, int], CollectiveEntry]] = {
        # A p2p entry is a PointToPointEntry (its peer): the flight recorder's send or receive.
        r: {(e["op"], int(cast(PointToPointEntry, e).get("peer", -1))): e for e in t if e.get("p2p")}
        for r, t in traces.items()
    }

    def count(rank: int, op: str, peer: int) -> int:
        return sum(e["seq"] for (o, p), e in posted.get(rank, {}).items() if o == op and p in (peer, -1))

    # Each stuck rank's sends and receives that its peer has not matched, with how many it had.
    unmatched = {
        (r, op, peer): (e, count(peer, "recv" if op == "send" else "send", r))
        for r in sorted(r for r in posted if doing.get(r) == STUCK)
        for (op, peer), e in sorted(posted[r].items())
        # a receive from any source has no one peer to blame
        if peer >= 0 and peer != r and count(peer, "recv" if op == "send" else "send", r) < e["seq"]
    }
    notes = []
    for (r, op, peer), (e, matched) in unmatched.items():
        answer = "recv" if op == "send" else "send"
        if (peer, op, r) in unmatched:  # the two wait on each other: said once, as the cycle it is
            if r < peer:
                notes.append(
                    f"ranks {r} and {peer}{label} each wait in a {op} {'to' if op == 'send' else 'from'} the "
                    f"other ({_describe_op(e)}), and neither has posted the matching {answer}: a deadlock. "
                    f"Post the {answer} first on one of them, or both together with dist.batch_isend_irecv"
                )
            continue
        towards = "to" if op == "send" else "from"
        what = "posted the matching recv" if op == "send" else "sent it"
        plural = "s" if matched != 1 else ""
        had = (
            f"it had posted {matched} {answer}{plural} {'from' if op == 'send' else 'to'} rank {r}"
            if peer in traces
            else "its record could not be read"
        )
        # The first unmatched one is where the pair parted (a schedule may post more before it waits).
        more = f" and {e['seq'] - matched - 1} after it" if e["seq"] > matched + 1 else ""
        notes.append(
            f"{op} #{matched + 1} {towards} rank {peer}{label} ({_describe_op(e)}): rank {r} waited in it{more}; "
            f"rank {peer} never {what} ({had}; {doing.get(peer, ABSENT)})"
        )
    return notes


def _diagnose_group(
    traces: Mapping[int, Sequence[CollectiveEntry]], doing: Mapping[int, str], label: str
) -> str | None:
    collectives = {r: [e for e in t if not e.get("p2p")] for r, t in traces.items()}
    # Only ranks that made a collective have a last one; the others count as at #0.
    last = {r: entries[-1] for r, entries in collectives.items() if entries}
    seq = {r: (last[r]["seq"] if r in last else 0) for r in collectives}
    front = max(seq.values(), default=0)
    if front == 0:
        return None
    ahead = sorted(r for r in seq if seq[r] == front)
    behind = sorted(r for r in seq if seq[r] < front)
    if behind:
        waiting = [r for r in ahead if doing.get(r) == STUCK] or ahead
        where = _describe_op(last[waiting[0]])
        lines = [f"collective #{front}{label} ({where}): rank {format_ranks(waiting)} waited in it"]
        by_last: dict[str, list[int]] = {}
        for r in behind:
            e = last.get(r)
            was = f"its last was #{e['seq']}, {_describe_op(e)}" if e else "it had made no collective"
            by_last.setdefault(f"{was}; {doing.get(r, STUCK)}", []).append(r)
        for what, ranks in by_last.items():
            lines.append(f"rank {format_ranks(ranks)} never arrived ({what})")
        return "; ".join(lines)
    seen = {_describe_op(last[r]) for r in ahead}
    if len(seen) > 1:
        calls = ", ".join(f"rank {r} {_describe_op(last[r])}" for r in ahead)
        return f"collective #{front}{label}: the ranks disagree on what it is ({calls})"
    return None


#: Failures of ranks distlab stopped because of another's (a deadline, a failed or dead peer, Ctrl-C).
STOPPED = ("Stopped", "KeyboardInterrupt")
# A file's path up to its package (site-packages, or the standard library's folder): a machine's
# paths do not belong in a saved notebook, and the package's path says where the frame is.
_PACKAGE_PATHS = (
    re.compile(r'File "[^"]*/(?:site|dist)-packages/'),
    re.compile(r'File "[^"]*/lib/python3\.\d+/'),
    # distlab installed from its source folder (editable): that folder, as this machine has it.
    re.compile(re.escape('File "' + os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)),
)


def _short_paths(traceback: str) -> str:
    for path in _PACKAGE_PATHS:  # a package's first: site-packages lies under lib/python3.x too
        traceback = path.sub('File "', traceback)
    return traceback


def _normalise_traceback(text: str, rank: int) -> str:
    # The cell's file name carries the rank ("<rank 3 cell>"); without this, identical
    # failures on different ranks would never group.
    return text.replace(CELL_FILE.format(rank=rank), "<rank cell>")


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def format_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_ranks(spec: str | int | Iterable[int], world_size: int) -> list[int]:
    """Parse '0,2-3' (or an int, or a list of ints) into sorted ranks, checked against world_size.

    Raises LabUsageError naming the bad part and the valid range; never evaluates the text.
    """
    valid = f"valid ranks are 0-{world_size - 1}" if world_size > 1 else "the only rank is 0"
    if isinstance(spec, bool):
        raise LabUsageError(f"ranks must be numbers like 0,2-3, not {spec!r}")
    if isinstance(spec, int):
        items: list[int] = [spec]
    elif isinstance(spec, str):
        items = []
        if not spec.strip():
            raise LabUsageError(f"no ranks given: write them like 0,2-3 ({valid})")
        for part in spec.split(","):
            match = _RANGE.match(part)
            if match is None:
                raise LabUsageError(
                    f"cannot read ranks {spec!r}: {part.strip()!r} is not a rank or a range; "
                    f"write them like 0,2-3 ({valid})"
                )
            first = int(match.group(1))
            last = int(match.group(2)) if match.group(2) is not None else first
            if last < first:
                raise LabUsageError(f"rank range {part.strip()!r} runs backwards: write {last}-{first}")
            items.extend(range(first, last + 1))
    else:
        items = []
        for item in spec:
            if isinstance(item, bool) or not isinstance(item, int):
                raise LabUsageError(f"ranks must be whole numbers, got {item!r} ({valid})")
            items.append(item)
        if not items:
            raise LabUsageError(f"no ranks given ({valid})")
    out_of_range = sorted({r for r in items if r < 0 or r >= world_size})
    if out_of_range:
        raise LabUsageError(
            f"rank {format_ranks(out_of_range)} does not exist in a world of {world_size}: {valid}"
        )
    return sorted(set(items))
