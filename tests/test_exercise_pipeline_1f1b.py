"""pipeline-1f1b: the reference passes; the mistakes learners make fail, each named."""

from __future__ import annotations

import pytest
from _exercises import Harness, learners_lab

pytestmark = pytest.mark.cluster

NAME = "pipeline-1f1b"
harness = Harness(NAME)
lab = learners_lab()


def test_the_reference_solution_passes_with_its_bubble_measured(lab):
    result = harness.check(lab, harness.solution)
    assert result.passed, result.feedback
    assert all(case.measured["in_flight_stage_0"] == 2 for case in result.cases)
    assert all(case.measured["in_flight_stage_1"] == 1 for case in result.cases)
    timed = [case for case in result.cases if "bubble_theory" in case.measured]
    assert len(timed) == 1
    assert timed[0].measured["bubble_theory"] == pytest.approx(1 / 9, abs=1e-4)  # p = 2, m = 8
    assert 0 <= timed[0].measured["bubble_stage_0"] <= 1


NOT_DIVIDED_BY_M = harness.changed("loss = loss_fn(stage(x), targets[i]) / m", "loss = loss_fn(stage(x), targets[i])")
RECEIVED_WITHOUT_REQUIRES_GRAD = harness.changed(
    "        x.requires_grad_()  # so that backward computes the gradient stage 0 needs\n", ""
)
GPIPE = harness.changed(
    "        warmup = min(2, m)  # p - stage forwards before the first backward", "        warmup = m"
)


@pytest.mark.parametrize(
    ("code", "named"),
    [
        (NOT_DIVIDED_BY_M, "the gradient is 2 times the unsplit model's"),
        (RECEIVED_WITHOUT_REQUIRES_GRAD, "set requires_grad on the received activation and send its .grad back"),
        (GPIPE, "that is GPipe: all forwards before any backward keeps m = 3 micro-batches in flight"),
    ],
    ids=["not-divided-by-m", "received-without-requires-grad", "gpipe"],
)
def test_each_mistake_fails_with_feedback_that_names_it(lab, code, named):
    result = harness.check(lab, code)
    assert not result.passed
    assert named in str(result), result  # the feedback or a case's row: what the learner sees
    assert result.failures[0].rank is not None
