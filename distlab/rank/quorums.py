"""What a healing rank records of its quorums, step by step, and of its heals; sent to the notebook.

In a cell that heals (``rank.heal``), each step attempt is recorded as ``opt.step()`` ends it: its
step, its quorum (torchft's id, the ranks in it), the participants, whether this rank was one
and whether the step committed. A heal (this rank was sent a live peer's state) is recorded with
its source, bytes and seconds. Consecutive attempts that agree in all but their step are one
:class:`wire.QuorumSpan`, so a record stays small however long the loop: a span per change of the
quorum, not a row per step.

It publishes through the rank's one publisher (``rank/publish.py``) under ``wire.HEALING_KEY``,
all of it each time (ipyparallel keeps a key's latest value), at most every ``INTERVAL_S``; the
cell's end sends the final state (:func:`flush`). A rank SIGKILLed loses what it had not sent: the
notebook knows its steps from the others' quorums (``notebook.healing_record``).

A quorum that failed (its lighthouse died while the rank waited) is said on the rank's output and
counted in a row (:class:`LostQuorums`): a lighthouse the lab started again answers the next step,
one that stays away would leave the loop skipping steps forever.
"""

from __future__ import annotations

import os
import re
import threading

from ..errors import DistlabError
from ..wire import HEALING_KEY, HealEvent, HealingPublish, QuorumSpan
from .hooks import at_cell_end
from .publish import Source, rank_publisher

__all__ = [
    "INTERVAL_S", "LOST_IN_A_ROW", "MAX_HEALS", "MAX_SPANS", "LostQuorums", "QuorumLog", "begin", "current", "flush",
]

#: Seconds between two publishes of the record, at least.
INTERVAL_S = 0.25
#: Spans and heals one publish carries at most (the latest): a quorum that changed thousands of
#: times in one cell keeps its latest changes.
MAX_SPANS = 500
MAX_HEALS = 100
#: Steps in a row whose quorum may fail before the cell raises.
LOST_IN_A_ROW = 3
# torchft's compiled client says a gRPC status whole ('status: Cancelled, message: "Timeout
# expired", details: [], metadata: ...'): its message is what the learner needs.
_GRPC_MESSAGE = re.compile(r'message: "([^"]*)"')


class LostQuorums:
    """One healing rank's quorums that failed, in a row: each said once, on the rank's output."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def lost(self, step: int, exc: BaseException) -> None:
        """Step ``step``'s quorum failed: it does not commit, and the next step asks for a new one."""
        self.in_a_row += 1
        text = str(exc).strip()
        found = _GRPC_MESSAGE.search(text)
        said = found.group(1) if found else (text.splitlines()[0][:120] if text else "no message")
        print(
            f"[distlab] step {step}: torchft's quorum failed ({type(exc).__name__}: {said}); the step does not "
            "commit, the next asks for a new quorum", flush=True,
        )

    def stepped(self, committed: bool) -> None:
        """After a step: a commit ends the row; the ``LOST_IN_A_ROW``-th loss raises, saying why."""
        if committed:
            self.in_a_row = 0
        elif self.in_a_row >= LOST_IN_A_ROW:
            raise DistlabError(
                f"torchft's quorum failed {self.in_a_row} steps in a row: the lab's lighthouse is not "
                "answering (lab.healer.lighthouse); %dist restart (lab.restart()) starts the lab again"
            )


class QuorumLog:
    """One rank's record of one healing cell. Its quorum calls come from torchft's quorum thread,
    its step calls from the training thread: a lock keeps them apart."""

    def __init__(self, rank: int, pid: int, replacement: bool) -> None:
        self.rank = rank
        self.pid = pid
        self.replacement = replacement
        self._lock = threading.Lock()
        self._quorum_id = -1
        self._members: list[int] = []
        self._spans: list[QuorumSpan] = []
        self._dropped = 0
        self._heals: list[HealEvent] = []
        self._seq = 0

    def quorum(self, quorum_id: int, members: list[int]) -> None:
        """A new quorum: its id and ranks, in torchft's replica order."""
        with self._lock:
            self._quorum_id, self._members = quorum_id, list(members)

    def member(self, replica_rank: int) -> int:
        """The rank at ``replica_rank`` in the current quorum (-1 if there is none)."""
        with self._lock:
            return self._members[replica_rank] if 0 <= replica_rank < len(self._members) else -1

    def attempt(self, step: int, participants: int, participating: bool, committed: bool) -> None:
        """A step attempt ended: the ``step``-th committed step (or the attempt at it that failed)."""
        with self._lock:
            key = (self._quorum_id, self._members, participants, participating, committed)
            last = self._spans[-1] if self._spans else None
            if last is not None and _key(last) == key and (
                step == last["last"] + 1 if committed else step == last["last"]
            ):
                last["last"] = step
                last["attempts"] += 1
                return
            self._spans.append({
                "first": step, "last": step, "attempts": 1, "quorum": self._quorum_id,
                "members": list(self._members), "participants": participants,
                "participating": participating, "committed": committed,
            })  # fmt: skip
            if len(self._spans) > MAX_SPANS:
                del self._spans[0]
                self._dropped += 1

    def healed(self, step: int, source: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._heals.append({"step": step, "source": source, "bytes": nbytes, "seconds": seconds})
            del self._heals[:-MAX_HEALS]

    def payload(self) -> HealingPublish:
        with self._lock:
            self._seq += 1
            return {
                "rank": self.rank, "pid": self.pid, "seq": self._seq, "replacement": self.replacement,
                "spans": [{**s, "members": list(s["members"])} for s in self._spans],
                "dropped": self._dropped, "heals": [h.copy() for h in self._heals],
            }  # fmt: skip


def _key(span: QuorumSpan) -> tuple[int, list[int], int, bool, bool]:
    return span["quorum"], span["members"], span["participants"], span["participating"], span["committed"]


_log: QuorumLog | None = None
_source: Source | None = None


def begin(rank: int, replacement: bool) -> QuorumLog:
    """A healing cell starts on this rank (``heal.heal``): a new record, published while it runs."""
    global _log, _source
    _log = QuorumLog(rank, os.getpid(), replacement)
    if _source is None:
        publisher = rank_publisher()  # None off an ipyparallel engine: recorded, not sent
        if publisher is not None:
            _source = publisher.source(HEALING_KEY, _build, INTERVAL_S)
    return _log


def current() -> QuorumLog | None:
    """The running healing cell's record on this rank."""
    return _log


def changed() -> None:
    """The record changed: publish it within ``INTERVAL_S``."""
    if _source is not None and _log is not None:
        _source.notify()


def _build(final: bool) -> HealingPublish | None:
    log = _log
    return log.payload() if log is not None else None


@at_cell_end
def flush() -> None:
    """The cell is ending: send the record's final state before the reply; the next cell starts with none."""
    global _log
    if _log is not None and _source is not None:
        _source.flush()
    _log = None
