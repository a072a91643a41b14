"""A healing cell's quorums, skipped steps and heals: what a rank records and publishes, how the
notebook folds the ranks' records into one, and how the cell's output shows it; no cluster."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from distlab.dashboard.healing import CellHealing, HealingConfig
from distlab.errors import DistlabError
from distlab.notebook.healing_record import (
    HEALED,
    PARTICIPATED,
    SKIPPED,
    HealingLog,
    HealingRecords,
    fold,
    step_ranges,
)
from distlab.notebook.observers import ObserverBus
from distlab.rank import quorums
from distlab.rank.publish import Publisher
from distlab.wire import HEALING_KEY, HealingPublish


def _log(rank: int, pid: int = 100, replacement: bool = False) -> quorums.QuorumLog:
    return quorums.QuorumLog(rank, pid, replacement)


def _steps(log: quorums.QuorumLog, steps: range, participants: int, participating: bool = True) -> None:
    for step in steps:
        log.attempt(step, participants, participating, committed=True)


# ------------------------------------------------------------------ what a rank records


def test_a_rank_records_a_span_per_change_of_its_quorum_not_a_row_per_step():
    log = _log(0)
    log.quorum(1, [0, 1, 2])
    _steps(log, range(1, 21), 3)
    log.quorum(2, [2, 0])  # torchft's replica order: kept, so that a heal's source can be read from it
    log.attempt(21, 2, True, committed=False)  # a member lost mid-step: retried at the same step
    log.attempt(21, 2, True, committed=False)
    _steps(log, range(21, 31), 2)
    payload = log.payload()
    spans = payload["spans"]
    assert [(s["first"], s["last"], s["attempts"], s["quorum"], s["members"], s["committed"]) for s in spans] == [
        (1, 20, 20, 1, [0, 1, 2], True),
        (21, 21, 2, 2, [2, 0], False),
        (21, 30, 10, 2, [2, 0], True),
    ]  # fmt: skip
    assert log.member(0) == 2 and log.member(1) == 0 and log.member(2) == -1
    assert (payload["rank"], payload["pid"], payload["seq"], payload["dropped"]) == (0, 100, 1, 0)
    assert log.payload()["seq"] == 2, "numbered, so that the notebook keeps the latest"


def test_a_gap_in_the_steps_or_a_change_of_participation_starts_a_new_span():
    log = _log(1, replacement=True)
    log.quorum(3, [0, 1, 2])
    log.attempt(40, 2, False, committed=True)  # its heal step: it did not take part
    _steps(log, range(41, 44), 3)
    _steps(log, range(50, 52), 3)  # steps it never saw (a publish lost)
    assert [(s["first"], s["last"], s["participating"]) for s in log.payload()["spans"]] == [
        (40, 40, False), (41, 43, True), (50, 51, True),
    ]  # fmt: skip


def test_a_record_keeps_its_latest_spans_and_heals_and_counts_what_it_left_out(monkeypatch):
    monkeypatch.setattr(quorums, "MAX_SPANS", 3)
    monkeypatch.setattr(quorums, "MAX_HEALS", 2)
    log = _log(0)
    for quorum in range(5):
        log.quorum(quorum, [0])
        log.attempt(quorum + 1, 1, True, committed=True)
        log.healed(quorum + 1, 1, 10, 0.1)
    payload = log.payload()
    assert [s["quorum"] for s in payload["spans"]] == [2, 3, 4] and payload["dropped"] == 2
    assert [h["step"] for h in payload["heals"]] == [4, 5]
    assert "2 earlier spans" in fold([payload]).text()


def test_a_healing_cell_publishes_its_record_rate_limited_and_its_end_sends_the_final_state_once(monkeypatch):
    sent: list[tuple[float, HealingPublish]] = []
    publisher = Publisher(lambda data: sent.append((time.monotonic(), data[HEALING_KEY])))
    monkeypatch.setattr(quorums, "rank_publisher", lambda: publisher)
    monkeypatch.setattr(quorums, "_source", None)
    try:
        log = quorums.begin(2, replacement=False)
        assert quorums.current() is log
        log.quorum(1, [0, 1, 2])
        start = time.monotonic()
        for step in range(1, 101):
            log.attempt(step, 3, True, committed=True)
            quorums.changed()
            time.sleep(0.005)
        duration = time.monotonic() - start
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        times = [t for t, _ in sent]
        assert 1 <= len(times) <= duration / quorums.INTERVAL_S + 2, (len(times), duration)
        assert all(b - a >= quorums.INTERVAL_S * 0.9 for a, b in itertools.pairwise(times))
        count = len(sent)
        quorums.flush()
        assert len(sent) == count + 1 and sent[-1][1]["spans"][-1]["last"] == 100, "the final state, before the reply"
        assert quorums.current() is None
        quorums.changed()
        quorums.flush()
        time.sleep(3 * quorums.INTERVAL_S)
        assert len(sent) == count + 1, "the next cell, which does not heal, publishes nothing"
    finally:
        publisher.close()
        monkeypatch.setattr(quorums, "_log", None)


# ------------------------------------------------------------------ folding the ranks' records


def _cell() -> list[HealingPublish]:
    """Three ranks; rank 1 dies after step 20, its last publish at step 17; the others' step 21 fails
    once, then they step without it until its replacement heals from rank 2 at step 30."""
    survivors = []
    for rank in (0, 2):
        log = _log(rank, pid=10 + rank)
        log.quorum(1, [0, 1, 2])
        log.attempt(1, 1, rank == 0, committed=True)  # the first quorum syncs ranks 1 and 2 from rank 0
        _steps(log, range(2, 21), 3)
        log.attempt(21, 3, True, committed=False)
        log.quorum(2, [0, 2])
        _steps(log, range(21, 30), 2)
        log.quorum(3, [0, 2, 1])
        _steps(log, range(30, 36), 3)
        if rank == 2:
            log.healed(1, 0, 144, 0.02)
        survivors.append(log.payload())
    dead = _log(1, pid=11)
    dead.quorum(1, [0, 1, 2])
    dead.attempt(1, 1, False, committed=True)
    dead.healed(1, 0, 144, 0.01)
    _steps(dead, range(2, 18), 3)
    replacement = _log(1, pid=21, replacement=True)
    replacement.quorum(3, [0, 2, 1])
    replacement.healed(30, replacement.member(1), 1440, 0.25)
    replacement.attempt(30, 2, False, committed=True)
    _steps(replacement, range(31, 36), 3)
    return [survivors[0], dead.payload(), survivors[1], replacement.payload()]


def test_the_fold_gives_each_step_its_quorum_and_participants_from_every_rank_s_record():
    record = fold(_cell())
    assert [s.step for s in record.steps] == list(range(1, 36)) and record.ranks == (0, 1, 2)
    assert record.step(1).participants == (0,), "ranks synced at the first quorum did not take part"
    # The dead rank published up to step 17: the others' quorums say it took part up to step 20.
    assert all(record.step(n).participants == (0, 1, 2) for n in range(2, 21))
    assert record.step(21).failed == 1 and record.step(21).members == (0, 2)
    two = [s.step for s in record.steps if s.participants == (0, 2)]
    assert two == list(range(21, 31)), "without rank 1, and at the step its replacement healed in"
    assert record.step(30).members == (0, 1, 2) and record.step(30).quorum == 3
    assert record.step(99) is None


def test_the_fold_says_which_steps_each_rank_skipped_and_every_heal_with_its_source_bytes_and_seconds():
    record = fold(_cell())
    assert record.skipped == {0: [], 1: list(range(21, 30)), 2: []}
    heals = [(h.rank, h.source, h.step, h.bytes, h.seconds, h.replacement) for h in record.heals]
    assert heals == [(1, 0, 1, 144, 0.01, False), (2, 0, 1, 144, 0.02, False), (1, 2, 30, 1440, 0.25, True)]
    marks = record.marks()
    assert marks[1][:2] == [HEALED, PARTICIPATED] and marks[1][20:29] == [SKIPPED] * 9
    assert marks[1][29] == HEALED and marks[1][30:] == [PARTICIPATED] * 5
    assert marks[0] == [PARTICIPATED] * 35


def test_the_record_reads_as_text_by_runs_of_steps_and_as_html():
    text = repr(fold(_cell()))
    assert text.splitlines() == [
        "healing: steps 1-35, ranks 0, 1, 2; 3 heals",
        "steps          quorum  ranks in it  took part",
        "1              1       0, 1, 2      0",
        "2-20           1       0, 1, 2      0, 1, 2",
        "21 (1 failed)  2       0, 2         0, 2",
        "22-29          2       0, 2         0, 2",
        "30             3       0, 1, 2      0, 2",
        "31-35          3       0, 1, 2      0, 1, 2",
        "skipped: rank 1: 21-29",
        "rank 1 healed at step 1 from rank 0: 144 B in 0.010 s",
        "rank 2 healed at step 1 from rank 0: 144 B in 0.020 s",
        "rank 1 (its replacement) healed at step 30 from rank 2: 1.44 KB in 0.250 s",
    ]
    html = fold(_cell())._repr_html_()
    assert html.count("rank 1") >= 3 and "title='steps 21-29: skipped'" in html and "1.44 KB" in html
    assert fold([]).text() == "healing: no step was taken"
    assert step_ranges([5, 1, 2, 3, 9, 10]) == "1-3, 5, 9-10"


# ------------------------------------------------------------------ the notebook's side of a cell


class _Polled:
    def __init__(self, data: Any) -> None:
        self._data = data

    @property
    def data(self) -> Any:
        if isinstance(self._data, Exception):
            raise self._data
        return self._data


def test_the_log_keeps_each_process_s_latest_record_a_replacement_s_beside_the_dead_rank_s():
    dead, survivor, _, replacement = _cell()
    log = HealingLog()
    assert not log and log.record is not None
    assert log.poll({0: _Polled({HEALING_KEY: survivor}), 1: _Polled({HEALING_KEY: dead})})
    assert not log.poll({0: _Polled({HEALING_KEY: survivor})}), "read before"
    older = dict(replacement, seq=0)
    # The dead rank's result is gone from the poll once replaced: what it sent stays.
    assert log.poll({1: _Polled({HEALING_KEY: replacement}), 2: _Polled(RuntimeError("engine gone"))})
    assert not log.merge(older) and not log.merge({"rank": 1}) and not log.merge("junk")
    assert not log.merge(dict(replacement, seq=9, spans=None)), "a record has its spans and heals"
    assert log.poll({0: _Polled({"distlab.progress": {}}), 1: _Polled(None)}) is False
    assert fold([dead, survivor, replacement]) == log.record()


class _Lab:
    """What a lab's healing records ask of it: its poll listeners (``observers.ObserverBus``)."""

    def __init__(self) -> None:
        self.bus = ObserverBus(self)
        self.add_listener, self.remove_listener = self.bus.add_listener, self.bus.remove_listener


