"""Predict, then measure: the prediction widget, driven from Python as a learner drives it."""

from __future__ import annotations

import pytest

from distlab import theory
from distlab.quiz import predict

RING = {"size_bytes": 16e6, "workers": 2, "bandwidth_bytes_per_s": 12.5e6, "latency_s": 0.0}


def _ring(**kwargs):
    return predict("How long will the all-reduce take?", theory="ring_allreduce_time_s", unit="ms", **kwargs, **RING)


def test_the_theory_value_comes_from_the_named_function():
    p = _ring()
    assert p.expected == pytest.approx(theory.ring_allreduce_time_s(**RING))


def test_a_guess_within_the_tolerance_is_right_and_one_outside_is_not():
    expected_ms = theory.ring_allreduce_time_s(**RING) * 1e3
    near, far = _ring(tolerance=0.2), _ring(tolerance=0.2)
    near.commit(f"{expected_ms * 1.15:.3f}")
    far.commit(f"{expected_ms * 1.3:.3f}")
    assert near.right(near.value) and "✔" in near.feedback.value
    assert not far.right(far.value) and "✘" in far.feedback.value


def test_a_guess_may_carry_its_own_unit():
    p = _ring()
    p.commit("1.3 s")
    assert p.value == pytest.approx(1.3)


def test_an_unreadable_guess_says_why_and_commits_nothing():
    p = _ring()
    p.commit("about a second")
    assert p.value is None
    assert "cannot read" in p.feedback.value
    assert not p.commit_button.disabled


def test_a_committed_prediction_cannot_be_changed():
    p = _ring()
    p.commit("1000")
    p.commit("5")
    assert p.value == pytest.approx(1.0)
    assert p.commit_button.disabled and p.entry.disabled


def test_reveal_puts_prediction_theory_and_measurement_side_by_side():
    p = _ring()
    p.commit("1200")
    expected = theory.ring_allreduce_time_s(**RING)
    comparison = p.reveal(expected * 1.1)
    assert comparison.prediction == pytest.approx(1.2)
    assert comparison.ratio == pytest.approx(1.1)
    assert comparison.prediction_right
    text = str(comparison)
    assert "1200 ms" in text and "1.10 x theory" in text
    assert "<table>" in comparison._repr_html_()


def test_reveal_without_a_prediction_says_none_was_committed():
    comparison = _ring().reveal(1.0)
    assert comparison.prediction is None and comparison.prediction_right is None
    assert "none committed" in str(comparison)


def test_percentages_show_in_percent():
    p = predict("Bubble?", theory="pipeline_bubble_fraction", unit="%", stages=2, micro_batches=8)
    p.commit("11")
    assert p.value == pytest.approx(0.11)
    assert "11.11%" in str(p.reveal(0.12))


def test_a_qualitative_prediction_is_graded_against_theorys_answer():
    p = predict("Which finishes first?", choices={"sync": "synchronous", "async": "asynchronous"}, answer="async")
    p.commit("sync")
    assert not p.right(p.value)
    comparison = p.reveal("async")
    assert "as theory says" in str(comparison) and "differs from theory" in str(comparison)
    with pytest.raises(ValueError, match="one of"):
        p.reveal("neither")


def test_reveal_refuses_what_is_not_a_measurement():
    for bad in ("1 s", float("nan"), True):
        with pytest.raises(ValueError, match="finite number"):
            _ring().reveal(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"theory": "no_such_model"}, "is not a function of distlab.theory"),
        ({}, "needs theory="),
        ({"theory": "speedup", "unit": "furlongs", "time_one_worker_s": 1, "time_n_workers_s": 1}, "unknown unit"),
        ({"theory": "speedup", "tolerance": 0, "time_one_worker_s": 1, "time_n_workers_s": 1}, "tolerance"),
        ({"choices": {"a": "A"}, "answer": "b"}, "one of the choices"),
        ({"choices": {"a": "A"}, "answer": "a", "theory": "speedup"}, "not both"),
        (
            {"theory": "speedup", "answer": "a", "time_one_worker_s": 1, "time_n_workers_s": 1},
            "answer= goes with choices=",
        ),
    ],
)
def test_bad_arguments_get_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        predict("Q?", **kwargs)
    assert "\n" not in str(error.value)
