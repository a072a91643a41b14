"""Every exercise of the catalog graded on real ranks: its reference solution passes in every world it is
graded in, and each mistake learners make fails with feedback that names it.

What is particular to one exercise (its mistakes, what its reference measures, tests of its own) is
in its file, ``test_exercise_<module>.py``; tests/_exercises.py says what each file holds. All the
checks share one learner's lab, and so the grader's labs it keeps: one per world size for the ten
exercises, where a lab per file started them again for each.
"""

from __future__ import annotations

import pytest
from _exercises import ALL, each_exercise, exercise_tests, learners_lab

pytestmark = pytest.mark.cluster

lab = learners_lab()


@each_exercise
def test_the_reference_solution_passes_in_every_world_it_is_graded_in(lab, exercise):
    tests = exercise_tests(exercise)
    result = tests.harness.check(lab, tests.harness.solution)
    assert result.passed, result.feedback
    assert {case.world_size for case in result.cases} == set(exercise.world_sizes)
    assert all(case.passed for case in result.cases)
    if hasattr(tests, "reference_measures"):
        tests.reference_measures(result)
    if hasattr(tests, "leftovers"):
        assert tests.leftovers() == []


MISTAKES = [
    pytest.param(exercise, mistake, id=f"{exercise.name}/{mistake}")
    for exercise in ALL
    for mistake in exercise_tests(exercise).MISTAKES
]


@pytest.mark.parametrize(("exercise", "mistake"), MISTAKES)
def test_each_mistake_fails_with_feedback_that_names_it(lab, monkeypatch, exercise, mistake):
    tests = exercise_tests(exercise)
    code, named = tests.MISTAKES[mistake]
    assert code != tests.harness.solution  # a change that changed nothing tests nothing
    if hasattr(tests, "MISTAKES_GRADED_AT"):
        tests.harness.graded_only_at(monkeypatch, *tests.MISTAKES_GRADED_AT)
    result = tests.harness.check(lab, code)
    assert not result.passed
    assert named in str(result), result  # the feedback or a case's row: what the learner sees
    assert result.failures[0].rank is not None
    if hasattr(tests, "leftovers"):
        assert tests.leftovers() == []