def test_outside_a_kernel_the_record_is_printed_once_at_the_end_and_a_cell_that_does_not_heal_shows_nothing(capsys):
    lab, records, cell = _Lab(), HealingRecords(), CellHealing(live=False)
    records.watch(cell.on_log)
    with records.cell(lab, stream=True):
        lab.bus.poll({r: _Polled({HEALING_KEY: p}) for r, p in enumerate(_cell()[:3])}, final=False)
        assert capsys.readouterr().out == "", "nothing while the cell runs"
        lab.bus.poll({}, final=True)
    cell.finish()
    assert capsys.readouterr().out == cell.record().text() + "\n"  # type: ignore[union-attr]
    assert records.last == cell.record(), "the lab keeps what its view showed: lab.heals()"
    records.unwatch(cell.on_log)
    with records.cell(lab, stream=False):  # a cell that does not stream: collected, not shown
        lab.bus.poll({0: _Polled({HEALING_KEY: _cell()[0]})}, final=True)
    assert capsys.readouterr().out == "" and records.last == fold([_cell()[0]])
    nothing, view = HealingRecords(), CellHealing(live=False)
    nothing.watch(view.on_log)
    with nothing.cell(lab, stream=True):
        lab.bus.poll({0: _Polled({})}, final=True)
    view.finish()
    assert capsys.readouterr().out == "" and nothing.last is None and view.record() is None
    assert lab.bus.poll({0: _Polled({HEALING_KEY: _cell()[0]})}, final=True) is None and nothing.last is None, (
        "after its cell the records listen no more"
    )


