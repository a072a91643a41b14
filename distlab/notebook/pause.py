"""A world paused at a collective: what each rank waits before (:class:`Pause`), and the notebook's
word to the ranks on ipyparallel's control channel (:class:`PauseControl`).

The ranks stop themselves (``rank.pause``); a cell's run asks them, while it waits, whether every
rank still running is paused (``CellRun``), and the lab hands the notebook back with the Pause.
"""

from __future__ import annotations

import base64
import html
import pickle
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import ipycompat
from ..errors import LabUsageError, RankError, RankFailure, format_ranks
from ..wire import PAUSE_REQUEST, Breakpoint, PausedAt
from .world import RankInfo

__all__ = ["Pause", "PauseControl", "PauseRow", "breakpoint_of"]

#: How often a waiting cell asks its ranks whether they are paused.
ASK_EVERY_S = 0.05
#: How long the ranks get to answer one question on the control channel.
ANSWER_S = 5.0
#: Collectives a breakpoint may name (``op=``), as distlab's tables and theory name them.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
       "send", "recv", "barrier")


def breakpoint_of(at: int | None, op: str | None, group: str | None, line: int | None, deadline_s: float) -> Breakpoint:
    """A :class:`Breakpoint` from ``lab.pause``'s arguments, or one line saying what is wrong."""
    from .. import checks

    if at is not None:
        checks.whole("at", at, example="lab.pause(at=3)")
        if at < 1:
            raise LabUsageError(f"at counts a cell's collectives from 1 (got {at}): "
                                "lab.pause(at=1) stops before the first")
    if op is not None and op not in OPS:
        raise LabUsageError(f"op={op!r} is no collective distlab can stop at: one of {', '.join(OPS)}")
    if group is not None and (not isinstance(group, str) or not group):
        raise LabUsageError(f"group names a process group as torch describes it, like 'default_pg' or 'mesh_tp' "
                            f"(got {group!r})")
    if line is not None:
        checks.whole("line", line, example="lab.pause(line=12)")
        if line < 1:
            raise LabUsageError(f"line is a line of the cell, from 1 (got {line})")
    return Breakpoint(at=1 if at is None else at, op=op, group=group, line=line, deadline_s=deadline_s)


@dataclass(frozen=True)
class PauseRow:
    """One rank of a paused world: the collective it waits before, where, and what it would send."""

    rank: int
    index: int  # the collective's place among its cell's collectives, from 1
    op: str
    group: str
    group_ranks: tuple[int, ...]
    line: int | None
    source: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    norms: tuple[float, ...]
    hashes: tuple[str, ...]
    agrees: bool  # same op, group, shapes and dtypes as the most of the world

    @property
    def key(self) -> tuple[object, ...]:
        return self.op, self.group, self.shapes, self.dtypes


@dataclass(frozen=True)
class Pause:
    """Every rank still in the cell, stopped before a collective; ``ended``: ranks that left the cell."""

    rows: tuple[PauseRow, ...]
    ended: tuple[int, ...] = ()

    @property
    def index(self) -> int:
        """The collective's place in the cell, from 1 (the most of the world's)."""
        return self._common().index

    @property
    def op(self) -> str:
        return self._common().op

    @property
    def group(self) -> str:
        return self._common().group

    @property
    def disagree(self) -> list[int]:
        """Ranks whose collective differs from the most of the world's (op, group, shapes or dtypes)."""
        return [r.rank for r in self.rows if not r.agrees]

    def _common(self) -> PauseRow:
        return next(r for r in self.rows if r.agrees)

    def text(self) -> str:
        head = (f"paused before collective {self.index} of the cell: {self.op} on {self.group} "
                f"(lab.step() runs every rank to its next collective, lab.cont() to the cell's end)")
        lines = [head, f"{'rank':>4}  {'#':>3}  {'op':<14} {'group':<12} {'line':>4}  tensors"]
        for r in self.rows:
            tensors = "; ".join(f"{list(s)} {d} norm {n:.4g} #{h}" for s, d, n, h in
                                zip(r.shapes, r.dtypes, r.norms, r.hashes, strict=True)) or "-"
            mark = "" if r.agrees else "   <- differs"
            lines.append(f"{r.rank:>4}  {r.index:>3}  {r.op:<14} {r.group:<12} {r.line or '-':>4}  {tensors}{mark}")
            if r.source:
                lines.append(f"{'':>4}  {'':>3}  {'':<14} {'':<12} {'':>4}  at: {r.source}")
        if self.ended:
            lines.append(f"rank {format_ranks(list(self.ended))} ended the cell without reaching a collective here")
        if self.disagree:
            lines.append(f"rank {format_ranks(self.disagree)} would run another collective than the rest: "
                         "stepping on would hang or fail; lab.cont() runs to the cell's deadline")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        head = html.escape(self.text().splitlines()[0])
        cells = "".join(f"<th>{h}</th>" for h in ("rank", "#", "op", "group", "line", "shape", "dtype", "norm", "hash"))
        body = []
        for r in self.rows:
            style = "" if r.agrees else ' style="background:#fdd"'
            first = [str(r.rank), str(r.index), r.op, r.group, f"{r.line}: {r.source}" if r.line else "-"]
            tensors = list(zip(r.shapes, r.dtypes, r.norms, r.hashes, strict=True)) or [((), "-", 0.0, "-")]
            for i, (s, d, n, h) in enumerate(tensors):
                lead = first if i == 0 else [""] * 5
                row = [*lead, str(list(s)), d, f"{n:.4g}", h]
                body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        foot = "".join(f"<p>{html.escape(line)}</p>" for line in self.text().splitlines()
                       if line.startswith("rank "))
        return f"<p><b>{head}</b></p><table><tr>{cells}</tr>{''.join(body)}</table>{foot}"


