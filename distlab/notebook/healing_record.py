"""A healing cell's quorums, skipped steps and heals, folded from what its ranks published (pure).

Each rank's process publishes its record under ``wire.HEALING_KEY`` (``rank.quorums``): spans of
step attempts, each with its quorum's id and ranks, whether the rank took part and whether the step
committed; and its heals. :func:`fold` makes one :class:`HealingRecord` of them all:

- per step, the quorum that committed it: its ranks (``members``) and the ranks whose gradients it
  averaged (``participants``: the members less any that healed in it);
- per rank, the steps it skipped: those whose quorum it was not in (it had died, or its replacement
  had not joined yet), and
- the heals: who was sent a live peer's state, by whom, at which step, how many bytes, how long.

A rank SIGKILLed never sends its last steps: they are known from the others' quorums, which is why
a step's members are taken from every rank's record, and a rank's own record only says where it
did not take part. A rank's replacement is another process, and publishes a record of its own
(``pid``).

The record is the notebook side's (what ``lab.heals()`` returns, kept by :class:`HealingRecords`);
it shows itself as text and as HTML, which the live view of a healing cell (``dashboard.healing``) draws.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from ..byte_text import size
from ..wire import HEALING_KEY, HealingPublish
from .observers import ObservedLab, Observer

__all__ = [
    "KEY",
    "Heal",
    "HealingLog",
    "HealingRecord",
    "HealingRecords",
    "RecordWatcher",
    "StepQuorum",
    "fold",
    "render_html",
    "render_text",
    "step_ranges",
]

#: The key the ranks publish their records under.
KEY = HEALING_KEY

#: A step's mark for one rank, in :meth:`HealingRecord.marks`.
PARTICIPATED, SKIPPED, HEALED = "participated", "skipped", "healed"


@dataclass(frozen=True)
class StepQuorum:
    """One committed step (or one no attempt of which committed) and the quorum that took it."""

    step: int
    #: torchft's quorum id (None where no attempt at the step committed).
    quorum: int | None
    #: The ranks in the quorum, sorted.
    members: tuple[int, ...]
    #: The members whose gradients the step averaged (a member that healed in it is not one).
    participants: tuple[int, ...]
    committed: bool = True
    #: Attempts at this step that did not commit (a member was lost mid-step), as the rank that saw most.
    failed: int = 0


@dataclass(frozen=True)
class Heal:
    """``rank`` was sent ``source``'s model and optimizer state, and took step ``step`` with the others."""

    rank: int
    source: int
    step: int
    bytes: int
    seconds: float
    #: The rank healed was a replacement for one that died (else a rank torchft found behind the
    #: others: at a cell's first quorum, every rank but one is synced from it).
    replacement: bool = False


@dataclass(frozen=True)
class HealingRecord:
    """A healing cell's steps, each rank's skipped steps and the heals: ``print(lab.heals())``."""

    steps: tuple[StepQuorum, ...]
    #: Every rank the cell's records name, sorted.
    ranks: tuple[int, ...]
    #: rank -> the committed steps whose quorum it was not in (its heal step is not one: see ``heals``).
    skipped: dict[int, list[int]] = field(default_factory=dict)
    heals: tuple[Heal, ...] = ()
    #: Spans the ranks left out of their records (a cell whose quorum changed very often): the
    #: earliest steps may be missing.
    dropped: int = 0

    def step(self, number: int) -> StepQuorum | None:
        """The step ``number`` (None if no rank recorded it)."""
        return next((s for s in self.steps if s.step == number), None)

    def marks(self) -> dict[int, list[str]]:
        """rank -> a mark per step of ``steps``: ``participated``, ``skipped`` or ``healed``."""
        healed = {(h.rank, h.step) for h in self.heals}
        return {
            rank: [
                HEALED if (rank, s.step) in healed else PARTICIPATED if rank in s.participants else SKIPPED
                for s in self.steps
            ]
            for rank in self.ranks
        }

    def text(self) -> str:
        return render_text(self)

    def __repr__(self) -> str:
        return render_text(self)

    def _repr_html_(self) -> str:
        return render_html(self)