def test_in_a_kernel_one_widget_is_redrawn_at_most_every_interval_and_becomes_the_text_at_the_end(monkeypatch):
    shown: list[Any] = []

    class Handle:
        def update(self, bundle: Any, raw: bool = False) -> None:
            shown.append(bundle)

    def display(obj: Any, display_id: bool = False, raw: bool = False) -> Handle:
        shown.append(obj)
        return Handle()

    monkeypatch.setattr("IPython.display.display", display)
    clock = [0.0]
    cell = CellHealing(HealingConfig(min_interval_s=0.5), clock=lambda: clock[0], live=True)
    lab, healing = _Lab(), HealingRecords()
    healing.watch(cell.on_log)
    records = _cell()
    values = []
    log = _log(0, pid=99)
    log.quorum(1, [0])
    with healing.cell(lab, stream=True):
        for tick in range(40):  # a step and a publish every 0.05 s for 2 s
            clock[0] = tick * 0.05
            log.attempt(tick + 1, 1, True, committed=True)
            lab.bus.poll({0: _Polled({HEALING_KEY: log.payload()}), 1: _Polled({HEALING_KEY: records[1]})}, False)
            if cell.view is not None and (not values or values[-1] != cell.view.value):
                values.append(cell.view.value)
        assert len(shown) == 1 and shown[0] is cell.view, "one widget"
        assert 3 <= len(values) <= 5, len(values)
        lab.bus.poll({}, final=True)
    assert shown[-1]["text/plain"] == cell.record().text() and "<table>" in shown[-1]["text/html"]  # type: ignore[union-attr]
    assert cell.view.comm is None, "the widget was closed: the saved notebook keeps the text and HTML"


def test_a_lost_quorum_is_said_by_its_grpc_message_and_the_third_in_a_row_ends_the_cell(capsys):
    lost = quorums.LostQuorums()
    grpc = TimeoutError('status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap {}')
    lost.lost(201, grpc)
    lost.stepped(committed=False)
    assert capsys.readouterr().out == (
        "[distlab] step 201: torchft's quorum failed (TimeoutError: Timeout expired); the step does not commit, "
        "the next asks for a new quorum\n"
    )
    lost.stepped(committed=True)  # the new lighthouse answered: the row ends
    for step in range(202, 202 + quorums.LOST_IN_A_ROW - 1):
        lost.lost(step, RuntimeError("connection refused"))
        lost.stepped(committed=False)
    lost.lost(204, RuntimeError("connection refused"))
    with pytest.raises(DistlabError, match="torchft's quorum failed 3 steps in a row: the lab's lighthouse"):
        lost.stepped(committed=False)