def _rows(states: dict[int, PausedAt]) -> tuple[PauseRow, ...]:
    rows = [
        PauseRow(rank, s["index"], s["op"], s["group"], tuple(s["group_ranks"]), s["line"], s["source"],
                 tuple(tuple(t["shape"]) for t in s["tensors"]), tuple(t["dtype"] for t in s["tensors"]),
                 tuple(t["norm"] for t in s["tensors"]), tuple(t["hash"] for t in s["tensors"]), True)
        for rank, s in sorted(states.items())
    ]
    counts = Counter(r.key for r in rows)
    # The most common collective is the world's; a tie goes to the lowest rank's.
    common = max(rows, key=lambda r: (counts[r.key], -r.rank)).key if rows else None
    return tuple(PauseRow(**{**r.__dict__, "agrees": r.key == common}) for r in rows)


class PauseControl:
    """Asks a cell's ranks whether they are paused, and sends them the notebook's word."""

    def __init__(self, client: ipycompat.IppClient, table: Sequence[RankInfo], line_offset: int = 0) -> None:
        self._client = client
        self._line_offset = line_offset  # the cell's leading blank lines, which its ranks do not count
        self._table = table
        self._asked_at = 0.0
        self._seen: dict[int, int] = {}  # rank -> the seq of its pause the notebook has shown
        self.current: Pause | None = None
        self._states: dict[int, PausedAt] = {}

    def check(self, running: list[int], ended: list[int]) -> Pause | None:
        """The Pause, once every rank still ``running`` waits before a collective it has not shown."""
        now = time.monotonic()
        if not running or now - self._asked_at < ASK_EVERY_S:
            return None
        self._asked_at = now
        states = self._ask(running, {"do": "state"})
        if states is None:
            return None
        paused: dict[int, PausedAt] = {}
        for rank, reply in states.items():
            state = reply.get("paused")
            if not isinstance(state, dict) or state.get("seq") == self._seen.get(rank):
                return None
            if state.get("line") is not None:
                state["line"] += self._line_offset
            paused[rank] = state  # type: ignore[assignment]  # the rank's PausedAt, as JSON
        self._states = paused
        self._seen.update({rank: s["seq"] for rank, s in paused.items()})
        self.current = Pause(_rows(paused), tuple(sorted(ended)))
        return self.current

    def tell(self, word: str) -> None:
        """``step`` or ``cont`` to every paused rank; a rank that does not hear it is said in one line."""
        asked = self._ask(list(self._states), {"do": word}, seqs=True)
        self.current = None
        if asked is None:
            raise LabUsageError(f"the paused ranks did not answer {word!r} within {ANSWER_S:g} s: "
                                "lab.stop() ends the cell and its pause")

    def read(self, name: str, ranks: list[int]) -> dict[int, Any]:
        """``name`` in each paused rank's cell frame (``lab.pull`` while paused)."""
        unpaused = [r for r in ranks if r not in self._states]
        if unpaused:
            raise LabUsageError(f"rank {format_ranks(unpaused)} is not paused: it left the cell or never ran it")
        replies = self._ask(ranks, {"do": "read", "name": name}, seqs=True)
        if replies is None:
            raise LabUsageError(f"the paused ranks did not answer within {ANSWER_S:g} s")
        values, failures = {}, {}
        for rank, reply in replies.items():
            if "value" in reply:
                values[rank] = pickle.loads(base64.b64decode(str(reply["value"])))
            else:
                failures[rank] = RankFailure(rank, "NameError", str(reply.get("error", "no answer")))
        if failures:
            raise RankError(failures)
        return values

    def _ask(
        self, ranks: list[int], content: dict[str, object], seqs: bool = False
    ) -> dict[int, dict[str, Any]] | None:
        answers: dict[int, dict[str, Any]] = {}
        if not seqs:  # one question to every rank at once; the replies come in the targets' order
            replies = ipycompat.control_request(self._client, [self._table[r].engine_id for r in ranks],
                                                PAUSE_REQUEST, content, ANSWER_S)
            if replies is None or len(replies) != len(ranks):
                return None
            return {r: (m.get("content", m) if isinstance(m, dict) else {})
                    for r, m in zip(ranks, replies, strict=True)}
        for rank in ranks:  # one at a time: a rank's own seq goes with its word
            message = {**content, "seq": self._states[rank]["seq"]} if seqs else content
            replies = ipycompat.control_request(self._client, [self._table[rank].engine_id], PAUSE_REQUEST,
                                                message, ANSWER_S)
            if not replies:
                return None
            reply = replies[0]
            answers[rank] = reply.get("content", reply) if isinstance(reply, dict) else {}
        return answers
