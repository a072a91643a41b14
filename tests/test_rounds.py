"""The training round as a table (distlab.dashboard.rounds), from records made here: no process."""

from __future__ import annotations

from typing import Any

import pytest

from distlab.dashboard import rounds


def _record(
    rank: int, step: int, checksum: int, *, grad: float = 0.5, epoch: int = 0, **metrics: float
) -> dict[str, Any]:
    return {
        "rank": rank,
        "step": step,
        "t": 0.0,
        "epoch": epoch,
        "loss": 2.0 - 0.1 * step + 0.01 * rank,
        "metrics": dict(metrics),
        "step_time_s": 0.01,
        "compute_s": 0.005,
        "comm_s": 0.005,
        "idle_s": None,
        "allreduce": [
            {"bucket": 0, "bytes": 400, "seconds": 0.001, "start_s": 0.0},
            {"bucket": 1, "bytes": 40, "seconds": 0.001, "start_s": 0.0},
        ],
        "grad_norm": {"0": grad},
        "weight_norm": {"0": 3.0 + step},
        "update_ratio": {},
        "checksum": checksum,
        "layer_checksums": {"0": checksum},
    }


def _meta(rank: int, start: int = 100) -> dict[str, Any]:
    return {
        "rank": rank,
        "world_size": 2,
        "run": f"r{rank}",
        "ddp": False,
        "layers": ["0"],
        "grad_bytes": 440,
        "initial_checksums": {"0": start},
        "timed": True,
        "config": {},
        "notes": [],
        "closed": True,
    }


def _run(
    steps: int = 12, per_epoch: int = 6, drift_from: int | None = None
) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    records = []
    for step in range(steps):
        for rank in (0, 1):
            checksum = 1000 + step + (rank if drift_from is not None and step >= drift_from else 0)
            extra = {"start_w0": 0.1, "start_w1": 0.2} if step == 0 else {}
            first = rank * 96 + (step % per_epoch) * 16
            records.append(
                _record(
                    rank,
                    step,
                    checksum,
                    epoch=step // per_epoch,
                    samples_from=first,
                    samples_to=first + 15,
                    own_grad_norm=0.4 + rank,
                    w0=0.1 + step / 100,
                    w1=0.2,
                    **extra,
                )
            )
    return records, {0: _meta(0), 1: _meta(1)}


def test_every_step_has_a_row_per_rank_and_action_and_the_run_ends_with_the_exit_row():
    table = rounds.round_table(*_run())
    assert table.facts() == {
        "steps": 12,
        "epochs": [0, 1],
        "rows per step": [6],
        "every rank's local weights equal the global ones after each update": True,
        "the global weights change at every step": True,
        "the last row is the exit": True,
        "no sample is on two ranks in the same step": True,
    }
    kinds = [row.kind for row in table.rows if row.step == 3]
    assert kinds == ["compute", "compute", "share", "aggregate", "update", "update"]
    first = table.rows[0]
    assert (first.node, first.action) == ("rank 0", "forward/backward on samples 0..15")
    assert "own gradient norm 0.4000" in first.local and "(the start)" in first.global_state
    share = next(row for row in table.rows if row.kind == "share")
    assert "2 tensors, 440 bytes from each rank" in share.action
    update = next(row for row in table.rows if row.kind == "update" and row.step == 4)
    assert rounds.checksum_text(1004) in update.local and "(= global)" in update.local
    assert update.global_state.startswith(f"weights {rounds.checksum_text(1004)}")
    # The next step starts from the weights this update left.
    assert rounds.checksum_text(1004) in next(r for r in table.rows if r.step == 5).global_state
    assert "12 steps" in table.rows[-1].action and table.rows[-1].step is None
    assert "exit" in str(table) and "<table>" in table._repr_html_()


def test_ranks_that_differ_have_no_global_model_and_the_facts_say_so():
    table = rounds.round_table(*_run(drift_from=3))
    for question in table.questions(seed=4):  # the questions still have one right answer each
        attempt = question.draw(seed=5)
        assert attempt.check(attempt.answer()).correct, question.id
    facts = table.facts()
    assert facts["every rank's local weights equal the global ones after each update"] is False
    assert table.global_checksum(2) == 1002 and table.global_checksum(3) is None
    update = next(row for row in table.rows if row.kind == "update" and row.step == 3)
    assert "none: the ranks differ" in update.global_state and "differs" in update.local


def test_the_tracker_shows_the_start_the_steps_asked_for_and_the_end():
    tracker = rounds.round_table(*_run()).tracker(after=(5, 10))
    assert [p.when for p in tracker.points] == ["start", "after step 5", "after step 10", "end (after step 11)"]
    start, five = tracker.points[0], tracker.points[1]
    assert start.global_checksum == 100 and start.global_values == (0.1, 0.2)
    assert five.global_checksum == 1005 and five.local_values[1] == (0.1 + 5 / 100, 0.2)
    assert all(p.locals_equal_global() for p in tracker.points)
    assert "rank 1: local weights" in str(tracker)


def test_questions_are_graded_against_the_table():
    table = rounds.round_table(*_run())
    questions = table.questions(seed=1)
    assert {q.id.removeprefix("training-round/your-table-") for q in questions} == {
        "global-after",
        "local-values",
        "who-differs",
        "samples",
        "local-loss",
    }
    for question in questions:
        attempt = question.draw(seed=2)
        assert attempt.check(attempt.answer()).correct, question.id
    by_id = {q.id.rsplit("-table-", 1)[1]: q for q in questions}
    after = by_id["global-after"].draw(seed=0)
    right = next(o for o in after.choices if o.correct)
    assert right.text == rounds.checksum_text(1005)  # step 5 asked for, when the run has it
    assert not after.check(next(o.id for o in after.choices if not o.correct)).correct
    values = by_id["local-values"].draw(seed=0)
    assert values.check("0.2, 0.2").correct  # after step 10: w0 = 0.1 + 10/100
    assert not values.check("0.25, 0.2").correct
    short = values.check("0.2")  # one number of two: graded, and wrong
    assert short.counted and not short.correct
    assert not values.check("").counted


def test_a_run_without_checksums_or_steps_is_refused_with_the_fix():
    records, meta = _run(steps=2)
    for rec in records:
        rec["checksum"] = None
    with pytest.raises(ValueError, match="checksum_every=1"):
        rounds.round_table(records, meta)
    with pytest.raises(ValueError, match=r"distlab.watch"):
        rounds.round_table([], {})