def fold(records: Iterable[HealingPublish]) -> HealingRecord:
    """One cell's :class:`HealingRecord` from its ranks' records (one per process)."""
    committed: dict[int, tuple[int, tuple[int, ...]]] = {}  # step -> (quorum, members) that committed it
    sat_out: dict[int, set[int]] = {}  # step -> ranks that said they did not take part in its commit
    failed: dict[int, int] = {}
    ranks: set[int] = set()
    heals: list[Heal] = []
    dropped = 0
    for record in records:
        rank = int(record["rank"])
        ranks.add(rank)
        dropped += int(record.get("dropped", 0))
        failed_here: dict[int, int] = {}
        for span in record["spans"]:
            members = tuple(sorted(int(m) for m in span["members"]))
            ranks.update(members)
            for step in range(int(span["first"]), int(span["last"]) + 1):
                if span["committed"]:
                    committed.setdefault(step, (int(span["quorum"]), members))
                    if not span["participating"]:
                        sat_out.setdefault(step, set()).add(rank)
                else:
                    failed_here[step] = failed_here.get(step, 0) + int(span["attempts"])
        for step, count in failed_here.items():
            failed[step] = max(failed.get(step, 0), count)
        replacement = bool(record.get("replacement", False))
        heals += [
            Heal(rank, int(h["source"]), int(h["step"]), int(h["bytes"]), float(h["seconds"]), replacement)
            for h in record["heals"]
        ]
    steps = []
    for number in sorted(set(committed) | set(failed)):
        if number in committed:
            quorum, members = committed[number]
            out = sat_out.get(number, set())
            steps.append(StepQuorum(
                number, quorum, members, tuple(m for m in members if m not in out), True, failed.get(number, 0)
            ))  # fmt: skip
        else:
            steps.append(StepQuorum(number, None, (), (), False, failed[number]))
    healed_at = {(h.rank, h.step) for h in heals}
    skipped = {
        rank: [s.step for s in steps if s.committed and rank not in s.participants and (rank, s.step) not in healed_at]
        for rank in sorted(ranks)
    }
    heals.sort(key=lambda h: (h.step, h.rank))
    return HealingRecord(tuple(steps), tuple(sorted(ranks)), skipped, tuple(heals), dropped)


class HealingLog:
    """A cell's records as they arrive: the latest of each rank's process (by its ``seq``)."""

    def __init__(self) -> None:
        self._records: dict[tuple[int, int], HealingPublish] = {}  # (rank, pid) -> its latest record

    def __bool__(self) -> bool:
        return bool(self._records)

    def merge(self, payload: Any) -> bool:
        """Take a publish; True if it is one not read before."""
        try:
            key, seq = (int(payload["rank"]), int(payload["pid"])), int(payload["seq"])
        except (KeyError, TypeError, ValueError):
            return False
        if not (isinstance(payload.get("spans"), list) and isinstance(payload.get("heals"), list)):
            return False
        known = self._records.get(key)
        if known is not None and int(known["seq"]) >= seq:
            return False
        self._records[key] = cast(HealingPublish, payload)
        return True

    def poll(self, pending: dict[int, Any]) -> bool:
        """Read each rank's latest publish from a poll (``lab.add_listener``); True if any is new."""
        new = False
        for ar in pending.values():
            try:
                data = ar.data
            except Exception:  # noqa: BLE001 - a dead engine's result may not answer
                data = None
            payload = data.get(KEY) if isinstance(data, dict) else None
            if isinstance(payload, dict):
                new |= self.merge(payload)
        return new

    def record(self) -> HealingRecord:
        return fold(self._records.values())


#: Told of a healing cell's log on each poll that brought news, and once at its end: ``(log, final)``.
RecordWatcher = Callable[[HealingLog, bool], None]


class HealingRecords(Observer):
    """An observer of a lab: each cell's healing log, read from its polls, and the record of the last
    cell that healed (:attr:`last`, what ``lab.heals()`` returns). Views watch a cell's log (``watch``)."""

    def __init__(self) -> None:
        self.last: HealingRecord | None = None
        self._watchers: list[RecordWatcher] = []

    def watch(self, watcher: RecordWatcher) -> None:
        self._watchers.append(watcher)

    def unwatch(self, watcher: RecordWatcher) -> None:
        with contextlib.suppress(ValueError):
            self._watchers.remove(watcher)

    @contextlib.contextmanager
    def cell(self, lab: ObservedLab, stream: bool) -> Iterator[None]:
        log = HealingLog()

        def on_poll(pending: dict[int, Any], final: bool) -> None:
            try:
                news = log.poll(pending)
            except Exception:  # noqa: BLE001 - a broken record must not break the cell it records
                return
            if news or final:
                for watcher in list(self._watchers):
                    watcher(log, final)

        lab.add_listener(on_poll)
        try:
            yield
        finally:
            lab.remove_listener(on_poll)
            with contextlib.suppress(Exception):  # a broken record must not break the cell's result
                if log:
                    self.last = log.record()



# ------------------------------------------------------------------ text


def step_ranges(steps: Iterable[int]) -> str:
    """``1-20, 29, 31-40``: sorted steps, runs joined."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in ranks) or "-"


def _runs(record: HealingRecord) -> list[tuple[int, int, StepQuorum]]:
    """Consecutive steps alike in quorum, members, participants and outcome: (first, last, the first's)."""
    runs: list[tuple[int, int, StepQuorum]] = []
    for s in record.steps:
        if runs:
            first, last, like = runs[-1]
            alike = (s.quorum, s.members, s.participants, s.committed) == (
                like.quorum, like.members, like.participants, like.committed
            )
            if alike and s.step == last + 1 and not (s.failed or like.failed):  # a retried step stands alone
                runs[-1] = (first, s.step, like)
                continue
        runs.append((s.step, s.step, s))
    return runs


def _heal_line(h: Heal) -> str:
    return (
        f"rank {h.rank}{' (its replacement)' if h.replacement else ''} healed at step {h.step} from rank {h.source}: "
        f"{size(h.bytes)} in {h.seconds:.3f} s"
    )


def render_text(record: HealingRecord) -> str:
    """The record as a script prints it: the steps' quorums by runs, then what each rank skipped, then the heals."""
    if not record.steps:
        return "healing: no step was taken"
    first, last = record.steps[0].step, record.steps[-1].step
    heals = len(record.heals)
    lines = [f"healing: steps {first}-{last}, ranks {_ranks(record.ranks)}; {heals} heal{'s' * (heals != 1)}"]
    rows = [("steps", "quorum", "ranks in it", "took part")]
    for a, b, s in _runs(record):
        steps = str(a) if a == b else f"{a}-{b}"
        if s.failed:
            steps += f" ({s.failed} failed)"
        quorum = "-" if s.quorum is None else str(s.quorum)
        took = _ranks(s.participants) if s.committed else "did not commit"
        rows.append((steps, quorum, _ranks(s.members), took))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    skipped = [f"rank {rank}: {step_ranges(steps)}" for rank, steps in sorted(record.skipped.items()) if steps]
    lines.append("skipped: " + ("; ".join(skipped) if skipped else "none"))
    lines += [_heal_line(h) for h in record.heals]
    if record.dropped:
        lines.append(f"({record.dropped} earlier spans of steps were left out of the ranks' records)")
    return "\n".join(lines)


# ------------------------------------------------------------------ HTML

_COLOURS = {PARTICIPATED: "#4c9a2a", SKIPPED: "#c8c8c8", HEALED: "#e08a1e"}


def _strip(marks: list[str], steps: tuple[StepQuorum, ...]) -> str:
    """One rank's steps as a bar of coloured runs, each titled with its steps and mark."""
    cells, i = [], 0
    while i < len(marks):
        j = i
        while j + 1 < len(marks) and marks[j + 1] == marks[i] and steps[j + 1].step == steps[j].step + 1:
            j += 1
        a, b = steps[i].step, steps[j].step
        title = f"step {a}" if a == b else f"steps {a}-{b}"
        cells.append(
            f"<div title='{title}: {marks[i]}' style='flex:{j - i + 1};background:{_COLOURS[marks[i]]}'></div>"
        )
        i = j + 1
    return f"<div style='display:flex;width:32em;height:0.9em;gap:1px'>{''.join(cells)}</div>"


def render_html(record: HealingRecord) -> str:
    """Steps across, ranks down (took part, skipped, healed), the quorums by runs, and the heals."""
    if not record.steps:
        return "<p>healing: no step was taken</p>"
    first, last = record.steps[0].step, record.steps[-1].step
    marks = record.marks()
    rows = "".join(
        f"<tr><td style='text-align:left'>rank {rank}</td><td>{_strip(marks[rank], record.steps)}</td>"
        f"<td style='text-align:left'>{html.escape(step_ranges(record.skipped.get(rank, [])) or '')}</td></tr>"
        for rank in record.ranks
    )
    legend = " ".join(
        f"<span style='background:{colour};padding:0 0.5em'>&nbsp;</span> {name}" for name, colour in _COLOURS.items()
    )
    runs = "".join(
        f"<tr><td style='text-align:left'>{a if a == b else f'{a}-{b}'}"
        f"{f' ({s.failed} failed)' if s.failed else ''}</td>"
        f"<td>{'-' if s.quorum is None else s.quorum}</td><td style='text-align:left'>{_ranks(s.members)}</td>"
        f"<td style='text-align:left'>{_ranks(s.participants) if s.committed else 'did not commit'}</td></tr>"
        for a, b, s in _runs(record)
    )
    heals = "".join(f"<li>{html.escape(_heal_line(h))}</li>" for h in record.heals)
    return (
        "<div class='distlab-healing'>"
        f"<p><b>healing</b>: steps {first}-{last} &nbsp; {legend}</p>"
        f"<table><tr><th></th><th style='text-align:left'>steps {first} to {last}</th>"
        f"<th style='text-align:left'>skipped</th></tr>{rows}</table>"
        "<table><tr><th style='text-align:left'>steps</th><th>quorum</th>"
        f"<th style='text-align:left'>ranks in it</th><th style='text-align:left'>took part</th></tr>{runs}</table>"
        f"{f'<ul>{heals}</ul>' if heals else '<p>no heal</p>'}"
        "</div>"
    )
